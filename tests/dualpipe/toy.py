"""A small stage model for pipeline tests: linear layers whose weight gradients can be deferred.

The single-process oracle runs the same stages in sequence on the same micro-batches, so losses must be
bitwise equal and gradients equal up to the order of accumulation (tests run in float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd import Variable

from dualpipe import WeightGradStore
from dualpipe.utils import run_backward


class DeferredLinearFn(torch.autograd.Function):
    """``x Wᵀ`` whose weight gradient follows DualPipe's protocol: handed to ``WeightGradStore`` when it is
    enabled, computed at once otherwise."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors

        def weight_grad() -> None:
            g = grad_out.flatten(0, -2).T @ x.flatten(0, -2)
            weight.grad = g if weight.grad is None else weight.grad + g

        if WeightGradStore.enabled:
            WeightGradStore.put(weight_grad)
        else:
            weight_grad()
        return grad_out @ weight, None


class DeferLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return DeferredLinearFn.apply(x, self.weight)


class ToyStage(nn.Module):
    """A residual MLP block; ``forward(x) -> x + W2 gelu(W1 x)``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = DeferLinear(hidden, 2 * hidden, bias=False)
        self.down = DeferLinear(2 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class ToyStageOverlap(ToyStage):
    """The same stage with an ``overlapped_forward_backward`` hook (forward, then the other backward),
    recording every call so tests can see the hook was used."""

    calls = 0  # counted per process (each rank is its own process in these tests)

    @classmethod
    def overlapped_forward_backward(
        cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, output_grads1
    ):
        type(module0).calls += 1
        outputs0 = module0(*inputs0)
        outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else outputs0
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        plain_backward(loss1, outputs1, output_grads1)
        return outputs0, loss0


def plain_backward(loss1, outputs1, output_grads1) -> None:
    """The backward half of the hook's contract, done plainly: from the loss, or from outputs and grads."""
    if loss1 is not None:
        loss1.backward()
        loss1.detach_()
    else:
        run_backward(outputs1, output_grads1)


class NoInputGrad(ToyStageOverlap):
    """Backpropagates into the parameters only: the input gradient never reaches ``.grad``."""

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, grads1):
        outputs0 = [module0(*inputs0)]
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        params = list(module1.parameters())
        if loss1 is not None:
            loss1.backward(inputs=params)
            loss1.detach_()
        else:
            # dualpipe.utils.run_backward's engine call, restricted to the parameters (torch.autograd.backward
            # would check the shapes of outputs1, which the pipeline has freed).
            Variable._execution_engine.run_backward(
                tuple(outputs1), tuple(grads1), False, False, tuple(params), True, True
            )
        return outputs0, loss0


def criterion(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target).clone()


def make_stages(num_stages: int, hidden: int, seed: int, cls: type[ToyStage] = ToyStage) -> list[ToyStage]:
    torch.manual_seed(seed)
    return [cls(hidden).double() for _ in range(num_stages)]


def reference_step(
    stages: list[nn.Module], x: torch.Tensor, labels: torch.Tensor, chunks: int, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run micro-batches through all stages in one process: (per-chunk losses, outputs)."""
    losses, outs = [], []
    for xc, lc in zip(x.tensor_split(chunks), labels.tensor_split(chunks)):
        y = xc
        for s in stages:
            y = s(y)
        loss = criterion(y, lc)
        (loss * scale if scale != 1.0 else loss).backward()
        losses.append(loss.detach())
        outs.append(y.detach())
    return torch.stack(losses), torch.cat(outs)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-300)).item()

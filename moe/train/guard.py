"""The non-finite guard: find a NaN or infinity in a step's loss or gradients, on every rank alike.

One small ``all_reduce`` (MAX over the default group) carries a flag for the loss and one per global stage,
so every rank takes the same decision (stop or skip) and none waits on a peer that chose otherwise. The
stage is known from the gradients: backward runs from the last stage to the first, and a non-finite value
born in one stage's backward reaches every stage before it, never one after, so the highest stage with a
non-finite gradient is where it appeared. A non-finite loss reaches every gradient: no stage is named then.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from moe.train.optimizer import grad_of

__all__ = ["NonFinite", "find_nonfinite", "weights_are_finite"]


@dataclass(frozen=True, slots=True)
class NonFinite:
    """What one step found non-finite (false when nothing was)."""

    loss: bool
    """The step's loss (on any rank computing one) is NaN or infinite."""
    stages: tuple[int, ...]
    """Global indices of the stages holding a non-finite gradient, ascending."""

    def __bool__(self) -> bool:
        return self.loss or bool(self.stages)

    def describe(self, step: int) -> str:
        """``non-finite loss at step 7``, or ``non-finite gradient at step 7, first in stage 2``."""
        if self.loss:
            return f"non-finite loss at step {step}"
        return f"non-finite gradient at step {step}, first in stage {self.stages[-1]}"


def _stage_modules(modules: Sequence[nn.Module]) -> list[tuple[int, nn.Module]]:
    return [(i if getattr(m, "stage_index", None) is None else m.stage_index, m) for i, m in enumerate(modules)]


def find_nonfinite(
    modules: Sequence[nn.Module], loss: torch.Tensor | None, num_stages: int, group: dist.ProcessGroup | None = None
) -> NonFinite:
    """Collective over ``group`` (default: the world): every rank calls it after backward, gets the same answer.

    ``modules`` are this rank's stages (``stage_index`` attribute, else their position); ``loss`` its
    micro-batch losses, or None on a rank without a last stage. Call it before the gradients are reduced
    over data-parallel ranks to keep the stage exact, or after: the reduction only copies a flag to replicas.
    """
    device = next((p.device for m in modules for p in m.parameters()), torch.device("cpu"))
    flags = torch.zeros(1 + num_stages, dtype=torch.float32, device=device)
    if loss is not None:
        flags[0] = (~torch.isfinite(loss.detach())).any().float()
    for index, module in _stage_modules(modules):
        grads = [grad_of(p) for p in module.parameters() if p.grad is not None or hasattr(p, "main_grad")]
        if grads:
            # the norm is non-finite if an element is, or if it overflows (the "gradient norm")
            norms = torch.stack([torch.linalg.vector_norm(g) for g in grads])
            flags[1 + index] = torch.maximum(flags[1 + index], (~torch.isfinite(norms)).any().float())
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    found = flags.tolist()
    return NonFinite(loss=found[0] > 0, stages=tuple(i for i in range(num_stages) if found[1 + i] > 0))


def weights_are_finite(modules: Sequence[nn.Module], group: dist.ProcessGroup | None = None) -> bool:
    """Collective: no rank holds a NaN or infinite parameter (checked before a checkpoint is written)."""
    params = [p.detach() for m in modules for p in m.parameters()]
    device = params[0].device if params else torch.device("cpu")
    flag = torch.zeros(1, device=device)
    for p in params:  # element-wise: a large but finite weight is fine, unlike a large gradient norm
        flag = torch.maximum(flag, (~torch.isfinite(p)).any().float())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return flag.item() == 0

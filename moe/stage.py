"""A pipeline stage of the MoE transformer and DualPipe's ``overlapped_forward_backward`` hook.

Legend for shape suffixes: B batch, S sequence, D hidden, V vocabulary.

How the piecewise backward meets autograd. A stage forward runs its blocks sub-stage by sub-stage
(:class:`moe.block.BlockRun`), each on detached leaves, and keeps them in a :class:`StageRun`. The stage's
output is produced by :class:`_StageGraph`, one autograd node whose backward replays the stage backward
piece by piece and returns the input gradient. So the pipeline's plain ``run_backward(outputs, grads)`` or
``loss.backward()`` works unchanged, and ``overlapped_forward_backward`` finds the same :class:`StageRun`
from the outputs (or the loss) and drives its backward interleaved with another micro-batch's forward.
The two paths run the same sub-stage code and give the same gradients.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence

import torch
from torch import nn

from dualpipe.utils import run_backward
from moe.block import Block, BlockRun
from moe.config import MoEConfig
from moe.dispatch.base import TokenDispatcher
from moe.dispatch.local import LocalDispatcher
from moe.events import EventRecorder, record_span
from moe.layers import Linear, RMSNorm, WgradSink

__all__ = ["MoEStage", "StageRun"]


class StageRun:
    """One micro-batch through one :class:`MoEStage`: the per-block runs plus embedding and head pieces."""

    def __init__(self, stage: MoEStage, inputs: Sequence[torch.Tensor], recorder: EventRecorder | None) -> None:
        self.stage = stage
        self.inputs = tuple(inputs)
        self.recorder = recorder
        self.blocks = [BlockRun(b, stage.recompute, recorder, stage.aux_loss_scale) for b in stage.blocks.values()]
        self.capture = False
        self.captured_grad: torch.Tensor | None = None
        self.head_sink = WgradSink()

    # ---- forward pieces ------------------------------------------------------------------------------
    def pre_forward(self) -> torch.Tensor:
        if self.stage.embed is None:
            return self.inputs[0]
        with record_span(self.recorder, "embed", "fwd", -1):
            self.embed_out = self.stage.embed(self.inputs[0])
        return self.embed_out.detach()

    def post_forward(self, h_BSD: torch.Tensor) -> torch.Tensor:
        if self.stage.head is None:
            return h_BSD
        with record_span(self.recorder, "head", "fwd", -1):
            self.h_last = h_BSD.detach().requires_grad_(torch.is_grad_enabled())
            self.logits = self.stage.head(self.stage.norm(self.h_last), self.head_sink)
        return self.logits

    def forward(self) -> torch.Tensor:
        h = self.pre_forward()
        for br in self.blocks:
            h = br.forward(h)
        return self.post_forward(h)

    # ---- backward pieces -----------------------------------------------------------------------------
    def post_backward(self, grad_out: torch.Tensor) -> torch.Tensor:
        if self.stage.head is None:
            return grad_out
        with record_span(self.recorder, "head", "bwd", -1):
            self.head_sink.collect = True
            run_backward([self.logits], [grad_out])
            self.head_sink.collect = False
            self.head_sink.run()
            grad = self.h_last.grad
            del self.logits, self.h_last
        assert grad is not None
        return grad

    def pre_backward(self, grad_h: torch.Tensor) -> torch.Tensor | None:
        """Embedding backward (first stage; returns None) or the gradient of the hidden-state input."""
        if self.stage.embed is None:
            return grad_h
        with record_span(self.recorder, "embed", "bwd", -1):
            run_backward([self.embed_out], [grad_h])
            del self.embed_out
        return None

    def backward(self, grad_out: torch.Tensor) -> torch.Tensor | None:
        g = self.post_backward(grad_out)
        for br in reversed(self.blocks):
            g = br.backward(g)
        return self.pre_backward(g)

    def deliver_input_grad(self, grad_in: torch.Tensor | None) -> None:
        """Accumulate the input gradient exactly as ``run_backward`` through the stage would."""
        if grad_in is None:
            return
        x = self.inputs[0]
        if x.requires_grad:
            run_backward([x], [grad_in])

    @property
    def aux_losses(self) -> list[torch.Tensor]:
        """Detached sequence-wise balance losses of the MoE blocks (for logging)."""
        return [br.aux_loss for br in self.blocks if br.aux_loss is not None]


class _StageGraph(torch.autograd.Function):
    """Autograd node standing for a whole stage: backward replays :class:`StageRun` piece by piece."""

    @staticmethod
    def forward(ctx, run: StageRun, output: torch.Tensor, anchor: torch.Tensor, *inputs: torch.Tensor):
        ctx.run = run
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        run: StageRun | None = ctx.run
        if run is None:
            raise RuntimeError("this MoEStage micro-batch was already backpropagated")
        ctx.run = None
        num_inputs = len(run.inputs)
        if run.capture:
            # overlapped_forward_backward asked for the output gradient only; it runs the backward itself.
            run.captured_grad = grad_out
            return (None, None, None, *([None] * num_inputs))
        grad_in = run.backward(grad_out)
        grads = [None] * num_inputs
        if grad_in is not None and ctx.needs_input_grad[3]:
            grads[0] = grad_in
        return (None, None, None, *grads)


def _find_run(roots: Iterable[torch.Tensor]) -> StageRun:
    # Walk the graph from the roots to the nearest _StageGraph node (the loss graph above it is small).
    stack = [r.grad_fn for r in roots]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        run = getattr(node, "run", None)
        if isinstance(run, StageRun):
            return run
        stack.extend(nxt for nxt, _ in node.next_functions)
    raise RuntimeError("no pending MoEStage forward found behind the given outputs/loss (already backpropagated?)")


def _stable_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


class MoEStage(nn.Module):
    """Consecutive blocks ``layers`` of the model, plus the embedding (``first``) and norm + head (``last``).

    Input: token ids ``[B, S]`` (first stage) or hidden states ``[B, S, D]``. Output: hidden states, or
    logits ``[B, S, V]`` on the last stage (loss: :func:`moe.model.lm_loss`). Parameters are named by
    global layer index, so any partition of the model carries the same names.

    ``piecewise=False`` builds one ordinary autograd graph instead: in one process the oracle the piecewise
    path is tested against; with expert parallelism each all-to-all is a blocking autograd node, as in a
    model without overlap (the graph ``torch.distributed.pipelining`` schedules take apart). Such stages
    run in a pipeline with ``overlap=False`` only: ``overlapped_forward_backward`` needs the piecewise path.
    ``recorder`` (an :class:`EventRecorder`) records sub-stage events (only the all-to-alls when not
    piecewise).
    ``stage_index`` is the stage's position in the pipeline (set by :func:`moe.parallel.build_stages`).
    ``aux_loss_scale`` weights the sequence-wise balance loss's gradient per micro-batch: keep 1.0 when the
    pipeline sums micro-batch losses (DualPipe's default), set ``1 / num_chunks`` with
    ``loss_reduction="mean"`` so the balance loss is averaged like the language-model loss.
    """

    def __init__(
        self,
        cfg: MoEConfig,
        layers: Sequence[int],
        *,
        first: bool,
        last: bool,
        dispatcher: TokenDispatcher | None = None,
        recompute: bool = False,
        comm_sms: int = 0,
        piecewise: bool = True,
        stage_index: int | None = None,
    ) -> None:
        super().__init__()
        layers = list(layers)
        if any(not 0 <= i < cfg.num_layers for i in layers):
            raise ValueError(f"layers {layers} outside [0, {cfg.num_layers})")
        self.cfg = cfg
        self.first, self.last = first, last
        dispatcher = dispatcher if dispatcher is not None else LocalDispatcher(cfg.num_experts)
        self.dispatcher = dispatcher
        self.recompute = recompute
        self.piecewise = piecewise
        self.recorder: EventRecorder | None = None
        self.stage_index = stage_index
        self.aux_loss_scale = 1.0
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if first else None
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i, dispatcher, comm_sms) for i in layers})
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if last else None
        self.head = Linear(cfg.hidden_size, cfg.vocab_size) if last else None

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Deterministic init from (seed, parameter name): every partition and EP rank gets the same model.

        Expert weights are drawn for all experts and sliced to this rank's block.
        """
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            gen = torch.Generator().manual_seed(_stable_seed(seed, name))
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif ".experts." in name:
                block = self.blocks[name.split(".")[1]]
                assert isinstance(block, Block) and block.dispatcher is not None
                full = torch.randn((self.cfg.num_experts, *p.shape[1:]), generator=gen) * std
                local = block.dispatcher.local_experts
                p.copy_(full[local.start : local.stop])
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        for block in self.blocks.values():
            if isinstance(block, Block) and block.is_moe:
                block.router.expert_bias.zero_()
                block.router.expert_load.zero_()

    def expert_parameters(self) -> list[nn.Parameter]:
        """Parameters sharded over the expert-parallel group (the rest are replicated)."""
        return [p for n, p in self.named_parameters() if ".experts." in n]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.piecewise:
            return self._graph_forward(x)
        run = StageRun(self, (x,), self.recorder)
        out = run.forward()
        if not torch.is_grad_enabled():
            return out
        # The anchor makes the output differentiable even when the input is token ids.
        anchor = torch.empty(0, device=out.device, requires_grad=True)
        return _StageGraph.apply(run, out.detach(), anchor, x)

    def _graph_forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks.values():
            h = block(h, self.aux_loss_scale, self.recorder)
        if self.head is not None:
            assert self.norm is not None
            h = self.head(self.norm(h))
        return h

    @classmethod
    def overlapped_forward_backward(
        cls,
        module0: MoEStage,
        inputs0: Sequence[torch.Tensor],
        criterion0,
        labels0: Sequence[torch.Tensor],
        module1: MoEStage,
        loss1: torch.Tensor | None,
        outputs1: Sequence[torch.Tensor] | None,
        output_grads1: Sequence[torch.Tensor] | None,
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Forward of ``module0`` on ``inputs0`` interleaved with the backward of an earlier micro-batch of
        ``module1`` (from ``loss1``, or from ``outputs1`` with ``output_grads1``).

        Forward block i is paired with backward block L-1-i; each pair runs (DeepSeek-V3 Figure 4)::

            comm:     B.combine        | F.dispatch   B.dispatch      | F.combine  (next B.combine)
            compute:  F.attention      | B.mlp (dX, dW)  F.mlp        | B.attention (dX | dW)

        Every all-to-all is started before the other micro-batch's compute and waited where its result is
        consumed. A backend whose dispatch waits for a row-count exchange of its own (``alltoall``; DeepEP
        counts inside its dispatch) starts F.dispatch after B.mlp dX instead, so that wait is hidden
        rather than blocking right after routing.

        The pairs' boundaries are not aligned with the blocks': the next backward block's combine starts as
        soon as this block's input gradient exists (after B.attention dX), so it runs behind B.attention dW,
        the forward's combine and the next F.attention instead of the last alone. The first one starts
        before the embedding forward, and the stage's input-gradient computation (the embedding backward on
        the first stage) runs while the last forward combine is in flight. Returns
        ``(outputs0, loss0)`` as the reference hook does.
        """
        if not (module0.piecewise and module1.piecewise):
            raise ValueError(
                "overlapped_forward_backward needs piecewise=True stages; run piecewise=False ones with overlap=False"
            )
        if loss1 is not None:
            run1 = _find_run([loss1])
            run1.capture = True
            run_backward([loss1], [torch.ones_like(loss1)])
            loss1.detach_()
            grad1 = run1.captured_grad
            run1.capture, run1.captured_grad = False, None
            if grad1 is None:
                raise RuntimeError("loss1 does not depend on module1's output")
        elif not outputs1:
            # Nothing reaches module1's outputs (the reference's run_backward would be a no-op).
            outputs0 = module0(*inputs0)
            outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else list(outputs0)
            return outputs0, criterion0(*outputs0, *labels0) if criterion0 is not None else None
        else:
            if output_grads1 is None or len(output_grads1) != len(outputs1):
                raise ValueError("outputs1 needs one gradient per output in output_grads1")
            run1 = _find_run(outputs1)
            grad1 = output_grads1[0]
            # The backward is run here, piece by piece: the node must not replay it again.
            outputs1[0].grad_fn.run = None
        if run1.stage is not module1:
            raise RuntimeError("the outputs/loss given for module1 come from another module")

        run0 = StageRun(module0, tuple(inputs0), module0.recorder)
        g1 = run1.post_backward(grad1)
        n0, n1 = len(run0.blocks), len(run1.blocks)
        pairs = min(n0, n1)
        backward = run1.blocks[::-1]  # in backward order
        if pairs:
            backward[0].combine_backward_start(g1)
        h0 = run0.pre_forward()
        delivered = False
        for i in range(pairs):
            f = run0.blocks[i]
            g1 = _overlap_pair(f, h0, backward[i], backward[i + 1] if i + 1 < pairs else None)
            if i + 1 == n1:  # the last backward block: the stage's input gradient, while F.combine flies
                run1.deliver_input_grad(run1.pre_backward(g1))
                delivered = True
            h0 = f.combine_wait()
        for f in run0.blocks[pairs:]:
            h0 = f.forward(h0)
        for b in backward[pairs:]:
            g1 = b.backward(g1)
        out0 = run0.post_forward(h0)
        if not delivered:
            run1.deliver_input_grad(run1.pre_backward(g1))

        anchor = torch.empty(0, device=out0.device, requires_grad=True)
        outputs0 = [_StageGraph.apply(run0, out0.detach(), anchor, *inputs0)]
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        return outputs0, loss0


def _overlap_pair(f: BlockRun, h: torch.Tensor, b: BlockRun, next_b: BlockRun | None) -> torch.Tensor:
    """Forward of block run ``f`` on ``h`` and backward of ``b`` (whose combine backward was started),
    interleaved up to ``f``'s combine, which is left in flight for the caller to wait. Starts ``next_b``'s
    combine backward as soon as ``b``'s input gradient exists. Returns that gradient."""
    f.attn_forward(h)  # compute F.attention (router; a row-count exchange starts, if the backend has one)
    counts = f.exchanges_counts
    if not counts:
        f.dispatch_start()  # comm  F.dispatch
    b.combine_backward_wait()
    b.mlp_backward_dx()  # compute B.mlp dX
    if counts:
        f.dispatch_start()  # comm  F.dispatch, once the counts had B.mlp dX to arrive behind
    b.dispatch_backward_start()  # comm  B.dispatch (combine direction)
    b.mlp_backward_dw()  # compute B.mlp dW, while both dispatches are in flight
    f.dispatch_wait()
    f.mlp_forward()  # compute F.mlp
    f.combine_start()  # comm  F.combine
    b.dispatch_backward_wait()
    b.attn_backward_dx()  # compute B.attention dX
    assert b.grad_in is not None
    if next_b is not None:
        next_b.combine_backward_start(b.grad_in)  # comm  next B.combine (dispatch direction)
    b.attn_backward_dw()  # compute B.attention dW
    return b.grad_in

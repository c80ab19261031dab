"""One transformer block and its sub-stage decomposition: attention -> dispatch -> MLP -> combine.

Legend for shape suffixes: B batch, S sequence, T tokens (B*S), D hidden, R rows received by this rank's
experts, K top-k slots.

:class:`Block` holds the parameters and two pure compute pieces (``attn_compute``, ``mlp_compute``).
:class:`BlockRun` is one micro-batch going through one block: every compute sub-stage runs on detached
leaf inputs, so its backward can be run by itself, and the two all-to-alls sit between them as explicit
operations (their backward is the opposite all-to-all). Backward of a compute sub-stage is split into dX
(autograd, weight-gradient closures collected) and dW (the closures). The regular forward/backward
(:meth:`BlockRun.forward`, :meth:`BlockRun.backward`) and the overlapped pair (moe.stage) call these same
methods in a different order.
"""

from __future__ import annotations

import torch
from torch import nn

from dualpipe.utils import run_backward
from moe.config import MoEConfig
from moe.dispatch.base import Dispatched, Pending, Route, TokenDispatcher
from moe.events import EventRecorder, record_edge, record_span
from moe.experts import GroupedExperts
from moe.layers import Attention, DenseMLP, RMSNorm, WgradSink
from moe.router import Router, Routing

__all__ = ["Block", "BlockRun"]


class _AttachAux(torch.autograd.Function):
    """Identity on ``x`` whose backward also seeds the auxiliary loss with gradient ``scale``.

    This puts the balance loss into the gradient without threading it through the pipeline's outputs.
    ``scale`` is the weight the training loss gives one micro-batch (1 when micro-batch losses are summed,
    as DualPipe does; 1/num_chunks when they are averaged).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device, scale)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        shape, dtype, device, scale = ctx.aux_meta
        return grad, torch.full(shape, scale, dtype=dtype, device=device), None


class Block(nn.Module):
    """Pre-norm block: ``a = h + attn(norm(h))``, ``h' = a + mlp(norm(a))`` with a dense or MoE MLP."""

    def __init__(self, cfg: MoEConfig, layer: int, dispatcher: TokenDispatcher | None, comm_sms: int = 0) -> None:
        super().__init__()
        self.layer = layer
        self.is_moe = cfg.is_moe_layer(layer)
        self.comm_sms = comm_sms
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.attn_head_dim, cfg.rope_theta)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        # The dispatcher holds process groups and buffers, not parameters: keep it out of the module tree.
        self._dispatcher = dispatcher if self.is_moe else None
        if self.is_moe:
            if dispatcher is None:
                raise ValueError(f"layer {layer} is an MoE layer and needs a token dispatcher")
            if dispatcher.num_experts != cfg.num_experts:
                raise ValueError(f"dispatcher routes {dispatcher.num_experts} experts, config has {cfg.num_experts}")
            self.router = Router(cfg)
            self.experts = GroupedExperts(dispatcher.num_local_experts, cfg.hidden_size, cfg.moe_intermediate_size)
            self.shared = (
                DenseMLP(cfg.hidden_size, cfg.num_shared_experts * cfg.moe_intermediate_size)
                if cfg.num_shared_experts
                else None
            )
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size)

    @property
    def dispatcher(self) -> TokenDispatcher | None:
        return self._dispatcher

    def attn_compute(
        self,
        h_BSD: torch.Tensor,
        sink: WgradSink | None,
        replay_idx_TK: torch.Tensor | None = None,
        aux_scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor, Routing | None]:
        """Attention sub-stage: residual ``a``, normed MLP input ``z`` and (MoE) the routing."""
        a_BSD = h_BSD + self.attn(self.attn_norm(h_BSD), sink)
        z_BSD = self.mlp_norm(a_BSD)
        if not self.is_moe:
            return a_BSD, z_BSD, None
        routing = self.router(z_BSD, sink, replay_idx_TK)
        if routing.aux_loss is not None:
            a_BSD = _AttachAux.apply(a_BSD, routing.aux_loss, aux_scale)
        return a_BSD, z_BSD, routing

    def mlp_compute(
        self, recv: Dispatched | None, z_BSD: torch.Tensor, sink: WgradSink | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """MLP sub-stage: (routed rows ``[R, D]`` or the dense output ``[B, S, D]``, shared output or None)."""
        if not self.is_moe:
            return self.mlp(z_BSD, sink), None
        assert recv is not None
        y_RD = self.experts(recv.x_RD, recv.local_idx_RK, recv.weights_RK, sink, self.comm_sms)
        shared_BSD = self.shared(z_BSD, sink) if self.shared is not None else None
        return y_RD, shared_BSD

    def forward(
        self, h_BSD: torch.Tensor, aux_scale: float = 1.0, recorder: EventRecorder | None = None
    ) -> torch.Tensor:
        """One autograd graph through the whole block.

        Without expert parallelism dispatch is the identity. With a communicating dispatcher each
        all-to-all is a blocking autograd node (:class:`_BlockingDispatch`, :class:`_BlockingCombine`) whose
        backward is the opposite all-to-all: the plain graph a model with blocking all-to-all has, which
        graph-walking schedules (torch.distributed.pipelining's split backward) can take apart. ``recorder``
        records the all-to-alls (they hide nothing: each is waited right after it starts).
        """
        a_BSD, z_BSD, routing = self.attn_compute(h_BSD, None, aux_scale=aux_scale)
        if routing is None:
            y_BSD, _ = self.mlp_compute(None, z_BSD, None)
            return a_BSD + y_BSD
        assert self._dispatcher is not None
        z_TD = z_BSD.reshape(-1, z_BSD.shape[-1])
        if self._dispatcher.communicates:
            comm = _BlockingComm(self._dispatcher, self._dispatcher.plan(routing.topk_idx_TK), recorder, self.layer)
            x_RD, weights_RK = _BlockingDispatch.apply(comm, z_TD, routing.topk_weights_TK)
            recv = Dispatched(x_RD, comm.local_idx_RK, weights_RK)
        else:
            comm = None
            recv = Dispatched(z_TD, routing.topk_idx_TK, routing.topk_weights_TK)
        y_RD, shared_BSD = self.mlp_compute(recv, z_BSD, None)
        y_TD = y_RD if comm is None else _BlockingCombine.apply(comm, y_RD)
        out_BSD = a_BSD + y_TD.view_as(a_BSD)
        return out_BSD + shared_BSD if shared_BSD is not None else out_BSD


class _BlockingComm:
    """What one block's blocking all-to-alls share for one micro-batch: dispatcher, route, recorder."""

    def __init__(self, dispatcher: TokenDispatcher, route: Route, recorder: EventRecorder | None, layer: int) -> None:
        self.dispatcher, self.route, self.recorder, self.layer = dispatcher, route, recorder, layer
        self.local_idx_RK: torch.Tensor | None = None
        if route.exchanges_counts:
            record_edge(recorder, "counts", "fwd", layer, "start")

    def wait_counts(self) -> None:
        if self.route.exchanges_counts:
            self.route.wait_counts()
            record_edge(self.recorder, "counts", "fwd", self.layer, "wait")

    def run(self, name: str, direction: str, start):
        """Start one all-to-all and wait for it right away (recording both edges)."""
        record_edge(self.recorder, name, direction, self.layer, "start")
        out = start().wait()
        record_edge(self.recorder, name, direction, self.layer, "wait")
        return out


class _BlockingDispatch(torch.autograd.Function):
    """``(x_TD, weights_TK) -> (x_RD, weights_RK)``; backward: the dispatch gradient (combine direction)."""

    @staticmethod
    def forward(ctx, comm: _BlockingComm, x_TD: torch.Tensor, weights_TK: torch.Tensor):
        comm.wait_counts()
        got = comm.run("dispatch", "fwd", lambda: comm.dispatcher.dispatch(comm.route, x_TD, weights_TK))
        comm.local_idx_RK = got.local_idx_RK
        ctx.comm = comm
        # Shapes for zero gradients of an unused output (a rank whose experts received no rows).
        ctx.metas = tuple((t.shape, t.dtype, t.device) for t in (got.x_RD, got.weights_RK))
        return got.x_RD, got.weights_RK

    @staticmethod
    def backward(ctx, grad_x_RD: torch.Tensor | None, grad_w_RK: torch.Tensor | None):
        comm: _BlockingComm = ctx.comm
        (x_shape, x_dtype, device), (w_shape, w_dtype, _) = ctx.metas
        if grad_x_RD is None:
            grad_x_RD = torch.zeros(x_shape, dtype=x_dtype, device=device)
        if grad_w_RK is None:
            grad_w_RK = torch.zeros(w_shape, dtype=w_dtype, device=device)
        grad_x_TD, grad_w_TK = comm.run(
            "dispatch", "bwd", lambda: comm.dispatcher.dispatch_backward(comm.route, grad_x_RD, grad_w_RK)
        )
        return None, grad_x_TD, grad_w_TK


class _BlockingCombine(torch.autograd.Function):
    """``y_RD -> y_TD`` (partial rows summed into their tokens); backward: the combine gradient."""

    @staticmethod
    def forward(ctx, comm: _BlockingComm, y_RD: torch.Tensor):
        ctx.comm = comm
        return comm.run("combine", "fwd", lambda: comm.dispatcher.combine(comm.route, y_RD))

    @staticmethod
    def backward(ctx, grad_y_TD: torch.Tensor):
        comm: _BlockingComm = ctx.comm
        return None, comm.run("combine", "bwd", lambda: comm.dispatcher.combine_backward(comm.route, grad_y_TD))


def _leaf(x: torch.Tensor) -> torch.Tensor:
    # A sub-stage boundary: the sub-stage's backward stops here and leaves the gradient in .grad.
    return x.detach().requires_grad_(x.is_floating_point() and torch.is_grad_enabled())


class BlockRun:
    """One micro-batch through one :class:`Block`, sub-stage by sub-stage, forward and backward.

    Forward: :meth:`attn_forward` -> :meth:`dispatch_start` / :meth:`dispatch_wait` -> :meth:`mlp_forward`
    -> :meth:`combine_start` / :meth:`combine_wait`. Backward: :meth:`combine_backward_start` /
    ``_wait`` -> :meth:`mlp_backward_dx` -> :meth:`dispatch_backward_start` -> :meth:`mlp_backward_dw` ->
    :meth:`dispatch_backward_wait` -> :meth:`attn_backward_dx` -> :meth:`attn_backward_dw`; the block's
    input gradient is then :attr:`grad_in`. Dense blocks keep the same calls; their communication is empty.

    With ``recompute`` the compute sub-stages run without a graph in forward (only their inputs are kept)
    and are re-run under autograd right before their backward, replaying the recorded routing.
    """

    def __init__(
        self,
        block: Block,
        recompute: bool = False,
        recorder: EventRecorder | None = None,
        aux_scale: float = 1.0,
    ) -> None:
        self.block = block
        self.recompute = recompute
        self.aux_scale = aux_scale
        self.recorder = recorder
        self.attn_sink, self.mlp_sink = WgradSink(), WgradSink()
        self.aux_loss: torch.Tensor | None = None
        self.grad_in: torch.Tensor | None = None

    # ---- helpers -------------------------------------------------------------------------------------
    @property
    def _communicates(self) -> bool:
        d = self.block.dispatcher
        return d is not None and d.communicates

    def _comm(self, name: str, direction: str, edge: str) -> None:
        if self._communicates:
            record_edge(self.recorder, name, direction, self.block.layer, edge)

    def _span(self, name: str, direction: str):
        return record_span(self.recorder, name, direction, self.block.layer)

    def _run_attn(self, replay: bool) -> None:
        replay_idx = self.routing.topk_idx_TK if (replay and self.routing is not None) else None
        self.a_BSD, self.z_BSD, routing = self.block.attn_compute(self.h_in, self.attn_sink, replay_idx, self.aux_scale)
        if routing is not None:
            self.routing = routing

    def _run_mlp(self) -> None:
        self.y, self.shared_BSD = self.block.mlp_compute(self.recv, self.z_mlp, self.mlp_sink)

    # ---- forward -------------------------------------------------------------------------------------
    def attn_forward(self, h_BSD: torch.Tensor) -> None:
        """Attention, router and routing plan (whose count exchange starts here)."""
        with self._span("attn", "fwd"):
            self.h_in = _leaf(h_BSD)
            self.routing: Routing | None = None
            with torch.set_grad_enabled(torch.is_grad_enabled() and not self.recompute):
                self._run_attn(replay=False)
            if self.routing is not None:
                aux = self.routing.aux_loss
                self.aux_loss = None if aux is None else aux.detach()
                assert self.block.dispatcher is not None
                self.route: Route = self.block.dispatcher.plan(self.routing.topk_idx_TK)
                if self.route.exchanges_counts:
                    self._comm("counts", "fwd", "start")

    @property
    def exchanges_counts(self) -> bool:
        """Whether :meth:`dispatch_start` first waits for the row counts :meth:`attn_forward` started."""
        return self.routing is not None and self.route.exchanges_counts

    def dispatch_start(self) -> None:
        self._dispatch: Pending[Dispatched] | None = None
        if self.routing is None:
            return
        assert self.block.dispatcher is not None
        if self.route.exchanges_counts:  # the data all-to-all needs the row counts: a wait of its own
            self.route.wait_counts()
            self._comm("counts", "fwd", "wait")
        self._comm("dispatch", "fwd", "start")
        x_TD = self.z_BSD.detach().reshape(-1, self.z_BSD.shape[-1])
        self._dispatch = self.block.dispatcher.dispatch(self.route, x_TD, self.routing.topk_weights_TK.detach())

    def dispatch_wait(self) -> None:
        self.recv: Dispatched | None = None
        if self._dispatch is None:
            return
        got = self._dispatch.wait()
        self._comm("dispatch", "fwd", "wait")
        self.recv = Dispatched(_leaf(got.x_RD), got.local_idx_RK, _leaf(got.weights_RK))

    def mlp_forward(self) -> None:
        with self._span("mlp", "fwd"):
            self.z_mlp = _leaf(self.z_BSD)
            with torch.set_grad_enabled(torch.is_grad_enabled() and not self.recompute):
                self._run_mlp()

    def combine_start(self) -> None:
        self._combine: Pending[torch.Tensor] | None = None
        if self.routing is None:
            return
        assert self.block.dispatcher is not None
        self._comm("combine", "fwd", "start")
        self._combine = self.block.dispatcher.combine(self.route, self.y.detach())
        if self.recompute:
            del self.y  # recomputed before the MLP backward

    def combine_wait(self) -> torch.Tensor:
        """The block's output ``[B, S, D]`` (a plain tensor; the next sub-stage takes a leaf of it)."""
        if self._combine is None:
            y_BSD = self.y.detach()
        else:
            y_BSD = self._combine.wait().view_as(self.a_BSD)
            self._comm("combine", "fwd", "wait")
        with self._span("combine.add", "fwd"):
            out_BSD = self.a_BSD.detach() + y_BSD
            if self.shared_BSD is not None:
                out_BSD = out_BSD + self.shared_BSD.detach()
        if self.recompute:
            # Keep only sub-stage inputs (h_in, received rows, z for the shared experts); the rest is
            # recomputed right before each backward.
            del self.a_BSD, self.z_BSD, self.shared_BSD
            self.__dict__.pop("y", None)
        return out_BSD

    # ---- backward ------------------------------------------------------------------------------------
    def combine_backward_start(self, grad_out_BSD: torch.Tensor) -> None:
        """The output is ``a + combine(y) + shared``: all three get ``grad_out``; combine's goes back."""
        self.grad_out = grad_out_BSD
        self._combine_bwd: Pending[torch.Tensor] | None = None
        if self.routing is not None:
            assert self.block.dispatcher is not None
            self._comm("combine", "bwd", "start")
            grad_TD = grad_out_BSD.reshape(-1, grad_out_BSD.shape[-1])
            self._combine_bwd = self.block.dispatcher.combine_backward(self.route, grad_TD)

    def combine_backward_wait(self) -> None:
        if self._combine_bwd is None:
            self.grad_y = self.grad_out
        else:
            self.grad_y = self._combine_bwd.wait()
            self._comm("combine", "bwd", "wait")

    def mlp_backward_dx(self) -> None:
        with self._span("mlp.dx", "bwd"):
            if self.recompute:
                with torch.enable_grad():
                    self._run_mlp()
            roots, grads = [self.y], [self.grad_y]
            if self.shared_BSD is not None:
                roots.append(self.shared_BSD)
                grads.append(self.grad_out)
            self.mlp_sink.collect = True
            run_backward(roots, grads)
            self.mlp_sink.collect = False
            del self.y, self.shared_BSD, self.grad_y

    def mlp_backward_dw(self) -> None:
        with self._span("mlp.dw", "bwd"):
            self.mlp_sink.run()

    def dispatch_backward_start(self) -> None:
        self._dispatch_bwd: Pending[tuple[torch.Tensor, torch.Tensor]] | None = None
        if self.recv is None:
            return
        assert self.block.dispatcher is not None
        grad_x_RD = _grad_or_zeros(self.recv.x_RD)
        grad_w_RK = _grad_or_zeros(self.recv.weights_RK)
        self._comm("dispatch", "bwd", "start")
        self._dispatch_bwd = self.block.dispatcher.dispatch_backward(self.route, grad_x_RD, grad_w_RK)
        self.recv = None

    def dispatch_backward_wait(self) -> None:
        self.grad_w_TK: torch.Tensor | None = None
        grad_z_BSD = _grad_or_zeros(self.z_mlp)
        if self._dispatch_bwd is not None:
            grad_x_TD, self.grad_w_TK = self._dispatch_bwd.wait()
            self._comm("dispatch", "bwd", "wait")
            grad_z_BSD = grad_z_BSD + grad_x_TD.view_as(grad_z_BSD)
        self.grad_z = grad_z_BSD
        del self.z_mlp

    def attn_backward_dx(self) -> None:
        with self._span("attn.dx", "bwd"):
            if self.recompute:
                with torch.enable_grad():
                    self._run_attn(replay=True)
            roots, grads = [self.a_BSD, self.z_BSD], [self.grad_out, self.grad_z]
            if self.grad_w_TK is not None:
                assert self.routing is not None
                roots.append(self.routing.topk_weights_TK)
                grads.append(self.grad_w_TK)
            self.attn_sink.collect = True
            run_backward(roots, grads)
            self.attn_sink.collect = False
            self.grad_in = _grad_or_zeros(self.h_in)
            del self.a_BSD, self.z_BSD, self.grad_z, self.grad_out, self.h_in
            self.routing = None
            self.__dict__.pop("route", None)

    def attn_backward_dw(self) -> None:
        with self._span("attn.dw", "bwd"):
            self.attn_sink.run()

    # ---- regular order -------------------------------------------------------------------------------
    def forward(self, h_BSD: torch.Tensor) -> torch.Tensor:
        self.attn_forward(h_BSD)
        self.dispatch_start()
        self.dispatch_wait()
        self.mlp_forward()
        self.combine_start()
        return self.combine_wait()

    def backward(self, grad_out_BSD: torch.Tensor) -> torch.Tensor:
        self.combine_backward_start(grad_out_BSD)
        self.combine_backward_wait()
        self.mlp_backward_dx()
        self.dispatch_backward_start()
        self.mlp_backward_dw()
        self.dispatch_backward_wait()
        self.attn_backward_dx()
        self.attn_backward_dw()
        assert self.grad_in is not None
        return self.grad_in


def _grad_or_zeros(leaf: torch.Tensor) -> torch.Tensor:
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)

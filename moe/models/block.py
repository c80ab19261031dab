"""One transformer block and its sub-stage decomposition: attention -> dispatch -> MLP -> combine.

Legend for shape suffixes: B batch, S sequence, T tokens (B*S), D hidden, R rows received by this rank's
experts, K top-k slots.

:class:`Block` holds the parameters and two pure compute functions (``attn_compute``, ``mlp_compute``).
:meth:`Block.pieces` declares the block for the overlap runtime (:mod:`dualpipe.pieces`): the compute
pieces (attention, the shared experts, the routed MLP), with the two all-to-alls around the routed MLP as
communication pieces whose backward is the opposite all-to-all. The runtime runs them on detached leaves,
splits each compute backward into dX and dW, and interleaves two micro-batches (:mod:`dualpipe.overlap`).
:meth:`Block.forward` is the same block as one ordinary autograd graph (blocking all-to-alls), the oracle
and the graph torch's schedules take apart.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from dualpipe.collectives import Pending
from dualpipe.events import EventRecorder, record_edge
from dualpipe.pieces import Comm, Compute, Context, Pieces
from moe.dispatch.base import Dispatched, Route, TokenDispatcher
from moe.models import build_attention
from moe.models.config import MoEConfig
from moe.models.experts import GroupedExperts, free_storage
from moe.models.layers import DenseMLP, Kept, RMSNorm, caches_fp8, keep_fp8, release
from moe.models.router import Router, Routing

__all__ = ["Block", "attach_loss"]


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


def attach_loss(x: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` unchanged, with ``loss`` added to the objective: the backward through ``x`` also gives ``loss`` the
    gradient ``scale`` (the weight the training loss gives one micro-batch)."""
    return _AttachAux.apply(x, loss, scale)


class Block(nn.Module):
    """Pre-norm block: ``a = h + attn(norm(h))``, ``h' = a + mlp(norm(a))`` with a dense or MoE MLP."""

    def __init__(self, cfg: MoEConfig, layer: int, dispatcher: TokenDispatcher | None, comm_sms: int = 0) -> None:
        super().__init__()
        self.layer = layer
        self.is_moe = cfg.is_moe_layer(layer)
        self.comm_sms = comm_sms
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = build_attention(cfg)
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

    @property
    def caches_mlp_input(self) -> bool:
        """Whether the MLP's readers of ``z`` keep it in FP8 (FP8 caching, :func:`moe.models.layers.caches_fp8`):
        then nothing of the backward reads ``z`` itself (:meth:`_free_mlp_input`)."""
        if not self.is_moe:
            return caches_fp8(self.mlp.gate_up, self.mlp.down)
        shared = () if self.shared is None else (self.shared.gate_up, self.shared.down)
        return caches_fp8(self.experts, *shared)

    def attn_compute(
        self, h_BSD: torch.Tensor, replay_idx_TK: torch.Tensor | None = None, aux_scale: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor, Routing | None, Kept | None]:
        """Attention sub-stage: residual ``a``, normed MLP input ``z``, (MoE) the routing and (MoE, FP8 caching)
        ``z`` kept in FP8, which the router's gate and the shared experts save instead of ``z``.

        Selective recompute (:func:`moe.models.layers.selective_recompute`): the norms keep only their inputs, and the
        attention norm's output, which the q/k/v projections save, is freed after the attention and refilled
        when its backward starts; ``z`` is the piece's output, kept anyway (but under FP8 caching, freed once the
        MLP has read it)."""
        x_BSD = self.attn_norm(h_BSD)
        o_BSD = self.attn(x_BSD)
        release(x_BSD, after=o_BSD)  # a no-op unless the norm was recomputed
        a_BSD = h_BSD + o_BSD
        z_BSD = self.mlp_norm(a_BSD)
        if not self.is_moe:
            return a_BSD, z_BSD, None, None
        z_kept = keep_fp8(z_BSD) if self.caches_mlp_input else None
        routing = self.router(z_BSD, replay_idx_TK, kept=z_kept)
        if routing.aux_loss is not None:
            a_BSD = attach_loss(a_BSD, routing.aux_loss, aux_scale)
        return a_BSD, z_BSD, routing, z_kept

    def mlp_compute(
        self,
        recv: Dispatched | None,
        z_BSD: torch.Tensor,
        *,
        free_received: bool = False,
        shared: bool = True,
        z_kept: Kept | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """MLP sub-stage: (routed rows ``[R, D]`` or the dense output ``[B, S, D]``, shared output or None).

        free_received: free the received rows' storage once permute has copied them (the caller reads them no
        more; see :meth:`_mlp_moe`). shared=False leaves the shared experts out (a piece of their own). z_kept:
        :meth:`attn_compute`'s FP8 copy of ``z``, for the shared experts to save."""
        if not self.is_moe:
            return self.mlp(z_BSD), None
        assert recv is not None
        # A sync-free dispatcher's rows come padded to a host-known size: the experts keep to static sizes too.
        static = self._dispatcher is not None and self._dispatcher.sync_free
        y_RD = self.experts(
            recv.x_RD, recv.local_idx_RK, recv.weights_RK, self.comm_sms, static_rows=static, free_input=free_received
        )
        shared_BSD = self.shared(z_BSD, z_kept) if shared and self.shared is not None else None
        return y_RD, shared_BSD

    def pieces(self, aux_scale: float = 1.0) -> Pieces:
        """The block as pieces for :mod:`dualpipe.overlap`.

        MoE: ``attn`` (attention, router, routing plan) -> ``dispatch`` (its row-count exchange is the
        prepare step) -> ``shared`` (the shared experts, when the layer has them) -> ``mlp`` (the routed
        experts) -> ``combine``; output ``a + y (+ shared)``. The shared experts read only ``z`` and only the
        output reads theirs: a side piece the pair order runs beside the routed path
        (:mod:`dualpipe.pair_order`). Dense: ``attn`` -> ``mlp``; output ``a + y``.
        """
        if not self.is_moe:
            return Pieces(
                (Compute("attn", self._attn_dense, "h", ("a", "z")), Compute("mlp", self._mlp_dense, "z", "y")),
                input="h",
                output=("a", "y"),
                layer=self.layer,
            )
        dispatcher = self._dispatcher
        assert dispatcher is not None
        shared = ("shared",) if self.shared is not None else ()
        side = (Compute("shared", self._shared_moe, "z", "shared"),) if shared else ()
        communicates = dispatcher.communicates
        return Pieces(
            (
                Compute("attn", functools.partial(self._attn_moe, aux_scale), "h", ("a", "z", "weights")),
                Comm(
                    "dispatch",
                    self._dispatch,
                    self._dispatch_backward,
                    ("z", "weights"),
                    ("x_recv", "w_recv"),
                    prepare=self._plan,
                    communicates=communicates,
                    stream=lambda: dispatcher.comm_stream,
                ),
                *side,
                # z: read for its storage only (the received rows may be z itself, then not freed), so no
                # gradient from here; kept as a piece input, as the planner's full-recompute figure counts it
                Compute("mlp", self._mlp_moe, ("x_recv", "w_recv", "z"), "y_recv", no_grad="z"),
                Comm(
                    "combine",
                    self._combine,
                    self._combine_backward,
                    "y_recv",
                    "y",
                    communicates=communicates,
                    stream=lambda: dispatcher.comm_stream,
                ),
            ),
            input="h",
            output=("a", "y", *shared),
            layer=self.layer,
        )

    # ---- pieces --------------------------------------------------------------------------------------
    def _attn_dense(self, ctx: Context, h_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a_BSD, z_BSD, _, _ = self.attn_compute(h_BSD)
        return a_BSD, z_BSD

    def _mlp_dense(self, ctx: Context, z_BSD: torch.Tensor) -> torch.Tensor:
        y_BSD = self.mlp_compute(None, z_BSD)[0]
        self._free_mlp_input(ctx, z_BSD)
        return y_BSD

    def _free_mlp_input(self, ctx: Context, z_BSD: torch.Tensor) -> None:
        """Free ``z``'s storage once the MLP piece, its last reader in forward, has run, when every op that keeps
        it for backward keeps an FP8 copy instead (the runtime holds ``z`` as a piece output and input, for its
        metadata only). Not while a piece is recomputed: a recomputed piece reads ``z`` again."""
        if self.caches_mlp_input and not ctx.recomputing:
            free_storage(z_BSD)

    def _attn_moe(self, aux_scale: float, ctx: Context, h_BSD: torch.Tensor):
        # Recomputation replays the routing decided in forward (and adds nothing to the load statistics).
        replay = ctx.topk_idx_TK if ctx.recomputing else None
        a_BSD, z_BSD, routing, z_kept = self.attn_compute(h_BSD, replay, aux_scale)
        assert routing is not None
        if not ctx.recomputing:
            ctx.topk_idx_TK = routing.topk_idx_TK
            ctx.aux_loss = None if routing.aux_loss is None else routing.aux_loss.detach()
            ctx.z_kept = z_kept  # for the shared experts' piece, which takes it
        return a_BSD, z_BSD, routing.topk_weights_TK

    def _plan(self, ctx: Context, z_BSD: torch.Tensor, weights_TK: torch.Tensor) -> Pending[None] | None:
        """Where every token goes; an uneven all-to-all starts its row-count exchange here.

        Returns a ``Pending`` (in a pair the runtime then starts the dispatch after the other micro-batch's
        shared-expert backward, before its MLP's: :mod:`dualpipe.pair_order`) when the dispatch must wait for
        counts: exchanged here, or inside the dispatch (DeepEP's non-cached dispatch, :attr:`Route.defers_dispatch`).
        """
        assert self._dispatcher is not None
        ctx.route = route = self._dispatcher.plan(ctx.topk_idx_TK)
        if route.exchanges_counts:
            return Pending(route.wait_counts)
        # Nothing to wait for here, but the dispatch blocks the host: a pending prepare makes the runtime start
        # it after the other micro-batch's shared-expert backward (B.shared dX), as it does for a count exchange.
        return Pending.done(None) if route.defers_dispatch else None

    def _dispatch(self, ctx: Context, z_BSD: torch.Tensor, weights_TK: torch.Tensor):
        assert self._dispatcher is not None
        ctx.shape = z_BSD.shape
        got = self._dispatcher.dispatch(ctx.route, z_BSD.reshape(-1, z_BSD.shape[-1]), weights_TK)

        def finish() -> tuple[torch.Tensor, torch.Tensor]:
            recv = got.wait()
            ctx.local_idx_RK = recv.local_idx_RK
            return recv.x_RD, recv.weights_RK

        return Pending(finish)

    def _dispatch_backward(self, ctx: Context, grad_x_RD: torch.Tensor, grad_w_RK: torch.Tensor):
        assert self._dispatcher is not None
        got = self._dispatcher.dispatch_backward(ctx.route, grad_x_RD, grad_w_RK)

        def finish() -> tuple[torch.Tensor, torch.Tensor]:
            grad_x_TD, grad_w_TK = got.wait()
            return grad_x_TD.view(ctx.shape), grad_w_TK

        return Pending(finish)

    def _mlp_moe(self, ctx: Context, x_RD: torch.Tensor, w_RK: torch.Tensor, z_BSD: torch.Tensor):
        # The runtime keeps this piece's inputs for backward, but nothing there reads the received rows (permute
        # copies them into expert order and its gradient needs the row ids): free them once copied. Not when
        # the rows are z itself (no all-to-all: the shared expert and the router read z), nor in a forward
        # without a graph (full recompute: the backward runs this piece again from its inputs, rows included).
        free = (
            torch.is_grad_enabled()
            and self._dispatcher is not None
            and self._dispatcher.communicates
            and x_RD.untyped_storage().data_ptr() != z_BSD.untyped_storage().data_ptr()
        )
        recv = Dispatched(x_RD, ctx.local_idx_RK, w_RK)
        y_RD = self.mlp_compute(recv, z_BSD, free_received=free, shared=False)[0]
        self._free_mlp_input(ctx, z_BSD)  # after the shared experts' piece: the pair order runs it first
        return y_RD

    def _shared_moe(self, ctx: Context, z_BSD: torch.Tensor) -> torch.Tensor:
        assert self.shared is not None
        z_kept = None if ctx.recomputing else ctx.__dict__.pop("z_kept", None)
        return self.shared(z_BSD, z_kept)

    def _combine(self, ctx: Context, y_RD: torch.Tensor):
        assert self._dispatcher is not None
        got = self._dispatcher.combine(ctx.route, y_RD)
        return Pending(lambda: got.wait().view(ctx.shape))

    def _combine_backward(self, ctx: Context, grad_y_BSD: torch.Tensor):
        assert self._dispatcher is not None
        return self._dispatcher.combine_backward(ctx.route, grad_y_BSD.reshape(-1, grad_y_BSD.shape[-1]))

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
        a_BSD, z_BSD, routing, z_kept = self.attn_compute(h_BSD, aux_scale=aux_scale)
        if routing is None:
            y_BSD, _ = self.mlp_compute(None, z_BSD)
            return a_BSD + y_BSD
        assert self._dispatcher is not None
        z_TD = z_BSD.reshape(-1, z_BSD.shape[-1])
        if self._dispatcher.communicates or self._dispatcher.fp8:  # a local FP8 dispatch still round-trips
            rec = recorder if self._dispatcher.communicates else None
            comm = _BlockingComm(self._dispatcher, self._dispatcher.plan(routing.topk_idx_TK), rec, self.layer)
            x_RD, weights_RK = _BlockingDispatch.apply(comm, z_TD, routing.topk_weights_TK)
            recv = Dispatched(x_RD, comm.local_idx_RK, weights_RK)
        else:
            comm = None
            recv = Dispatched(z_TD, routing.topk_idx_TK, routing.topk_weights_TK)
        y_RD, shared_BSD = self.mlp_compute(recv, z_BSD, z_kept=z_kept)
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
        """Start one all-to-all and wait for it right away (recording both edges; ``start`` once issued, as the
        piecewise path records it)."""
        pending = start()
        record_edge(self.recorder, name, direction, self.layer, "start")
        out = pending.wait()
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

"""``alltoall``: ``torch.distributed.all_to_all_single`` with per-rank split sizes (NCCL or gloo).

Legend for shape suffixes: T local tokens, S rows this rank sends (token, destination-rank pairs),
R rows it receives, K top-k slots, D hidden, W expert-parallel ranks.

Every exchange goes through :mod:`dualpipe.collectives` (started with ``async_op=True``, waited in
:meth:`Pending.wait`): the same uneven all-to-all and count exchange any model's communication pieces use.
Combine and the gradient of dispatch are :meth:`AllToAll.backward` of the dispatch pattern.

Row counts travel first (``W`` integers, started in :meth:`plan` right after routing) because the receiving
buffers must be allocated before the data exchange starts; the host reads them once per layer, from pinned
memory (:func:`exchange_counts_to_host`), when the dispatch starts. They travel on ``counts_group``, a duplicate
of the expert group (same ranks, its own communicator, so on NCCL its own stream): on the expert group itself
the count exchange of one micro-batch would queue behind the other micro-batch's all-to-all in flight (NCCL runs
a communicator's collectives in issue order on one stream), and the host, which reads the counts, would wait
for that transfer inside the overlapped pair. The send order is computed on the device
(a stable sort, no ``nonzero``). ``sync_free=True`` pads every per-peer block to the worst case instead and
reads nothing on the host (:class:`AllToAllDispatcher`).

FP8 dispatch (``fp8=True``): the dispatch and the gradient of combine send one uint8 row per (token, rank) pair,
the token's FP8 values followed by its float32 scales (:func:`moe.dispatch.fp8.pack_rows`, each token quantized
once however many ranks it goes to), and dequantize on arrival; combine and the gradient of dispatch send the
model dtype. The ids and weights travel as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from dualpipe.collectives import AllToAll, Pending, exchange_counts_to_host
from moe.dispatch.base import Dispatched, Route, TokenDispatcher
from moe.dispatch.fp8 import pack_rows, unpack_rows, wire_row_bytes
from moe.dispatch.registry import DispatcherSpec, DispatchOptions, register_dispatcher

__all__ = ["AllToAllDispatcher"]


@dataclass(slots=True)
class _A2ARoute(Route):
    """Rows sent in (destination rank, token) order; the split sizes come from the exchanged counts."""

    topk_idx_TK: torch.Tensor
    e_local: int
    pairs_WT: torch.Tensor
    """Flat (rank * T + token) ids of the [W, T] destination table, the pairs to send first (stably sorted)."""
    counts: Pending[tuple[list[int], list[int]]]
    group: dist.ProcessGroup | None
    send_token_S: torch.Tensor | None = None
    """Token id of every sent row, rows ordered by destination rank then token."""
    send_local_idx_SK: torch.Tensor | None = None
    """Per sent row, the destination's local expert id of each slot (-1 elsewhere)."""
    _exchange: AllToAll | None = None
    exchanges_counts: ClassVar[bool] = True

    @property
    def num_tokens(self) -> int:
        return self.topk_idx_TK.shape[0]

    def wait_counts(self) -> None:
        self.exchange()

    def exchange(self) -> AllToAll:
        """The rows' exchange pattern, once the row counts have arrived (the one host read of a layer)."""
        if self._exchange is None:
            send, recv = self.counts.wait()
            # The sorted table lists the sent pairs first: its first S entries, S now known on the host.
            pairs_S = self.pairs_WT[: sum(send)]
            dest_S = torch.div(pairs_S, self.num_tokens, rounding_mode="floor")
            self.send_token_S = pairs_S - dest_S * self.num_tokens
            chosen_SK = self.topk_idx_TK.index_select(0, self.send_token_S)
            self.send_local_idx_SK = _local_ids(chosen_SK, dest_S, self.e_local)
            self._exchange = AllToAll(send, recv, self.group)
        return self._exchange


@dataclass(slots=True)
class _PaddedRoute(Route):
    """Sync-free: every token goes to every rank (a fixed ``[T, D]`` block per peer); rows a rank has no slot
    for carry local ids -1 only, which is the valid-row mask: the experts skip them, and their outputs and
    gradients are exact zeros, summed away."""

    topk_idx_TK: torch.Tensor
    send_token_S: torch.Tensor
    send_local_idx_SK: torch.Tensor
    _exchange: AllToAll

    @property
    def num_tokens(self) -> int:
        return self.topk_idx_TK.shape[0]

    def exchange(self) -> AllToAll:
        return self._exchange


def _local_ids(topk_idx_SK: torch.Tensor, dest_S: torch.Tensor, e_local: int) -> torch.Tensor:
    # Global expert ids -> the destination's local ids; -1 for slots served by another rank.
    local_SK = topk_idx_SK - (dest_S * e_local)[:, None]
    return torch.where((local_SK >= 0) & (local_SK < e_local), local_SK, torch.full_like(local_SK, -1))


def _ranks(group: dist.ProcessGroup | None) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


def _row_bytes(t_NX: torch.Tensor) -> int:
    return t_NX.shape[1] * t_NX.element_size()


def _scatter_sum(rows_SX: torch.Tensor, index_S: torch.Tensor, num_rows: int) -> torch.Tensor:
    # Sum rows into their token (a token sent to n ranks gets n partial rows back); fp32 accumulation.
    out = torch.zeros(num_rows, rows_SX.shape[1], dtype=torch.float32, device=rows_SX.device)
    out.index_add_(0, index_S, rows_SX.float())
    return out.to(rows_SX.dtype)


class AllToAllDispatcher(TokenDispatcher):
    """Expert parallelism over ``group`` with uneven, possibly empty, per-rank row counts.

    ``sync_free``: no host sync at all. Every rank sends a fixed ``[T, D]`` block to every peer (the worst
    case: all its tokens), so the split sizes are known without a count exchange; the rows a peer has no slot
    for travel with local ids -1 (the valid-row mask). It costs ``W x`` the traffic and expert-side rows of
    the worst case and needs every rank of the group to route the same number of tokens per micro-batch (as
    a pipeline's equal micro-batches do). Losses and gradients equal the normal mode's exactly.

    ``fp8``: FP8 dispatch (see the module docstring).

    ``counts_group``: where the row counts are exchanged, a duplicate of ``group`` (the same ranks in the same
    order; :attr:`moe.parallel.ParallelLayout.counts_group`); None: on ``group`` itself, behind its transfers.
    """

    def __init__(
        self,
        num_experts: int,
        group: dist.ProcessGroup | None = None,
        *,
        sync_free: bool = False,
        fp8: bool = False,
        counts_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(num_experts, dist.get_world_size(group), dist.get_rank(group))
        if counts_group is not None and _ranks(counts_group) != _ranks(group):
            raise ValueError(
                f"counts_group must hold the expert group's ranks in its order, {_ranks(group)}; got "
                f"{_ranks(counts_group)}"
            )
        self.group = group
        self.counts_group = counts_group if counts_group is not None else group
        """The group the row counts travel on (``group`` when no duplicate was given)."""
        self.sync_free = sync_free
        self.fp8 = fp8

    def _send_rows(self, kind: str, a2a: AllToAll, x_TD: torch.Tensor, send_token_S: torch.Tensor, meta_bytes: int):
        """Start the dispatch-direction exchange of the rows ``send_token_S`` of ``x_TD`` (FP8 when ``fp8``);
        returns a ``Pending`` of the ``[R, D]`` rows in ``x_TD``'s dtype."""
        hidden, dtype = x_TD.shape[1], x_TD.dtype
        self.count(kind, send_token_S.shape[0], wire_row_bytes(hidden, dtype, self.fp8), meta_bytes)
        if not self.fp8:
            return a2a.forward(x_TD.index_select(0, send_token_S))
        packed_RB = a2a.forward(pack_rows(x_TD).index_select(0, send_token_S))
        return Pending(lambda: unpack_rows(packed_RB.wait(), hidden, dtype))

    def plan(self, topk_idx_TK: torch.Tensor) -> Route:
        num_tokens, _ = topk_idx_TK.shape
        e_local, world = self.num_local_experts, self.ep_size
        device = topk_idx_TK.device
        if self.sync_free:
            send_token_S = torch.arange(num_tokens, device=device).repeat(world)
            dest_S = torch.arange(world, device=device).repeat_interleave(num_tokens, output_size=world * num_tokens)
            local_SK = _local_ids(topk_idx_TK.repeat(world, 1), dest_S, e_local)
            a2a = AllToAll([num_tokens] * world, [num_tokens] * world, self.group)
            return _PaddedRoute(topk_idx_TK, send_token_S, local_SK, a2a)
        in_rank_WT = torch.zeros(world, num_tokens, dtype=torch.bool, device=device)
        in_rank_WT.scatter_(0, (topk_idx_TK // e_local).t(), True)
        # A stable sort of "not sent" puts the sent (rank, token) pairs first, by rank then token: the send
        # order nonzero() gives, without its data-dependent output size.
        pairs_WT = torch.sort((~in_rank_WT).reshape(-1).to(torch.uint8), stable=True).indices
        counts = exchange_counts_to_host(in_rank_WT.sum(1), self.counts_group)
        return _A2ARoute(topk_idx_TK, e_local, pairs_WT, counts, self.group)

    def dispatch(self, route: Route, x_TD: torch.Tensor, topk_weights_TK: torch.Tensor) -> Pending[Dispatched]:
        assert isinstance(route, (_A2ARoute, _PaddedRoute))
        a2a = route.exchange()
        k = topk_weights_TK.shape[1]
        # Ids and weights travel together in one fp32 message (ids are exact in fp32 below 2**24).
        meta_SK2 = torch.cat(
            [route.send_local_idx_SK.float(), topk_weights_TK.float().index_select(0, route.send_token_S)], dim=1
        )
        x_RD = self._send_rows("dispatch", a2a, x_TD, route.send_token_S, _row_bytes(meta_SK2))
        meta_RK2 = a2a.forward(meta_SK2)

        def finish() -> Dispatched:
            meta = meta_RK2.wait()
            return Dispatched(x_RD.wait(), meta[:, :k].long(), meta[:, k:].contiguous())

        return Pending(finish)

    def combine(self, route: Route, y_RD: torch.Tensor) -> Pending[torch.Tensor]:
        assert isinstance(route, (_A2ARoute, _PaddedRoute))
        self.count("combine", y_RD.shape[0], _row_bytes(y_RD))
        y_SD = route.exchange().backward(y_RD)
        return Pending(lambda: _scatter_sum(y_SD.wait(), route.send_token_S, route.num_tokens))

    def dispatch_backward(
        self, route: Route, grad_x_RD: torch.Tensor, grad_weights_RK: torch.Tensor
    ) -> Pending[tuple[torch.Tensor, torch.Tensor]]:
        assert isinstance(route, (_A2ARoute, _PaddedRoute))
        a2a = route.exchange()
        self.count("dispatch_backward", grad_x_RD.shape[0], _row_bytes(grad_x_RD), _row_bytes(grad_weights_RK))
        grad_x_SD, grad_w_SK = a2a.backward(grad_x_RD), a2a.backward(grad_weights_RK)

        def finish() -> tuple[torch.Tensor, torch.Tensor]:
            return (
                _scatter_sum(grad_x_SD.wait(), route.send_token_S, route.num_tokens),
                _scatter_sum(grad_w_SK.wait(), route.send_token_S, route.num_tokens),
            )

        return Pending(finish)

    def combine_backward(self, route: Route, grad_y_TD: torch.Tensor) -> Pending[torch.Tensor]:
        assert isinstance(route, (_A2ARoute, _PaddedRoute))
        return self._send_rows("combine_backward", route.exchange(), grad_y_TD, route.send_token_S, 0)


def _make_alltoall(num_experts: int, group: dist.ProcessGroup | None, options: DispatchOptions) -> TokenDispatcher:
    return AllToAllDispatcher(
        num_experts, group, sync_free=options.sync_free, fp8=options.fp8, counts_group=options.counts_group
    )


register_dispatcher(
    DispatcherSpec(name="alltoall", factory=_make_alltoall, sync_free=True, fp8=True, exchanges_counts=True)
)

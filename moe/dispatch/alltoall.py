"""``alltoall``: ``torch.distributed.all_to_all_single`` with per-rank split sizes (NCCL or gloo).

Legend for shape suffixes: T local tokens, S rows this rank sends (token, destination-rank pairs),
R rows it receives, K top-k slots, D hidden, W expert-parallel ranks.

Every exchange goes through :mod:`dualpipe.collectives` (started with ``async_op=True``, waited in
:meth:`Pending.wait`): the same uneven all-to-all and count exchange any model's communication pieces use.
Combine and the gradient of dispatch are :meth:`AllToAll.backward` of the dispatch pattern.

Row counts travel first (``W`` integers, started in :meth:`plan` right after routing) because the receiving
buffers must be allocated before the data exchange starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.distributed as dist

from dualpipe.collectives import AllToAll, Pending, exchange_counts
from moe.dispatch.base import Dispatched, Route, TokenDispatcher
from moe.dispatch.registry import DispatcherSpec, register_dispatcher

__all__ = ["AllToAllDispatcher"]


@dataclass(slots=True)
class _A2ARoute(Route):
    num_tokens: int
    send_token_S: torch.Tensor
    """Token id of every sent row, rows ordered by destination rank then token."""
    send_local_idx_SK: torch.Tensor
    """Per sent row, the destination's local expert id of each slot (-1 elsewhere)."""
    send_counts_W: torch.Tensor
    recv_counts: Pending[torch.Tensor]
    group: dist.ProcessGroup | None
    _exchange: AllToAll | None = None
    exchanges_counts: ClassVar[bool] = True

    def wait_counts(self) -> None:
        self.exchange()

    def exchange(self) -> AllToAll:
        """The rows' exchange pattern, once the row counts have arrived."""
        if self._exchange is None:
            self._exchange = AllToAll(self.send_counts_W.tolist(), self.recv_counts.wait().tolist(), self.group)
        return self._exchange


def _scatter_sum(rows_SX: torch.Tensor, index_S: torch.Tensor, num_rows: int) -> torch.Tensor:
    # Sum rows into their token (a token sent to n ranks gets n partial rows back); fp32 accumulation.
    out = torch.zeros(num_rows, rows_SX.shape[1], dtype=torch.float32, device=rows_SX.device)
    out.index_add_(0, index_S, rows_SX.float())
    return out.to(rows_SX.dtype)


class AllToAllDispatcher(TokenDispatcher):
    """Expert parallelism over ``group`` with uneven, possibly empty, per-rank row counts."""

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None = None) -> None:
        super().__init__(num_experts, dist.get_world_size(group), dist.get_rank(group))
        self.group = group

    def plan(self, topk_idx_TK: torch.Tensor) -> Route:
        num_tokens, _ = topk_idx_TK.shape
        e_local, world = self.num_local_experts, self.ep_size
        dest_TK = topk_idx_TK // e_local
        in_rank_TW = torch.zeros(num_tokens, world, dtype=torch.bool, device=topk_idx_TK.device)
        in_rank_TW.scatter_(1, dest_TK, True)
        # nonzero() of the transpose lists (rank, token) pairs sorted by rank, then token.
        pairs = in_rank_TW.t().nonzero()
        dest_S, send_token_S = pairs[:, 0], pairs[:, 1]
        local_SK = topk_idx_TK.index_select(0, send_token_S) - (dest_S * e_local)[:, None]
        local_SK = torch.where((local_SK >= 0) & (local_SK < e_local), local_SK, torch.full_like(local_SK, -1))
        send_counts_W = in_rank_TW.sum(0).to(torch.int64)
        recv_counts = exchange_counts(send_counts_W, self.group)
        return _A2ARoute(num_tokens, send_token_S, local_SK, send_counts_W, recv_counts, self.group)

    def dispatch(self, route: Route, x_TD: torch.Tensor, topk_weights_TK: torch.Tensor) -> Pending[Dispatched]:
        assert isinstance(route, _A2ARoute)
        a2a = route.exchange()
        k = topk_weights_TK.shape[1]
        # Ids and weights travel together in one fp32 message (ids are exact in fp32 below 2**24).
        meta_SK2 = torch.cat(
            [route.send_local_idx_SK.float(), topk_weights_TK.float().index_select(0, route.send_token_S)], dim=1
        )
        x_RD = a2a.forward(x_TD.index_select(0, route.send_token_S))
        meta_RK2 = a2a.forward(meta_SK2)

        def finish() -> Dispatched:
            meta = meta_RK2.wait()
            return Dispatched(x_RD.wait(), meta[:, :k].long(), meta[:, k:].contiguous())

        return Pending(finish)

    def combine(self, route: Route, y_RD: torch.Tensor) -> Pending[torch.Tensor]:
        assert isinstance(route, _A2ARoute)
        y_SD = route.exchange().backward(y_RD)
        return Pending(lambda: _scatter_sum(y_SD.wait(), route.send_token_S, route.num_tokens))

    def dispatch_backward(
        self, route: Route, grad_x_RD: torch.Tensor, grad_weights_RK: torch.Tensor
    ) -> Pending[tuple[torch.Tensor, torch.Tensor]]:
        assert isinstance(route, _A2ARoute)
        a2a = route.exchange()
        grad_x_SD, grad_w_SK = a2a.backward(grad_x_RD), a2a.backward(grad_weights_RK)

        def finish() -> tuple[torch.Tensor, torch.Tensor]:
            return (
                _scatter_sum(grad_x_SD.wait(), route.send_token_S, route.num_tokens),
                _scatter_sum(grad_w_SK.wait(), route.send_token_S, route.num_tokens),
            )

        return Pending(finish)

    def combine_backward(self, route: Route, grad_y_TD: torch.Tensor) -> Pending[torch.Tensor]:
        assert isinstance(route, _A2ARoute)
        return route.exchange().forward(grad_y_TD.index_select(0, route.send_token_S))


def _make_alltoall(
    num_experts: int, group: dist.ProcessGroup | None, *, hidden_size: int, dtype: torch.dtype, comm_sms: int
) -> TokenDispatcher:
    return AllToAllDispatcher(num_experts, group)


register_dispatcher(DispatcherSpec(name="alltoall", factory=_make_alltoall))

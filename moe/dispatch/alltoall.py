"""``alltoall``: ``torch.distributed.all_to_all_single`` with per-rank split sizes (NCCL or gloo).

Legend for shape suffixes: T local tokens, S rows this rank sends (token, destination-rank pairs),
R rows it receives, K top-k slots, D hidden, W expert-parallel ranks.

Every exchange is issued with ``async_op=True`` and waited in :meth:`Pending.wait`. On NCCL the collective
runs on the process group's internal stream, ordered after the compute stream's work at issue time, and
``wait()`` makes the compute stream wait for it, so the compute queued in between overlaps. On gloo the
transfer runs in gloo's worker thread. The list form ``all_to_all`` is avoided: with uneven sizes it fails
on gloo.

Row counts travel first (``W`` integers, started in :meth:`plan` right after routing) because the receiving
buffers must be allocated before the data exchange starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from moe.dispatch.base import Dispatched, Pending, Route, TokenDispatcher
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
    recv_counts_W: torch.Tensor
    counts_work: dist.Work | None
    send_splits: list[int] = field(default_factory=list)
    recv_splits: list[int] = field(default_factory=list)
    exchanges_counts: ClassVar[bool] = True

    def wait_counts(self) -> None:
        self.splits()

    def splits(self) -> tuple[list[int], list[int]]:
        if self.counts_work is not None:
            self.counts_work.wait()
            self.counts_work = None
            self.send_splits = self.send_counts_W.tolist()
            self.recv_splits = self.recv_counts_W.tolist()
        return self.send_splits, self.recv_splits


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

    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> dist.Work:
        return dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)

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
        recv_counts_W = torch.empty_like(send_counts_W)
        work = dist.all_to_all_single(recv_counts_W, send_counts_W, group=self.group, async_op=True)
        return _A2ARoute(num_tokens, send_token_S, local_SK, send_counts_W, recv_counts_W, work)

    def dispatch(self, route: Route, x_TD: torch.Tensor, topk_weights_TK: torch.Tensor) -> Pending[Dispatched]:
        assert isinstance(route, _A2ARoute)
        send_splits, recv_splits = route.splits()
        k = topk_weights_TK.shape[1]
        x_SD = x_TD.index_select(0, route.send_token_S)
        # Ids and weights travel together in one fp32 message (ids are exact in fp32 below 2**24).
        meta_SK2 = torch.cat(
            [route.send_local_idx_SK.float(), topk_weights_TK.float().index_select(0, route.send_token_S)], dim=1
        )
        num_recv = sum(recv_splits)
        x_RD = x_TD.new_empty(num_recv, x_TD.shape[1])
        meta_RK2 = meta_SK2.new_empty(num_recv, 2 * k)
        works = [
            self._a2a(x_RD, x_SD, recv_splits, send_splits),
            self._a2a(meta_RK2, meta_SK2, recv_splits, send_splits),
        ]

        def finish() -> Dispatched:
            for w in works:
                w.wait()
            return Dispatched(x_RD, meta_RK2[:, :k].long(), meta_RK2[:, k:].contiguous())

        return Pending(finish)

    def combine(self, route: Route, y_RD: torch.Tensor) -> Pending[torch.Tensor]:
        assert isinstance(route, _A2ARoute)
        send_splits, recv_splits = route.splits()
        y_SD = y_RD.new_empty(sum(send_splits), y_RD.shape[1])
        work = self._a2a(y_SD, y_RD.contiguous(), send_splits, recv_splits)

        def finish() -> torch.Tensor:
            work.wait()
            return _scatter_sum(y_SD, route.send_token_S, route.num_tokens)

        return Pending(finish)

    def dispatch_backward(
        self, route: Route, grad_x_RD: torch.Tensor, grad_weights_RK: torch.Tensor
    ) -> Pending[tuple[torch.Tensor, torch.Tensor]]:
        assert isinstance(route, _A2ARoute)
        send_splits, recv_splits = route.splits()
        num_send = sum(send_splits)
        grad_x_SD = grad_x_RD.new_empty(num_send, grad_x_RD.shape[1])
        grad_w_SK = grad_weights_RK.new_empty(num_send, grad_weights_RK.shape[1])
        works = [
            self._a2a(grad_x_SD, grad_x_RD.contiguous(), send_splits, recv_splits),
            self._a2a(grad_w_SK, grad_weights_RK.contiguous(), send_splits, recv_splits),
        ]

        def finish() -> tuple[torch.Tensor, torch.Tensor]:
            for w in works:
                w.wait()
            return (
                _scatter_sum(grad_x_SD, route.send_token_S, route.num_tokens),
                _scatter_sum(grad_w_SK, route.send_token_S, route.num_tokens),
            )

        return Pending(finish)

    def combine_backward(self, route: Route, grad_y_TD: torch.Tensor) -> Pending[torch.Tensor]:
        assert isinstance(route, _A2ARoute)
        send_splits, recv_splits = route.splits()
        grad_y_SD = grad_y_TD.index_select(0, route.send_token_S)
        grad_y_RD = grad_y_TD.new_empty(sum(recv_splits), grad_y_TD.shape[1])
        work = self._a2a(grad_y_RD, grad_y_SD, recv_splits, send_splits)

        def finish() -> torch.Tensor:
            work.wait()
            return grad_y_RD

        return Pending(finish)


def _make_alltoall(
    num_experts: int, group: dist.ProcessGroup | None, *, hidden_size: int, dtype: torch.dtype, comm_sms: int
) -> TokenDispatcher:
    return AllToAllDispatcher(num_experts, group)


register_dispatcher(DispatcherSpec(name="alltoall", factory=_make_alltoall))

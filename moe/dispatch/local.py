"""``local``: every expert on this rank, so dispatch and combine move nothing.

With ``fp8`` it applies FP8 dispatch's round trip all the same (quantize, dequantize: :func:`moe.dispatch.fp8.
round_trip`) to the rows it dispatches and to the gradient of combine, so that one process computes exactly
what an expert-parallel run with FP8 dispatch computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe.dispatch.base import Dispatched, Pending, Route, TokenDispatcher
from moe.dispatch.fp8 import round_trip
from moe.dispatch.registry import DispatcherSpec, DispatchOptions, register_dispatcher

__all__ = ["LocalDispatcher"]


@dataclass(slots=True)
class _LocalRoute(Route):
    topk_idx_TK: torch.Tensor


class LocalDispatcher(TokenDispatcher):
    """No expert parallelism: received rows are the local tokens, local expert ids are the global ones.

    It never syncs the host, so ``sync_free`` changes nothing (it is accepted for a uniform interface).
    ``fp8``: the rows dispatched and the gradient of combine go through FP8 dispatch's round trip.
    """

    def __init__(self, num_experts: int, *, sync_free: bool = False, fp8: bool = False) -> None:
        super().__init__(num_experts, ep_size=1, ep_rank=0)
        self.sync_free = sync_free
        self.fp8 = fp8

    def plan(self, topk_idx_TK: torch.Tensor) -> Route:
        return _LocalRoute(topk_idx_TK)

    def dispatch(self, route: Route, x_TD: torch.Tensor, topk_weights_TK: torch.Tensor) -> Pending[Dispatched]:
        assert isinstance(route, _LocalRoute)
        x_RD = round_trip(x_TD) if self.fp8 else x_TD
        return Pending.done(Dispatched(x_RD, route.topk_idx_TK, topk_weights_TK))

    def combine(self, route: Route, y_RD: torch.Tensor) -> Pending[torch.Tensor]:
        return Pending.done(y_RD)

    def dispatch_backward(
        self, route: Route, grad_x_RD: torch.Tensor, grad_weights_RK: torch.Tensor
    ) -> Pending[tuple[torch.Tensor, torch.Tensor]]:
        return Pending.done((grad_x_RD, grad_weights_RK))

    def combine_backward(self, route: Route, grad_y_TD: torch.Tensor) -> Pending[torch.Tensor]:
        return Pending.done(round_trip(grad_y_TD) if self.fp8 else grad_y_TD)


def _make_local(num_experts: int, group: dist.ProcessGroup | None, options: DispatchOptions) -> TokenDispatcher:
    return LocalDispatcher(num_experts, sync_free=options.sync_free, fp8=options.fp8)


register_dispatcher(DispatcherSpec(name="local", factory=_make_local, sync_free=True, fp8=True))

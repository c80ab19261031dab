"""The token-dispatcher interface shared by every backend.

Legend for shape suffixes: T local tokens, R rows received by this rank, K top-k slots, D hidden,
W expert-parallel ranks.

Semantics (DeepEP's): ``dispatch`` sends every token once to each rank that holds at least one of its
experts, with all K routing weights and the K expert ids rewritten to that rank's local ids (-1 for slots
served elsewhere). The expert side weights and sums its own slots into one row per received token, and
``combine`` sums those partial rows back into the token's rank. Sending a token once per rank rather than
once per expert is what the V3 report's node-limited routing relies on to cut traffic.

Every operation returns a :class:`Pending`: the communication is started, and ``wait()`` is called
where the result is consumed. A backend with nothing to send returns an already-finished one.

FP8 dispatch (``fp8``, :mod:`moe.dispatch.fp8`): ``dispatch`` and ``combine_backward`` move token rows in FP8
with their 1x128 scales and return them dequantized to the dtype they were given; ``combine`` and
``dispatch_backward`` move the model dtype. Gradients treat the quantization as the identity.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from dualpipe.collectives import Pending
from moe.dispatch.traffic import Traffic

__all__ = ["DEFAULT_COMM_SMS", "Dispatched", "Pending", "Route", "TokenDispatcher"]

# SMs reserved for communication kernels (DeepEP's Buffer.set_num_sms, NCCL's CTA cap) while the grouped
# GEMM runs on the rest: DeepSeek-V3 gives 20 of the H800's 132 SMs to all-to-all, enough to saturate IB
# and NVLink (technical report, section 3.2.2).
DEFAULT_COMM_SMS = 20


@dataclass(slots=True)
class Dispatched:
    """Rows one rank received for its experts."""

    x_RD: torch.Tensor
    """Token rows, grouped by source rank (ascending), token order within a source."""
    local_idx_RK: torch.Tensor
    """int64 local expert ids per slot; -1 where the slot's expert is on another rank."""
    weights_RK: torch.Tensor
    """fp32 routing weights of all K slots of the token."""


class Route:
    """Per-micro-batch, per-layer bookkeeping a backend keeps between dispatch, combine and their backward."""

    exchanges_counts: ClassVar[bool] = False
    """Whether :meth:`TokenDispatcher.plan` starts an exchange of row counts that ``dispatch`` must wait
    for (uneven all-to-all: the receive buffers are sized from them)."""

    defers_dispatch: ClassVar[bool] = False
    """Whether ``dispatch`` itself blocks the host until the peers' row counts arrive (DeepEP's non-cached
    dispatch busy-waits on its host-mapped counter): the overlap then starts it one compute piece of the other
    micro-batch later, so that compute is already queued on the device while the host waits."""

    def wait_counts(self) -> None:
        """Finish the row-count exchange :meth:`TokenDispatcher.plan` started (no-op without one)."""


class TokenDispatcher(ABC):
    """Moves token rows to the ranks that hold their experts and back."""

    sync_free: bool = False
    """Worst-case receive buffers, no host sync in dispatch or combine (backends that have the mode set it
    per instance); the expert computation then sizes its rows statically too."""

    fp8: bool = False
    """FP8 dispatch: ``dispatch`` and ``combine_backward`` send FP8 rows with their scales (backends that can set
    it per instance)."""

    def __init__(self, num_experts: int, ep_size: int, ep_rank: int) -> None:
        if num_experts % ep_size:
            raise ValueError(f"num_experts={num_experts} is not divisible by the expert-parallel size {ep_size}")
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.ep_rank = ep_rank
        self.num_local_experts = num_experts // ep_size
        self.traffic: Traffic | None = None
        """Set a :class:`~moe.dispatch.traffic.Traffic` to count what the all-to-alls send (None: not counted)."""

    def count(self, kind: str, rows: int | torch.Tensor, row_bytes: int, meta_row_bytes: int = 0) -> None:
        """Add one all-to-all to :attr:`traffic`, if it is counted (see :meth:`Traffic.add`)."""
        if self.traffic is not None:
            self.traffic.add(kind, rows, row_bytes, meta_row_bytes)

    @property
    def local_experts(self) -> range:
        """Global ids of the experts this rank holds (contiguous block)."""
        return range(self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts)

    @property
    def communicates(self) -> bool:
        """Whether dispatch/combine move data between ranks (False: nothing to overlap)."""
        return self.ep_size > 1

    @property
    def comm_stream(self) -> Any:
        """The CUDA stream this backend's transfers run on, where it exposes one (DeepEP's comm stream), so
        that profiling records a transfer's end there; None: not exposed (NCCL's is internal) or not CUDA."""
        return None

    def warm_up(
        self, num_tokens: int, top_k: int, hidden_size: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        """Run every transfer once at a step's shapes, so that the first step builds and compiles nothing.

        ``num_tokens`` tokens per rank (a micro-batch's batch x sequence), each routed to ``top_k`` experts, rows of
        ``hidden_size`` in ``dtype`` (sent as FP8 when the dispatcher was built with :attr:`fp8`): dispatch,
        combine and both backward directions run once on random routing (its own generator; the global RNG is
        untouched) and nothing is counted in :attr:`traffic`. That builds what a backend builds lazily and
        compiles what it compiles on first use (DeepEP V2's buffer and JIT kernels, NCCL's communicators), and
        waits for the device to finish. Collective over the group: every rank calls it with the same shapes.
        Without communication (:attr:`communicates` False) there is nothing to warm.
        """
        if not self.communicates:
            return
        device = torch.device(device)
        gen = torch.Generator(device).manual_seed(self.ep_rank)
        scores_TE = torch.rand(num_tokens, self.num_experts, generator=gen, device=device)
        topk_idx_TK = scores_TE.topk(top_k, dim=1).indices  # distinct experts per token, as a router picks
        weights_TK = torch.full((num_tokens, top_k), 1.0 / top_k, device=device)
        x_TD = torch.zeros(num_tokens, hidden_size, dtype=dtype, device=device)
        traffic, self.traffic = self.traffic, None
        try:
            route = self.plan(topk_idx_TK)
            got = self.dispatch(route, x_TD, weights_TK).wait()
            self.combine(route, got.x_RD).wait()
            self.dispatch_backward(route, got.x_RD, got.weights_RK).wait()
            self.combine_backward(route, x_TD).wait()
        finally:
            self.traffic = traffic
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def close(self) -> None:
        """Release what the backend holds beyond Python objects; the clean path calls it once on every rank
        before ``destroy_process_group`` (it may synchronise with peers). Default: nothing to release."""
        return

    @abstractmethod
    def plan(self, topk_idx_TK: torch.Tensor) -> Route:
        """Work out where every token goes; may start the (small) count exchange asynchronously."""

    @abstractmethod
    def dispatch(self, route: Route, x_TD: torch.Tensor, topk_weights_TK: torch.Tensor) -> Pending[Dispatched]:
        """Start sending token rows and routing weights to the expert ranks."""

    @abstractmethod
    def combine(self, route: Route, y_RD: torch.Tensor) -> Pending[torch.Tensor]:
        """Start sending expert outputs back; the result is ``[T, D]``, summed over ranks."""

    @abstractmethod
    def dispatch_backward(
        self, route: Route, grad_x_RD: torch.Tensor, grad_weights_RK: torch.Tensor
    ) -> Pending[tuple[torch.Tensor, torch.Tensor]]:
        """Gradient of dispatch (combine direction): returns ``([T, D], [T, K])``."""

    @abstractmethod
    def combine_backward(self, route: Route, grad_y_TD: torch.Tensor) -> Pending[torch.Tensor]:
        """Gradient of combine (dispatch direction): returns ``[R, D]``."""

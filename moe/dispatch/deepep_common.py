"""What the ``deepep`` (V1 ``Buffer``) and ``deepep-v2`` (V2 ``ElasticBuffer``) dispatchers share.

Legend for shape suffixes: T local tokens, R received rows, K top-k slots, D hidden.

Both import ``deep_ep`` lazily (it only exists where it was built, on GPU machines), hand it routing in the
dtypes its host asserts require, and read back local expert ids in the dtype the rest of the project uses.
:class:`DeepEPBase` holds what the two APIs do alike: combine, the gradient of dispatch (a ``combine`` with
``topk_weights``) and the gradient of combine (a cached ``dispatch`` along the forward handle), each waited in
``Pending.wait()``, and the traffic counts. A backend states how it routes (:meth:`DeepEPBase.plan`,
:meth:`DeepEPBase.dispatch`), the keywords every launch takes (:meth:`DeepEPBase._launch_kwargs`) and the rows
a dispatch sends (:meth:`DeepEPBase._sent_rows`).
"""

from __future__ import annotations

import importlib
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from kernels.fp8 import Quantized, quantize_rows
from moe.dispatch.base import Dispatched, Pending, Route, TokenDispatcher
from moe.dispatch.fp8 import wire_row_bytes

__all__ = [
    "DeepEPBase",
    "DeepEPRoute",
    "as_local_idx",
    "as_topk_idx",
    "as_topk_weights",
    "dispatch_input",
    "dispatch_output",
    "import_deep_ep",
    "received_rows",
    "row_bytes",
    "sent_rows",
]


def dispatch_input(x_TD: torch.Tensor, fp8: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Rows as DeepEP's dispatch takes them: dense, in their dtype; or, with ``fp8``, the pair ``(x, scales)``
    in 1x128 tiles (:func:`kernels.fp8.quantize_rows`)."""
    return tuple(quantize_rows(x_TD)) if fp8 else x_TD.contiguous()


def dispatch_output(
    recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor], dtype: torch.dtype, fp8: bool
) -> torch.Tensor:
    """Received rows in ``dtype``: the FP8 pair dequantized (rows past a sync-free dispatch's received count hold
    whatever DeepEP left there, and no expert reads them)."""
    return Quantized(*recv_x).dequantize(dtype) if fp8 else recv_x


def import_deep_ep(install_hint: str, *, needs: str | None = None) -> Any:
    """Import ``deep_ep`` lazily; a missing or unusable install raises ImportError with ``install_hint``.

    ``needs``: an attribute the backend uses (``ElasticBuffer``: DeepEP >= 2.0), checked so that an older
    build fails here, in words, rather than with an AttributeError later.
    """
    try:
        module = importlib.import_module("deep_ep")
    except ImportError as exc:
        raise ImportError(install_hint) from exc
    except AssertionError as exc:
        # DeepEP 2.x checks at import that the libnccl loaded in this process is byte-identical to the one it
        # links (deep_ep/__init__.py ``check_nccl_so``), and asserts; torch's bundled NCCL usually differs.
        raise ImportError(
            f"'import deep_ep' failed its NCCL check ({exc}): the libnccl loaded by torch is not the one DeepEP "
            f"was built against (DeepEP 2.x needs NCCL >= 2.30.4). {install_hint}"
        ) from exc
    if needs is not None and not hasattr(module, needs):
        version = getattr(module, "__version__", "unknown")
        raise ImportError(f"the installed deep_ep (version {version}) has no {needs}. {install_hint}")
    return module


def buffer_comm_stream(buffer: Any) -> Any:
    """A built DeepEP buffer's communication stream on CUDA, else None. Both APIs have it:
    ``Buffer.get_comm_stream()`` (V1, deep_ep/buffer.py:191 at 567632d) and ``ElasticBuffer.get_comm_stream()``
    (V2, deep_ep/buffers/elastic.py:539)."""
    if buffer is None or not torch.cuda.is_available():
        return None
    return buffer.get_comm_stream()


def row_bytes(hidden_size: int, dtype: torch.dtype) -> int:
    """Bytes of one row of ``hidden_size`` elements of ``dtype``."""
    return hidden_size * dtype.itemsize


def as_topk_idx(topk_idx_TK: torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """``[T, K]`` expert ids as DeepEP's ``topk_idx_t`` (int64 unless built otherwise), dense: its host
    asserts check dtype and contiguity rather than converting."""
    return topk_idx_TK.to(dtype).contiguous()


def as_topk_weights(weights_TK: torch.Tensor) -> torch.Tensor:
    """``[T, K]`` routing weights (or their gradients) as DeepEP takes them: fp32, dense."""
    return weights_TK.float().contiguous()


def as_local_idx(recv_topk_idx_RK: torch.Tensor) -> torch.Tensor:
    """DeepEP's received ``[R, K]`` local expert ids (-1: another rank's expert) as the project's int64."""
    return recv_topk_idx_RK.long()


def received_rows(local_idx_RK: torch.Tensor) -> torch.Tensor:
    """Rows a dispatch delivered, as a device count: each has a slot of this rank's (padding has none)."""
    return (local_idx_RK >= 0).any(dim=1).sum()


def sent_rows(topk_idx_TK: torch.Tensor, num_local_experts: int, num_ranks: int) -> torch.Tensor:
    """(token, rank) pairs a dispatch sends, as a device count: each token once to every rank holding one of its
    experts (slots of -1 go nowhere)."""
    rank_TK = torch.where(topk_idx_TK >= 0, topk_idx_TK // num_local_experts, num_ranks)
    in_rank = torch.zeros(topk_idx_TK.shape[0], num_ranks + 1, dtype=torch.bool, device=topk_idx_TK.device)
    return in_rank.scatter_(1, rank_TK, True)[:, :num_ranks].sum()


_T = TypeVar("_T")


def _after(event: Any, result: Callable[[], _T]) -> Pending[_T]:
    """A launch's result, read once the compute stream waited for its ``event`` (``EventOverlap``)."""

    def finish() -> _T:
        event.current_stream_wait()
        return result()

    return Pending(finish)


@dataclass(slots=True)
class DeepEPRoute(Route):
    """What one micro-batch's layer keeps between DeepEP's dispatch, combine and their backward."""

    topk_idx_TK: torch.Tensor
    """``[T, K]`` expert ids in the dtype DeepEP asserts (:func:`as_topk_idx`)."""
    handle: Any = None
    """The forward dispatch's handle: combine and both backward directions run along it."""
    defers_dispatch: bool = True
    """A host-synced dispatch waits on the host for the received counts (not so in the sync-free mode)."""
    recv_rows: Any = None
    """Rows the dispatch delivered (padding excluded), where :attr:`TokenDispatcher.traffic` counts them."""


class DeepEPBase(TokenDispatcher):
    """Expert parallelism through one DeepEP buffer (``self.buffer``; None before it is built or once closed).

    ``sync_free``: worst-case receive allocation, no host sync in dispatch. ``fp8``: FP8 dispatch, the pair
    ``(x, scales)`` in the dispatch direction (:func:`dispatch_input`, :func:`dispatch_output`).
    """

    buffer: Any

    def __init__(self, num_experts: int, group: dist.ProcessGroup, *, sync_free: bool, fp8: bool) -> None:
        super().__init__(num_experts, dist.get_world_size(group), dist.get_rank(group))
        self.sync_free = sync_free
        self.fp8 = fp8

    @property
    def comm_stream(self) -> Any:
        return buffer_comm_stream(self.buffer)

    def close(self) -> None:
        """Release the buffer (its ``destroy()``: a device sync and a barrier with the peers).

        Call it on every rank on the clean path, before ``destroy_process_group``; never on an error path,
        where a peer may never reach the barrier. A second call does nothing.
        """
        if self.buffer is not None:
            buffer, self.buffer = self.buffer, None
            buffer.destroy()

    @abstractmethod
    def _launch_kwargs(self) -> dict[str, Any]:
        """The keywords every launch on the buffer takes: its stream order, SMs. Called once a launch's inputs are
        made (V1 captures the compute stream's progress in it)."""

    @abstractmethod
    def _sent_rows(self, route: DeepEPRoute) -> torch.Tensor:
        """(token, rank) pairs a dispatch along ``route`` sends, as a device count."""

    def _count_sent(self, kind: str, route: DeepEPRoute, x_TD: torch.Tensor, meta_row_bytes: int = 0) -> None:
        """Count a dispatch-direction exchange of ``x_TD``'s rows (FP8 on the wire under :attr:`fp8`)."""
        if self.traffic is not None:
            row_bytes = wire_row_bytes(x_TD.shape[1], x_TD.dtype, self.fp8)
            self.count(kind, self._sent_rows(route), row_bytes, meta_row_bytes)

    def _count_back(self, kind: str, route: DeepEPRoute, x_RD: torch.Tensor, meta_row_bytes: int = 0) -> None:
        """Count a combine-direction exchange: the rows the dispatch delivered go back."""
        if self.traffic is not None and route.recv_rows is not None:
            self.count(kind, route.recv_rows, x_RD.shape[1] * x_RD.element_size(), meta_row_bytes)

    def _received(
        self,
        route: DeepEPRoute,
        recv_x: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        local_idx_RK: torch.Tensor,
        weights_RK: torch.Tensor,
        dtype: torch.dtype,
    ) -> Dispatched:
        """A waited dispatch's rows, in ``dtype``; the rows delivered noted for the combine-direction counts."""
        if self.traffic is not None:
            route.recv_rows = received_rows(local_idx_RK)
        return Dispatched(dispatch_output(recv_x, dtype, self.fp8), local_idx_RK, weights_RK)

    def combine(self, route: Route, y_RD: torch.Tensor) -> Pending[torch.Tensor]:
        assert isinstance(route, DeepEPRoute)
        self._count_back("combine", route, y_RD)
        # Arguments are evaluated in order: V1's event is captured after the copy that makes y contiguous.
        combined_x, _, event = self.buffer.combine(y_RD.contiguous(), route.handle, **self._launch_kwargs())
        return _after(event, lambda: combined_x)

    def dispatch_backward(
        self, route: Route, grad_x_RD: torch.Tensor, grad_weights_RK: torch.Tensor
    ) -> Pending[tuple[torch.Tensor, torch.Tensor]]:
        assert isinstance(route, DeepEPRoute)
        self._count_back("dispatch_backward", route, grad_x_RD, grad_weights_RK.shape[1] * 4)  # fp32 to DeepEP
        # V2's combine returns, for slot k of a token, the weight gradient sent by the rank holding that slot's
        # expert (combine_reduce_epilogue.cuh:127-141): the other ranks' entries are zero, as here.
        grad_x_TD, grad_w_TK, event = self.buffer.combine(
            grad_x_RD.contiguous(),
            route.handle,
            topk_weights=as_topk_weights(grad_weights_RK),
            **self._launch_kwargs(),
        )
        return _after(event, lambda: (grad_x_TD, grad_w_TK))

    def combine_backward(self, route: Route, grad_y_TD: torch.Tensor) -> Pending[torch.Tensor]:
        assert isinstance(route, DeepEPRoute)
        dtype = grad_y_TD.dtype
        self._count_sent("combine_backward", route, grad_y_TD)
        # Cached mode: the forward handle's layout, no count exchange and no host wait (V2: buffer.hpp:1011-1016).
        # Arguments are evaluated in order: V1's event is captured after the rows are made.
        grad_y, *_, event = self.buffer.dispatch(
            dispatch_input(grad_y_TD, self.fp8), handle=route.handle, **self._launch_kwargs()
        )
        return _after(event, lambda: dispatch_output(grad_y, dtype, self.fp8))

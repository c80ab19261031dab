"""``emulated``: the expert all-to-all stood in for on one device, over a link of a given bandwidth.

Legend for shape suffixes: T local tokens (also the rows received: this device holds every expert), K top-k
slots, D hidden, W ranks of the modelled expert-parallel group.

What it computes is ``local``'s (every expert on this device, so the received rows are the tokens in order and
the local expert ids are the global ones); what it costs is what one rank of a ``W``-way all-to-all over a link
of ``gbps`` GB/s (1e9 bytes a second) would wait. Each transfer copies the rows it returns (on the device's
communication stream on CUDA, in a background thread elsewhere) and does not finish before
``bytes / (gbps * 1e9)`` seconds, with those bytes:

- the rows that would leave the rank: the device plays rank 0 of a ``W``-way group whose ranks hold contiguous
  blocks of ``num_experts / W`` experts, and a token goes once to every rank that holds one of its experts
  (:mod:`moe.dispatch.base`), so a token leaves once per *other* rank among its experts' ranks. Its own share
  stays on the rank and costs nothing. The other ranks are assumed to route alike, so the rank receives what
  it sends and the combine direction returns the same (token, rank) pairs: every one of a layer's four
  transfers charges the same row count, ``sum over tokens of |{ranks of its experts} - {0}|``;
- times the bytes ``alltoall`` puts on the wire per row for that transfer: dispatch, a row
  (:func:`moe.dispatch.fp8.wire_row_bytes`: FP8 values and scales under FP8 dispatch) plus the K expert ids
  and K weights in fp32; combine, a row of the expert output's dtype; the gradient of dispatch, a gradient row
  plus the K weight gradients; the gradient of combine, a row as dispatch sends it.

The row counts per modelled rank are read on the host once per layer, as ``alltoall`` reads its exchanged
counts (the route's ``exchanges_counts``): computed on the device in :meth:`plan`, copied to the host behind an
event, read when the dispatch starts. That small exchange is charged no link time.

On CUDA a transfer runs on the dispatcher's own stream (:attr:`comm_stream`), after the work already queued on
the issuing stream, as NCCL runs a collective: the copy, then ``torch.cuda._sleep`` (one block of one thread,
ATen's ``spin_kernel``, spinning a number of SM clock cycles) for the link time, cycles per second measured
once per device against CUDA events. ``wait()`` makes the current stream wait for the transfer; the host does
not. The copy's own time (HBM speed) adds to the link time; a GPU clock that moves under load after the
measurement stretches or shortens the spin (the CUDA-event timeline shows the real span). The SMs: the
transfer itself holds one SM while it spins; the grouped GEMMs leave ``comm_sms`` free as they do beside a real
all-to-all, because the stage is built with the same ``comm_sms`` whichever dispatcher it has.

Elsewhere a transfer runs in the dispatcher's one background thread (one link: transfers go in issue order,
each timed from when the thread takes it up), which copies the rows and sleeps for the rest of the link time;
``wait()`` blocks until the thread is done with it, so compute run between the start and the wait hides it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from moe.dispatch.base import Dispatched, Pending, Route, TokenDispatcher
from moe.dispatch.fp8 import pack_rows, unpack_rows, wire_row_bytes
from moe.dispatch.registry import DispatcherSpec, DispatchOptions, Launch, register_dispatcher
from moe.dispatch.traffic import KINDS

__all__ = ["DEFAULT_EP", "DEFAULT_GBPS", "LINK_KERNEL", "Charge", "EmulatedDispatcher"]

DEFAULT_GBPS = 50.0
"""GB/s: one GPU's share of the inter-node link in DeepSeek-V3's cluster (a 400 Gb/s InfiniBand NIC per GPU)."""

DEFAULT_EP = 8
"""Ranks of the modelled expert-parallel group: one node of 8 GPUs."""

LINK_KERNEL = "spin_kernel"
"""Name of the kernel ``torch.cuda._sleep`` launches (ATen's ``at::cuda::sleep``): in a profiler trace, the
stream that runs it is this dispatcher's communication stream."""

_CALIBRATION_CYCLES = 1 << 24  # about 8 ms at 2 GHz: long against the events' resolution and launch jitter


@dataclass(slots=True)
class Charge:
    """What the link was charged for one kind of transfer, summed since the counters were last cleared."""

    transfers: int = 0
    rows: int = 0
    """Rows that left the modelled rank."""
    bytes: int = 0
    seconds: float = 0.0
    """Link time, ``bytes / (gbps * 1e9)``."""


@dataclass(slots=True)
class _EmulatedRoute(Route):
    topk_idx_TK: torch.Tensor
    counts: Pending[list[int]]
    """(token, rank) pairs per modelled rank, read on the host."""
    exchanges_counts: ClassVar[bool] = True

    def wait_counts(self) -> None:
        self.counts.wait()

    @property
    def leaving_rows(self) -> int:
        """Rows that leave rank 0: its pairs with every other rank."""
        return sum(self.counts.wait()[1:])

    @property
    def pairs(self) -> int:
        """Every (token, rank) pair, the rank's own share included (what ``alltoall`` counts as traffic)."""
        return sum(self.counts.wait())


def _host_counts(counts_W: torch.Tensor) -> Pending[list[int]]:
    """``counts_W`` read on the host when waited; on CUDA copied behind an event as soon as it is computed, so
    that the read waits for those few bytes only, not for compute queued after them."""
    if counts_W.device.type != "cuda":
        return Pending(counts_W.tolist)
    host_W = counts_W.to("cpu", non_blocking=True)  # into pinned memory (torch pins a non-blocking copy's output)
    landed = torch.cuda.Event()
    landed.record(torch.cuda.current_stream(counts_W.device))

    def read() -> list[int]:
        landed.synchronize()
        return host_W.tolist()

    return Pending(read)


class _Link:
    """One link: moves tensors and takes ``bytes / (gbps * 1e9)`` seconds doing it (see the module docstring)."""

    def __init__(self, gbps: float) -> None:
        self.gbps = gbps
        self.stream: Any = None
        self._cycles_per_s = 0.0
        self._thread: ThreadPoolExecutor | None = None

    def seconds(self, nbytes: int) -> float:
        return nbytes / (self.gbps * 1e9)

    def send(self, tensors: Sequence[torch.Tensor], seconds: float) -> Pending[list[torch.Tensor]]:
        """Start moving ``tensors``; the ``Pending`` gives copies of them once the link time has passed."""
        if tensors[0].device.type == "cuda":
            return self._send_cuda(tensors, seconds)
        return self._send_thread(tensors, seconds)

    def _send_thread(self, tensors: Sequence[torch.Tensor], seconds: float) -> Pending[list[torch.Tensor]]:
        sent = [t.detach() for t in tensors]  # the thread builds no autograd graph (grad mode is per thread)

        def move() -> list[torch.Tensor]:
            began = time.perf_counter()
            got = [t.clone() for t in sent]
            time.sleep(max(0.0, began + seconds - time.perf_counter()))
            return got

        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="emulated-link")
        return Pending(self._thread.submit(move).result)

    def _send_cuda(self, tensors: Sequence[torch.Tensor], seconds: float) -> Pending[list[torch.Tensor]]:
        device = tensors[0].device
        if self.stream is None:
            self.stream = torch.cuda.Stream(device=device)
            self._cycles_per_s = _cycles_per_second(device)
        elif self.stream.device != device:
            raise ValueError(f"the emulated link runs on {self.stream.device}; got tensors on {device}")
        issuing = torch.cuda.current_stream(device)
        # Allocated on the issuing stream, where they are used and freed; record_stream below keeps them (and
        # the inputs) from being reused before the link's stream is done with them.
        got = [torch.empty_like(t) for t in tensors]
        self.stream.wait_stream(issuing)  # the inputs are computed there
        with torch.cuda.stream(self.stream):
            for out, t in zip(got, tensors, strict=True):
                out.copy_(t)
            if seconds > 0:
                torch.cuda._sleep(round(seconds * self._cycles_per_s))
            landed = torch.cuda.Event()
            landed.record(self.stream)
        for t in (*tensors, *got):
            t.record_stream(self.stream)

        def finish() -> list[torch.Tensor]:
            torch.cuda.current_stream(device).wait_event(landed)
            return got

        return Pending(finish)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None


def _cycles_per_second(device: torch.device) -> float:
    """SM clock cycles ``torch.cuda._sleep`` spins per second on ``device``, measured with CUDA events."""
    with torch.cuda.device(device):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # The first spin loads the kernel and lets an idle GPU's clock ramp up; the second is measured.
        for _ in range(2):
            begin.record()
            torch.cuda._sleep(_CALIBRATION_CYCLES)
            end.record()
            end.synchronize()
        return _CALIBRATION_CYCLES / (begin.elapsed_time(end) * 1e-3)


class EmulatedDispatcher(TokenDispatcher):
    """Every expert on this device, each transfer timed as rank 0 of an ``ep``-way all-to-all over a link of
    ``gbps`` GB/s (see the module docstring for the bytes charged and how the time is produced).

    ``fp8``: FP8 dispatch, as ``alltoall`` sends it (rows packed with their scales, dequantized on arrival), so
    the results equal ``local``'s with ``fp8``. :attr:`charged` holds the link's charges per kind of transfer.
    """

    def __init__(self, num_experts: int, *, gbps: float = DEFAULT_GBPS, ep: int = DEFAULT_EP, fp8: bool = False):
        super().__init__(num_experts, ep_size=1, ep_rank=0)
        if not gbps > 0:  # also refuses NaN
            raise ValueError(f"the emulated link needs a bandwidth > 0 GB/s, got {gbps}")
        if ep < 1 or num_experts % ep:
            raise ValueError(f"the modelled ep={ep} must be >= 1 and divide num_experts={num_experts}")
        self.modelled_ep = ep
        self.fp8 = fp8
        self.charged: dict[str, Charge] = {kind: Charge() for kind in KINDS}
        """Link charges per kind of transfer (:data:`moe.dispatch.traffic.KINDS`); reset with :meth:`clear_charges`."""
        self._link = _Link(gbps)

    @property
    def gbps(self) -> float:
        return self._link.gbps

    @property
    def communicates(self) -> bool:
        return True  # one rank, but every transfer takes the link's time: there is something to overlap

    @property
    def comm_stream(self) -> Any:
        return self._link.stream

    def clear_charges(self) -> None:
        self.charged = {kind: Charge() for kind in KINDS}

    def close(self) -> None:
        self._link.close()

    def _send(
        self, kind: str, route: _EmulatedRoute, tensors: Sequence[torch.Tensor], row_bytes: int, meta_bytes: int = 0
    ) -> Pending[list[torch.Tensor]]:
        """Charge ``kind`` for the rows that leave the rank and start moving ``tensors``."""
        rows = route.leaving_rows
        self.count(kind, route.pairs, row_bytes, meta_bytes)
        nbytes = rows * (row_bytes + meta_bytes)
        seconds = self._link.seconds(nbytes)
        charge = self.charged[kind]
        charge.transfers, charge.rows, charge.bytes = charge.transfers + 1, charge.rows + rows, charge.bytes + nbytes
        charge.seconds += seconds
        return self._link.send(tensors, seconds)

    def _send_rows(
        self, kind: str, route: _EmulatedRoute, x_TD: torch.Tensor, extra: Sequence[torch.Tensor], meta_bytes: int
    ) -> Pending[list[torch.Tensor]]:
        """The dispatch direction: ``x_TD`` (packed as FP8 under :attr:`fp8`) and ``extra``; the ``Pending`` gives
        the rows in ``x_TD``'s dtype, then ``extra``'s copies."""
        hidden, dtype = x_TD.shape[1], x_TD.dtype
        row_bytes = wire_row_bytes(hidden, dtype, self.fp8)
        moved = self._send(kind, route, [pack_rows(x_TD) if self.fp8 else x_TD, *extra], row_bytes, meta_bytes)

        def arrive() -> list[torch.Tensor]:
            rows, *rest = moved.wait()
            return [unpack_rows(rows, hidden, dtype) if self.fp8 else rows, *rest]

        return Pending(arrive)

    def plan(self, topk_idx_TK: torch.Tensor) -> Route:
        num_tokens, _ = topk_idx_TK.shape
        ranks = self.modelled_ep
        in_rank_WT = torch.zeros(ranks, num_tokens, dtype=torch.bool, device=topk_idx_TK.device)
        in_rank_WT.scatter_(0, (topk_idx_TK // (self.num_experts // ranks)).t(), True)
        return _EmulatedRoute(topk_idx_TK, _host_counts(in_rank_WT.sum(1)))

    def dispatch(self, route: Route, x_TD: torch.Tensor, topk_weights_TK: torch.Tensor) -> Pending[Dispatched]:
        assert isinstance(route, _EmulatedRoute)
        k = topk_weights_TK.shape[1]
        meta_bytes = 2 * k * torch.float32.itemsize  # ids and weights, in fp32 as alltoall sends them
        moved = self._send_rows("dispatch", route, x_TD, [topk_weights_TK], meta_bytes)

        def finish() -> Dispatched:
            x_RD, weights_RK = moved.wait()
            return Dispatched(x_RD, route.topk_idx_TK, weights_RK)

        return Pending(finish)

    def combine(self, route: Route, y_RD: torch.Tensor) -> Pending[torch.Tensor]:
        assert isinstance(route, _EmulatedRoute)
        moved = self._send("combine", route, [y_RD], y_RD.shape[1] * y_RD.element_size())
        return Pending(lambda: moved.wait()[0])

    def dispatch_backward(
        self, route: Route, grad_x_RD: torch.Tensor, grad_weights_RK: torch.Tensor
    ) -> Pending[tuple[torch.Tensor, torch.Tensor]]:
        assert isinstance(route, _EmulatedRoute)
        row_bytes = grad_x_RD.shape[1] * grad_x_RD.element_size()
        meta_bytes = grad_weights_RK.shape[1] * grad_weights_RK.element_size()
        moved = self._send("dispatch_backward", route, [grad_x_RD, grad_weights_RK], row_bytes, meta_bytes)
        return Pending(lambda: tuple(moved.wait()))

    def combine_backward(self, route: Route, grad_y_TD: torch.Tensor) -> Pending[torch.Tensor]:
        assert isinstance(route, _EmulatedRoute)
        moved = self._send_rows("combine_backward", route, grad_y_TD, [], 0)
        return Pending(lambda: moved.wait()[0])


def _one_rank(launch: Launch) -> list[str]:
    ranks = launch.group_size
    if ranks is not None and ranks > 1:
        return [f"an expert group of one rank (it stands in for the all-to-all on one device; got {ranks} ranks)"]
    return []


def _make_emulated(num_experts: int, group: dist.ProcessGroup | None, options: DispatchOptions) -> TokenDispatcher:
    return EmulatedDispatcher(num_experts, fp8=options.fp8)


register_dispatcher(DispatcherSpec(name="emulated", factory=_make_emulated, fp8=True, rules=_one_rank))

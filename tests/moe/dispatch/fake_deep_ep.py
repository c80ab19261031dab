"""An emulation of DeepEP's V1 ``deep_ep.Buffer`` (intranode, high-throughput path) on torch.distributed.

DeepEP's kernels need 2-8 NVLink-connected GPUs, so tests inject this module as ``deep_ep``. It keeps the
public surface the ``deepep`` dispatcher relies on, with DeepEP's documented semantics:

* ``get_dispatch_layout`` -> ``(num_tokens_per_rank [W] int32, None, num_tokens_per_expert [E] int32,
  is_token_in_rank [T, W] bool, event)`` (``None``: no RDMA ranks intranode);
* ``dispatch`` sends each token once per destination rank; received rows are grouped by source rank
  (ascending) in source token order; ``recv_topk_idx`` holds local expert ids with -1 for experts on other
  ranks (their weights zeroed); ``num_recv_tokens_per_expert_list`` is a Python list aligned to
  ``expert_alignment``; with a ``handle`` (cached mode) ``topk_idx``/``topk_weights`` must be None and only
  ``recv_x`` comes back;
* ``combine`` sends rows back along the handle and sums them per source token (and ``topk_weights`` too);
* ``async_finish=True`` returns an ``EventOverlap`` whose ``current_stream_wait()`` must be called before
  the results are read: here the outputs are filled by gloo's worker thread and finished in that wait.
  ``allocate_on_comm_stream`` requires a ``previous_event``, as in DeepEP.

The receive counts are exchanged synchronously inside ``dispatch``, like DeepEP's CPU-side wait for its
``notify_dispatch`` counters. ``num_worst_tokens > 0`` (no CPU sync in DeepEP) allocates that many received
rows instead, as DeepEP does: the real rows first, then ``recv_topk_idx`` -1 and rows, source ids and weights
left unwritten (NaN here, -1 for ids, so a consumer that reads them shows it); the counts list comes back empty,
the handle keeps the padded size (cached dispatch returns it, combine takes it). It needs ``topk_idx`` and
``topk_weights``; receiving more than ``num_worst_tokens`` rows would overrun DeepEP's buffers, a device
assert here.

FP8 input (``x=(x_fp8, x_scales)``, deep_ep/buffer.py ``dispatch``) is taken as DeepEP takes it: with or without
a handle, the received rows come back as the pair ``(recv_x, recv_x_scales)``; the host checks of
csrc/deep_ep.cpp ``intranode_dispatch`` hold (x of 1-byte elements, x_scales 2-D, float32 or int, one row per
token; any number of scales per row and any strides, which the kernels read: the documented ``hidden // 128``
scales are the caller's contract, not checked by DeepEP); the row-size limits apply to the 1-byte rows.
gloo takes no float8 tensors: 1-byte rows travel as uint8.

It is as strict as DeepEP where DeepEP would fail: rows in bf16 (dispatch as documented, or an fp8 pair; combine
has one dtype case), contiguous 2-D inputs, int64 ``topk_idx``, fp32 ``topk_weights``, an even, positive SM count,
intranode rows of whole 32-byte pairs up to 16,368 bytes. A host check fails as DeepEP's ``EP_HOST_ASSERT``
does (a RuntimeError, "Assertion exception"), a kernel's ``EP_DEVICE_ASSERT`` as a CUDA error would, and the
Python-level asserts of ``deep_ep/buffers/legacy.py`` as AssertionError. ``destroy()`` exists with
``explicitly_destroy=True`` only, as in DeepEP, and may run once.

Stream order (opt-in, ``with StreamOrder():``): on CUDA a launch given ``previous_event`` runs on DeepEP's
comm stream after that event and nothing else (csrc/deep_ep.cpp ``stream_wait(comm_stream,
previous_event)``; without one, after the compute stream as it is at the launch). Under :class:`StreamOrder`
every torch op outside the Buffer is a step of the compute stream and stamps the tensors it creates;
``Buffer.capture()`` records the step reached, and an event a launch returns the step that launch waited for.
A launch reading an input created after the step its ``previous_event`` stands for would read it before the
compute stream writes it: a race DeepEP does not see, raised here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "StreamOrder"]

# csrc/kernels/legacy/intranode.cu ``dispatch``: half a row and an 8-byte mbarrier fit a warp's 8192-byte TMA
# buffer, and rows are whole pairs of int4.
_TMA_BYTES_PER_WARP = 8192


def _host_assert(ok: bool, where: str, cond: str) -> None:
    """DeepEP's ``EP_HOST_ASSERT``: an EPException, which pybind11 raises as RuntimeError."""
    if not ok:
        raise RuntimeError(f"Assertion exception ({where}): {cond}")


def _device_assert(ok: bool, kernel: str, cond: str) -> None:
    """DeepEP's ``EP_DEVICE_ASSERT``: the kernel traps and the next CUDA call reports it."""
    if not ok:
        raise RuntimeError(f"CUDA error: device-side assert triggered ({kernel}: {cond})")


def _a2a(
    out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> dist.Work:
    """An async uneven all-to-all; 1-byte rows (float8) as uint8, which gloo takes."""
    inp = inp.contiguous()
    if out.element_size() == 1:
        out, inp = out.view(torch.uint8), inp.view(torch.uint8)
    return dist.all_to_all_single(out, inp, out_splits, in_splits, group=group, async_op=True)


def _check_fp8_input(x: torch.Tensor, x_scales: torch.Tensor) -> None:
    """csrc/deep_ep.cpp ``intranode_dispatch``, "FP8 scales checks"."""
    _host_assert(x.element_size() == 1, "deep_ep.cpp", "x.element_size() == 1")
    ok_dtype = x_scales.dtype in (torch.float32, torch.int32)
    _host_assert(ok_dtype, "deep_ep.cpp", "x_scales->scalar_type() == torch::kFloat32 or torch::kInt")
    _host_assert(x_scales.dim() == 2, "deep_ep.cpp", "x_scales->dim() == 2")
    _host_assert(x_scales.shape[0] == x.shape[0], "deep_ep.cpp", "x_scales->size(0) == num_tokens")


def _unfilled(rows: int, like: torch.Tensor) -> torch.Tensor:
    """Received rows not yet written: NaN (or -1 for integer scales), so a reader of unwritten rows shows it."""
    fill = float("nan") if like.is_floating_point() else -1
    return torch.full((rows, like.shape[1]), fill, dtype=like.dtype)


# ---- the exchange both emulations run (fake_deep_ep_v2 builds on it) -----------------------------------------


def _token_in_rank(topk_idx: torch.Tensor, num_experts: int, num_ranks: int) -> torch.Tensor:
    """``[T, W]`` bool: token t has a slot of rank r's (experts in contiguous blocks per rank; slot -1: none)."""
    in_rank = torch.zeros(topk_idx.shape[0], num_ranks, dtype=torch.bool)
    rows, cols = (topk_idx >= 0).nonzero(as_tuple=True)
    in_rank[rows, topk_idx[rows, cols] // (num_experts // num_ranks)] = True
    return in_rank


def _notify(group: dist.ProcessGroup, per_rank: torch.Tensor, per_expert: torch.Tensor) -> tuple[list[int], list[int]]:
    """The count exchange before a dispatch (DeepEP's notify step): this rank's rows per destination ``[W]`` and
    slots per expert ``[E]`` go out; back come the rows from each source rank and the slots per local expert."""
    w = per_rank.shape[0]
    send_meta = torch.cat([per_rank.view(w, 1).long(), per_expert.view(w, -1).long()], dim=1)
    recv_meta = torch.empty_like(send_meta)
    dist.all_to_all_single(recv_meta, send_meta, group=group)
    return recv_meta[:, 0].tolist(), recv_meta[:, 1:].sum(0).tolist()


@dataclass
class _Exchange:
    """One dispatch's routes over ``group``: token ``send_token[i]`` goes to rank ``dest[i]``, rank then token
    order (what each receiver sees as source order); ``send_counts`` rows to each rank, ``recv_counts`` from each."""

    group: dist.ProcessGroup
    dest: torch.Tensor
    send_token: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]

    @staticmethod
    def order(is_token_in_rank: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(dest, send_token)`` of every (token, rank) pair of ``is_token_in_rank`` ``[T, W]``, rank then token."""
        pairs = is_token_in_rank.t().nonzero()
        return pairs[:, 0], pairs[:, 1]

    @property
    def num_recv(self) -> int:
        return sum(self.recv_counts)

    def local_ids(self, topk_idx: torch.Tensor, num_local_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each sent row's ``[S, K]`` expert ids as its destination's local ids (-1: another rank's expert), and
        where they are its."""
        local = topk_idx.index_select(0, self.send_token) - (self.dest * num_local_experts)[:, None]
        on_dest = (local >= 0) & (local < num_local_experts)
        return torch.where(on_dest, local, torch.full_like(local, -1)), on_dest

    def send(self, out: torch.Tensor, rows: torch.Tensor, *, gather: bool = True) -> dist.Work:
        """Dispatch direction: ``rows`` (per token, or with ``gather=False`` already one per sent pair) to their
        destinations, into ``out`` (``num_recv`` rows in source order)."""
        sent = rows.index_select(0, self.send_token) if gather else rows
        return _a2a(out, sent, self.recv_counts, self.send_counts, self.group)

    def back(self, out: torch.Tensor, rows: torch.Tensor) -> dist.Work:
        """Combine direction: ``num_recv`` received ``rows`` in source order back to their source ranks, into
        ``out`` (one row per sent pair, in send order)."""
        return _a2a(out, rows, self.send_counts, self.recv_counts, self.group)


def _launch_event(
    overlap: Callable[..., Any],
    works: list[dist.Work],
    finish: Callable[[], None] | None,
    asynchronous: bool,
    step: int | None = None,
) -> Any:
    """A launch's event: pending (``overlap(EventHandle)``, waited by the caller) when ``asynchronous``, else
    waited here and ``overlap(None)``."""
    handle = EventHandle(works, finish, step=step)
    if asynchronous:
        return overlap(handle)
    handle.current_stream_wait()
    return overlap(None)


class Config:
    """Performance-tuning knobs (only the buffer-size hints matter here)."""

    def __init__(
        self,
        num_sms: int,
        num_max_nvl_chunked_send_tokens: int,
        num_max_nvl_chunked_recv_tokens: int,
        num_max_rdma_chunked_send_tokens: int = 6,
        num_max_rdma_chunked_recv_tokens: int = 128,
    ) -> None:
        self.num_sms = num_sms
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        # channels (num_sms / 2) x ranks x recv-chunk tokens x hidden bytes, as DeepEP sizes it (roughly).
        return (self.num_sms // 2) * num_ranks * self.num_max_nvl_chunked_recv_tokens * hidden_bytes

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return 0 if num_ranks <= 8 else self.get_nvl_buffer_size_hint(hidden_bytes, num_ranks)


class StreamOrder(TorchFunctionMode):
    """The compute stream's order, while active (see the module docstring): ``step`` counts the torch ops run
    outside the Buffer, and each tensor such an op creates records the step that wrote it."""

    active: StreamOrder | None = None
    """The order in force (one at a time): Buffer launches check their inputs against it."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.paused = False

    def __enter__(self) -> StreamOrder:
        assert StreamOrder.active is None, "one StreamOrder at a time"
        StreamOrder.active = self
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        StreamOrder.active = None
        super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            self.step += 1
            given = {id(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and id(t) not in given:  # an op returning its input writes nothing
                    t._written_at = self.step
        return out

    @staticmethod
    def now() -> int | None:
        return None if StreamOrder.active is None else StreamOrder.active.step


def _on_comm_stream(method: Callable) -> Callable:
    """A Buffer entry point: its own ops run on the comm stream, not as steps of the compute stream."""

    @functools.wraps(method)
    def launch(*args, **kwargs):
        order = StreamOrder.active
        if order is None or order.paused:
            return method(*args, **kwargs)
        order.paused = True
        try:
            return method(*args, **kwargs)
        finally:
            order.paused = False

    return launch


class EventHandle:
    """Stands for a CUDA event on the comm stream: the pending gloo works plus what finishes the outputs.
    ``step``: the compute stream's step it orders after (:class:`StreamOrder`; None: not known)."""

    def __init__(
        self, works: list[dist.Work] | None = None, finish: Callable[[], None] | None = None, step: int | None = None
    ) -> None:
        self._works = works or []
        self._finish = finish
        self.step = step

    def current_stream_wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []
        if self._finish is not None:
            finish, self._finish = self._finish, None
            finish()


class EventOverlap:
    """DeepEP's event wrapper: ``current_stream_wait()`` and use as a context manager."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple | None = None) -> None:
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        assert self.event is not None
        self.event.current_stream_wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.event is not None:
            self.event.current_stream_wait()


class Buffer:
    # DeepEP's own class default (deep_ep/buffer.py), written as the library has it rather than taken from
    # moe.dispatch.DEFAULT_COMM_SMS: the emulation follows DeepEP, not this project's configuration.
    num_sms: int = 20

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_nvl_bytes: int = 0,
        num_rdma_bytes: int = 0,
        low_latency_mode: bool = False,
        num_qps_per_rank: int = 24,
        allow_nvlink_for_low_latency_mode: bool = True,
        allow_mnnvl: bool = False,
        explicitly_destroy: bool = False,
        enable_shrink: bool = False,
        comm=None,
    ) -> None:
        assert not low_latency_mode, "the emulation covers the high-throughput kernels only"
        self.explicitly_destroy = explicitly_destroy
        self.destroyed = False
        self.group = group
        self.rank = dist.get_rank(group)
        self.group_size = dist.get_world_size(group)
        assert self.group_size in (2, 4, 8), "DeepEP intranode kernels run on 2, 4 or 8 ranks"
        assert num_nvl_bytes > 0, "intranode dispatch needs an NVLink buffer"
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.calls: list[str] = []  # for tests: which entry points ran, in order
        self.launches: list[tuple[bool, bool]] = []  # for tests: (previous_event given, allocate_on_comm_stream)

    def destroy(self) -> None:
        """DeepEP: a device sync and a barrier with the NVLink peers, then the memory is released."""
        assert self.explicitly_destroy, "`explicitly_destroy` flag must be set"
        _host_assert(not self.destroyed, "buffer.hpp", "not destroyed")
        self.calls.append("destroy")
        dist.barrier(group=self.group)  # stands for intranode::barrier: every peer must come
        self.destroyed = True

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current (compute) stream: the work issued so far."""
        return EventOverlap(EventHandle(step=StreamOrder.now()))

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        table = {2: (24, 256), 4: (6, 256), 8: (6, 256)}
        assert num_ranks in table, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *table[num_ranks], 6, 128)

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        table = {2: (10, 256), 4: (9, 256), 8: (4, 256)}
        assert num_ranks in table, f"Unsupported number of EP ranks: {num_ranks}"
        return Config(Buffer.num_sms, *table[num_ranks], 6, 128)

    # ---- helpers -------------------------------------------------------------------------------------
    def _check_alive(self) -> None:
        _host_assert(not self.destroyed, "buffer.hpp", "not destroyed")

    @staticmethod
    def _check_sms(config: Config | None) -> None:
        num_sms = (config or Buffer.get_dispatch_config(2)).num_sms
        _host_assert(num_sms % 2 == 0, "buffer.hpp", "config.num_sms % 2 == 0")
        # num_sms / 2 channels: 0 SMs is a launch of 0 blocks, which CUDA refuses.
        if num_sms <= 0:
            raise RuntimeError("CUDA error: invalid configuration argument (a kernel launched on 0 SMs)")

    def _check_launch(
        self, previous_event, async_finish: bool, allocate_on_comm_stream: bool, **inputs: torch.Tensor | None
    ) -> int | None:
        """DeepEP's launch checks; returns the compute step the launch runs after (:class:`StreamOrder`)."""
        if allocate_on_comm_stream:
            assert previous_event is not None and async_finish
        self.launches.append((previous_event is not None, allocate_on_comm_stream))
        after = StreamOrder.now()  # no event: the comm stream waits for the compute stream as it is now
        if previous_event is not None:
            after = None if previous_event.event is None else previous_event.event.step
            previous_event.current_stream_wait()
        if after is not None:
            for name, t in inputs.items():
                written = getattr(t, "_written_at", None)
                if written is not None and written > after:
                    raise RuntimeError(
                        f"race: {name} is written at step {written} of the compute stream, after the event this "
                        f"launch waits for (step {after}): on CUDA the comm stream would read it before it is written"
                    )
        return after

    def _unpack(self, handle: tuple) -> tuple[_Exchange, torch.Tensor, int]:
        """A dispatch handle's exchange, its ``recv_src_idx`` (sized as the dispatch allocated) and token count."""
        send_counts, recv_counts, _, recv_src_idx, is_token_in_rank, send_token_idx = handle
        dest = torch.repeat_interleave(torch.arange(self.group_size), torch.tensor(send_counts, dtype=torch.int64))
        exchange = _Exchange(self.group, dest, send_token_idx, send_counts, recv_counts)
        return exchange, recv_src_idx, is_token_in_rank.shape[0]

    # ---- layout --------------------------------------------------------------------------------------
    @_on_comm_stream
    def get_dispatch_layout(
        self,
        topk_idx: torch.Tensor,
        num_experts: int,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        self._check_alive()
        _host_assert(topk_idx.dim() == 2, "buffer.hpp", "topk_idx.dim() == 2")
        _host_assert(topk_idx.is_contiguous(), "buffer.hpp", "topk_idx.is_contiguous()")
        _host_assert(topk_idx.dtype == torch.int64, "buffer.hpp", "topk_idx dtype is topk_idx_t (int64)")
        assert num_experts % self.group_size == 0
        after = self._check_launch(previous_event, async_finish, allocate_on_comm_stream, topk_idx=topk_idx)
        self.calls.append("get_dispatch_layout")
        num_tokens_per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).to(torch.int32)
        is_token_in_rank = _token_in_rank(topk_idx, num_experts, self.group_size)
        num_tokens_per_rank = is_token_in_rank.sum(0).to(torch.int32)
        event = EventOverlap(EventHandle(step=after)) if async_finish else EventOverlap(None)
        return num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, event

    # ---- dispatch ------------------------------------------------------------------------------------
    @_on_comm_stream
    def dispatch(
        self,
        x,
        handle=None,
        num_tokens_per_rank=None,
        num_tokens_per_rdma_rank=None,
        is_token_in_rank=None,
        num_tokens_per_expert=None,
        topk_idx=None,
        topk_weights=None,
        expert_alignment: int = 1,
        num_worst_tokens: int = 0,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        x, x_scales = x if isinstance(x, tuple) else (x, None)
        self._check_alive()
        self._check_sms(config)
        _host_assert(x.dim() == 2 and x.is_contiguous(), "buffer.hpp", "x.dim() == 2 and x.is_contiguous()")
        if x_scales is None:
            # legacy.py ``dispatch``: "the shape must be [num_tokens, hidden], and type must be torch.bfloat16".
            assert x.dtype == torch.bfloat16, f"dispatch takes bf16 rows or an fp8 tuple, got {x.dtype}"
        else:
            _check_fp8_input(x, x_scales)
        row_bytes = x.shape[1] * x.element_size()
        _host_assert(row_bytes % 16 == 0, "buffer.hpp", "(x.size(1) * x.element_size()) % sizeof(int4) == 0")
        half_hidden_bytes = row_bytes // 2
        _device_assert(
            (row_bytes // 16) % 2 == 0 and half_hidden_bytes + 8 <= _TMA_BYTES_PER_WARP,
            "intranode::dispatch",
            "hidden_int4 % 2 == 0 and half_hidden_bytes + sizeof(uint64_t) <= kNumTMABytesPerWarp",
        )
        after = self._check_launch(
            previous_event,
            async_finish,
            allocate_on_comm_stream,
            x=x,
            x_scales=x_scales,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
        )
        w = self.group_size
        if handle is not None:
            assert topk_idx is None and topk_weights is None
            self.calls.append("dispatch(cached)")
            exchange, recv_src_idx, _ = self._unpack(handle)
            # buffer.hpp: cached mode allocates the handle's size (recv_src_idx.size(0), padded or not).
            num_recv = exchange.num_recv
            recv_x = _unfilled(recv_src_idx.shape[0], x)
            works = [exchange.send(recv_x[:num_recv], x)]
            if x_scales is not None:
                recv_x_scales = _unfilled(recv_src_idx.shape[0], x_scales)
                works.append(exchange.send(recv_x_scales[:num_recv], x_scales))
                recv_x = (recv_x, recv_x_scales)
            return recv_x, None, None, None, None, _launch_event(EventOverlap, works, None, async_finish, after)

        assert num_tokens_per_rank is not None and is_token_in_rank is not None
        assert num_tokens_per_expert is not None and topk_idx is not None and topk_idx.dtype == torch.int64
        assert num_tokens_per_rdma_rank is None, "intranode only"
        _host_assert(topk_idx.dim() == 2 and topk_idx.is_contiguous(), "buffer.hpp", "topk_idx->is_contiguous()")
        _host_assert(topk_weights is not None, "buffer.hpp", "topk_idx.has_value() == topk_weights.has_value()")
        _host_assert(topk_weights.is_contiguous(), "buffer.hpp", "topk_weights->is_contiguous()")
        _host_assert(topk_weights.dtype == torch.float32, "buffer.hpp", "topk_weights->scalar_type() == kFloat32")
        _host_assert(is_token_in_rank.dtype == torch.bool, "buffer.hpp", "is_token_in_rank.scalar_type() == kBool")
        for t in (num_tokens_per_rank, num_tokens_per_expert):
            _host_assert(t.dtype == torch.int32 and t.is_contiguous(), "buffer.hpp", "num_tokens_per_* int32")
        if num_worst_tokens > 0:  # buffer.hpp: "Must be forward with top-k stuffs"
            _host_assert(topk_idx is not None and topk_weights is not None, "buffer.hpp", "topk_idx.has_value()")
        self.calls.append("dispatch")
        num_experts = num_tokens_per_expert.shape[0]
        e_local = num_experts // w
        # notify_dispatch: every rank learns how many rows, and rows per local expert, it will receive.
        recv_counts, per_expert = _notify(self.group, num_tokens_per_rank, num_tokens_per_expert)
        num_recv_tokens_per_expert_list = [int(math.ceil(n / expert_alignment) * expert_alignment) for n in per_expert]
        dest, send_token_idx = _Exchange.order(is_token_in_rank)
        exchange = _Exchange(self.group, dest, send_token_idx, num_tokens_per_rank.tolist(), recv_counts)
        local_idx, on_dest = exchange.local_ids(topk_idx, e_local)
        num_recv = exchange.num_recv
        num_rows = num_recv
        if num_worst_tokens > 0:
            # Real DeepEP writes past its buffers here; the emulation stops.
            _device_assert(num_recv <= num_worst_tokens, "intranode::dispatch", "num_recv_tokens <= num_worst_tokens")
            num_rows = num_worst_tokens
            num_recv_tokens_per_expert_list = []
        k = topk_idx.shape[1]
        nan = float("nan")
        recv_x = _unfilled(num_rows, x)
        recv_topk_idx = torch.full((num_rows, k), -1, dtype=torch.int64)  # the kernel cleans the padding to -1
        recv_src_idx = torch.full((num_rows,), -1, dtype=torch.int64)
        works = [
            exchange.send(recv_x[:num_recv], x),
            exchange.send(recv_topk_idx[:num_recv], local_idx, gather=False),
            exchange.send(recv_src_idx[:num_recv], send_token_idx, gather=False),
        ]
        send_w = torch.where(on_dest, topk_weights.index_select(0, send_token_idx), 0.0)
        recv_topk_weights = torch.full((num_rows, k), nan, dtype=torch.float32)
        works.append(exchange.send(recv_topk_weights[:num_recv], send_w, gather=False))
        if x_scales is not None:  # the received pair, as deep_ep/buffer.py returns it
            recv_x_scales = _unfilled(num_rows, x_scales)
            works.append(exchange.send(recv_x_scales[:num_recv], x_scales))
            recv_x = (recv_x, recv_x_scales)
        handle = (exchange.send_counts, recv_counts, None, recv_src_idx, is_token_in_rank, send_token_idx)
        event = _launch_event(EventOverlap, works, None, async_finish, after)
        return recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event

    # ---- combine -------------------------------------------------------------------------------------
    @_on_comm_stream
    def combine(
        self,
        x: torch.Tensor,
        handle,
        topk_weights: torch.Tensor | None = None,
        config: Config | None = None,
        previous_event: EventOverlap | None = None,
        async_finish: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        self._check_alive()
        self._check_sms(config)
        _host_assert(x.dim() == 2 and x.is_contiguous(), "buffer.hpp", "x.dim() == 2 and x.is_contiguous()")
        # intranode::combine dispatches on the dtype with SWITCH_TYPES, whose one case is CUDA_R_16BF.
        _host_assert(x.dtype == torch.bfloat16, "launch.cuh", 'false and "Unsupported type"')
        if topk_weights is not None:
            _host_assert(topk_weights.is_contiguous(), "buffer.hpp", "topk_weights->is_contiguous()")
            _host_assert(topk_weights.dtype == torch.float32, "buffer.hpp", "topk_weights->scalar_type() == kFloat32")
        after = self._check_launch(
            previous_event, async_finish, allocate_on_comm_stream, x=x, topk_weights=topk_weights
        )
        self.calls.append("combine")
        exchange, recv_src_idx, num_tokens = self._unpack(handle)
        send_token_idx = exchange.send_token
        _host_assert(x.shape[0] == recv_src_idx.shape[0], "buffer.hpp", "src_idx.size(0) == num_tokens")
        num_recv = exchange.num_recv  # rows past it (num_worst_tokens padding) are not read, as in DeepEP
        back_x = x.new_empty(send_token_idx.shape[0], x.shape[1])
        works = [exchange.back(back_x, x[:num_recv])]
        combined_x = x.new_empty(num_tokens, x.shape[1])
        combined_w = back_w = None
        if topk_weights is not None:
            _host_assert(topk_weights.shape[0] == x.shape[0], "buffer.hpp", "topk_weights->size(0) == num_tokens")
            back_w = topk_weights.new_empty(send_token_idx.shape[0], topk_weights.shape[1])
            works.append(exchange.back(back_w, topk_weights[:num_recv]))
            combined_w = topk_weights.new_empty(num_tokens, topk_weights.shape[1])

        def reduce() -> None:
            acc = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32)
            combined_x.copy_(acc.index_add_(0, send_token_idx, back_x.float()))
            if combined_w is not None:
                accw = torch.zeros(num_tokens, back_w.shape[1], dtype=torch.float32)
                combined_w.copy_(accw.index_add_(0, send_token_idx, back_w.float()))

        return combined_x, combined_w, _launch_event(EventOverlap, works, reduce, async_finish, after)

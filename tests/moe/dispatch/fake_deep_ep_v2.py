"""An emulation of DeepEP V2 (``deep_ep`` 2.x: ``ElasticBuffer``, ``EPHandle``) on torch.distributed.

DeepEP's kernels need NVLink-connected GPUs and NCCL >= 2.30.4, so tests inject this module as ``deep_ep``.
It keeps the surface the ``deepep-v2`` dispatcher relies on, with V2's semantics as its sources state them
(deepseek-ai/DeepEP ``deep_ep/buffers/elastic.py``, ``csrc/elastic/buffer.hpp``, the kernels under
``deep_ep/include/deep_ep/impls`` and the reference ``deep_ep/utils/refs.py``):

* one NVLink domain holding every rank (``get_logical_domain_size() == (1, W)``), non-expanded layout;
* ``dispatch`` sends each token once per destination rank; a token's global id is
  ``src_rank * num_max_tokens_per_rank + index`` (``handle.recv_src_metadata[:, 0]``); received rows come in
  arrival order (here: the reverse of source order), or sorted by that id with ``deterministic=True``;
  ``recv_topk_idx`` holds local expert ids, -1 for other ranks' experts; ``recv_topk_weights`` all K
  weights as sent (unmasked, as the copy epilogue writes them);
* ``do_cpu_sync=False`` allocates every receive tensor for ``num_max_tokens_per_rank * W`` rows and writes
  only the first ``handle.psum_num_recv_tokens_per_scaleup_rank[-1]``; the rest stay uninitialised, which
  here means NaN rows and out-of-range expert ids, so that a caller reading them fails;
* with a ``handle`` (cached mode) ``topk_idx`` must be None and the rows land where the handle's dispatch put
  them;
* ``combine`` sends rows back along the handle and, per token, accumulates in fp32 the rows of its ranks in
  the order of their first top-k slot, rounding once to bf16 (for at most two ranks the kernel's bf16 add is
  the same number); ``combined_topk_weights[t, k]`` is the value the rank holding slot k's expert sent for
  slot k (0 for slot -1), a selection, not a sum (combine_reduce_epilogue.cuh:127-141);
* ``async_with_compute_stream=True`` returns an ``EventOverlap`` whose ``current_stream_wait()`` must be
  called before the results are read (here: gloo's worker thread fills them and the wait finishes them);
  without it the call waits itself and returns an ``EventOverlap(None)``, which cannot be waited.

The receive counts are exchanged synchronously inside ``dispatch`` in both ``do_cpu_sync`` modes: gloo needs
them to size its exchange (the real kernel only skips the host's wait for them). The exchange itself (routes,
the count exchange, the row all-to-alls, the events) is the V1 emulation's (``fake_deep_ep._Exchange``); this
module adds V2's surface, its checks, the arrival order and V2's reduction.

As strict as V2 where V2 fails: its Python asserts as AssertionError, ``EP_HOST_ASSERT`` as RuntimeError
("Assertion exception"), ``EP_DEVICE_ASSERT`` as a CUDA error, a JIT kernel's static assert as a compile
error. Checked: bf16 rows, contiguous 2-D inputs, ``topk_idx_t`` (int64) indices, fp32 weights, at most
``num_max_tokens_per_rank`` tokens, ``num_sms > 0`` (and at most the device's), the buffer size, experts
(<= 2048, <= 256 per rank, divisible by ranks), top-k <= 32, no expert twice in a token, hidden % 256 for
combine, and (``check_torch_deterministic``, utils/envs.py) not torch's deterministic algorithms together
with ``fill_uninitialized_memory``. ``destroy()`` needs ``explicitly_destroy=True`` and is a barrier with
every rank. FP8 input, ``x=(x_fp8, sf)``: x float8_e4m3fn as documented (elastic.py:881-884), sf checked as
buffer.hpp:762-772 checks it (2-D, one row per token, 4-byte elements: FP32 or packed UE8M0; any count and
strides), the received pair ``(recv_x, recv_sf)`` row-major (``use_tma_aligned_col_major_sf`` is not emulated),
sorted with the rows when deterministic; 1-byte rows travel as uint8 (gloo takes no float8). The expanded
layout, bias and Engram/PP/AGRS paths are not emulated (asserted off).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from tests.moe.dispatch import fake_deep_ep as v1
from tests.moe.dispatch.fake_deep_ep import (
    Buffer,
    Config,
    EventHandle,
    _device_assert,
    _Exchange,
    _launch_event,
    _notify,
    _token_in_rank,
    _unfilled,
)

__all__ = ["Buffer", "Config", "EPHandle", "ElasticBuffer", "EventHandle", "EventOverlap", "topk_idx_t"]

__version__ = "2.1.0"

topk_idx_t = torch.int64
"""``deep_ep._C.topk_idx_t``: int64 unless built with ``EP_NUM_TOPK_IDX_BITS``."""

_NUM_DEVICE_SMS = 132  # an H800/H100 SXM
_ALIGNMENT = 2 << 20  # symmetric::kNumAlignmentBytes: buffer sizes are 2 MiB aligned (elastic.py:252-253)
_GARBAGE_IDX = 1 << 40  # stands for an uninitialised int64: never a valid expert id


def _host_assert(ok: bool, cond: str) -> None:
    """``EP_HOST_ASSERT`` in V2's buffer.hpp (V1's emulation raises it the same way)."""
    v1._host_assert(ok, "buffer.hpp", cond)


def _static_assert(ok: bool, kernel: str, cond: str) -> None:
    """``EP_STATIC_ASSERT`` in a JIT-compiled kernel: the compile fails when the kernel is first built."""
    if not ok:
        raise RuntimeError(f"JIT compilation failed ({kernel}): static assertion failed: {cond}")


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _token_bytes(hidden_bytes: int, num_topk: int) -> int:
    # layout.cuh TokenLayout: data, top-k ids and weights, source id and slots (a close stand-in).
    return _align(hidden_bytes + num_topk * 8 + (1 + num_topk) * 4, 32)


def _buffer_bytes(num_max_tokens_per_rank: int, hidden: int, num_topk: int, num_ranks: int) -> int:
    """Direct-mode dispatch and combine buffers (buffer.hpp get_dispatch/combine_buffer_size), bf16 rows."""
    token = _token_bytes(hidden * 2, num_topk)
    dispatch = token * (num_ranks + 1) * num_max_tokens_per_rank
    combine = token * (num_ranks + min(num_ranks, num_topk)) * num_max_tokens_per_rank
    return _align(max(dispatch, combine), _ALIGNMENT)


class EventOverlap(v1.EventOverlap):
    """deep_ep/utils/event.py: V1's wrapper (``current_stream_wait()`` asserts an event) plus a hook run after
    the wait."""

    def __init__(self, event: EventHandle | None = None, extra_tensors: tuple | None = None) -> None:
        super().__init__(event, extra_tensors)
        self.hook_after_wait: Callable | None = None

    def current_stream_wait(self, release_handle: bool = False) -> None:
        assert self.event is not None
        self.event.current_stream_wait()
        if self.hook_after_wait is not None:
            self.hook_after_wait()
            self.hook_after_wait = None
        if release_handle:
            self.event = None

    def register_hook_after_wait(self, hook_after_wait: Callable) -> None:
        assert self.hook_after_wait is None, "A hook is already registered on this `EventOverlap`"
        self.hook_after_wait = hook_after_wait

    def __exit__(self, *exc) -> None:
        if self.event is not None:
            self.current_stream_wait()


class EPHandle:
    """elastic.py ``EPHandle`` (non-expanded fields); ``recv_src_metadata[:, 0]`` is the source token's
    global id, column 1 ``src_rank * K + first local slot`` (dispatch_copy_epilogue.cuh:192-199)."""

    def __init__(
        self,
        num_experts: int,
        expert_alignment: int,
        num_max_tokens_per_rank: int,
        num_sms: int,
        topk_idx: torch.Tensor,
        num_recv_tokens: int,
        num_recv_tokens_per_expert_list: list,
        psum_num_recv_tokens_per_scaleup_rank: torch.Tensor,
        psum_num_recv_tokens_per_expert: torch.Tensor,
        recv_src_metadata: torch.Tensor,
    ) -> None:
        self.do_expand = False
        self.num_experts = num_experts
        self.expert_alignment = expert_alignment
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_sms = num_sms
        self.topk_idx = topk_idx
        self.num_recv_tokens = num_recv_tokens
        self.num_expanded_tokens = num_recv_tokens
        self.num_recv_tokens_per_expert_list = num_recv_tokens_per_expert_list
        self.psum_num_recv_tokens_per_scaleup_rank = psum_num_recv_tokens_per_scaleup_rank
        self.psum_num_recv_tokens_per_expert = psum_num_recv_tokens_per_expert
        self.num_unaligned_recv_tokens_per_expert = None
        self.recv_src_metadata = recv_src_metadata
        self.dst_buffer_slot_idx = None
        self.token_metadata_at_forward = None
        self.channel_linked_list = None


class ElasticBuffer:
    def __init__(
        self,
        group: dist.ProcessGroup,
        num_bytes: int | None = None,
        num_cpu_bytes: int = 0,
        num_max_tokens_per_rank: int = 0,
        hidden: int = 0,
        num_topk: int = 0,
        use_fp8_dispatch: bool = False,
        deterministic: bool = False,
        allow_hybrid_mode: bool = True,
        allow_multiple_reduction: bool = True,
        prefer_overlap_with_compute: bool = True,
        sl_idx: int = 3,
        num_allocated_qps: int = 0,
        num_cpu_timeout_secs: int = 300,
        num_gpu_timeout_secs: int = 100,
        explicitly_destroy: bool = False,
    ) -> None:
        # FP8 dispatch sizes the dispatch layout for 1-byte rows plus scales: never more than the bf16 combine
        # layout this emulation sizes for, so the flag changes nothing here.
        assert num_cpu_bytes == 0, "the emulation has no CPU buffer"
        self.use_fp8_dispatch = use_fp8_dispatch
        self.group = group
        self.rank_idx = group.rank()
        self.num_ranks = group.size()
        self.deterministic = deterministic
        self.prefer_overlap_with_compute = prefer_overlap_with_compute
        if num_bytes is None:
            # calculate_buffer_size (buffer.hpp:657-663): a top-k of 0 sizes for 32.
            _host_assert(num_max_tokens_per_rank > 0 and hidden > 0, "num_max_tokens_per_rank > 0 and hidden > 0")
            _host_assert(math.ceil(hidden / 32) * 4 <= hidden, "ceil_div(hidden, 32) * sizeof(float) <= hidden")
            num_bytes = _buffer_bytes(num_max_tokens_per_rank, hidden, num_topk or 32, self.num_ranks)
        _host_assert(num_bytes > 0 and num_bytes % _ALIGNMENT == 0, "num_buffer_bytes % kNumAlignmentBytes == 0")
        self.num_bytes = num_bytes
        self.num_max_tokens_per_rank = num_max_tokens_per_rank
        self.num_allocated_qps = num_allocated_qps or 65
        self.explicitly_destroy = explicitly_destroy
        self.runtime: object | None = object()  # the C++ runtime: None once destroyed
        self.num_scaleout_ranks, self.num_scaleup_ranks = 1, self.num_ranks
        self.scaleout_rank_idx, self.scaleup_rank_idx = 0, self.rank_idx
        self.num_rdma_ranks, self.num_nvlink_ranks = 1, self.num_ranks
        self.calls: list[str] = []  # for tests: which entry points ran, in order
        self.compiled: list[tuple] = []
        """For tests: the JIT kernels built, in order, each as (kernel, template arguments its call fixes). V2
        compiles a kernel the first time a combination runs (csrc/kernels/elastic/dispatch.hpp, combine.hpp
        ``generate_impl``: SMs, row bytes, scale packs, token capacity, experts, top-k, ``do_cpu_sync``, cached
        mode); the emulation keeps that key and compiles nothing."""
        dist.barrier(group=group)  # elastic.py:364-367: every peer must come

    def destroy(self) -> None:
        """elastic.py:369-378: needs ``explicitly_destroy``; the runtime's destroy is a barrier with every rank."""
        assert self.explicitly_destroy
        if self.runtime is not None:
            self.calls.append("destroy")
            dist.barrier(group=self.group)
            self.runtime = None

    @staticmethod
    def capture() -> EventHandle:
        return EventHandle()

    def get_logical_domain_size(self) -> tuple[int, int]:
        return self.num_scaleout_ranks, self.num_scaleup_ranks

    def get_physical_domain_size(self) -> tuple[int, int]:
        return self.num_rdma_ranks, self.num_nvlink_ranks

    def get_theoretical_num_sms(
        self,
        num_experts: int,
        num_topk: int,
        num_scaleout_topk: int = 0,
        rdma_gbs: float = 0,
        nvlink_gbs: float = 0,
        sm_read_gbs: float = 200,
        sm_write_gbs: float = 50,
    ) -> int:
        """elastic.py:728-834 for one NVLink domain: the SMs that keep NVLink busy, even, at least 4.
        ``nvlink_gbs=0``: DeepEP reads 0.9 x the links' sum from ``nvidia-smi nvlink -s`` (utils/envs.py
        ``get_nvlink_gbs``); the emulation has no links and takes a fixed stand-in."""
        assert num_scaleout_topk == 0
        nvlink_gbs = nvlink_gbs or 405.0
        groups = self.num_ranks
        expected_topk = groups * (
            1 - math.comb(num_experts - num_experts // groups, num_topk) / math.comb(num_experts, num_topk)
        )
        sm_read, sm_write = 1 / expected_topk, 1.0
        traffic = 1 - 1 / self.num_ranks
        num_sms = _NUM_DEVICE_SMS
        if traffic > 0:
            num_sms = max(nvlink_gbs / traffic * sm_read / sm_read_gbs, nvlink_gbs / traffic * sm_write / sm_write_gbs)
        num_sms = _align(max(4, math.ceil(num_sms * 1.25)), 2)
        num_sms = num_sms if self.prefer_overlap_with_compute else max(num_sms, 64)
        return min(num_sms, _NUM_DEVICE_SMS)

    # ---- helpers -------------------------------------------------------------------------------------
    def _alive(self, method: str) -> None:
        if self.runtime is None:  # elastic.py:377: the runtime is gone, its methods with it
            raise AttributeError(f"'NoneType' object has no attribute '{method}'")

    @staticmethod
    def _check_torch_deterministic() -> None:
        """utils/envs.py ``check_torch_deterministic``, the first line of dispatch and combine: with both on,
        ``torch.empty`` launches a fill kernel that may overlap the communication stream."""
        assert not (
            torch.are_deterministic_algorithms_enabled() and torch.utils.deterministic.fill_uninitialized_memory
        )

    def _prologue(self, previous_event, allocate_on_comm_stream: bool, num_sms: int) -> None:
        _host_assert(num_sms > 0, "num_sms > 0")
        _host_assert(num_sms <= _NUM_DEVICE_SMS, "num_sms <= jit::device_runtime->get_num_sms()")
        if previous_event is not None:  # stream_control_prologue, buffer.hpp:539-540
            _host_assert(allocate_on_comm_stream, "allocate_on_comm_stream")
            previous_event.current_stream_wait()

    def _jit(self, kernel: str, *template: object) -> None:
        """The JIT build of ``kernel`` for these template arguments, the first time they occur."""
        if (key := (kernel, *template)) not in self.compiled:
            self.compiled.append(key)

    def _exchange(
        self, topk_idx: torch.Tensor, num_experts: int, handle: EPHandle | None
    ) -> tuple[_Exchange, list[int]]:
        """The routes of ``topk_idx`` (V1's exchange) and the slots each local expert receives: from the
        ``handle``'s counts (cached mode: ``[]``), else from the notify step, run now."""
        in_rank = _token_in_rank(topk_idx, num_experts, self.num_ranks)
        dest, send_token = _Exchange.order(in_rank)
        send_counts = in_rank.sum(0)
        if handle is not None:
            psum = handle.psum_num_recv_tokens_per_scaleup_rank
            recv_counts, per_expert = torch.diff(psum, prepend=psum.new_zeros(1)).tolist(), []
        else:  # rows per source rank and slots per local expert, for every rank
            slots = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts)
            recv_counts, per_expert = _notify(self.group, send_counts, slots)
        return _Exchange(self.group, dest, send_token, send_counts.tolist(), recv_counts), per_expert

    def _placement(self, n: int) -> torch.Tensor:
        """Where each of ``n`` received rows (in source order) lands: sorted by global id, or in arrival order."""
        return torch.arange(n) if self.deterministic else torch.arange(n - 1, -1, -1)

    # ---- dispatch ------------------------------------------------------------------------------------
    def dispatch(
        self,
        x,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        cumulative_local_expert_recv_stats: torch.Tensor | None = None,
        num_experts: int | None = None,
        num_max_tokens_per_rank: int | None = None,
        expert_alignment: int | None = None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: EventHandle | None = None,
        previous_event_before_epilogue: EventHandle | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
        handle: EPHandle | None = None,
        do_handle_copy: bool = True,
        do_cpu_sync: bool | None = None,
        do_expand: bool = False,
        do_zero_padding: bool = False,
        use_tma_aligned_col_major_sf: bool = False,
    ):
        x, sf = x if isinstance(x, tuple) else (x, None)  # elastic.py:939, "Unpack SF"
        assert not do_expand and cumulative_local_expert_recv_stats is None, "not emulated"
        assert not use_tma_aligned_col_major_sf, "not emulated"
        self._alive("dispatch")
        self._check_torch_deterministic()
        # elastic.py:926-961, the Python half.
        num_topk = (handle.topk_idx if topk_idx is None else topk_idx).shape[1]
        num_sms = self.get_theoretical_num_sms(num_experts, num_topk) if num_sms == 0 else num_sms
        cached = handle is not None
        if cached:
            assert topk_idx is None
            assert do_cpu_sync is None or not do_cpu_sync, "Cannot do CPU sync with cached handle"
            topk_idx = handle.topk_idx
            num_max_tokens_per_rank = num_max_tokens_per_rank or handle.num_max_tokens_per_rank
            num_experts = num_experts or handle.num_experts
            expert_alignment = expert_alignment or handle.expert_alignment
            do_cpu_sync = False
            assert (num_experts, expert_alignment, num_max_tokens_per_rank) == (
                handle.num_experts,
                handle.expert_alignment,
                handle.num_max_tokens_per_rank,
            )
        num_max_tokens_per_rank = num_max_tokens_per_rank or self.num_max_tokens_per_rank
        expert_alignment = expert_alignment or 1
        do_cpu_sync = True if do_cpu_sync is None else do_cpu_sync

        # buffer.hpp:727-805, the host checks.
        self._prologue(previous_event, allocate_on_comm_stream, num_sms)
        _host_assert(x.dim() == 2 and x.is_contiguous(), "x.dim() == 2 and x.is_contiguous()")
        # elastic.py:881-884: "the shape must be [num_tokens, hidden], and type must be torch.bfloat16"; with
        # scale factors, "[num_tokens, hidden] with type torch.float8_e4m3fn".
        want = torch.bfloat16 if sf is None else torch.float8_e4m3fn
        assert x.dtype == want, f"dispatch takes bf16 rows or an fp8 tuple, got {x.dtype}"
        num_tokens, hidden = x.shape
        if sf is not None:  # buffer.hpp:762-772
            _host_assert(sf.dim() == 2 and sf.shape[0] == num_tokens, "num_tokens == num_tokens_")
            _host_assert(sf.element_size() == 4, "sf->element_size() == sizeof(sf_pack_t)")
        _host_assert(hidden * x.element_size() % 16 == 0, "(x.size(1) * x.element_size()) % sizeof(int4) == 0")
        _host_assert(num_tokens <= num_max_tokens_per_rank, "num_tokens <= num_max_tokens_per_rank")
        _host_assert(topk_idx.dim() == 2 and topk_idx.shape[0] == num_tokens, "num_tokens == num_tokens_")
        _host_assert(topk_idx.dtype == topk_idx_t, "topk_idx.scalar_type() == topk_idx_t")
        _host_assert(topk_idx.is_contiguous(), "topk_idx.is_cuda() and topk_idx.is_contiguous()")
        if topk_weights is not None:
            _host_assert(tuple(topk_weights.shape) == tuple(topk_idx.shape), "num_tokens == num_tokens__")
            _host_assert(topk_weights.is_contiguous(), "topk_weights->is_contiguous()")
            if topk_weights.dtype != torch.float32:  # data_ptr<float>() on another dtype
                raise RuntimeError(f"expected scalar type Float but found {topk_weights.dtype}")
        w = self.num_ranks
        _host_assert(num_experts % w == 0, "num_experts % num_ranks == 0")
        e_local = num_experts // w
        _host_assert(num_experts <= 2048 and e_local <= 256, "num_experts <= kNumMaxExperts (layout.cuh)")
        _static_assert(num_topk <= 32, "dispatch_impl", "kNumTopk <= 32")
        _host_assert(
            _buffer_bytes(num_max_tokens_per_rank, hidden, num_topk, w) <= self.num_bytes,
            "get_dispatch_buffer_size(...) <= num_buffer_bytes",
        )
        _device_assert(bool((topk_idx < num_experts).all()), "dispatch_impl", "expert index out of range")
        sorted_idx = topk_idx.sort(dim=1).values
        dup = (sorted_idx[:, 1:] == sorted_idx[:, :-1]) & (sorted_idx[:, 1:] >= 0)
        _device_assert(
            not bool(dup.any()),
            "dispatch_copy_epilogue_impl",
            "ptx::deduplicate(dst_expert_idx, lane_idx) or dst_expert_idx == -1",
        )
        self.calls.append("dispatch(cached)" if cached else "dispatch")
        sf_packs = 0 if sf is None else sf.shape[1]
        template = (num_sms, hidden * x.element_size(), sf_packs, num_max_tokens_per_rank, num_experts, num_topk)
        self._jit("dispatch_impl", *template, expert_alignment, do_cpu_sync, cached)
        self._jit("dispatch_copy_epilogue_impl", *template, expert_alignment, cached)

        exchange, per_expert = self._exchange(topk_idx, num_experts, handle)
        per_expert = [_align(int(n), expert_alignment) for n in per_expert]
        recv_counts, num_recv = exchange.recv_counts, exchange.num_recv
        num_alloc = num_recv if do_cpu_sync else num_max_tokens_per_rank * w
        if cached:
            num_alloc = handle.num_recv_tokens

        # Exchange in source order (rank, then token): the sorted order of the global ids.
        got_x = x.new_empty(num_recv, hidden)
        works = [exchange.send(got_x, x)]
        got_sf = None
        if sf is not None:
            got_sf = sf.new_empty(num_recv, sf.shape[1])
            works.append(exchange.send(got_sf, sf))
        if not cached:
            local, _ = exchange.local_ids(topk_idx, e_local)
            got_idx = torch.empty(num_recv, num_topk, dtype=topk_idx_t)
            works.append(exchange.send(got_idx, local, gather=False))
            global_id = exchange.send_token + self.rank_idx * num_max_tokens_per_rank
            first_local = torch.where(local >= 0, torch.arange(num_topk), num_topk).min(1).values
            meta = torch.stack([global_id, self.rank_idx * num_topk + first_local], 1).to(torch.int32)
            got_meta = torch.empty(num_recv, 2, dtype=torch.int32)
            works.append(exchange.send(got_meta, meta, gather=False))
        got_w = None
        if topk_weights is not None:
            got_w = torch.empty(num_recv, num_topk, dtype=torch.float32)
            works.append(exchange.send(got_w, topk_weights))

        recv_x = _unfilled(num_alloc, x)
        recv_sf = None if sf is None else _unfilled(num_alloc, sf)
        recv_w = None if got_w is None else torch.full((num_alloc, num_topk), float("nan"))
        if cached:
            recv_idx, src_meta = None, handle.recv_src_metadata
            order = src_meta[:num_recv, 0].long().argsort()  # row i of source order lands at order[i]
        else:
            recv_idx = torch.full((num_alloc, num_topk), _GARBAGE_IDX, dtype=topk_idx_t)
            src_meta = torch.full((num_alloc, num_topk + 2), -1, dtype=torch.int32)
            order = self._placement(num_recv)
        psum_rank = torch.tensor(recv_counts, dtype=torch.int32).cumsum(0).to(torch.int32)

        def land() -> None:
            recv_x[order] = got_x
            if recv_sf is not None:
                recv_sf[order] = got_sf
            if recv_w is not None:
                recv_w[order] = got_w
            if not cached:
                recv_idx[order] = got_idx
                src_meta[order, :2] = got_meta

        event = _launch_event(EventOverlap, works, land, async_with_compute_stream)
        if not cached:
            # The host learns the per-expert list only when it waits for the counters (buffer.hpp:1017-1064).
            handle = EPHandle(
                num_experts,
                expert_alignment,
                num_max_tokens_per_rank,
                num_sms,
                topk_idx.clone() if do_handle_copy else topk_idx,
                num_alloc,
                per_expert if do_cpu_sync else [],
                psum_rank,
                torch.tensor(per_expert, dtype=torch.int64).cumsum(0).to(torch.int32),
                src_meta,
            )
        recv = recv_x if recv_sf is None else (recv_x, recv_sf)  # elastic.py:1030, "Repack SF"
        return recv, recv_idx, recv_w, handle, event

    # ---- combine -------------------------------------------------------------------------------------
    def combine(
        self,
        x: torch.Tensor,
        handle: EPHandle,
        topk_weights: torch.Tensor | None = None,
        bias=None,
        num_sms: int = 0,
        num_qps: int = 0,
        previous_event: EventHandle | None = None,
        previous_event_before_epilogue: EventHandle | None = None,
        async_with_compute_stream: bool = False,
        allocate_on_comm_stream: bool = False,
    ):
        assert bias is None, "not emulated"
        self._alive("combine")
        self._check_torch_deterministic()
        num_sms = handle.num_sms if num_sms == 0 else num_sms
        # buffer.hpp:1197-1256.
        self._prologue(previous_event, allocate_on_comm_stream, num_sms)
        _host_assert(x.dim() == 2 and x.is_contiguous(), "x.is_cuda() and x.is_contiguous()")
        _host_assert(x.dtype == torch.bfloat16, "x.scalar_type() == torch::kBFloat16")
        num_rows, hidden = x.shape
        _host_assert(hidden * x.element_size() % 16 == 0, "(x.size(1) * x.element_size()) % sizeof(int4) == 0")
        topk_idx = handle.topk_idx
        num_tokens, num_topk = topk_idx.shape
        _host_assert(topk_idx.dtype == topk_idx_t and topk_idx.is_contiguous(), "combined_topk_idx is topk_idx_t")
        _host_assert(num_tokens <= handle.num_max_tokens_per_rank, "num_combined_tokens <= num_max_tokens_per_rank")
        _host_assert(handle.recv_src_metadata.shape[0] == num_rows, "num_reduced_tokens == num_tokens")
        if topk_weights is not None:
            _host_assert(tuple(topk_weights.shape) == (num_rows, num_topk), "num_tokens == num_tokens__")
            _host_assert(topk_weights.is_contiguous(), "topk_weights->is_contiguous()")
            _host_assert(topk_weights.dtype == torch.float32, "topk_weights->scalar_type() == torch::kFloat")
        _static_assert(hidden % 256 == 0, "combine_impl", "kHidden % (32 * sizeof(int4) / sizeof(nv_bfloat16)) == 0")
        _host_assert(
            _buffer_bytes(handle.num_max_tokens_per_rank, hidden, num_topk, self.num_ranks) <= self.num_bytes,
            "get_combine_buffer_size(...) <= num_buffer_bytes",
        )
        self.calls.append("combine")
        self._jit("combine_impl", num_sms, hidden, handle.num_max_tokens_per_rank, handle.num_experts, num_topk)
        self._jit("combine_reduce_epilogue_impl", num_sms, hidden, handle.num_max_tokens_per_rank, num_topk)

        w = self.num_ranks
        e_local = handle.num_experts // w
        exchange, _ = self._exchange(topk_idx, handle.num_experts, handle)
        dest, send_token, num_recv = exchange.dest, exchange.send_token, exchange.num_recv
        # Rows back in source order (what each source rank expects: its tokens per rank, ascending).
        order = handle.recv_src_metadata[:num_recv, 0].long().argsort()
        back_x = x.new_empty(send_token.shape[0], hidden)
        works = [exchange.back(back_x, x[:num_recv][order])]
        back_w = None
        if topk_weights is not None:
            back_w = torch.empty(send_token.shape[0], num_topk)
            works.append(exchange.back(back_w, topk_weights[:num_recv][order]))
        combined_x = x.new_empty(num_tokens, hidden)
        combined_w = None if topk_weights is None else torch.empty(num_tokens, num_topk)

        def reduce() -> None:
            from_rank = torch.zeros(w, num_tokens, hidden)
            from_rank[dest, send_token] = back_x.float()
            owner = torch.where(topk_idx >= 0, topk_idx // e_local, -1)
            acc = torch.zeros(num_tokens, hidden)
            tokens = torch.arange(num_tokens)
            for k in range(num_topk):
                # A rank's row is added at its first slot: ranks in order of first appearance.
                first = (owner[:, k] >= 0) & ~(owner[:, :k] == owner[:, k : k + 1]).any(1)
                acc += torch.where(first[:, None], from_rank[owner[:, k].clamp(min=0), tokens], 0.0)
            combined_x.copy_(acc)
            if combined_w is not None:
                w_from_rank = torch.zeros(w, num_tokens, num_topk)
                w_from_rank[dest, send_token] = back_w
                picked = w_from_rank[owner.clamp(min=0), tokens[:, None], torch.arange(num_topk)]
                combined_w.copy_(torch.where(owner >= 0, picked, 0.0))

        return combined_x, combined_w, _launch_event(EventOverlap, works, reduce, async_with_compute_stream)

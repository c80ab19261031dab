"""``deepep-v2``: DeepEP V2's ``deep_ep.ElasticBuffer`` (NCCL Gin backend, JIT kernels, DeepEP >= 2.0).

Legend for shape suffixes: T local tokens, R received rows, K top-k slots, D hidden, W expert-parallel ranks.

Source references are to deepseek-ai/DeepEP (V2, ``__version__ = '2.1.0'``): ``deep_ep/buffers/elastic.py``
(the Python API), ``csrc/elastic/buffer.hpp`` (its host checks) and the kernels under
``deep_ep/include/deep_ep/impls``.

How it maps onto :class:`~moe.dispatch.base.TokenDispatcher`:

* There is no layout call: ``ElasticBuffer.dispatch`` computes the routing itself, so :meth:`plan` only
  puts the expert ids in the dtype DeepEP asserts (and builds the buffer if :meth:`warm_up` did not).
* Every call passes ``async_with_compute_stream=True``: the kernels run on DeepEP's communication stream,
  which first waits for the compute stream (``stream_control_prologue``, buffer.hpp:542-547, so no
  ``previous_event`` is needed), and the returned ``EventOverlap`` is waited in ``Pending.wait()`` where the
  result is consumed. Backward reuses the forward ``EPHandle``: the gradient of dispatch is a ``combine`` with
  ``topk_weights`` (it returns their gradient too), the gradient of combine a cached ``dispatch``.
* Received rows come back in arrival order unless the buffer is ``deterministic`` (elastic.py:1021-1027: a
  sort by source token after the wait, and across nodes a boolean-mask gather, a host sync). Any order is
  correct (each row carries its expert ids and weights, combine follows the handle), but only source order,
  rows grouped by source rank, token order within one (what ``alltoall`` gives), repeats bit for bit and
  makes gradients bit-equal to ``alltoall``'s: ``deterministic=True`` (``--deterministic-dispatch``; the
  tests) pays for it, the default does not.
* The SM count: ``comm_sms > 0`` is passed as ``num_sms`` to every call; ``comm_sms == 0`` lets DeepEP pick
  (``get_theoretical_num_sms``, elastic.py:728-834, which models a balanced gate and says not to use it for
  V3's group-limited gate, elastic.py:754-755: prefer an explicit count for such routers).
* ``sync_free=True`` is V2's ``do_cpu_sync=False`` (its ``num_worst_tokens``): the host does not wait for the
  received-token count (buffer.hpp:1017-1064), every receive tensor is allocated for the worst case,
  ``num_max_tokens_per_rank * W`` rows (buffer.hpp:1065-1071), and only the first
  ``handle.psum_num_recv_tokens_per_scaleup_rank[-1]`` rows are written. The rows past it get local expert
  id -1 and weight 0 here (on the device, no sync); their ``x`` values are unspecified.

``ElasticBuffer`` sizes itself from ``num_max_tokens_per_rank`` (equal on every rank: a token's global id is
``src_rank * num_max_tokens_per_rank + index``, elastic.py:25-57 and ``deep_ep/utils/refs.py``) and the top-k.
Building it is a barrier with every peer, and each kernel is JIT-compiled (NVCC, into the user's cache) the first
time a combination of its template arguments runs (csrc/kernels/elastic/dispatch.hpp and combine.hpp
``generate_impl``: SMs, row bytes, FP8 scale packs, token capacity, experts, top-k, ``do_cpu_sync``, cached
mode), which can take longer than the peers' GPU-side timeout (``num_gpu_timeout_secs=100``). The trainer
therefore builds and warms it at setup, at the step's shapes: :meth:`DeepEPV2Dispatcher.warm_up`. Otherwise it
is built at the first :meth:`plan`, when the top-k is known. ``max_tokens_per_rank=None`` takes the largest
token count of the build over the group (one all-reduce and host sync, once).

FP8 dispatch (``fp8=True``): the buffer is built with ``use_fp8_dispatch=True`` (elastic.py:258: "the received
data will be a tuple of FP8 tensor and scaling factors"), and dispatch and the gradient of combine (a cached
dispatch) pass the pair ``(x [T, D] float8_e4m3fn, sf [T, ceil(D / 128)] float32)`` from
:func:`kernels.fp8.quantize_rows` (buffer.hpp:762-772: sf 2-D, one row per token, 4-byte elements, FP32
or packed UE8M0; row-major, not ``use_tma_aligned_col_major_sf``); the received pair is dequantized here after
the wait. Combine and the gradient of dispatch stay bf16.

Real V2 combines bf16 rows only (buffer.hpp:1203) and needs ``hidden % 256 == 0`` (combine.cuh:109) and a
group whose NVLink domains are equal blocks of consecutive group ranks (csrc/kernels/backend/nccl.cu:110-115):
:func:`deepep_v2_rules`.

The buffer is built with ``explicitly_destroy=True``; otherwise its destructor runs ``destroy()``, a
barrier with every peer plus a device sync (buffer.hpp:142-166), and a rank that died leaves its peers
spinning. The clean path calls :meth:`DeepEPV2Dispatcher.close`; an error path only drops the object.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from moe.dispatch.base import DEFAULT_COMM_SMS, Dispatched, Pending, Route, TokenDispatcher
from moe.dispatch.deepep_common import (
    DeepEPBase,
    DeepEPRoute,
    as_local_idx,
    as_topk_idx,
    as_topk_weights,
    dispatch_input,
    import_deep_ep,
    sent_rows,
)
from moe.dispatch.registry import DispatcherSpec, DispatchOptions, Launch, register_dispatcher

__all__ = ["DEEPEP_V2_INSTALL_HINT", "DeepEPV2Dispatcher", "deepep_v2_rules", "nvlink_domain_problem"]

# The combine kernels reduce rows in warps of 32 int4 loads (combine.cuh:109, hybrid_combine.cuh:219:
# EP_STATIC_ASSERT(kHidden % (32 * sizeof(int4) / sizeof(nv_bfloat16)) == 0)): a JIT compile error otherwise.
COMBINE_HIDDEN_MULTIPLE = 256
# deep_ep/include/deep_ep/common/layout.cuh:19-21 (WorkspaceLayout): kNumMaxRanks, kNumMaxExperts,
# kNumMaxExpertsPerRank; dispatch.cuh:93 and friends: EP_STATIC_ASSERT(kNumTopk <= 32).
MAX_RANKS = 1024
MAX_EXPERTS = 2048
MAX_EXPERTS_PER_RANK = 256
MAX_TOPK = 32

DEEPEP_V2_INSTALL_HINT = (
    "the 'deepep-v2' dispatcher needs DeepEP >= 2.0 (module 'deep_ep' with ElasticBuffer), built from source on "
    "a GPU machine (SM90, CUDA >= 12.3, torch >= 2.10): pip install 'nvidia-nccl-cu13>=2.30.4' --no-deps (V2 "
    "needs NCCL >= 2.30.4, and 'import deep_ep' asserts that the libnccl loaded in the process is the one it "
    "was built against; torch's bundled NCCL usually is not, so load that same libnccl first), NVSHMEM for its "
    "legacy kernels (docs/nvshmem.md), then git clone https://github.com/deepseek-ai/DeepEP && cd DeepEP && "
    "python setup.py install (see its README). Do not use the PyPI package 'deep-ep' (an unbuildable "
    "re-upload). Or pick dispatcher='alltoall', or 'deepep' (the V1 Buffer)."
)


class DeepEPV2Dispatcher(DeepEPBase):
    """Expert parallelism through one ``deep_ep.ElasticBuffer`` over ``group`` (built by :meth:`warm_up`, else at
    the first plan).

    ``hidden_size``: width of the bf16 rows. ``comm_sms``: SMs of every dispatch and combine (0: DeepEP
    picks). ``max_tokens_per_rank``: the most tokens one rank dispatches at once, equal on every rank (None:
    the group's largest count at the first plan). ``sync_free``: worst-case receive allocation, no host
    sync in dispatch. ``deterministic``: received rows in source order (V2 sorts them after each dispatch)
    rather than arrival order. ``fp8``: FP8 dispatch (see the module docstring).
    """

    def __init__(
        self,
        num_experts: int,
        group: dist.ProcessGroup,
        *,
        hidden_size: int,
        comm_sms: int = DEFAULT_COMM_SMS,
        max_tokens_per_rank: int | None = None,
        sync_free: bool = False,
        deterministic: bool = False,
        fp8: bool = False,
    ) -> None:
        super().__init__(num_experts, group, sync_free=sync_free, fp8=fp8)
        self._deep_ep = import_deep_ep(DEEPEP_V2_INSTALL_HINT, needs="ElasticBuffer")
        if num_experts > MAX_EXPERTS or self.num_local_experts > MAX_EXPERTS_PER_RANK:
            raise ValueError(
                f"DeepEP V2 takes at most {MAX_EXPERTS} experts and {MAX_EXPERTS_PER_RANK} per rank, got "
                f"{num_experts} over {self.ep_size} ranks"
            )
        if comm_sms < 0:
            raise ValueError(f"comm_sms must be >= 0 (0: DeepEP V2 picks), got {comm_sms}")
        if max_tokens_per_rank is not None and max_tokens_per_rank <= 0:
            raise ValueError(f"max_tokens_per_rank must be positive, got {max_tokens_per_rank}")
        self.group = group
        self.hidden_size = hidden_size
        self.comm_sms = comm_sms
        self.max_tokens_per_rank = max_tokens_per_rank
        self.deterministic = deterministic
        self.buffer: Any = None
        self.num_sms = comm_sms
        """SMs of every call; with ``comm_sms=0``, DeepEP's own count once the buffer exists."""
        self._closed = False

    def close(self) -> None:
        """Release the ElasticBuffer (``destroy()``: a barrier with every peer and a device sync), as
        :meth:`DeepEPBase.close`; a later :meth:`plan` or :meth:`warm_up` raises rather than build another."""
        self._closed = True
        super().close()

    def warm_up(
        self, num_tokens: int, top_k: int, hidden_size: int, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        """Build the ElasticBuffer for ``num_tokens`` per rank and ``top_k`` (``max_tokens_per_rank=None``: the
        group's largest ``num_tokens``), then run dispatch, combine and their backward once at these shapes
        (:meth:`TokenDispatcher.warm_up`), so that every JIT kernel the step runs is compiled. Collective."""
        if self._closed:
            raise RuntimeError("this deepep-v2 dispatcher was closed (its ElasticBuffer destroyed)")
        if top_k > MAX_TOPK:
            raise ValueError(f"DeepEP V2 takes at most {MAX_TOPK} experts per token, got top-k {top_k}")
        if self.buffer is None:
            self._build_buffer(num_tokens, top_k, torch.device(device))
        super().warm_up(num_tokens, top_k, hidden_size, dtype=dtype, device=device)

    def _build_buffer(self, num_tokens: int, num_topk: int, device: torch.device) -> None:
        if self.max_tokens_per_rank is None:
            # Every rank must pass the same num_max_tokens_per_rank: agree on the largest first batch. The count is
            # filled on the device (no upload); reading the maximum back is this build's one host sync.
            count = torch.full((1,), num_tokens, dtype=torch.int64, device=device)
            dist.all_reduce(count, op=dist.ReduceOp.MAX, group=self.group)
            self.max_tokens_per_rank = max(1, int(count.item()))
        self.buffer = self._deep_ep.ElasticBuffer(
            self.group,
            num_max_tokens_per_rank=self.max_tokens_per_rank,
            hidden=self.hidden_size,
            num_topk=num_topk,
            use_fp8_dispatch=self.fp8,
            deterministic=self.deterministic,
            explicitly_destroy=True,
        )
        if self.comm_sms == 0:
            self.num_sms = self.buffer.get_theoretical_num_sms(self.num_experts, num_topk)

    def plan(self, topk_idx_TK: torch.Tensor) -> Route:
        if self._closed:
            raise RuntimeError("this deepep-v2 dispatcher was closed (its ElasticBuffer destroyed)")
        num_tokens, num_topk = topk_idx_TK.shape
        if num_topk > MAX_TOPK:
            raise ValueError(f"DeepEP V2 takes at most {MAX_TOPK} experts per token, got top-k {num_topk}")
        if self.buffer is None:  # not warmed up: built now, in the step
            self._build_buffer(num_tokens, num_topk, topk_idx_TK.device)
        if num_tokens > self.max_tokens_per_rank:
            raise ValueError(
                f"{num_tokens} tokens on this rank, more than the {self.max_tokens_per_rank} the ElasticBuffer was "
                f"built for; pass max_tokens_per_rank >= the largest micro-batch (batch x sequence)"
            )
        return DeepEPRoute(as_topk_idx(topk_idx_TK, self._deep_ep.topk_idx_t), defers_dispatch=not self.sync_free)

    def _launch_kwargs(self) -> dict[str, Any]:
        return {"num_sms": self.num_sms, "async_with_compute_stream": True}

    def _sent_rows(self, route: DeepEPRoute) -> torch.Tensor:
        return sent_rows(route.topk_idx_TK, self.num_local_experts, self.ep_size)

    def dispatch(self, route: Route, x_TD: torch.Tensor, topk_weights_TK: torch.Tensor) -> Pending[Dispatched]:
        assert isinstance(route, DeepEPRoute)
        dtype = x_TD.dtype
        if self.traffic is not None:  # ids (topk_idx_t) and fp32 weights go with every row
            meta = route.topk_idx_TK.shape[1] * (route.topk_idx_TK.element_size() + 4)
            self._count_sent("dispatch", route, x_TD, meta)
        recv_x, recv_idx, recv_w, handle, event = self.buffer.dispatch(
            dispatch_input(x_TD, self.fp8),
            topk_idx=route.topk_idx_TK,
            topk_weights=as_topk_weights(topk_weights_TK),
            num_experts=self.num_experts,
            do_cpu_sync=not self.sync_free,
            **self._launch_kwargs(),
        )
        route.handle = handle

        def finish() -> Dispatched:
            event.current_stream_wait()  # also runs the deterministic sort, if any (elastic.py:1027)
            local_idx, weights_RK = as_local_idx(recv_idx), recv_w
            if self.sync_free:
                # Worst-case allocation: rows past the received count were never written.
                received = handle.psum_num_recv_tokens_per_scaleup_rank[-1]
                pad_R1 = (torch.arange(local_idx.shape[0], device=local_idx.device) >= received)[:, None]
                local_idx, weights_RK = local_idx.masked_fill(pad_R1, -1), weights_RK.masked_fill(pad_R1, 0.0)
            return self._received(route, recv_x, local_idx, weights_RK, dtype)

        return Pending(finish)


def _make_deepep_v2(num_experts: int, group: dist.ProcessGroup | None, options: DispatchOptions) -> TokenDispatcher:
    assert group is not None  # needs_group: make_dispatcher refused None already
    # max_tokens_per_rank=None: the group's largest token count at the warm-up (or the first plan).
    return DeepEPV2Dispatcher(
        num_experts,
        group,
        hidden_size=options.hidden_size,
        comm_sms=options.comm_sms,
        sync_free=options.sync_free,
        deterministic=options.deterministic,
        fp8=options.fp8,
    )


def nvlink_domain_problem(ep_ranks: Sequence[int], local_world_size: int) -> str | None:
    """Why DeepEP V2 cannot split the group of global ``ep_ranks`` into NVLink domains, with
    ``local_world_size`` ranks per node (torchrun numbering: node ``r // local_world_size``); None if it can.

    V2 takes NCCL's NVLink (LSA) team as the scale-up domain and requires group rank
    ``i == (i // n) * n + i % n`` with ``n`` the team size, every team the same size (csrc/kernels/backend/
    nccl.cu:110-115): each node's ranks consecutive in the group, the same number on every node. Unlike V1
    there is no 2/4/8 or multiple-of-8 rule. (Where NVLink spans nodes, NVL72, the team is larger than a node;
    this check takes one node as the domain.)
    """
    ranks = list(ep_ranks)
    if len(ranks) > MAX_RANKS:
        return f"an ep group of {len(ranks)} ranks; DeepEP V2 takes at most {MAX_RANKS}"
    runs: list[list[int]] = []  # [node, count] per run of consecutive group ranks on one node
    for r in ranks:
        node = r // local_world_size
        if runs and runs[-1][0] == node:
            runs[-1][1] += 1
        else:
            runs.append([node, 1])
    nodes = [node for node, _ in runs]
    if len(set(nodes)) < len(nodes):
        return (
            f"ep ranks {ranks}: a node's ranks are not consecutive in the group (local world size {local_world_size})"
        )
    if len({count for _, count in runs}) > 1:
        per_node = {node: count for node, count in runs}
        return f"ep ranks {ranks} put {per_node} ranks on nodes; DeepEP V2 needs the same number on every node"
    return None


def deepep_v2_rules(launch: Launch) -> list[str]:
    """DeepEP V2's limits on ``launch``, each broken one in words (the bf16 rule is the spec's ``dtypes``)."""
    found = []
    if launch.comm_sms is not None and launch.comm_sms < 0:
        found.append(f"a --comm-sms >= 0 (0: DeepEP V2 picks its own count; got {launch.comm_sms})")
    if launch.hidden_size and launch.hidden_size % COMBINE_HIDDEN_MULTIPLE:
        found.append(f"hidden % {COMBINE_HIDDEN_MULTIPLE} == 0 (got {launch.hidden_size})")
    topology = launch.ep_ranks is not None and launch.local_world_size
    if topology and (problem := nvlink_domain_problem(launch.ep_ranks, launch.local_world_size)):
        found.append(problem)
    return found


# CUDA is recorded, not enforced (tests run this backend over a CPU emulation); bf16 rows are enforced
# (combine: EP_HOST_ASSERT(x.scalar_type() == torch::kBFloat16), buffer.hpp:1203).
register_dispatcher(
    DispatcherSpec(
        name="deepep-v2",
        factory=_make_deepep_v2,
        needs_group=True,
        needs_cuda=True,
        dtypes=(torch.bfloat16,),
        rules=deepep_v2_rules,
        package="deep_ep",
        install_hint=DEEPEP_V2_INSTALL_HINT,
        sync_free=True,
        deterministic=True,
        fp8=True,
    )
)

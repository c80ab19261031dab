"""``deepep``: DeepEP's high-throughput V1 ``deep_ep.Buffer`` (NVLink intranode, RDMA internode).

Legend for shape suffixes: T local tokens, R received rows, K top-k slots, D hidden, E global experts.

DeepEP launches its kernels on its own communication stream on ``Buffer.num_sms`` SMs. Each call here
passes ``previous_event``, the compute stream's progress captured with ``Buffer.capture()`` once the call's
inputs are in place (after the copies that make them contiguous and fp32), because the comm stream then waits
for that event only (csrc/deep_ep.cpp ``stream_wait(comm_stream, previous_event)``): an older event, such as
the layout's, would let dispatch read tokens the compute stream has not written yet. ``async_finish=True``
lets the compute stream go on; ``Pending.wait()`` calls ``event.current_stream_wait()`` where the result is
consumed. Backward reuses the forward handle: the gradient of dispatch is a ``combine`` (which also sums the
routing-weight gradients), the gradient of combine is a cached-mode ``dispatch``.

Real DeepEP wants bf16 rows (or an fp8 tuple); run the model in bf16 on the cluster. :func:`deepep_rules`
states DeepEP's limits on a launch so that ``make_dispatcher`` refuses one before a ``Buffer`` exists.

FP8 dispatch (``fp8=True``): dispatch and the gradient of combine (a cached dispatch) pass DeepEP's FP8 input,
the pair ``(x [T, D] float8_e4m3fn, x_scales [T, D // 128] float32)`` (deep_ep/buffer.py ``dispatch``: "the
second must be [num_tokens, hidden // 128] (requiring divisible) with type torch.float"), from
:func:`kernels.fp8.quantize_rows`; DeepEP returns the received pair, dequantized here once the event is
waited. Combine and the gradient of dispatch stay bf16 (V1 combine has no FP8 path).

The Buffer is built with ``explicitly_destroy=True``: otherwise its destructor runs ``destroy()``, a device
sync plus a barrier with every NVLink peer, and a rank that dies leaves its peers spinning in it. The clean
path calls :meth:`DeepEPDispatcher.close`; an error path only drops the object (the destructor then warns).
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kernels.reference_fp8 import FP8_DTYPE
from moe.dispatch import deepep_common
from moe.dispatch.base import DEFAULT_COMM_SMS, Dispatched, Pending, Route, TokenDispatcher
from moe.dispatch.deepep_common import (
    DeepEPBase,
    DeepEPRoute,
    as_local_idx,
    as_topk_idx,
    as_topk_weights,
    dispatch_input,
    row_bytes,
)
from moe.dispatch.registry import DispatcherSpec, DispatchOptions, Launch, register_dispatcher

__all__ = [
    "DEEPEP_INSTALL_HINT",
    "DEEPEP_V1_COMMIT",
    "INTERNODE_RANKS",
    "INTRANODE_RANKS",
    "NVL_PEERS",
    "DeepEPApi",
    "DeepEPDispatcher",
    "deep_ep_api",
    "deepep_rules",
    "import_deep_ep",
    "size_problem",
    "topology_problem",
]

NVL_PEERS = 8
"""Ranks one node serves over NVLink (DeepEP's ``NUM_MAX_NVL_PEERS``, csrc/kernels/legacy/compiled.cuh)."""

# The intranode dispatch kernel stages half a row plus an 8-byte mbarrier in an 8192-byte TMA buffer per warp
# (csrc/kernels/legacy/intranode.cu ``dispatch``: EP_DEVICE_ASSERT(hidden_int4 % 2 == 0 and
# half_hidden_bytes + sizeof(uint64_t) <= kNumTMABytesPerWarp)): rows of whole 32-byte pairs, <= 16,368 B.
MAX_INTRANODE_ROW_BYTES = 2 * (8192 - 8)
ROW_BYTES_MULTIPLE = 32
# The internode combine reduces rows in TMA chunks of 32 int4 (csrc/kernels/legacy/internode.cu ``combine``:
# EP_DEVICE_ASSERT(hidden_int4 % 32 == 0)), i.e. hidden % 256 == 0 in bf16.
INTERNODE_HIDDEN_MULTIPLE = 256
# FP8 dispatch input: x_scales is [num_tokens, hidden // 128], "requiring divisible" (deep_ep/buffer.py
# ``dispatch``), one float32 scale per 128 elements as DeepSeek-V3 quantizes activations.
FP8_HIDDEN_MULTIPLE = 128

DEEPEP_V1_COMMIT = "567632dd59810d77b3cc05553df953cc0f779799"
"""The DeepEP this backend is written against: the last commit before V2 (2026-02-03; it installs as
``deep_ep`` version ``1.2.1+567632d``). The backend calls only V1 ``Buffer`` entry points that every commit
from ``0c984e2`` (2025-07-11, ``explicitly_destroy``; tag v1.2.1 has it) on provides, and V2 (2.x) keeps the
same class as ``deep_ep.buffers.legacy.Buffer``; docs/gpu.md has the install steps."""

# What this file calls on the Buffer class; a V1 build that lacks one is too old for this backend.
_V1_ENTRY_POINTS = (
    "set_num_sms", "capture", "get_dispatch_config", "get_combine_config",
    "get_dispatch_layout", "dispatch", "combine", "destroy",
)  # fmt: skip

DEEPEP_INSTALL_HINT = (
    "the 'deepep' dispatcher needs DeepEP (module 'deep_ep'), which is built from source on a GPU machine "
    "with NVSHMEM: git clone https://github.com/deepseek-ai/DeepEP && cd DeepEP && git checkout "
    f"{DEEPEP_V1_COMMIT[:7]} && NVSHMEM_DIR=/path/to/nvshmem python setup.py install (docs/gpu.md has the "
    "steps; DeepEP 2.x works too, through its legacy Buffer). Do not use the PyPI package 'deep-ep' (an "
    "unbuildable re-upload). Or pick dispatcher='alltoall'."
)


@dataclass(frozen=True, slots=True)
class DeepEPApi:
    """Which DeepEP was imported and the V1-API ``Buffer`` class this backend drives in it."""

    generation: int
    """1: a V1 package (``deep_ep.Buffer`` is the V1 class); 2: a V2 package (``Buffer`` is its legacy copy)."""
    version: str
    """The installed distribution's version (V1: ``1.2.1+<commit>``), V2's ``__version__``, or "unknown"."""
    buffer_cls: Any

    def describe(self) -> str:
        """One line for logs: which API the ``deepep`` backend found."""
        if self.generation == 2:
            return (
                f"DeepEP {self.version} (V2): the 'deepep' backend uses its legacy V1 Buffer "
                "(deep_ep/buffers/legacy.py, NVSHMEM for internode); 'deepep-v2' uses its ElasticBuffer"
            )
        return f"DeepEP {self.version} (V1 Buffer API, targeted at commit {DEEPEP_V1_COMMIT[:7]})"


def _distribution_version(module: Any) -> str:
    version = getattr(module, "__version__", None)  # V2 sets it in deep_ep/__init__.py; V1 does not
    if version is None:
        try:
            version = importlib.metadata.version("deep_ep")  # setup.py: name='deep_ep', '1.2.1+<rev>'
        except importlib.metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, or a test stand-in
            version = "unknown"
    return str(version)


def deep_ep_api(module: Any) -> DeepEPApi:
    """Check that the imported ``deep_ep`` offers the V1 Buffer API this backend calls; say which it is.

    Raises ImportError naming the problem: a V1 build older than ``explicitly_destroy`` (or missing another
    entry point), or a build whose ``topk_idx_t`` is not int64 (``TOPK_IDX_BITS=32`` in V1,
    ``EP_NUM_TOPK_IDX_BITS=32`` in V2; this backend passes int64 expert ids).
    """
    version = _distribution_version(module)
    major = version.split(".")[0]
    generation = 2 if hasattr(module, "ElasticBuffer") or (major.isdigit() and int(major) >= 2) else 1
    where = getattr(module, "__file__", None) or "an unnamed module"
    buffer_cls = getattr(module, "Buffer", None)
    if buffer_cls is None:
        raise ImportError(f"DeepEP {version} at {where} has no Buffer class; {DEEPEP_INSTALL_HINT}")
    missing = [name for name in _V1_ENTRY_POINTS if not callable(getattr(buffer_cls, name, None))]
    try:
        if "explicitly_destroy" not in inspect.signature(buffer_cls.__init__).parameters:
            missing.append("Buffer(explicitly_destroy=...)")
    except (TypeError, ValueError):  # a compiled class without a signature: trust the entry points
        pass
    if missing:
        raise ImportError(
            f"DeepEP {version} at {where} is older than the V1 API the 'deepep' backend calls (missing "
            f"{', '.join(missing)}; needs commit 0c984e2 or later, targets {DEEPEP_V1_COMMIT[:7]}). "
            f"{DEEPEP_INSTALL_HINT}"
        )
    topk_idx_t = getattr(module, "topk_idx_t", torch.int64)  # absent before TOPK_IDX_BITS existed: int64
    if topk_idx_t != torch.int64:
        raise ImportError(
            f"DeepEP {version} at {where} was built with topk_idx_t={topk_idx_t}; the 'deepep' backend passes "
            "int64 expert ids: rebuild without TOPK_IDX_BITS / EP_NUM_TOPK_IDX_BITS (the default is 64)"
        )
    return DeepEPApi(generation, version, buffer_cls)


def import_deep_ep() -> Any:
    """Import ``deep_ep`` lazily (a missing install or V2's NCCL refusal: ImportError with build instructions,
    :func:`moe.dispatch.deepep_common.import_deep_ep`) and check it offers the V1 API (:func:`deep_ep_api`)."""
    module = deepep_common.import_deep_ep(DEEPEP_INSTALL_HINT)
    deep_ep_api(module)
    return module


@dataclass(slots=True)
class _DeepEPRoute(DeepEPRoute):
    num_tokens_per_rank: torch.Tensor = field(kw_only=True)
    num_tokens_per_rdma_rank: torch.Tensor | None = field(kw_only=True)
    num_tokens_per_expert: torch.Tensor = field(kw_only=True)
    is_token_in_rank: torch.Tensor = field(kw_only=True)


class DeepEPDispatcher(DeepEPBase):
    """Expert parallelism through one ``deep_ep.Buffer`` over ``group``.

    ``hidden_bytes`` (hidden size times the element size of the rows sent) sizes the NVLink/RDMA buffers
    from DeepEP's own hints. ``comm_sms`` is applied with ``Buffer.set_num_sms`` (DeepEP requires it even).

    ``sync_free``: dispatch passes DeepEP's ``num_worst_tokens`` = W x T (every token of every rank, all
    ranks routing T tokens), so DeepEP allocates the worst case instead of busy-waiting on the host for the
    received counts (deep_ep/buffers/legacy.py ``dispatch``: "if specified, there will be no CPU sync";
    csrc/legacy/buffer.hpp ``intranode_dispatch``: ``num_recv_tokens = num_worst_tokens``). Received tensors
    then have W x T rows: the real ones first, the rest with ``recv_topk_idx`` -1 (csrc/kernels/legacy/
    intranode.cu cleans them) and rows and weights left unwritten, which the experts never read (no slot of
    theirs is routed there). Intranode only (<= 8 ranks), as DeepEP asserts.

    ``fp8``: FP8 dispatch (see the module docstring).
    """

    def __init__(
        self,
        num_experts: int,
        group: dist.ProcessGroup,
        hidden_bytes: int,
        comm_sms: int = DEFAULT_COMM_SMS,
        *,
        sync_free: bool = False,
        fp8: bool = False,
    ) -> None:
        super().__init__(num_experts, group, sync_free=sync_free, fp8=fp8)
        if sync_free and self.ep_size > NVL_PEERS:
            # legacy.py ``dispatch``: "Internode dispatch does not support `num_worst_tokens > 0`".
            raise ValueError(f"sync-free DeepEP dispatch is intranode only (<= {NVL_PEERS} ranks), got {self.ep_size}")
        self.api = deep_ep_api(import_deep_ep())
        if comm_sms <= 0 or comm_sms % 2:
            raise ValueError(f"DeepEP needs a positive, even SM count, got comm_sms={comm_sms}")
        buffer_cls = self.api.buffer_cls
        buffer_cls.set_num_sms(comm_sms)
        num_nvl_bytes = num_rdma_bytes = 0
        for cfg in (buffer_cls.get_dispatch_config(self.ep_size), buffer_cls.get_combine_config(self.ep_size)):
            num_nvl_bytes = max(num_nvl_bytes, cfg.get_nvl_buffer_size_hint(hidden_bytes, self.ep_size))
            num_rdma_bytes = max(num_rdma_bytes, cfg.get_rdma_buffer_size_hint(hidden_bytes, self.ep_size))
        self.buffer = buffer_cls(group, num_nvl_bytes, num_rdma_bytes, explicitly_destroy=True)
        self._buffer_cls = buffer_cls

    def _launch_kwargs(self) -> dict[str, Any]:
        """Order the comm stream after the compute stream's work so far (call it once the inputs are made)
        and allocate the results there. The same on CUDA and over the in-test emulation."""
        return {"previous_event": self._buffer_cls.capture(), "async_finish": True, "allocate_on_comm_stream": True}

    def _sent_rows(self, route: DeepEPRoute) -> torch.Tensor:
        assert isinstance(route, _DeepEPRoute)
        return route.is_token_in_rank.sum()

    def plan(self, topk_idx_TK: torch.Tensor) -> Route:
        topk_idx_TK = as_topk_idx(topk_idx_TK)
        # The layout's event is not kept: the layout runs on the comm stream, before dispatch on that stream.
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(
            topk_idx_TK, self.num_experts, **self._launch_kwargs()
        )
        return _DeepEPRoute(
            topk_idx_TK,
            defers_dispatch=not self.sync_free,
            num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank,
            num_tokens_per_expert=per_expert,
            is_token_in_rank=in_rank,
        )

    def dispatch(self, route: Route, x_TD: torch.Tensor, topk_weights_TK: torch.Tensor) -> Pending[Dispatched]:
        assert isinstance(route, _DeepEPRoute)
        dtype = x_TD.dtype
        x_in, weights_TK = dispatch_input(x_TD, self.fp8), as_topk_weights(topk_weights_TK)
        if self.traffic is not None:  # ids (topk_idx_t) and weights go with every row
            meta = route.topk_idx_TK.shape[1] * (route.topk_idx_TK.element_size() + weights_TK.element_size())
            self._count_sent("dispatch", route, x_TD, meta)
        # Captured now: the tokens and weights may come from compute issued after plan (and from the copies
        # and the quantization just above); the comm stream waits for nothing newer than this event.
        kwargs = self._launch_kwargs()
        if self.sync_free:
            kwargs["num_worst_tokens"] = self.ep_size * x_TD.shape[0]
        recv_x, recv_idx, recv_w, _, handle, event = self.buffer.dispatch(
            x_in,
            num_tokens_per_rank=route.num_tokens_per_rank,
            num_tokens_per_rdma_rank=route.num_tokens_per_rdma_rank,
            is_token_in_rank=route.is_token_in_rank,
            num_tokens_per_expert=route.num_tokens_per_expert,
            topk_idx=route.topk_idx_TK,
            topk_weights=weights_TK,
            **kwargs,
        )
        route.handle = handle

        def finish() -> Dispatched:
            event.current_stream_wait()
            return self._received(route, recv_x, as_local_idx(recv_idx), recv_w, dtype)

        return Pending(finish)


def _make_deepep(num_experts: int, group: dist.ProcessGroup | None, options: DispatchOptions) -> TokenDispatcher:
    assert group is not None  # needs_group: make_dispatcher refused None already
    # The buffers are sized for the bf16 rows of combine; an FP8 row with its scales is smaller, and DeepEP's
    # size hints reserve room for up to 128 scales per token (csrc/config.hpp kNumMaxScales) either way.
    hidden_bytes = row_bytes(options.hidden_size, options.dtype)
    return DeepEPDispatcher(
        num_experts,
        group,
        hidden_bytes=hidden_bytes,
        comm_sms=options.comm_sms,
        sync_free=options.sync_free,
        fp8=options.fp8,
    )


INTRANODE_RANKS = (2, 4, 8)
"""Group sizes the V1 intranode kernels take (SWITCH_RANKS in csrc/kernels/legacy/launch.cuh)."""
INTERNODE_RANKS = (16, 24, 32, 48, 64, 96, 128, 144, 160)
"""Group sizes the V1 internode kernels take: 8 NVLink peers times the RDMA rank counts SWITCH_RDMA_RANKS
instantiates (2, 3, 4, 6, 8, 12, 16, 18, 20)."""
INTERNODE_MIN_SMS = 4
"""Communication SMs the internode kernels need at least."""


def size_problem(size: int) -> str | None:
    """Why DeepEP V1 cannot run an expert-parallel group of ``size`` ranks; None if it can."""
    if size in INTRANODE_RANKS or size in INTERNODE_RANKS:
        return None
    return (
        f"an ep group of {size} ranks; DeepEP runs {', '.join(map(str, INTRANODE_RANKS))} ranks within a node and "
        f"{', '.join(map(str, INTERNODE_RANKS))} across nodes"
    )


def topology_problem(ep_ranks: Sequence[int], local_world_size: int) -> str | None:
    """Why DeepEP cannot run over the group of global ``ep_ranks`` with ``local_world_size`` ranks per node
    (torchrun numbering: node ``r // local_world_size``); None if it can.

    DeepEP splits a group rank into ``rdma_rank = rank // 8`` and ``nvl_rank = rank % 8`` and opens CUDA IPC
    handles to the other ranks of its block of 8 (csrc/legacy/buffer.hpp ``Buffer::Buffer`` and ``sync``):
    a group of at most 8 is all NVLink peers, one node; a larger one must be whole blocks of 8
    (``num_ranks < 8 or num_ranks % 8 == 0``), each block the consecutive ranks of one node.
    """
    ranks = list(ep_ranks)
    size = len(ranks)
    nodes = [r // local_world_size for r in ranks]
    if problem := size_problem(size):
        return problem
    if size <= NVL_PEERS:
        if len(set(nodes)) > 1:
            return f"ep ranks {ranks} span nodes {sorted(set(nodes))}; a group of <= 8 needs NVLink, one node"
        return None
    for i in range(0, size, NVL_PEERS):
        block = ranks[i : i + NVL_PEERS]
        if len(set(nodes[i : i + NVL_PEERS])) > 1 or block != list(range(block[0], block[0] + NVL_PEERS)):
            return (
                f"ep ranks {block} (group ranks {i}-{i + NVL_PEERS - 1}) are not 8 consecutive ranks of one node "
                f"(local world size {local_world_size})"
            )
    return None


def deepep_rules(launch: Launch) -> list[str]:
    """DeepEP's limits on ``launch``, each broken one in words (the bf16 rule is the spec's ``dtypes``)."""
    found = []
    if launch.comm_sms is not None and (launch.comm_sms <= 0 or launch.comm_sms % 2):
        # Buffer.set_num_sms asserts an even count; one channel is a sender/receiver pair of SMs, so 0 SMs
        # is no channel at all (csrc/legacy/buffer.hpp: num_channels = config.num_sms / 2).
        found.append(f"a positive, even --comm-sms (got {launch.comm_sms})")
    if launch.hidden_size and launch.fp8 and launch.hidden_size % FP8_HIDDEN_MULTIPLE:
        found.append(f"hidden % {FP8_HIDDEN_MULTIPLE} == 0 for FP8 dispatch (got {launch.hidden_size})")
    if launch.hidden_size and launch.dtype is not None:
        # The dispatch kernel's limit, on the rows dispatch sends: FP8 ones under FP8 dispatch (combine has none).
        sent = FP8_DTYPE if launch.fp8 else launch.dtype
        nbytes = row_bytes(launch.hidden_size, sent)
        if nbytes > MAX_INTRANODE_ROW_BYTES or nbytes % ROW_BYTES_MULTIPLE:
            found.append(
                f"rows of at most {MAX_INTRANODE_ROW_BYTES} bytes, a multiple of {ROW_BYTES_MULTIPLE} "
                f"(hidden {launch.hidden_size} x {sent} = {nbytes})"
            )
        internode = (launch.group_size or 0) > NVL_PEERS
        if internode and launch.hidden_size % INTERNODE_HIDDEN_MULTIPLE:
            found.append(f"hidden % {INTERNODE_HIDDEN_MULTIPLE} == 0 across nodes (got {launch.hidden_size})")
    size = launch.group_size
    problem = None if size is None else size_problem(size)
    if problem is None and launch.ep_ranks is not None and launch.local_world_size:
        problem = topology_problem(launch.ep_ranks, launch.local_world_size)  # the placement on nodes
    if problem is not None:
        found.append(problem)
    internode = size is not None and size > NVL_PEERS
    if internode and launch.comm_sms is not None and 0 < launch.comm_sms < INTERNODE_MIN_SMS:
        found.append(f"at least {INTERNODE_MIN_SMS} --comm-sms across nodes (got {launch.comm_sms})")
    return found


# CUDA is the real library's need, recorded, not enforced, because the tests run this backend over a CPU
# emulation. bf16 rows are enforced (V1 combine takes bf16 only: SWITCH_TYPES in csrc/kernels/legacy/
# launch.cuh has one case, CUDA_R_16BF; internode.cu ``combine`` asserts it too).
register_dispatcher(
    DispatcherSpec(
        name="deepep",
        factory=_make_deepep,
        needs_group=True,
        needs_cuda=True,
        dtypes=(torch.bfloat16,),
        rules=deepep_rules,
        package="deep_ep",
        install_hint=DEEPEP_INSTALL_HINT,
        sync_free=True,
        fp8=True,
    )
)

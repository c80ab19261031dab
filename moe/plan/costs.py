"""Analytic seconds per sub-stage for one micro-batch: compute from FLOPs and bytes, communication from bytes.

Time of an operation (:mod:`moe.plan.flops`): ``max(FLOPs / rate, bytes / HBM bandwidth)``, the roofline
bound, where ``rate`` is the bf16 or FP8 peak (:attr:`moe.plan.flops.Op.fp8`) times the
device's cited efficiency for the op (:func:`moe.plan.flops.efficiency_key`: a GEMM's precision and shape
class, the attention core's forward or backward; :mod:`moe.plan.efficiency`) on all SMs, or on
``sms - comm_sms`` of them for the grouped expert GEMMs (which are what runs while the all-to-all holds its
SMs: kernels take ``num_sms - comm_sms``, DESIGN.md). Memory-bound ops land on the bytes term. The table's
``launch`` and ``host`` entries are not applied here yet: the host runs ahead of the GPU, and what it costs
per piece is the calibration's to measure (bench.overlap --calibrate).

All-to-all (DeepEP's scheme, DeepSeek-V3 report 3.2.2): a token crossing nodes goes over InfiniBand once
per destination node, to the GPU with its own local index there, which forwards it over NVLink to every
GPU of that node that holds one of its experts; inside its own node it goes over NVLink directly. Per rank
and direction, with d_r distinct ranks and d_n distinct nodes per token (:mod:`moe.plan.routing`), n nodes
in the ep group and r = ep / n ranks per node (ep innermost: a node holds r consecutive ep ranks):

    IB bytes     = T x d_n x (1 - 1/n) x D x b        (remote nodes reached; the own node costs no IB)
    NVLink bytes = T x d_r x (1 - 1/r) x D x b        (every reached rank but the one the row lands on)

The second line counts, on each reached node, the reached ranks other than the one the row arrives at
(the sender itself on its own node, the IB receiver on a remote one: 1/r of the reached ranks by symmetry).
Time is ``max(NVLink bytes / NVLink bw, IB bytes / IB bw)`` at DeepEP's published rates for the direction
(``deepep.*`` entries of :mod:`moe.plan.efficiency`): the two links are separate hardware that DeepEP drives
at once, forwarding chunks over NVLink as they arrive from IB, so the slower one bounds the
transfer. Combine sends the same rows back, and each backward all-to-all moves the same rows the other way:
the combine's gradient along the dispatch's routes, the dispatch's along the combine's. ``b`` is the
activation's element size, but in the dispatch direction (the forward dispatch and the combine's backward)
under FP8 dispatch (:attr:`Precision.dispatch_fp8`): one E4M3 byte and an fp32 scale per 128 elements
(:data:`moe.plan.flops.FP8_BYTES`); the combine direction stays in the activation dtype (DeepEP V1's combine
takes bf16 only). Each row's fp32 routing weights and int64 expert ids (12 bytes per top-k slot) ride along
and are left out: under 1% of a row at V3's width.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from dualpipe.schedule import schedule_spec
from moe.models.config import MoEConfig
from moe.models.layers import RECOMPUTE, recompute_granularity
from moe.optim_state import STATE_DTYPES
from moe.pipeline_layout import AUTO
from moe.plan import flops as fl
from moe.plan.hardware import GPU, Cluster
from moe.plan.params import ConfigKey, rank_params
from moe.plan.routing import expected_nodes, expected_ranks

__all__ = [
    "COMPUTE_FIELDS",
    "NO_FP8",
    "RECOMPUTE",
    "STATE_DTYPES",
    "TRAINER_DEFAULTS",
    "AllToAllBytes",
    "CostSource",
    "MemoryOptions",
    "Parallelism",
    "Precision",
    "SubstageCosts",
    "Workload",
    "all_to_all_bytes",
    "all_to_all_seconds",
    "allreduce_busbw",
    "allreduce_seconds",
    "analytic_costs",
    "dp_reduce_seconds",
    "layer_ops",
    "op_seconds",
    "p2p_seconds",
    "phase_work",
    "recompute_granularity",
    "substage_costs",
]

# The trainer's names, defined once where the trainer reads them: ``parallel.recompute`` (RECOMPUTE: none;
# selective, the DeepSeek-V3 report's (3.2.3), every RMSNorm and MLA's up-projections run again in backward;
# full, each piece keeps only its inputs) and ``optimizer.state_dtype`` (STATE_DTYPES; the report (3.3.3)
# keeps AdamW's moments in bf16, the master weights and gradients in fp32).


COMPUTE_FIELDS = (
    "attn_F",
    "attn_dX",
    "attn_dW",
    "shared_F",
    "shared_dX",
    "shared_dW",
    "mlp_F",
    "mlp_dX",
    "mlp_dW",
    "embed_F",
    "embed_B",
    "head_F",
    "head_B",
)
"""The compute fields of :class:`SubstageCosts` (seconds on the GPU's SMs)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Parallelism:
    """The (pp, dp, ep) layout of issue 12: world = pp x dp, ep divides dp, edp = dp / ep replicas; ranks in
    (pp, edp, ep) order, ep innermost."""

    pp: int
    dp: int
    ep: int
    schedule: str = "dualpipev"
    """A schedule of :data:`dualpipe.schedule.SCHEDULES` (its layout places the stages)."""
    modules_per_rank: int | None = None
    """For schedules that take any number (interleaved 1F1B); None: the schedule's own."""
    pipeline_layout: str = AUTO
    """What each stage holds, the trainer's ``parallel.pipeline_layout`` (:mod:`moe.pipeline_layout`);
    ``auto``: stages balanced by cost."""
    extra_warmup: int = 0
    """Warm-up forwards added on every rank, the trainer's ``parallel.extra_warmup`` (each rank keeps as many
    more micro-batches in flight)."""
    offload: str = ""
    """Saved activations moved to host memory between each forward and its backward, the trainer's
    ``parallel.offload`` (:mod:`moe.plan.offload`'s syntax; empty: none)."""

    def __post_init__(self) -> None:
        if min(self.pp, self.dp, self.ep) < 1:
            raise ValueError(f"pp, dp and ep must be >= 1, got pp={self.pp} dp={self.dp} ep={self.ep}")
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp}")
        schedule_spec(self.schedule).check_ranks(self.pp)

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    @property
    def world(self) -> int:
        return self.pp * self.dp

    @property
    def mirrored(self) -> bool:
        """The schedule holds every stage twice (DualPipe)."""
        return schedule_spec(self.schedule).stage_layout(self.pp, self.modules_per_rank).mirrored


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryOptions:
    """The memory options of a run besides its recompute granularity (which the search tries per candidate):
    each a :class:`Workload` field of the same name."""

    state_dtype: str = "float32"
    fp8_activations: bool = False
    mtp_shared: bool = True
    ema: bool = False


TRAINER_DEFAULTS = MemoryOptions()
"""The trainer's defaults: fp32 moments, no FP8, MTP sharing the embedding and head."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Precision:
    """What the GEMMs and the all-to-alls compute and carry: the trainer's ``training.fp8`` and
    ``training.fp8_dispatch`` (its ``fp8_activations``, a memory option, is :class:`MemoryOptions`')."""

    fp8: bool = False
    """FP8 GEMMs as DeepSeek-V3 trains (:mod:`moe.plan.flops`' docstring: every linear but the head and the
    router's gate, at the device's FP8 peak, with the quantization's traffic); False: the activation dtype."""
    fp8_dispatch: bool | None = None
    """FP8 rows in the dispatch direction (the forward dispatch and the combine's backward); None: exactly
    when ``fp8`` (the trainer's default)."""

    @property
    def dispatch_fp8(self) -> bool:
        return self.fp8 if self.fp8_dispatch is None else self.fp8_dispatch

    def to_dict(self) -> dict[str, bool]:
        """By the names the plan reports it."""
        return {"fp8_gemms": self.fp8, "fp8_dispatch": self.dispatch_fp8}


NO_FP8 = Precision()
"""The trainer's default: GEMMs and all-to-alls in the activation dtype."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """One micro-batch and the run's execution options."""

    seq_len: int
    micro_batch: int
    """Sequences per micro-batch (per data-parallel rank)."""
    comm_sms: int = 20
    """SMs reserved for communication while experts compute (0 at ep = 1). 20: the DeepSeek-V3 report's
    figure, enough to saturate IB and NVLink on H800 (3.2.2)."""
    recompute: str | bool = "none"
    """A granularity of :data:`RECOMPUTE` (a bool is read as ``full`` / ``none``): ``full`` adds the
    attention and MLP forward to their dX, ``selective`` the forward of the ops it runs again
    (:attr:`moe.plan.flops.Op.selective`)."""
    act_bytes: int = 2
    """Bytes per activation element (bf16)."""
    master_weights: bool = True
    """bf16 parameters with fp32 masters and fp32 gradient buffers (issue 12's default); False: pure bf16."""
    state_dtype: str = "float32"
    """Dtype of the optimizer's moments (:data:`STATE_DTYPES`); ``bfloat16`` as the DeepSeek-V3 report."""
    fp8_activations: bool = False
    """The routed experts keep the up-projection's input and the SwiGLU input for backward in FP8 with their
    scales instead of the activation dtype; every other saved tensor is unchanged (the trainer's
    ``training.fp8_activations``; needs ``precision.fp8``; see :mod:`moe.plan.footprint`)."""
    mtp_shared: bool = True
    """The MTP modules share the main model's embedding and head (the report's 3.2.3; no second copy on a
    rank that holds both); False: each module holds its own, as the published checkpoint stores them."""
    precision: Precision = NO_FP8
    """FP8 GEMMs and FP8 dispatch (:class:`Precision`)."""
    ema: bool = False
    """A moving average of the weights in host memory (the trainer's ``optimizer.ema``): no GPU bytes, its host
    bytes in :attr:`moe.plan.footprint.Footprint.host`."""
    expert_imbalance: float = 1.0
    """Routed rows of the busiest expert-parallel rank over the group's mean (1: balanced, the routing model's
    uniform state). That rank's routed-expert compute and its all-to-alls take this much longer, and every rank
    of the group waits for it at each all-to-all, so the pipeline runs at its pace (:func:`substage_costs`)."""

    def __post_init__(self) -> None:
        if self.seq_len < 1 or self.micro_batch < 1 or self.comm_sms < 0 or self.act_bytes < 1:
            raise ValueError(f"invalid workload {self}")
        if not self.expert_imbalance >= 1.0:
            raise ValueError(f"expert_imbalance={self.expert_imbalance}: the busiest rank over the mean is at least 1")
        object.__setattr__(self, "recompute", recompute_granularity(self.recompute))
        if self.state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype={self.state_dtype!r}: choose one of {STATE_DTYPES}")
        if self.fp8_activations and not self.precision.fp8:
            raise ValueError("fp8_activations needs fp8: the FP8 experts keep their inputs in FP8")

    @property
    def tokens(self) -> int:
        return self.seq_len * self.micro_batch

    @property
    def dispatch_bytes(self) -> float:
        """Bytes per element in the dispatch direction: FP8 with its scale under FP8 dispatch, else the
        activation's (the combine direction always moves the activation's)."""
        return fl.FP8_BYTES if self.precision.dispatch_fp8 else self.act_bytes

    @property
    def grad_bytes(self) -> int:
        """Bytes per gradient element as reduced: fp32 main_grad under master weights, else the parameter's."""
        return 4 if self.master_weights else self.act_bytes

    def memory_options(self) -> dict[str, object]:
        """The memory-saving options this workload runs with, by the names the plan reports them."""
        return {
            "recompute": self.recompute,
            "optimizer_state_dtype": self.state_dtype,
            "mtp_shares_embedding_and_head": self.mtp_shared,
            "fp8_activations": self.fp8_activations,
            "ema_on_host": self.ema,
        }


@dataclass(frozen=True, slots=True)
class AllToAllBytes:
    """One rank's bytes for one all-to-all (dispatch or combine) of one micro-batch, one direction."""

    nvlink: float
    internode: float
    ranks_reached: float
    """Expected distinct ep ranks per token."""
    nodes_reached: float
    """Expected distinct nodes per token."""


def all_to_all_bytes(cfg: MoEConfig, cluster: Cluster, ep: int, tokens: int, elem_bytes: float) -> AllToAllBytes:
    """NVLink and IB bytes per rank for one all-to-all of ``tokens`` tokens' rows of ``elem_bytes`` per element
    (see the module docstring)."""
    if ep == 1:
        return AllToAllBytes(0.0, 0.0, 1.0, 1.0)
    d_r = expected_ranks(cfg, ep)
    d_n = expected_nodes(cfg, ep, cluster.gpus_per_node)
    per_node = min(ep, cluster.gpus_per_node)
    nodes = ep // per_node
    row = tokens * cfg.hidden_size * elem_bytes
    return AllToAllBytes(
        nvlink=row * d_r * (1 - 1 / per_node),
        internode=row * d_n * (1 - 1 / nodes),
        ranks_reached=d_r,
        nodes_reached=d_n,
    )


def all_to_all_seconds(moved: AllToAllBytes, gpu: GPU, direction: str = "dispatch") -> float:
    """``max(NVLink part / NVLink bw, IB part / IB bw)`` at DeepEP's rates for ``direction`` (``"dispatch"`` or
    ``"combine"``): the two links work at once."""
    nvlink = moved.nvlink / gpu.value(f"deepep.intranode.{direction}") if moved.nvlink else 0.0
    internode = moved.internode / gpu.value(f"deepep.internode.{direction}") if moved.internode else 0.0
    return max(nvlink, internode)


def op_seconds(op: fl.Op, phase: str, gpu: GPU, comm_sms: int) -> float:
    """Roofline time of ``op``'s ``phase`` (``"fwd"``, ``"dx"``, ``"dw"``) at its cited rate (the module
    docstring); expert GEMMs get ``sms - comm_sms`` of the SMs."""
    if op.experts and comm_sms >= gpu.sms:
        raise ValueError(f"comm_sms={comm_sms} leaves no SM of {gpu.sms} for the experts")
    flops, nbytes = getattr(op, f"{phase}_flops"), getattr(op, f"{phase}_bytes")
    t = nbytes / gpu.hbm_bytes_per_s
    key = fl.efficiency_key(op, phase)
    if key is not None:
        rate = gpu.peak(op.fp8) * gpu.value(key) * ((gpu.sms - comm_sms) / gpu.sms if op.experts else 1.0)
        t = max(t, flops / rate)
    return t


OpTimer = Callable[[fl.Op, str, GPU, int], float]
"""Seconds of one op's phase, with :func:`op_seconds`'s arguments (a costs file's ``ops`` may override it)."""


def _phases(ops: list[fl.Op], gpu: GPU, comm_sms: int, timer: OpTimer) -> tuple[float, float, float]:
    return tuple(sum(timer(op, ph, gpu, comm_sms) for op in ops) for ph in ("fwd", "dx", "dw"))  # type: ignore[return-value]


def allreduce_seconds(nbytes: float, group: int, bytes_per_s: float) -> float:
    """Ring all-reduce of ``nbytes`` over ``group`` ranks: each rank sends ``2 (n-1)/n x nbytes``."""
    if group <= 1 or nbytes == 0:
        return 0.0
    return 2 * (group - 1) / group * nbytes / bytes_per_s


def allreduce_busbw(cluster: Cluster, group: int, stride: int) -> float:
    """NCCL all-reduce bus bandwidth of a group of ``group`` ranks ``stride`` apart (``nccl.allreduce.*``
    entries of :mod:`moe.plan.efficiency`): the intra-node figure when the group fits in a node, else each
    node's ranks of the group send through their own NICs at once (NCCL's channels, one a NIC), so r ranks a
    node reach r times one NIC's figure, never more than the intra-node one."""
    gpu, per_node = cluster.gpu, cluster.gpus_per_node
    inside = gpu.value("nccl.allreduce.intranode")
    if (group - 1) * stride + 1 <= per_node:  # every rank of the group in one node
        return inside
    r = min(group, max(1, per_node // stride))
    return min(inside, r * gpu.value("nccl.allreduce.internode"))


def p2p_seconds(cfg: MoEConfig, cluster: Cluster, par: Parallelism, work: Workload) -> float:
    """One ``[micro_batch, seq, hidden]`` activation (or its gradient) between pipeline neighbours.

    Pipeline neighbours are ``dp`` ranks apart (pp outermost): over NVLink only when the whole pipeline's
    ranks fit in one node, else some boundary crosses nodes and the slowest boundary paces the pipeline."""
    if par.pp == 1:
        return 0.0
    nbytes = work.tokens * cfg.hidden_size * work.act_bytes
    where = "intranode" if par.pp * par.dp <= cluster.gpus_per_node else "internode"
    return nbytes / cluster.gpu.value(f"nccl.p2p.{where}")


@functools.lru_cache(maxsize=4096)
def _grad_elements(
    key: ConfigKey,
    pp: int,
    ep: int,
    schedule: str,
    rank: int,
    modules_per_rank: int | None,
    mtp_shared: bool,
    pipeline_layout: str,
) -> tuple[int, int]:
    """(dense, expert) parameter elements pipeline rank ``rank`` holds, by value (a search asks per candidate)."""
    specs = rank_params(
        key.cfg, pp, ep, schedule, rank, modules_per_rank, mtp_shared=mtp_shared, pipeline_layout=pipeline_layout
    )
    return sum(p.numel for p in specs if not p.expert), sum(p.numel for p in specs if p.expert)


def dp_reduce_seconds(cfg: MoEConfig, cluster: Cluster, par: Parallelism, work: Workload) -> float:
    """Gradient reduction of one step on the busiest pipeline rank, not overlapped with anything.

    Dense gradients all-reduced over dp (dp consecutive ranks), expert gradients over the edp replicas
    (``ep`` apart, spanning dp ranks), fp32 buffers under master weights; DualPipe first sums its two
    mirrored copies over a 2-rank group (pipeline ranks r and pp-1-r). Every rank's gradients are sent
    once per group; the slowest rank bounds the step."""
    worst = 0.0
    layout = schedule_spec(par.schedule).stage_layout(par.pp, par.modules_per_rank)
    key = ConfigKey.of(cfg)
    for r in range(par.pp):
        dense, expert = (
            n * work.grad_bytes
            for n in _grad_elements(
                key, par.pp, par.ep, par.schedule, r, par.modules_per_rank, work.mtp_shared, par.pipeline_layout
            )
        )
        t = allreduce_seconds(dense, par.dp, allreduce_busbw(cluster, par.dp, 1))
        t += allreduce_seconds(expert, par.edp, allreduce_busbw(cluster, par.edp, par.ep))
        if layout.mirrored:  # ranks r and pp-1-r: up to (pp-1) dp apart
            t += allreduce_seconds(dense + expert, 2, allreduce_busbw(cluster, 2, (par.pp - 1) * par.dp))
        worst = max(worst, t)
    return worst


@dataclass(frozen=True, slots=True)
class SubstageCosts:
    """Seconds for one micro-batch through one layer (and the stage extras), on one GPU.

    ``attn_*`` is the attention sub-stage (MoE layers: router included), ``mlp_*`` the MLP sub-stage
    (permute, routed and shared experts, unpermute; a dense layer's MLP). ``dispatch`` / ``combine``: one
    all-to-all of each direction (0 for a dense layer or ep = 1): ``dispatch`` is the forward dispatch and the
    combine's backward, ``combine`` the forward combine and the dispatch's backward (they differ under FP8
    dispatch). ``embed_*`` and
    ``head_*`` (head includes the final norm and the loss, and each MTP module's work around its block:
    :func:`moe.plan.flops.mtp_ops`) run only on the first / last stage. ``p2p``: one activation to the next
    pipeline stage. ``dp_reduce``: the whole step's gradient reduction (once per step, not per micro-batch).
    With recompute, ``attn_dX`` and ``mlp_dX`` (and ``head_B`` under ``selective``: its norms) include the
    forward of what runs again.
    """

    moe: bool
    attn_F: float
    attn_dX: float
    attn_dW: float
    mlp_F: float
    mlp_dX: float
    mlp_dW: float
    dispatch: float
    combine: float
    embed_F: float
    embed_B: float
    head_F: float
    head_B: float
    p2p: float
    dp_reduce: float
    shared_F: float = 0.0
    """An MoE layer's shared experts, a compute piece of their own in the runtime (the pair runs the other
    micro-batch's under the forward dispatch's row counts, :mod:`dualpipe.pair_order`); ``mlp_*`` is the rest."""
    shared_dX: float = 0.0
    shared_dW: float = 0.0
    host_F: float = 0.0
    """Host work between an MoE layer's forward pieces (issuing transfers, routing metadata), on the compute
    stream's time but no compute: measured only (:attr:`moe.plan.measured.MeasuredCosts.host`); the analytic
    model has the host run ahead of the GPU."""
    host_B: float = 0.0
    counts: float = 0.0
    """The forward dispatch's row-count exchange, waited for before the rows start (measured only; analytic:
    inside ``dispatch``)."""
    detail: dict[str, float] = field(default_factory=dict, compare=False)
    """Per-op seconds (``"<op>.<phase>"``) behind the sums, for tables and checks."""

    @property
    def F(self) -> float:
        """Forward compute of the layer (no communication)."""
        return self.attn_F + self.shared_F + self.mlp_F

    @property
    def B(self) -> float:
        """Full backward compute of the layer (dX + dW, recompute included)."""
        return self.attn_dX + self.attn_dW + self.shared_dX + self.shared_dW + self.mlp_dX + self.mlp_dW

    @property
    def W(self) -> float:
        """Weight-gradient part of :attr:`B`."""
        return self.attn_dW + self.shared_dW + self.mlp_dW

    @property
    def comm(self) -> float:
        """All-to-all time of one direction of the layer (dispatch + combine)."""
        return self.dispatch + self.combine


def _sub_ops(
    cfg: MoEConfig, tokens: int, seq_len: int, ep: int, rows: float, b: int, moe: bool, fp8: bool
) -> dict[str, list]:
    attn = fl.attention_ops(cfg, tokens, seq_len, b, fp8) + (fl.router_ops(cfg, tokens, b) if moe else [])
    mlp = fl.moe_mlp_ops(cfg, tokens, rows, b, ep, fp8) if moe else fl.dense_mlp_ops(cfg, tokens, b, fp8)
    shared = [op for op in mlp if op.name.startswith(fl.SHARED_PREFIX)]  # the runtime's side piece
    mlp = [op for op in mlp if not op.name.startswith(fl.SHARED_PREFIX)]
    head = fl.head_ops(cfg, tokens, b) + cfg.mtp_layers * fl.mtp_ops(cfg, tokens, b, fp8)
    return {"attn": attn, "shared": shared, "mlp": mlp, "embed": fl.embed_ops(cfg, tokens, b), "head": head}


def layer_ops(
    cfg: MoEConfig,
    tokens: int,
    seq_len: int,
    *,
    ep: int = 1,
    act_bytes: int = 2,
    moe: bool = True,
    fp8: bool = False,
) -> dict[str, list[fl.Op]]:
    """The ops of each sub-stage (``"attn"``, ``"mlp"``, ``"embed"``, ``"head"``) of one layer for one
    micro-batch of ``tokens`` tokens on one rank of an ep group of ``ep``; ``fp8``: FP8 GEMMs."""
    rows = tokens * (expected_ranks(cfg, ep) if ep > 1 else 1.0)
    return _sub_ops(cfg, tokens, seq_len, ep, rows, act_bytes, moe, fp8)


def phase_work(
    cfg: MoEConfig,
    tokens: int,
    seq_len: int,
    *,
    ep: int = 1,
    act_bytes: int = 2,
    moe: bool = True,
    fp8: bool = False,
) -> dict[str, tuple[float, float]]:
    """``(FLOPs, HBM bytes)`` behind each compute field of :class:`SubstageCosts` (no recompute): what
    measured times are scaled by (:mod:`moe.plan.measured`)."""
    subs = layer_ops(cfg, tokens, seq_len, ep=ep, act_bytes=act_bytes, moe=moe, fp8=fp8)
    out = {}
    for sub in ("attn", "shared", "mlp"):
        for name, ph in (("F", "fwd"), ("dX", "dx"), ("dW", "dw")):
            out[f"{sub}_{name}"] = (fl.total(subs[sub], f"{ph}_flops"), fl.total(subs[sub], f"{ph}_bytes"))
    for sub in ("embed", "head"):
        ops = subs[sub]
        out[f"{sub}_F"] = (fl.total(ops, "fwd_flops"), fl.total(ops, "fwd_bytes"))
        back = [fl.total(ops, f) for f in ("dx_flops", "dw_flops", "dx_bytes", "dw_bytes")]
        out[f"{sub}_B"] = (back[0] + back[1], back[2] + back[3])
    return out


class CostSource(Protocol):
    """Measured costs that replace analytic ones (:class:`moe.plan.measured.MeasuredCosts` is one): this
    module asks them, and never imports the module that reads them."""

    def op_timer(self) -> OpTimer:
        """:func:`op_seconds`, with what was measured of single ops in."""

    def apply(
        self, analytic: SubstageCosts, cfg: MoEConfig, cluster: Cluster, par: Parallelism, work: Workload
    ) -> SubstageCosts:
        """``analytic`` with every measured sub-stage field in."""


def substage_costs(
    cfg: MoEConfig,
    cluster: Cluster,
    par: Parallelism,
    work: Workload,
    *,
    moe: bool = True,
    measured: CostSource | None = None,
) -> SubstageCosts:
    """:class:`SubstageCosts` of one MoE layer (``moe=True``) or one dense layer.

    Analytic unless ``measured`` (a :class:`moe.plan.measured.MeasuredCosts`) is given: then each op its
    ``ops`` section holds takes its measured time scaled to this config in the sums
    (:meth:`CostSource.op_timer`), and every sub-stage field its layer entry holds replaces the sum by its
    measured time scaled to this config (:meth:`CostSource.apply`); the rest stay analytic. ``comm_sms`` is
    reserved only where an all-to-all exists (MoE layer, ep > 1), as moe.parallel does.

    ``work.expert_imbalance`` then stretches the routed experts (``mlp_*``: permute, experts, unpermute) and
    both all-to-alls of an MoE layer at ep > 1: the costs are the busiest rank's, whose pace the group keeps
    (the per-op ``detail`` stays the mean rank's). All-to-all times measured on an unevenly loaded group
    already hold part of its waiting (the lighter ranks wait for the busiest): stretched again, they err long."""
    if measured is None:
        costs = analytic_costs(cfg, cluster, par, work, moe)
    else:
        costs = measured.apply(
            analytic_costs(cfg, cluster, par, work, moe, measured.op_timer()), cfg, cluster, par, work
        )
    k = work.expert_imbalance
    if not moe or par.ep == 1 or k == 1.0:
        return costs
    return replace(
        costs,
        mlp_F=costs.mlp_F * k,
        mlp_dX=costs.mlp_dX * k,
        mlp_dW=costs.mlp_dW * k,
        dispatch=costs.dispatch * k,
        combine=costs.combine * k,
    )


def _selective(ops: list[fl.Op], gpu: GPU, comm_sms: int, timer: OpTimer) -> float:
    """Forward seconds of the ops selective recompute runs again."""
    return sum(timer(op, "fwd", gpu, comm_sms) for op in ops if op.selective)


def analytic_costs(
    cfg: MoEConfig, cluster: Cluster, par: Parallelism, work: Workload, moe: bool, timer: OpTimer = op_seconds
) -> SubstageCosts:
    """:class:`SubstageCosts` from the roofline of every op (``timer``: seconds of one op's phase). A layer's
    fields depend on the parallelism only through ``ep`` (the P2P and the data-parallel reduction on all of it):
    with the roofline's own timer they are computed once per (model, cluster, ep, workload)."""
    if moe and not cfg.moe_layers:
        raise ValueError("the config has no MoE layer")
    if timer is op_seconds:
        layer = _roofline_layer(ConfigKey.of(cfg), cluster, par.ep, work, moe)
    else:
        layer = _layer_costs(cfg, cluster, par.ep, work, moe, timer)
    return replace(
        layer, p2p=p2p_seconds(cfg, cluster, par, work), dp_reduce=dp_reduce_seconds(cfg, cluster, par, work)
    )


@functools.lru_cache(maxsize=1024)
def _roofline_layer(key: ConfigKey, cluster: Cluster, ep: int, work: Workload, moe: bool) -> SubstageCosts:
    return _layer_costs(key.cfg, cluster, ep, work, moe, op_seconds)


def _layer_costs(cfg: MoEConfig, cluster: Cluster, ep: int, work: Workload, moe: bool, timer: OpTimer) -> SubstageCosts:
    """One layer's fields of :func:`analytic_costs` (``p2p`` and ``dp_reduce`` left 0)."""
    gpu, t, b = cluster.gpu, work.tokens, work.act_bytes
    comm_sms = work.comm_sms if (moe and ep > 1) else 0
    moved = all_to_all_bytes(cfg, cluster, ep, t, work.dispatch_bytes)
    back = all_to_all_bytes(cfg, cluster, ep, t, b)
    dispatch = all_to_all_seconds(moved, gpu, "dispatch") if moe else 0.0
    combine = all_to_all_seconds(back, gpu, "combine") if moe else 0.0
    subs = _sub_ops(cfg, t, work.seq_len, ep, t * moved.ranks_reached, b, moe, work.precision.fp8)
    attn, shared, mlp = subs["attn"], subs["shared"], subs["mlp"]
    detail = {
        f"{op.name}.{ph}": timer(op, ph, gpu, comm_sms) for op in attn + shared + mlp for ph in ("fwd", "dx", "dw")
    }
    a_f, a_dx, a_dw = _phases(attn, gpu, comm_sms, timer)
    s_f, s_dx, s_dw = _phases(shared, gpu, comm_sms, timer)
    m_f, m_dx, m_dw = _phases(mlp, gpu, comm_sms, timer)
    e_f, e_dx, e_dw = _phases(subs["embed"], gpu, 0, timer)
    h_f, h_dx, h_dw = _phases(subs["head"], gpu, 0, timer)
    if work.recompute == "full":  # the embedding and head pieces never recompute
        a_dx, s_dx, m_dx = a_dx + a_f, s_dx + s_f, m_dx + m_f
    elif work.recompute == "selective":
        a_dx += _selective(attn, gpu, comm_sms, timer)
        s_dx += _selective(shared, gpu, comm_sms, timer)
        m_dx += _selective(mlp, gpu, comm_sms, timer)
        h_dx += _selective(subs["head"], gpu, 0, timer)
    return SubstageCosts(
        moe=moe,
        attn_F=a_f,
        attn_dX=a_dx,
        attn_dW=a_dw,
        mlp_F=m_f,
        mlp_dX=m_dx,
        mlp_dW=m_dw,
        shared_F=s_f,
        shared_dX=s_dx,
        shared_dW=s_dw,
        dispatch=dispatch,
        combine=combine,
        embed_F=e_f,
        embed_B=e_dx + e_dw,
        head_F=h_f,
        head_B=h_dx + h_dw,
        p2p=0.0,
        dp_reduce=0.0,
        detail=detail,
    )

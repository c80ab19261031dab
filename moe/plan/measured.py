"""Measured sub-stage costs: the JSON file ``bench.overlap --calibrate`` and ``bench.kernels`` write and the
planner's ``--costs FILE`` reads, and their scaling to another model, micro-batch and cluster.

Format (version 1)::

    {
      "format": "dualpipe-moe/plan-costs",
      "version": 1,
      "device": "NVIDIA H100 80GB HBM3",      # where it was measured (free text; "cpu" on the CPU)
      "source": "bench.overlap --calibrate",   # what wrote it
      "date": "2026-11-23",
      "config": {...},                         # MoEConfig fields of the measured model
      "seq_len": 4096, "tokens": 4096,         # the measured micro-batch (tokens = sequences x seq_len)
      "act_bytes": 2, "ep": 8, "gpus_per_node": 8, "comm_sms": 20, "recompute": false,
      "nvlink_bytes_per_s": 1.6e11,            # link rates the all-to-alls ran on (needed with dispatch/combine)
      "internode_bytes_per_s": 5e10,
      "moe": {"attn_F": 0.001, ..., "dispatch": 0.002, "combine": 0.002},   # seconds, one MoE layer
      "dense": {"attn_F": ..., ...},           # optional: one dense layer
      "ops": {"experts_gate_up.fwd": 0.0004, "permute.fwd": 0.0001, ...}   # optional: single ops
    }

Layer entries take any of :data:`moe.plan.costs.COMPUTE_FIELDS` plus ``dispatch`` and ``combine``; what a
file leaves out stays analytic. Measured ``*_dX`` of a run with ``recompute`` (full) include the forward again
(as :class:`~moe.plan.costs.SubstageCosts` does): scaling takes it out first.

``ops`` holds seconds of single planner ops at the file's shape (config, tokens, seq_len, ep, act_bytes),
one key ``"<op>.<phase>"`` each, named as :mod:`moe.plan.flops` and ``SubstageCosts.detail`` name them
(phase ``fwd``, ``dx`` or ``dw``; never recompute). In the sums behind every sub-stage field a measured op
replaces its roofline time (:func:`op_timer`), the other ops stay analytic; a sub-stage field the layer
entry measured as a whole still replaces the whole sum. An op of the expert GEMMs measured with
``comm_sms`` SMs held by communication is rescaled to the SMs the plan leaves them. ``bench.kernels
--costs-out`` writes a file of ``ops`` only (its ``moe`` entry is empty).

Scaling (:func:`scale_field`): a compute time is multiplied by the FLOP ratio of that sub-stage phase
between the target and the measured shape (:func:`moe.plan.costs.phase_work`; by the byte ratio for a phase
without FLOPs, e.g. the embedding); a measured op likewise by its own FLOP (or byte) ratio. That keeps the
measured device's achieved rate, so a file measured on one device describes that device: measure on the GPU
you plan for. An all-to-all time is multiplied by the ratio of the analytic all-to-all times
(:func:`moe.plan.costs.all_to_all_seconds`), target over measured, each with its own bytes (tokens, hidden
size, ranks and nodes reached) and its own link rates: the byte ratio and the bandwidth ratio together.
The file's all-to-alls moved ``act_bytes`` an element; a plan with FP8 dispatch scales ``dispatch`` to its
FP8 rows.

Measured GEMMs ran in the file's ``act_bytes`` dtype: a plan with FP8 GEMMs (``Precision.fp8``) refuses a
measured single op it runs in FP8, and a measured sub-stage field whose ops include one (the attention and
MLP fields; the head's with an MTP module's ``eh_proj``), rather than scale a bf16 time to an FP8 GEMM.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from moe.models.config import MoEConfig
from moe.plan.costs import (
    COMPUTE_FIELDS,
    OpTimer,
    Parallelism,
    SubstageCosts,
    Workload,
    all_to_all_bytes,
    all_to_all_seconds,
    analytic_costs,
    layer_ops,
    op_seconds,
    phase_work,
)
from moe.plan.flops import Op
from moe.plan.hardware import GPU, Cluster, with_overrides

__all__ = [
    "COMM_FIELDS",
    "FORMAT",
    "HOST_FIELDS",
    "VERSION",
    "MeasuredCosts",
    "apply_measured",
    "device_of",
    "gpu_of",
    "load_costs",
    "measured_ops",
    "op_timer",
    "save_costs",
    "scale_field",
    "work_ratio",
]

FORMAT = "dualpipe-moe/plan-costs"
VERSION = 1
COMM_FIELDS = ("dispatch", "combine")
HOST_FIELDS = ("F", "B", "counts", "cores_per_rank", "cpu_share", "comm_cpu", "expert_imbalance")
"""The ``host`` entry: ``F`` and ``B``, host seconds between an MoE layer's forward (backward) pieces for one
micro-batch (issuing transfers, routing metadata); ``counts``, the forward dispatch's row-count exchange as the
rank waits for it (latency and the wait for the group's last rank); ``cores_per_rank``, the machine's cores over
the ranks sharing them; ``cpu_share``, the CPU a rank's compute thread used over the time it was busy;
``comm_cpu``, the CPU seconds the communication threads used per MoE layer and micro-batch, forward and
backward; ``expert_imbalance``, the busiest expert-parallel rank's routed-expert time over the mean."""
_LAYER_FIELDS = frozenset(COMPUTE_FIELDS) | frozenset(COMM_FIELDS)
PHASES = ("fwd", "dx", "dw")


@dataclass(kw_only=True, slots=True)
class MeasuredCosts:
    """One costs file in memory (see the module docstring for each field)."""

    config: MoEConfig
    seq_len: int
    tokens: int
    moe: dict[str, float]
    dense: dict[str, float] = field(default_factory=dict)
    device: str = "unknown"
    source: str = ""
    date: str = ""
    act_bytes: int = 2
    ep: int = 1
    gpus_per_node: int = 8
    comm_sms: int = 0
    recompute: bool = False
    nvlink_bytes_per_s: float | None = None
    internode_bytes_per_s: float | None = None
    ops: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)
    """What the measured machine's host side costs (:data:`HOST_FIELDS`; ``bench.overlap --calibrate`` writes
    it from CPU ranks on the emulated cluster, where the host is the device). Taken as measured, never scaled:
    host work is per piece, not per FLOP, and the machine's cores are its own."""

    def shared_cores(self) -> tuple[float, float, float] | None:
        """``(cores per rank, cpu share, communication CPU per block)`` (:func:`moe.plan.search.cpu_bound`), or
        None where the file does not describe the machine's cores."""
        if "cores_per_rank" not in self.host:
            return None
        return self.host["cores_per_rank"], self.host.get("cpu_share", 1.0), self.host.get("comm_cpu", 0.0)

    def __post_init__(self) -> None:
        if self.seq_len < 1 or self.tokens < 1 or self.tokens % self.seq_len:
            raise ValueError(f"costs file: tokens={self.tokens} must be a positive multiple of seq_len={self.seq_len}")
        if self.ep < 1 or self.gpus_per_node < 1 or self.act_bytes < 1 or self.comm_sms < 0:
            raise ValueError("costs file: ep, gpus_per_node and act_bytes must be >= 1, comm_sms >= 0")
        for kind, entry in (("moe", self.moe), ("dense", self.dense)):
            unknown = set(entry) - _LAYER_FIELDS
            if unknown:
                raise ValueError(
                    f"costs file: unknown fields {sorted(unknown)} in {kind!r}; known: {sorted(_LAYER_FIELDS)}"
                )
            for name, value in entry.items():
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                    raise ValueError(f"costs file: {kind}.{name} must be a number of seconds >= 0, got {value!r}")
            if kind == "dense" and set(entry) & set(COMM_FIELDS):
                raise ValueError("costs file: a dense layer has no dispatch or combine")
        comm = any(n in self.moe for n in COMM_FIELDS)
        # an ep group with one rank per node sends nothing over NVLink: no intra-node rate is needed then
        intra = min(self.ep, self.gpus_per_node) > 1
        no_rate = self.internode_bytes_per_s is None or (intra and self.nvlink_bytes_per_s is None)
        if comm and (no_rate or self.ep == 1):
            raise ValueError(
                "costs file: measured dispatch/combine need ep > 1 and the link rates they ran on "
                "(internode_bytes_per_s; nvlink_bytes_per_s too where an ep group shares a node)"
            )
        for name in ("nvlink_bytes_per_s", "internode_bytes_per_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"costs file: {name} must be positive, got {value!r}")
        for name, value in self.host.items():
            if name not in HOST_FIELDS:
                raise ValueError(f"costs file: unknown field {name!r} in 'host'; known: {', '.join(HOST_FIELDS)}")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"costs file: host.{name} must be a number >= 0, got {value!r}")
        if not 0 < self.host.get("cpu_share", 1.0) <= 1 or not self.host.get("cores_per_rank", 1.0) > 0:
            raise ValueError("costs file: host.cpu_share must be in (0, 1] and host.cores_per_rank positive")
        if not self.host.get("expert_imbalance", 1.0) >= 1:
            raise ValueError("costs file: host.expert_imbalance is the busiest rank over the mean: at least 1")
        known = measured_ops(self) if self.ops else {}
        for key, value in self.ops.items():
            name, _, phase = key.rpartition(".")
            if name not in known or phase not in PHASES:
                raise ValueError(
                    f"costs file: unknown op {key!r} in 'ops'; known: '<op>.<phase>' with phase one of "
                    f"{', '.join(PHASES)} and op one of {', '.join(sorted(known))}"
                )
            op = known[name]
            if not (getattr(op, f"{phase}_flops") > 0 or getattr(op, f"{phase}_bytes") > 0):
                raise ValueError(f"costs file: ops.{key}: {name} does no work in its {phase} phase")
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"costs file: ops.{key} must be a number of seconds >= 0, got {value!r}")

    def op_timer(self) -> OpTimer:
        """:func:`op_timer` of this file (:class:`moe.plan.costs.CostSource`)."""
        return op_timer(self)

    def apply(
        self, analytic: SubstageCosts, cfg: MoEConfig, cluster: Cluster, par: Parallelism, work: Workload
    ) -> SubstageCosts:
        """:func:`apply_measured` of this file (:class:`moe.plan.costs.CostSource`)."""
        return apply_measured(self, analytic, cfg, cluster, par, work)

    def to_json(self) -> dict[str, Any]:
        out = {"format": FORMAT, "version": VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("ops", "host") and not value:
                continue  # a file without single ops or host costs reads as version 1 always did
            out[f.name] = dataclasses.asdict(value) if isinstance(value, MoEConfig) else value
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "costs file") -> MeasuredCosts:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f'{where}: not a planner costs file (expected "format": {FORMAT!r})')
        version = data.get("version")
        if version != VERSION:
            raise ValueError(f"{where}: version {version!r} is not supported (this planner reads version {VERSION})")
        body = {k: v for k, v in data.items() if k not in ("format", "version")}
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(body) - names
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        missing = {"config", "seq_len", "tokens", "moe"} - set(body)
        if missing:
            raise ValueError(f"{where}: missing keys {sorted(missing)}")
        try:
            body["config"] = MoEConfig(**body["config"])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: bad config: {exc}") from exc
        try:
            return cls(**body)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{where}: {exc}") from exc


def save_costs(path: str | os.PathLike[str], costs: MeasuredCosts) -> None:
    """Write ``costs`` as JSON (the format of the module docstring)."""
    with open(path, "w") as f:
        json.dump(costs.to_json(), f, indent=2, sort_keys=True)
        f.write("\n")


def load_costs(path: str | os.PathLike[str]) -> MeasuredCosts:
    """Read and validate a costs file; ``ValueError`` names the file and what is wrong."""
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from exc
    except OSError as exc:
        raise ValueError(f"{path}: cannot read it: {exc.strerror}") from exc
    return MeasuredCosts.from_json(data, where=str(path))


def work_ratio(target: tuple[float, float], base: tuple[float, float], name: str) -> float:
    """Target over base ``(FLOPs, bytes)``: the FLOP ratio, or the byte ratio where the base has no FLOPs."""
    (tf, tb), (bf, bb) = target, base
    if bf > 0:
        return tf / bf
    if bb > 0:
        return tb / bb
    raise ValueError(f"cannot scale {name}: the measured shape does no work in it")


def scale_field(
    measured: MeasuredCosts, name: str, cfg: MoEConfig, cluster: Cluster, par: Parallelism, work: Workload, *, moe: bool
) -> float:
    """Measured ``name`` (a field of the ``moe`` or ``dense`` entry) scaled to (``cfg``, ``work``) on
    ``cluster`` with ``par``; see the module docstring. ``KeyError`` if the file does not hold it."""
    entry = measured.moe if moe else measured.dense
    value = entry[name]
    if name in COMM_FIELDS:
        base_gpu = with_overrides(  # no NVLink rate: the measured all-to-all moved no NVLink bytes
            cluster.gpu,
            "costs file",
            nvlink_bytes_per_s=measured.nvlink_bytes_per_s or cluster.gpu.nvlink_bytes_per_s,
            internode_bytes_per_s=measured.internode_bytes_per_s,
        )
        base_cluster = Cluster(base_gpu, measured.ep, min(measured.ep, measured.gpus_per_node))
        base = all_to_all_seconds(
            all_to_all_bytes(measured.config, base_cluster, measured.ep, measured.tokens, measured.act_bytes),
            base_gpu,
            name,
        )
        elem = work.dispatch_bytes if name == "dispatch" else work.act_bytes
        target = all_to_all_seconds(all_to_all_bytes(cfg, cluster, par.ep, work.tokens, elem), cluster.gpu, name)
        return value * target / base
    base_work = _measured_work(measured, moe)
    target_work = _file_work(
        entry, phase_work(cfg, work.tokens, work.seq_len, ep=par.ep, act_bytes=work.act_bytes, moe=moe)
    )
    if name.endswith("_dX") and measured.recompute:
        forward = name.replace("_dX", "_F")
        if forward not in entry:
            raise ValueError(f"costs file: {name} was measured with recompute; {forward} is needed to take it out")
        value -= entry[forward]
    scaled = value * work_ratio(target_work[name], base_work[name], name)
    if name.endswith("_dX") and work.recompute == "full":
        forward = name.replace("_dX", "_F")
        scaled += (
            scale_field(measured, forward, cfg, cluster, par, work, moe=moe)
            if forward in entry
            else _analytic_field(measured, forward, cfg, cluster, par, work, moe)
        )
    elif name.endswith("_dX") and work.recompute == "selective":  # what runs again, at the ops' own times
        plain = dataclasses.replace(work, recompute="none")
        scaled += _analytic_field(measured, name, cfg, cluster, par, work, moe) - _analytic_field(
            measured, name, cfg, cluster, par, plain, moe
        )
    return scaled


def _analytic_field(
    measured: MeasuredCosts, name: str, cfg: MoEConfig, cluster: Cluster, par: Parallelism, work: Workload, moe: bool
) -> float:
    """The sum behind field ``name`` (measured ops in, layer entries not: no recursion into this module)."""
    return getattr(analytic_costs(cfg, cluster, par, work, moe, op_timer(measured)), name)


def measured_ops(measured: MeasuredCosts) -> dict[str, Op]:
    """Every planner op at the file's shape by name: the attention, router, MoE and dense MLP, embedding
    and head ops (a name in two places, e.g. ``residual``, does the same work in both)."""
    out: dict[str, Op] = {}
    for moe in (True, False):
        subs = layer_ops(
            measured.config, measured.tokens, measured.seq_len, ep=measured.ep, act_bytes=measured.act_bytes, moe=moe
        )
        for ops in subs.values():
            for op in ops:
                out.setdefault(op.name, op)
    return out


def op_timer(measured: MeasuredCosts) -> OpTimer:
    """:func:`moe.plan.costs.op_seconds` with the file's ``ops`` in: a measured op's phase takes its
    measured seconds times the op's FLOP (or byte) ratio, planned over measured shape; an expert GEMM's
    also times the ratio of SMs it ran on to the SMs it gets. Unmeasured ops stay analytic."""
    if not measured.ops:
        return op_seconds
    base = measured_ops(measured)

    def timer(op: Op, phase: str, gpu: GPU, comm_sms: int) -> float:
        value = measured.ops.get(f"{op.name}.{phase}")
        if value is None:
            return op_seconds(op, phase, gpu, comm_sms)
        if op.fp8:
            raise ValueError(_FP8_REFUSED.format(what=f"ops.{op.name}.{phase}"))
        ref = base[op.name]
        work = (getattr(op, f"{phase}_flops"), getattr(op, f"{phase}_bytes"))
        ref_work = (getattr(ref, f"{phase}_flops"), getattr(ref, f"{phase}_bytes"))
        scaled = value * work_ratio(work, ref_work, f"{op.name}.{phase}")
        if op.experts and comm_sms != measured.comm_sms:
            if max(comm_sms, measured.comm_sms) >= gpu.sms:
                raise ValueError(f"comm_sms={comm_sms} leaves no SM of {gpu.sms} for the experts")
            scaled *= (gpu.sms - measured.comm_sms) / (gpu.sms - comm_sms)
        return scaled

    return timer


def apply_measured(
    measured: MeasuredCosts,
    analytic: SubstageCosts,
    cfg: MoEConfig,
    cluster: Cluster,
    par: Parallelism,
    work: Workload,
) -> SubstageCosts:
    """``analytic`` with every field the file measured (for its layer kind) replaced by the scaled measurement
    (``detail``, the per-op breakdown, keeps the per-op times: analytic or from the file's ``ops``)."""
    entry = measured.moe if analytic.moe else measured.dense
    if work.precision.fp8:
        subs = layer_ops(
            cfg, work.tokens, work.seq_len, ep=par.ep, act_bytes=work.act_bytes, moe=analytic.moe, fp8=True
        )
        for name in entry:
            if any(op.fp8 for op in subs.get(name.rpartition("_")[0], [])):
                raise ValueError(_FP8_REFUSED.format(what=f"{'moe' if analytic.moe else 'dense'}.{name}"))
    changes = {name: scale_field(measured, name, cfg, cluster, par, work, moe=analytic.moe) for name in entry}
    if analytic.moe:  # the host work between an MoE layer's pieces; the row counts where there is an all-to-all
        taken = (("host_F", "F"), ("host_B", "B"), *((("counts", "counts"),) if par.ep > 1 else ()))
        changes.update({f: measured.host[k] for f, k in taken if k in measured.host})
    if _shared_inside_mlp(entry):
        changes.update(shared_F=0.0, shared_dX=0.0, shared_dW=0.0)
    return dataclasses.replace(analytic, **changes)


def _shared_inside_mlp(entry: dict[str, float]) -> bool:
    """A file from before the shared experts were timed apart: its ``mlp_*`` include them."""
    return any(n.startswith("mlp_") for n in entry) and not any(n.startswith("shared_") for n in entry)


def _file_work(entry: dict[str, float], work: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """:func:`moe.plan.costs.phase_work` as the file's fields divide it (the shared experts' work in ``mlp_*``
    for a file that measured them there)."""
    if not _shared_inside_mlp(entry):
        return work
    out = dict(work)
    for ph in ("F", "dX", "dW"):
        (mf, mb), (sf, sb) = work[f"mlp_{ph}"], work[f"shared_{ph}"]
        out[f"mlp_{ph}"] = (mf + sf, mb + sb)
    return out


def _measured_work(measured: MeasuredCosts, moe: bool) -> dict[str, tuple[float, float]]:
    """The work behind each field of the file's ``moe`` or ``dense`` entry, at the shape it was measured at."""
    entry = measured.moe if moe else measured.dense
    shape = phase_work(
        measured.config, measured.tokens, measured.seq_len, ep=measured.ep, act_bytes=measured.act_bytes, moe=moe
    )
    return _file_work(entry, shape)


_FP8_REFUSED = (
    "costs file: {what} was measured with GEMMs in the file's dtype; the plan runs them in FP8 (--fp8): plan "
    "without --fp8 or leave it out of the file"
)


def gpu_of(measured: MeasuredCosts, base: GPU) -> GPU:
    """``base`` with the link rates the file was measured on (for comparing a prediction with the run)."""
    return with_overrides(
        base,
        "costs file",
        nvlink_bytes_per_s=measured.nvlink_bytes_per_s,
        internode_bytes_per_s=measured.internode_bytes_per_s,
    )


def device_of(measured: MeasuredCosts, *, memory_bytes: float, name: str | None = None) -> GPU:
    """A device profile for the machine the file was measured on, from the file alone (e.g. CPU ranks on
    the emulated cluster, which no datasheet describes).

    Compute: the rate the measured sub-stages achieved, their FLOPs over their seconds (``gemm_efficiency``
    1: the rate is already an achieved one), and as memory bandwidth their HBM bytes over the same seconds;
    the roofline then gives the measured fields back on average, and the fields the file lacks (analytic)
    run at the same achieved rates. Links: the file's rates; where it has no intra-node rate (no byte
    stayed inside a node) the inter-node one stands in, which only a target placing an ep group inside a
    node would use. ``memory_bytes``: what one rank may use (on the CPU: the machine's memory over its
    ranks). ``sms`` is 1: nothing is reserved for communication, which runs on its own thread."""
    flop = nbytes = seconds = 0.0
    for moe, entry in ((True, measured.moe), (False, measured.dense)):
        if not entry:
            continue
        work = _measured_work(measured, moe)
        for field_name, value in entry.items():
            if field_name in COMM_FIELDS:
                continue
            forward = field_name.replace("_dX", "_F")
            if field_name.endswith("_dX") and measured.recompute and forward in entry:
                value -= entry[forward]
            f, b = work[field_name]
            flop, nbytes, seconds = flop + f, nbytes + b, seconds + value
    if not (flop > 0 and seconds > 0):
        raise ValueError(
            "costs file: no measured compute with FLOPs to derive a device's rate from (single ops, as "
            "bench.kernels writes them, describe no whole machine: name its profile, moe.plan --gpu)"
        )
    if measured.internode_bytes_per_s is None:
        raise ValueError("costs file: no link rate to describe the device's network with")
    return GPU(
        name=name or measured.device,
        bf16_flops=flop / seconds,
        gemm_efficiency=1.0,
        hbm_bytes_per_s=nbytes / seconds,
        hbm_bytes=memory_bytes,
        sms=1,
        nvlink_bytes_per_s=measured.nvlink_bytes_per_s or measured.internode_bytes_per_s,
        internode_bytes_per_s=measured.internode_bytes_per_s,
    )

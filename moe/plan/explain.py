"""``moe.plan --explain``: the efficiency-table entries a plan used (:mod:`moe.plan.efficiency`), each with its
value and where it came from: the cited source, an override flag, or a costs file's measurement."""

from __future__ import annotations

from moe.models.config import MoEConfig
from moe.plan import flops as fl
from moe.plan.costs import layer_ops
from moe.plan.hardware import Cluster
from moe.plan.measured import MeasuredCosts

__all__ = ["explain", "used_entries"]


def used_entries(
    cfg: MoEConfig, cluster: Cluster, *, pp: int, dp: int, ep: int, tokens: int, seq_len: int, fp8: bool
) -> dict[str, list[str]]:
    """Each entry a plan at (pp, dp, ep) with ``tokens``-token micro-batches uses, with the op phases (or links)
    it times."""
    used: dict[str, list[str]] = {}
    kinds = ([True] if cfg.moe_layers else []) + ([False] if cfg.num_layers > len(cfg.moe_layers) else [])
    for moe in kinds:
        for ops in layer_ops(cfg, tokens, seq_len, ep=ep, moe=moe, fp8=fp8).values():
            for op in ops:
                for phase in ("fwd", "dx", "dw"):
                    key = fl.efficiency_key(op, phase)
                    if key is not None and f"{op.name}.{phase}" not in used.get(key, []):
                        used.setdefault(key, []).append(f"{op.name}.{phase}")
    per_node = cluster.gpus_per_node
    if ep > 1 and cfg.moe_layers:
        for where, on in (("intranode", min(ep, per_node) > 1), ("internode", ep > per_node)):
            if on:
                for way in ("dispatch", "combine"):
                    used[f"deepep.{where}.{way}"] = ["all-to-all"]
    if dp > 1:
        used["nccl.allreduce.intranode"] = ["gradient all-reduce"]
        if dp > per_node:
            used["nccl.allreduce.internode"] = ["gradient all-reduce across nodes"]
    if pp > 1:
        used[f"nccl.p2p.{'intranode' if pp * dp <= per_node else 'internode'}"] = ["pipeline send/receive"]
    return used


def _value(key: str, value: float) -> str:
    if key.startswith(("gemm.", "attention.")):
        return f"{value:.1%} of peak"
    if key.startswith(("deepep.", "nccl.")):
        return f"{value / 1e9:,.0f} GB/s"
    return f"{value * 1e6:.1f} us"


def explain(
    cfg: MoEConfig,
    cluster: Cluster,
    *,
    pp: int,
    dp: int,
    ep: int,
    tokens: int,
    seq_len: int,
    fp8: bool,
    measured: MeasuredCosts | None = None,
) -> str:
    """The lines ``--explain`` prints: every entry :func:`used_entries` names, its value, its origin; an op
    phase a costs file measured is named as measured (its time replaces the entry's for that op)."""
    gpu = cluster.gpu
    lines = [f"efficiencies used ({gpu.name}; moe/plan/efficiency.py):"]
    measured_ops = set(measured.ops) if measured is not None else set()
    for key, what in used_entries(cfg, cluster, pp=pp, dp=dp, ep=ep, tokens=tokens, seq_len=seq_len, fp8=fp8).items():
        value, origin = gpu.entry(key)
        sms = gpu.efficiencies[key].sms if key in gpu.efficiencies and origin.startswith("cited") else None
        lines.append(f"  {key} = {_value(key, value)}{f' at {sms} SMs' if sms else ''}: {origin}")
        from_file = [w for w in what if w in measured_ops]
        if from_file:
            where = measured.source or "a costs file"
            lines.append(f"    measured instead for {', '.join(from_file)} (--costs, {where})")
    if measured is not None and (measured.moe or measured.dense):
        fields = sorted({*measured.moe, *measured.dense})
        lines.append(f"  measured sub-stage fields replace the sums above: {', '.join(fields)} (--costs)")
    return "\n".join(lines)

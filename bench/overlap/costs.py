"""One MoE layer's measured sub-stage seconds, from the overlap benchmark's recorded events, in the planner's
costs format (:func:`calibration_costs`): what ``bench.overlap --calibrate`` writes and
:mod:`bench.overlap.calibrate` checks the planner with.

Sub-stages. The calibration runs DualPipeV without overlap, so every all-to-all is waited for (the one
exception below) and each chunk's host time splits into compute and waiting. Within each lone chunk (or
each half of a pair run one after the other) the window is cut where the rank is blocked on an
all-to-all; each remaining piece is compute, and its time goes to the recorded compute spans inside it in
proportion to their lengths: host work between spans (issuing an all-to-all, autograd glue, the loss) is
compute the step pays, so it belongs to the sub-stage it sits with. The spans map onto the planner's fields
as :data:`SPAN_FIELDS` says; the residual add after a combine is counted into ``attn_F`` (it runs on the
way to the next attention, before the next dispatch, where the planner puts attention). All-to-alls cost the
time the rank waits for them: the forward dispatch (the row-count exchange, then the rows), the backward
dispatch (issued after the MLP's input gradient; the weight gradient computes under it, counted once as
compute, as the planner's backward puts it before the dispatch), forward and backward combine. ``dispatch``
and ``combine`` are the means over both directions (the planner takes one time for both).

Statistics: per timed step, each field's mean over its instances (layers x micro-batches x ranks): a step
is a sum of many sub-stages and the mean is what the sum costs per term (a median would drop the instances
the operating system descheduled, which the step pays); then the median over steps, which one disturbed
step does not move.

Link rates (:func:`link_rates`): inter-node is the ``tbf`` rate of a node's link shared by the ranks on it
(the planner counts bandwidth per GPU). The intra-node path is loopback, unshaped and not measured, so no
intra-node rate is written, and dispatch and combine are written only where no all-to-all byte stays inside
a node: one ep rank per node, as the emulated cluster's layouts place them (``gpus_per_node`` = 1 in the
file: ranks of one expert-parallel group per node, what the planner's all-to-all needs). On loopback (no
``--cluster``) every byte is intra-node: only compute is written.
"""

from __future__ import annotations

import datetime
import re
import statistics
from collections.abc import Iterable, Sequence

from bench.overlap.stats import RankSteps, pipelines, step_parts
from moe.models.config import MoEConfig
from moe.plan.measured import MeasuredCosts

__all__ = [
    "SPAN_FIELDS",
    "calibration_costs",
    "expert_imbalance",
    "link_rates",
    "machine_costs",
    "rate_bytes_per_s",
    "substage_seconds",
]


SPAN_FIELDS = {
    ("attn", "fwd"): "attn_F",
    ("attn.dx", "bwd"): "attn_dX",
    ("attn.dw", "bwd"): "attn_dW",
    ("mlp", "fwd"): "mlp_F",
    ("mlp.dx", "bwd"): "mlp_dX",
    ("mlp.dw", "bwd"): "mlp_dW",
    ("shared", "fwd"): "shared_F",
    ("shared.dx", "bwd"): "shared_dX",
    ("shared.dw", "bwd"): "shared_dW",
    ("embed", "fwd"): "embed_F",
    ("embed", "bwd"): "embed_B",
    ("head", "fwd"): "head_F",
    ("head", "bwd"): "head_B",
}
"""Recorded compute span (name, direction) -> the planner's field (:data:`moe.plan.costs.COMPUTE_FIELDS`)."""

PART_FIELDS = {
    ("residual", "fwd"): "attn_F",
}
"""Spans that are part of another's field, adding no instance of it: the residual sum before a block's
attention."""

_UNITS = {  # tc(8): SI multiples; "bit" units are bits per second, "bps" units bytes per second
    "bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
    "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12,
}  # fmt: skip


def rate_bytes_per_s(rate: str) -> float:
    """A tc rate (``"400mbit"``, ``"50mbps"``, ``"1gbit"``) in bytes per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", rate)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a tc rate: {rate!r} (e.g. 400mbit, 50mbps; units {sorted(_UNITS)})")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _chunk_windows(r: RankSteps) -> list[tuple[tuple[float, float], str]]:
    """The innermost compute actions: a lone chunk, either half of a pair that runs them one after the
    other (recorded nested in the pair), or an overlapped pair (nothing nested): the windows whose host
    time the sub-stages account for, each with its op."""
    halves = [a for a in r.actions if a.op in ("F", "B", "I")]
    pairs = [a for a in r.actions if a.op == "FB" and not any(a.start <= h.start and h.end <= a.end for h in halves)]
    return [((a.start, a.end), a.op) for a in halves + pairs]


def _segment_time(r: RankSteps, window: tuple[float, float]) -> list[tuple[list, float]]:
    """The window cut where the rank is blocked on an all-to-all: each remaining piece (less
    pipeline-message waits) with the compute spans inside it. Host work between recorded spans (issuing
    an all-to-all, autograd glue, the loss) is compute on the way to the next all-to-all; compute that
    runs while an all-to-all is in flight (a backward issues its dispatch after the MLP's input gradient
    and computes the weight gradient under it) is compute too."""
    t0, t1 = window
    cuts = sorted((c.blocked_from, c.wait) for c in r.comm if t0 <= c.start and c.wait <= t1)
    pieces, at = [], t0
    for a, b in [*cuts, (t1, t1)]:
        if a > at:
            pieces.append((at, a))
        at = max(at, b)
    out = []
    for a, b in pieces:
        spans = [c for c in r.compute if a <= c.start and c.end <= b]
        out.append((spans, b - a - r.waited(a, b)))
    return out


def _blocks(r: RankSteps, window: tuple[float, float], op: str) -> int:
    """The blocks a lone forward (``op`` F) or backward runs in ``window``: its attention pieces."""
    name, direction = ("attn", "fwd") if op == "F" else ("attn.dx", "bwd")
    t0, t1 = window
    return sum(1 for c in r.compute if c.name == name and c.direction == direction and t0 <= c.start and c.end <= t1)


def _step_fields(
    ranks: Iterable[RankSteps],
) -> tuple[dict[str, float], dict[str, int], dict[str, tuple[float, int]], dict[str, tuple[float, int]]]:
    """One step's totals: seconds per field (the recorded spans), how many instances (micro-batch x layer)
    of each, per all-to-all kind (``name.direction``) its seconds blocked on and count, and per direction
    (``F``, ``B``) the host seconds between the pieces and the blocks they ran."""
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    comm: dict[str, tuple[float, int]] = {}
    host: dict[str, tuple[float, int]] = {}
    for r in ranks:
        for window, op in _chunk_windows(r):
            pieces = _segment_time(r, window)
            recorded = 0.0
            for spans, _ in pieces:
                for c in spans:
                    part = PART_FIELDS.get((c.name, c.direction))
                    key = part or SPAN_FIELDS.get((c.name, c.direction))
                    if key is None:
                        continue
                    total[key] = total.get(key, 0.0) + (c.end - c.start)
                    recorded += c.end - c.start
                    if part is None:
                        count[key] = count.get(key, 0) + 1
            if op in ("F", "B"):
                t, n = host.get(op, (0.0, 0))
                host[op] = (t + sum(seconds for _, seconds in pieces) - recorded, n + _blocks(r, window, op))
        for c in r.comm:
            kind = f"{c.name}.{c.direction}"
            t, n = comm.get(kind, (0.0, 0))
            comm[kind] = (t + c.exposed, n + 1)
    return total, count, comm, host


def substage_seconds(steps: Iterable[Iterable[RankSteps]]) -> dict[str, float]:
    """One layer's sub-stage seconds for one micro-batch (see the module docstring), from the spans of
    blocking (non-overlapped) steps, each step's ranks together; a kind nobody recorded is left out. Besides
    the planner's layer fields: ``host_F`` and ``host_B``, the host work between a block's forward (backward)
    pieces, and ``counts``, the forward dispatch's row-count exchange as the rank waited for it.

    Per step, each field is its mean over the step's instances: the step is a sum of many sub-stages, and
    the mean is what a sum costs per term (a median would drop the descheduled instances a shared machine
    has, and those are paid); then the median over steps, which a disturbed step does not move."""
    per_step: dict[str, list[float]] = {}
    for ranks in steps:
        total, count, comm, host = _step_fields(ranks)
        for key, seconds in total.items():
            if count.get(key):
                per_step.setdefault(key, []).append(seconds / count[key])
        for op, (seconds, blocks) in host.items():
            if blocks:
                per_step.setdefault(f"host_{op}", []).append(max(0.0, seconds) / blocks)
        # A transfer's duration is what a lone forward waits for it: the forward computes nothing while it
        # flies. A lone backward runs the MLP's dW under its dispatch, so its wait is less than the transfer;
        # the planner's two-stream model puts that dW there itself. The row counts are waited for apart.
        for field_name, kind in (("counts", "counts.fwd"), ("dispatch", "dispatch.fwd"), ("combine", "combine.fwd")):
            t, n = comm.get(kind, (0.0, 0))
            if n:
                per_step.setdefault(field_name, []).append(t / n)
    return {k: _median(v) for k, v in per_step.items() if v}


def expert_imbalance(steps: Iterable[dict[int, RankSteps]], pp: int) -> float:
    """The busiest expert-parallel rank's routed-expert time (its ``mlp`` pieces, forward and backward) over
    its group's mean: per step the mean over the groups (one per pipeline rank), then the median over steps."""
    per_step = []
    for ranks in steps:
        ratios = []
        for group in zip(*pipelines(ranks, pp)):
            mlp = [sum(c.end - c.start for c in r.compute if c.name.startswith("mlp")) for r in group]
            if sum(mlp) > 0:
                ratios.append(max(mlp) * len(mlp) / sum(mlp))
        if ratios:
            per_step.append(statistics.fmean(ratios))
    return _median(per_step) or 1.0


def machine_costs(rank_files: Sequence[dict], steps: Sequence[dict[int, RankSteps]], mode: str) -> dict[str, float]:
    """How the ranks share the machine's cores in ``mode``'s timed steps: ``cores_per_rank``, ``cpu_share``
    (the compute threads' CPU over the time they were busy: computing or doing host work, never waiting) and
    ``comm_cpu`` (the other threads' CPU, gloo's transfers, per block a micro-batch ran forward and backward)."""
    cpu = thread = 0.0
    for record in rank_files:
        for s in record["steps"]:
            if s["mode"] == mode and not s["warmup"]:
                cpu, thread = cpu + s["cpu_s"], thread + s["thread_s"]
    busy = passes = 0
    for ranks in steps:
        for r in ranks.values():
            parts = step_parts(r)
            busy += parts.compute + parts.host
            passes += sum(1 for c in r.compute if (c.name, c.direction) == ("attn", "fwd"))
    world = len(rank_files)
    return {
        "cores_per_rank": rank_files[0]["cores"] / world,
        "cpu_share": min(1.0, thread / busy),
        "comm_cpu": (cpu - thread) / passes,
    }


def link_rates(rate: str | None, ranks_per_node: int, ep: int) -> float | None:
    """Inter-node bytes per second per rank (the node link's ``tbf`` rate over its ranks), or None where the
    measured all-to-alls cannot be described: no shaped link (loopback), or ep ranks sharing a node (their
    bytes would cross the unshaped, unmeasured loopback)."""
    if rate is None or ep < 2:
        return None
    return rate_bytes_per_s(rate) / ranks_per_node


def calibration_costs(
    steps: Iterable[Iterable[RankSteps]],
    *,
    cfg: MoEConfig,
    seq_len: int,
    micro_batch: int,
    ep: int,
    ranks_per_node: int,
    ep_ranks_per_node: int,
    act_bytes: int,
    device: str,
    rate: str | None,
    machine: dict[str, float] | None = None,
    source: str = "bench.overlap --calibrate",
) -> MeasuredCosts:
    """The planner's costs file for one calibration run. ``ranks_per_node``: ranks sharing one node's link;
    ``ep_ranks_per_node``: ranks of one expert-parallel group on one node (1 on the emulated cluster's
    layouts); ``rate``: the tbf rate, None on loopback; ``machine``: the file's ``host`` entries of the
    machine (:func:`machine_costs`, ``expert_imbalance``)."""
    measured = substage_seconds(steps)
    host = {k: measured.pop(f"host_{k}") for k in ("F", "B") if f"host_{k}" in measured}
    internode = link_rates(rate, ranks_per_node, ep) if ep_ranks_per_node == 1 else None
    counts = measured.pop("counts", None)
    if internode is None:
        measured = {k: v for k, v in measured.items() if k not in ("dispatch", "combine")}
    elif counts is not None:
        host["counts"] = counts
    return MeasuredCosts(
        config=cfg,
        seq_len=seq_len,
        tokens=seq_len * micro_batch,
        moe=measured,
        device=device,
        source=source,
        date=datetime.date.today().isoformat(),
        act_bytes=act_bytes,
        ep=ep,
        gpus_per_node=ep_ranks_per_node,
        comm_sms=0,
        recompute=False,
        internode_bytes_per_s=internode,
        host={**host, **(machine or {})},
    )

"""Every registered schedule at one layout, with and without overlap: ``python -m moe.plan --compare-schedules``.

The layout (``pp``, ``ep``; ``dp = gpus / pp``, micro-batches ``global batch / (dp x micro-batch)``, one
recompute granularity and one count of communication SMs) is fixed; each schedule of
:data:`dualpipe.schedule.SCHEDULES` is timed and sized there by the planner's own evaluation of one candidate
(:func:`moe.plan.report.evaluate_both`), once with its ``FB`` pairs overlapped and once with each pair run as its
forward, then its backward. Exposed all-to-all is the planner's (:mod:`moe.plan.pair`: what an action's
duration leaves beyond its compute, over all all-to-all of the step). Memory is the fullest GPU's, as the
search reports it; it is the same with and without overlap (the same action lists keep the same activations).
The 1F1B family is shown again with one extra warm-up forward (``1f1b+w1``): what pairs 1F1B's and ZB1P's last
rank and the rest of interleaved 1F1B's steady steps, at the memory of one more micro-batch in flight per rank.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from dualpipe.schedule import DEFAULT_SCHEDULE, SCHEDULES, Op, build_schedule, schedule_spec
from moe.models.config import MoEConfig
from moe.plan.costs import TRAINER_DEFAULTS, MemoryOptions
from moe.plan.hardware import Cluster
from moe.plan.measured import MeasuredCosts
from moe.plan.report import GIB, RunShape, evaluate_both
from moe.plan.search import Candidate, seconds

__all__ = ["compare_schedules", "compare_schedules_table", "layout_candidate"]


def layout_candidate(
    cfg: MoEConfig, cluster: Cluster, run: RunShape, *, pp: int, ep: int, recompute: str, comm_sms: int
) -> Candidate:
    """The candidate of ``pp`` x ``ep`` on ``cluster`` (schedule still the default), or ``ValueError`` saying which
    number does not divide."""
    if cluster.num_gpus % pp:
        raise ValueError(f"--pp {pp} does not divide --gpus {cluster.num_gpus}")
    dp = cluster.num_gpus // pp
    if dp % ep or cfg.num_experts % ep:
        raise ValueError(f"--ep {ep} must divide dp = gpus / pp = {dp} and the {cfg.num_experts} experts")
    if run.global_batch % (dp * run.micro_batch):
        raise ValueError(
            f"--global-batch-size {run.global_batch} is not a multiple of dp x micro-batch = {dp} x {run.micro_batch}"
        )
    chunks = run.global_batch // (dp * run.micro_batch)
    return Candidate(DEFAULT_SCHEDULE, pp, dp, ep, chunks, 0 if ep == 1 else comm_sms, recompute)


def compare_schedules(
    cfg: MoEConfig,
    cluster: Cluster,
    run: RunShape,
    layout: Candidate,
    *,
    measured: MeasuredCosts | None = None,
    options: MemoryOptions = TRAINER_DEFAULTS,
    extra_warmup: Sequence[int] = (1,),
) -> list[dict[str, Any]]:
    """Two rows per registered schedule (overlap, then none) at ``layout``'s pp, dp, ep, micro-batches, recompute
    and SMs; a schedule that does not run there gets one row with the reason in ``note``. A schedule with a
    warm-up rule (the 1F1B family) has two more per extra warm-up of ``extra_warmup`` the batch holds (the
    extra forwards that pair 1F1B's and ZB1P's last rank and the rest of interleaved 1F1B's steps)."""
    rows: list[dict[str, Any]] = []
    for name in SCHEDULES:
        c = dataclasses.replace(layout, schedule=name)
        try:
            spec = schedule_spec(name)
            spec.validate(c.pp, c.num_chunks)
            if spec.stage_layout(c.pp).num_stages > cfg.num_layers:
                raise ValueError(f"{spec.stage_layout(c.pp).num_stages} stages for {cfg.num_layers} layers")
        except ValueError as exc:
            rows.append({"schedule": name, "label": name, "note": f"does not run here: {exc}"})
            continue
        rows += _rows(cfg, cluster, run, c, measured, options)
        for e in extra_warmup if spec.warmup is not None else ():
            try:
                spec.validate(c.pp, c.num_chunks, extra_warmup=e)
            except ValueError as exc:
                label = dataclasses.replace(c, extra_warmup=e).label
                rows.append({"schedule": name, "label": label, "extra_warmup": e, "note": f"does not run here: {exc}"})
                continue
            rows += _rows(cfg, cluster, run, dataclasses.replace(c, extra_warmup=e), measured, options)
    return rows


def _rows(
    cfg: MoEConfig,
    cluster: Cluster,
    run: RunShape,
    c: Candidate,
    measured: MeasuredCosts | None,
    options: MemoryOptions,
) -> list[dict[str, Any]]:
    """``c`` with its pairs overlapped, then without."""
    schedule = build_schedule(c.schedule, c.pp, c.num_chunks, extra_warmup=c.extra_warmup)
    pairs = sum(a.op is Op.FB for actions in schedule.ranks for a in actions)
    rows = []
    for overlap, p in zip((True, False), evaluate_both(cfg, cluster, run, c, measured, options), strict=True):
        rows.append(
            {
                **p.to_dict(),
                "label": c.label,
                "overlap": overlap,
                "pairs": pairs if overlap else 0,
                "exposed_a2a_s_per_rank": p.exposed_a2a_fraction * p.a2a_per_rank,
                "memory_gib": p.memory.total / GIB,
                "parameter_copies": p.sim.parameter_copies,
                "note": "" if pairs else "no FB pairs: both rows the same",
            }
        )
    return rows


_HEADER = ("schedule", "overlap", "pairs", "step", "tok/s/GPU", "bubble", "exposed a2a", "per rank", "GiB/GPU",
           "fits", "copies", "note")  # fmt: skip


def _cells(r: dict[str, Any]) -> list[str]:
    if "step_time_s" not in r:
        return [r["label"], *["-"] * (len(_HEADER) - 2), r["note"]]
    return [
        r["label"],
        "yes" if r["overlap"] else "no",
        str(r["pairs"]),
        seconds(r["step_time_s"]),
        f"{r['tokens_per_s_per_gpu']:,.0f}",
        f"{r['bubble_fraction']:.1%}",
        f"{r['exposed_a2a_fraction']:.1%}",
        seconds(r["exposed_a2a_s_per_rank"]),
        f"{r['memory_gib']:.1f}",
        "yes" if r["fits"] else "NO",
        f"{r['parameter_copies']:g}",
        r["note"],
    ]


def compare_schedules_table(rows: Sequence[dict[str, Any]], layout: Candidate, cluster: Cluster) -> str:
    """The rows as an aligned table under a line naming the layout."""
    cells = [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in [list(_HEADER), *cells]) for i in range(len(_HEADER))]
    last = len(_HEADER) - 1

    def line(values: Sequence[str]) -> str:
        out = [v.ljust(w) if i in (0, last) else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths))]
        return "  ".join(out).rstrip()

    head = (
        f"every schedule at pp={layout.pp} dp={layout.dp} ep={layout.ep} chunks={layout.num_chunks} "
        f"comm_sms={layout.comm_sms} recompute={layout.recompute} on {cluster.num_gpus} x {cluster.gpu.name}; "
        "exposed a2a: share of the step's all-to-all and seconds per rank; GiB/GPU: the fullest GPU; copies: "
        "parameter and gradient copies"
    )
    return "\n".join([head, line(_HEADER), *(line(c) for c in cells)])

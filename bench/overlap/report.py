"""Summaries of one overlap benchmark run: per-mode rows, the targets, the tables.

Input: the ``rank<R>.json`` files the ranks wrote (:mod:`bench.overlap.run`). Per step, all ranks' spans
give one value of each metric; a mode's row holds the median over its timed steps and the spread
(min..max) of the step time. Warm-up steps are dropped.

Where the exposed all-to-all time comes from (:mod:`bench.overlap.stats` defines both): its split by kind
(forward and backward dispatch and combine, the row-count exchange) as means per rank and step, so the
kinds add up; and the skew of the expert-parallel peers, pooled over every all-to-all of the timed steps.
From a saved run (``python -m bench.overlap --keep-events`` keeps the rank files under ``<out>/events``)::

    python -m bench.overlap.report bench/results/events
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from bench.overlap.run import MODES, TORCH_MODE, TORCH_MODES, extra_warmup_of
from bench.overlap.stats import (
    COMM_KINDS,
    PeerSkew,
    RankSteps,
    StepParts,
    comm_by_kind,
    comm_totals,
    measured_bubble,
    measured_costs,
    parse_events,
    peer_skews,
    pipelines,
    predicted_bubble,
    rank_hidden,
    replayed_bubble,
    step_parts,
    step_window,
)
from dualpipe.events import HiddenFraction

__all__ = [
    "KindExposure",
    "ModeRow",
    "Target",
    "breakdown",
    "collect",
    "cpu_floor",
    "kind_table",
    "load_rank_files",
    "loss_check",
    "main",
    "rows_json",
    "skew_table",
    "summarise",
    "table",
    "targets",
]

BASELINE = TORCH_MODE


@dataclass(kw_only=True, slots=True)
class KindExposure:
    """One kind of all-to-all in one mode: means per rank and timed step (times in milliseconds)."""

    count: float
    in_flight_ms: float
    exposed_ms: float
    hidden: float
    """The kind's hidden fraction (:func:`dualpipe.events.hidden_fraction`), pooled over ranks and steps."""
    under_work: float
    """Of the kind's all-to-alls, the share that had compute doing work under some of their flight."""
    share: float
    """Of the mode's exposed all-to-all time."""
    peer_wait_ms: float
    """Of ``exposed_ms``: ranks ahead waiting for an expert-parallel peer to join."""


@dataclass(kw_only=True, slots=True)
class ModeRow:
    """Medians over the timed steps of one mode (times in milliseconds); the exposure breakdown at the end
    is pooled over those steps instead (means and quantiles, as its fields say)."""

    mode: str
    schedule: str
    overlap: bool
    steps: int
    step_ms: float
    step_ms_min: float
    step_ms_max: float
    tokens_per_s: float
    vs_torch: float | None
    """Step time over torch ScheduleDualPipeV's in the same run (< 1: faster)."""
    bubble: float
    bubble_predicted: float
    """The simulator's bubble fraction with every compute action costing what it took in the step (NaN for
    torch's schedule, whose action order ours does not describe)."""
    bubble_predicted_mean: float
    """The simulator's bubble fraction from one mean cost per action kind (the published formulas' model)."""
    a2a_ms: float
    """All-to-all in flight per rank per step (mean over ranks)."""
    a2a_exposed_ms: float
    """Of which the rank was blocked waiting."""
    hidden: float
    """All-to-all hidden fraction (:func:`dualpipe.events.hidden_fraction`: the union of the in-flight
    intervals under the union of compute that did work, per rank, pooled over the ranks)."""
    cpu_use: float
    """CPU time of all ranks over (cores x step time): near 1, the machine, not the schedule, sets the pace."""
    rank_use: float
    """The busiest rank's compute thread: its CPU time over the step time (NaN for runs recorded without it).
    Near 1, that rank's own work (its experts' share of the tokens included) sets the pace."""
    hidden_in_pairs: float | None
    """Hidden fraction of the all-to-alls inside overlapped F&B pairs only (None: no pairs)."""
    costs_ms: dict[str, float]
    loss: float | None
    exposed_by_kind: dict[str, KindExposure] = field(default_factory=dict)
    """The all-to-all time by kind (``dispatch.fwd``, ..., ``counts.fwd``: see ``COMM_KINDS``), in that order."""
    peer_skew_ms: float = math.nan
    """Median over the mode's all-to-alls of the spread of the expert-parallel group's start times."""
    peer_skew_p90_ms: float = math.nan
    peer_wait_ms: float = math.nan
    """Exposed time per rank and step (mean) that is a rank waiting for an expert-parallel peer to join."""
    peer_wait_share: float = math.nan
    """The same over the exposed all-to-all time."""
    step_parts_ms: dict[str, float] = field(default_factory=dict)
    """Where a rank's step went (means over ranks, medians over steps): its compute thread's ``compute``,
    ``host`` work between pieces, ``a2a_blocked`` and ``p2p_blocked`` (:class:`bench.overlap.stats.StepParts`),
    which add up to the step; the CPU its other threads used (``comm_threads_cpu``: gloo's transfers); and
    the machine's ``idle_cores``: core-milliseconds of the step that no thread of any rank used."""


def _cpu_seconds(rank_files: list[dict]) -> dict[tuple[str, int], tuple[float, float, float]]:
    """(mode, step) -> CPU seconds all ranks used in the step, the most one rank's compute thread used, and
    all ranks' compute threads used (NaN for runs recorded without the threads' time)."""
    out: dict[tuple[str, int], tuple[float, float, float]] = {}
    for record in rank_files:
        for s in record["steps"]:
            total, busiest, threads = out.get((s["mode"], s["step"]), (0.0, 0.0, 0.0))
            thread = s.get("thread_s", math.nan)
            out[(s["mode"], s["step"])] = (total + s.get("cpu_s", math.nan), max(busiest, thread), threads + thread)
    return out


def collect(rank_files: list[dict]) -> dict[str, list[tuple[int, dict[int, RankSteps]]]]:
    """mode -> [(step, {rank: spans})] over the timed (non-warm-up) steps, by step index; the modes in
    ``--modes`` order."""
    out: dict[str, dict[int, dict[int, RankSteps]]] = {}
    for record in rank_files:
        for s in record["steps"]:
            if s["warmup"]:
                continue
            out.setdefault(s["mode"], {}).setdefault(s["step"], {})[record["rank"]] = parse_events(s["events"])
    given = rank_files[0]["options"].get("modes", []) if rank_files else []
    order = [m for m in given if m in out] + [m for m in out if m not in given]
    return {mode: sorted(out[mode].items()) for mode in order}


def _mode_losses(rank_files: list[dict], mode: str) -> dict[int, list[float]]:
    """step -> every micro-batch loss any rank reported for ``mode``."""
    losses: dict[int, list[float]] = {}
    for record in rank_files:
        for s in record["steps"]:
            if s["mode"] == mode:
                losses.setdefault(s["step"], []).extend(s["losses"])
    return losses


def loss_check(rank_files: list[dict]) -> dict:
    """Mean micro-batch loss of every mode at every step (warm-up included: same weights, same data, so all
    modes must agree), the largest difference to torch's, and torch's squared gradient norm against
    DualPipeV's (same stage split, so the gradients must agree too)."""
    modes = list(dict.fromkeys(s["mode"] for r in rank_files for s in r["steps"]))
    means = {
        m: {step: statistics.fmean(v) for step, v in sorted(_mode_losses(rank_files, m).items()) if v} for m in modes
    }
    out: dict = {"mean_loss": {m: list(v.values()) for m, v in means.items()}}
    if BASELINE in means:
        ref = means[BASELINE]
        out["max_abs_diff_to_torch"] = {
            m: max((abs(v[s] - ref[s]) for s in v if s in ref), default=math.nan) for m, v in means.items()
        }
    grads = {}
    for s in rank_files[0]["steps"] if rank_files else []:
        if not s["warmup"]:
            grads.setdefault(s["mode"], []).append(s["grad_sq"])
    out["grad_sq"] = grads
    if BASELINE in grads and "dualpipev-overlap" in grads:
        pairs = zip(grads[BASELINE], grads["dualpipev-overlap"])
        out["grad_sq_rel_diff_torch_vs_dualpipev"] = max(abs(a - b) / max(abs(b), 1e-30) for a, b in pairs)
    return out


def _median(values: Sequence[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def _quantile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default); NaN for no values."""
    xs = sorted(values)
    if not xs:
        return math.nan
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _exposure(steps: list[tuple[int, dict[int, RankSteps]]], pp: int) -> dict:
    """ModeRow's exposure fields: the kinds summed over every rank and timed step, then divided by the
    rank-steps (means, so the kinds add up); the skews pooled over every all-to-all of those steps."""
    sums: dict[str, list[float]] = {}  # kind -> [count, in flight, exposed, peer wait], seconds
    skews: list[PeerSkew] = []
    hidden = HiddenFraction()
    for _, ranks in steps:
        for kind, totals in comm_by_kind(list(ranks.values())).items():
            acc = sums.setdefault(kind, [0.0, 0.0, 0.0, 0.0])
            for i, v in enumerate(totals):
                acc[i] += v
        hidden = sum((rank_hidden(r) for r in ranks.values()), hidden)
        for group in zip(*pipelines(ranks, pp)):
            skews += peer_skews(group)
    for s in skews:
        sums[s.kind][3] += s.peer_wait
    rank_steps = sum(len(ranks) for _, ranks in steps)
    exposed = sum(acc[2] for acc in sums.values())
    peer_wait = sum(s.peer_wait for s in skews)
    order = [k for k in COMM_KINDS if k in sums] + [k for k in sums if k not in COMM_KINDS]
    by_kind = {
        k: KindExposure(
            count=sums[k][0] / rank_steps,
            in_flight_ms=sums[k][1] / rank_steps * 1e3,
            exposed_ms=sums[k][2] / rank_steps * 1e3,
            hidden=hidden.kinds[k].fraction,
            under_work=hidden.kinds[k].covered / hidden.kinds[k].count if hidden.kinds[k].count else math.nan,
            share=sums[k][2] / exposed if exposed > 0 else math.nan,
            peer_wait_ms=sums[k][3] / rank_steps * 1e3,
        )
        for k in order
    }
    skew_ms = [s.skew * 1e3 for s in skews]
    return {
        "exposed_by_kind": by_kind,
        "peer_skew_ms": _quantile(skew_ms, 0.5),
        "peer_skew_p90_ms": _quantile(skew_ms, 0.9),
        "peer_wait_ms": peer_wait / rank_steps * 1e3 if skews else math.nan,
        "peer_wait_share": peer_wait / exposed if exposed > 0 else math.nan,
    }


def _row(
    mode: str, steps: list[tuple[int, dict[int, RankSteps]]], opts: dict, mean_loss: float | None, cpu: dict, cores: int
) -> ModeRow:
    schedule, overlap = MODES[mode]
    num_ranks = opts["pp"]
    extra = extra_warmup_of(schedule, opts.get("extra_warmup", 0))  # results from before the option: none
    per_step = []
    where: list[dict[str, float]] = []
    all_ranks: list[RankSteps] = []
    for step, ranks in steps:
        t0, t1 = step_window(list(ranks.values()))
        in_flight, exposed, hidden = comm_totals(list(ranks.values()))
        costs = measured_costs(list(ranks.values()))
        mean_predicted = predicted_bubble(schedule, num_ranks, opts["chunks"], costs, extra, overlap)
        per_pipeline = pipelines(ranks, num_ranks)
        # torch runs its own action order, which our schedule's replay does not describe
        replayed = math.nan
        if mode not in TORCH_MODES:
            replayed = replayed_bubble(schedule, per_pipeline, opts["chunks"], extra_warmup=extra, overlap=overlap)
        paired = comm_totals(list(ranks.values()), within="FB")[2]
        total, busiest, threads = cpu.get((mode, step), (math.nan, math.nan, math.nan))
        use, rank_use = total / (cores * (t1 - t0)), busiest / (t1 - t0)
        parts = [step_parts(r) for r in ranks.values()]
        where.append(
            {
                **{f.name: statistics.fmean(getattr(p, f.name) for p in parts) * 1e3 for f in fields(StepParts)},
                "comm_threads_cpu": (total - threads) / len(ranks) * 1e3,
                "idle_cores": (cores * (t1 - t0) - total) * 1e3,
            }
        )
        bubble = measured_bubble(list(ranks.values()))
        per_step.append((t1 - t0, bubble, replayed, in_flight, exposed, hidden, paired, use, mean_predicted, rank_use))
        all_ranks += ranks.values()
    med = [_median(col) for col in zip(*per_step)]
    step_s = med[0]
    world = len(steps[0][1])
    costs = measured_costs(all_ranks)
    return ModeRow(
        mode=mode,
        schedule=schedule,
        overlap=overlap,
        steps=len(steps),
        step_ms=step_s * 1e3,
        step_ms_min=min(p[0] for p in per_step) * 1e3,
        step_ms_max=max(p[0] for p in per_step) * 1e3,
        tokens_per_s=opts["chunks"] * opts["micro_batch"] * opts["ep"] * opts["seq_len"] / step_s,
        vs_torch=None,
        bubble=med[1],
        bubble_predicted=med[2],
        bubble_predicted_mean=med[8],
        a2a_ms=med[3] / world * 1e3,
        a2a_exposed_ms=med[4] / world * 1e3,
        hidden=med[5],
        hidden_in_pairs=None if math.isnan(med[6]) else med[6],
        cpu_use=med[7],
        rank_use=med[9],
        costs_ms={k: getattr(costs, k) * 1e3 for k in ("F", "B", "W", "FB")},
        loss=mean_loss,
        step_parts_ms={k: _median([w[k] for w in where]) for k in where[0]},
        **_exposure(steps, num_ranks),
    )


def summarise(rank_files: list[dict]) -> list[ModeRow]:
    """One row per mode, in ``--modes`` order, with the ratio to torch's schedule filled in."""
    opts = rank_files[0]["options"]
    losses = loss_check(rank_files)["mean_loss"]
    cpu, cores = _cpu_seconds(rank_files), rank_files[0].get("cores", 1)
    rows = [_row(m, steps, opts, (losses.get(m) or [None])[-1], cpu, cores) for m, steps in collect(rank_files).items()]
    base = next((r for r in rows if r.mode == BASELINE), None)
    for r in rows:
        r.vs_torch = r.step_ms / base.step_ms if base is not None else None
    return rows


@dataclass(frozen=True, slots=True)
class Target:
    what: str
    value: float
    goal: str
    met: bool


def targets(rows: list[ModeRow], pipeline_ranks: int = 2) -> list[Target]:
    """The issue's targets for DualPipeV with overlap, evaluated (printed, never asserted). Left out where
    they mean nothing: the bubble with one pipeline rank, the hidden fraction without all-to-all (ep=1)."""
    by = {r.mode: r for r in rows}
    out = []
    ours = by.get("dualpipev-overlap")
    if ours is None:
        return out
    if not math.isnan(ours.hidden):
        out.append(Target("all-to-all hidden (dualpipev-overlap)", ours.hidden, ">= 0.80", ours.hidden >= 0.80))
    if ours.vs_torch is not None:
        out.append(Target("step time vs torch ScheduleDualPipeV", ours.vs_torch, "<= 0.80x", ours.vs_torch <= 0.80))
    if pipeline_ranks > 1:
        predicted = ours.bubble_predicted
        rel = abs(ours.bubble - predicted) / predicted if predicted > 0 else math.nan
        out.append(Target("|bubble measured - simulated| / simulated", rel, "<= 0.15", rel <= 0.15))
    return out


def cpu_floor(rows: list[ModeRow]) -> float | None:
    """The least step time DualPipeV with overlap could take doing its CPU work, over torch's step time:
    the larger of its CPU time per step spread over all cores, and its busiest rank's compute-thread time
    (no core can run that rank's work for it; with one rank per core and experts unevenly loaded, this
    is the bound).

    Overlap hides waiting, not work: no schedule doing the same CPU work gets below this ratio on this
    machine. Above 0.8 the step-time target is out of reach here (typically: more ranks than cores, where
    the operating system already runs another rank while one waits, for torch's schedule too).
    """
    ours = next((r for r in rows if r.mode == "dualpipev-overlap"), None)
    if ours is None or ours.vs_torch is None or math.isnan(ours.cpu_use):
        return None
    return max(ours.cpu_use, ours.rank_use if not math.isnan(ours.rank_use) else 0.0) * ours.vs_torch


def _markdown(header: str, cells: Iterable[Sequence[str]], text_columns: int = 1) -> str:
    """A markdown table with the columns of ``header`` (names joined by " | "); the first ``text_columns``
    columns left-aligned, the numbers right-aligned."""
    width = len(header.split(" | "))
    align = ["---"] * text_columns + ["---:"] * (width - text_columns)
    lines = [f"| {header} |", f"|{'|'.join(align)}|"]
    return "\n".join(lines + [f"| {' | '.join(line)} |" for line in cells])


def table(rows: list[ModeRow]) -> str:
    """Markdown table of the rows."""
    header = (
        "mode | step ms (min..max) | tokens/s | vs torch | bubble | bubble (sim) | bubble (sim, mean costs) "
        "| a2a ms/rank | exposed ms | hidden | hidden in F&B pairs | CPU use | busiest rank"
    )
    cells = []
    for r in rows:
        vs = f"{r.vs_torch:.2f}x" if r.vs_torch is not None else "-"
        pairs = f"{r.hidden_in_pairs:.2f}" if r.hidden_in_pairs is not None else "-"
        cells.append(
            [
                r.mode,
                f"{r.step_ms:.0f} ({r.step_ms_min:.0f}..{r.step_ms_max:.0f})",
                f"{r.tokens_per_s:.0f}",
                vs,
                f"{r.bubble:.3f}",
                f"{r.bubble_predicted:.3f}",
                f"{r.bubble_predicted_mean:.3f}",
                f"{r.a2a_ms:.0f}",
                f"{r.a2a_exposed_ms:.0f}",
                f"{r.hidden:.2f}",
                pairs,
                f"{r.cpu_use:.2f}",
                f"{r.rank_use:.2f}",
            ]
        )
    return _markdown(header, cells)


def rows_json(rows: list[ModeRow]) -> list[dict]:
    return [asdict(r) for r in rows]


def kind_table(rows: list[ModeRow]) -> str:
    """Markdown table of the exposed all-to-all time by kind, a line per mode and kind."""
    header = (
        "mode | all-to-all | per rank & step | in flight ms | exposed ms | exposed ms each | hidden | under work "
        "| share of exposed | waiting for a peer ms"
    )
    cells = []
    for r in rows:
        for kind, k in r.exposed_by_kind.items():
            each = k.exposed_ms / k.count if k.count else math.nan
            cells.append(
                [
                    r.mode,
                    COMM_KINDS.get(kind, kind),
                    f"{k.count:.1f}",
                    f"{k.in_flight_ms:.1f}",
                    f"{k.exposed_ms:.1f}",
                    f"{each:.2f}",
                    f"{k.hidden:.2f}",
                    f"{k.under_work:.2f}",
                    f"{k.share:.2f}",
                    f"{k.peer_wait_ms:.1f}",
                ]
            )
    return _markdown(header, cells, text_columns=2)


def skew_table(rows: list[ModeRow]) -> str:
    """Markdown table of the expert-parallel peer skew, a line per mode."""
    header = "mode | skew median ms | skew p90 ms | waiting for a peer ms/rank | share of exposed"
    cells = [
        [
            r.mode,
            f"{r.peer_skew_ms:.2f}",
            f"{r.peer_skew_p90_ms:.2f}",
            f"{r.peer_wait_ms:.1f}",
            f"{r.peer_wait_share:.2f}",
        ]
        for r in rows
    ]
    return _markdown(header, cells)


WHERE = {
    "compute": "compute",
    "host": "host between pieces",
    "a2a_blocked": "blocked on all-to-all",
    "p2p_blocked": "blocked on pipeline",
    "comm_threads_cpu": "comm threads' CPU",
    "idle_cores": "idle core-ms (machine)",
}


def where_table(rows: list[ModeRow]) -> str:
    """Markdown table of where the step went (:attr:`ModeRow.step_parts_ms`), a line per mode."""

    def ms(v: float) -> str:
        return "-" if math.isnan(v) else f"{v:.0f}"

    cells = [[r.mode, f"{r.step_ms:.0f}", *(ms(r.step_parts_ms.get(k, math.nan)) for k in WHERE)] for r in rows]
    return _markdown("mode | step ms | " + " | ".join(WHERE.values()), cells)


def breakdown(rows: list[ModeRow]) -> str:
    """What exposes the all-to-all: the per-kind table and the peer-skew table, titled."""
    return (
        "\nall-to-all by kind (means per rank and timed step; hidden: dualpipe.events.hidden_fraction per kind, "
        "pooled over ranks and steps; under work: the share of them with working compute under their flight):\n\n"
        + kind_table(rows)
        + "\n\nexpert-parallel peer skew (every all-to-all of the timed steps, matched across its group):\n\n"
        + skew_table(rows)
        + "\n\nwhere the step went (ms; a rank's compute thread: compute, host work between pieces and its waits add "
        "up to the step; means over ranks, medians over steps; the CPU the ranks' other threads used; the cores' "
        "idle time):\n\n" + where_table(rows)
    )


def load_rank_files(folder: Path) -> list[dict]:
    """The ``rank<R>.json`` files in ``folder``, in rank order."""
    files = [json.loads(p.read_text()) for p in folder.glob("rank*.json")]
    return sorted(files, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overlap.report", description=__doc__.split("\n\n")[0])
    p.add_argument("events", type=Path, help="folder of rank<R>.json (bench.overlap --keep-events: <out>/events)")
    p.add_argument("--json", type=Path, help="also write the rows, breakdown included, to this file")
    args = p.parse_args(argv)
    rank_files = load_rank_files(args.events)
    if not rank_files:
        raise SystemExit(f"error: no rank*.json in {args.events}")
    o = rank_files[0]["options"]
    rows = summarise(rank_files)
    print(f"{args.events}: pp={o['pp']} ep={o['ep']} chunks={o['chunks']} steps={o['steps']} "
          f"(+{o['warmup']} warm-up), medians over steps\n")  # fmt: skip
    print(table(rows))
    print(breakdown(rows))
    if args.json is not None:
        args.json.write_text(json.dumps({"events": str(args.events), "rows": rows_json(rows)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

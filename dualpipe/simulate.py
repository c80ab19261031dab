"""Time a schedule from its action lists: per-rank timelines, makespan, bubbles, activation memory.

The simulator reads the same :class:`~dualpipe.schedule.Schedule` data the executor runs. Each compute action
takes a fixed cost (:class:`Costs`); communication actions take no rank time. A message produced on one rank
is available to its consumer ``latency`` after the producing rank reaches the send, i.e. right after the
compute before it; a compute starts when its rank is free and every message it consumes
(:func:`dualpipe.checks.needed_receives`) has arrived. Local hand-overs (DualPipeV's turn) need no message.
This is the ``"async"`` communication model of :mod:`dualpipe.checks`: receives never block a rank by
themselves, so ``early_receives`` does not change the timing.

Units
-----
Costs are per action, in the paper's notation: ``F`` a forward chunk, ``B`` a *full* backward chunk (input
and weight gradients), ``W`` its weight-gradient part, ``FB`` an overlapped forward/backward pair. So an ``I``
action costs ``B - W``. A "chunk" is one local module for one micro-batch: a full stage for 1F1B, ZB1P and
DualPipe, half a stage for DualPipeV (2N stages on N ranks), ``1/v`` of one for interleaved 1F1B.

Activations are counted in *modules*: one module's stored activation for one micro-batch, measured after
each compute action (``F`` adds one, ``B``/``I`` free one, ``FB`` adds one and frees one; what a pending
``W`` keeps for its weight gradients is not counted, as in the published table). ``peak_activation_stages``
converts to the unit of that table, one 1F1B stage for one micro-batch: a DualPipeV module is half a stage.

Published formulas (DeepSeek-V3 report, Table 2) and the exact cost regime in which this simulation
reproduces each one (``latency = 0``; "bubble" is a rank's idle time within one step, ``makespan - busy``):

- 1F1B, ``(PP-1)(F+B)`` on every rank: any costs, any chunk count >= 1.
- ZB1P, ``(PP-1)(F+B-2W)`` on every rank: ``W <= min(F, B-W)`` (each deferred W fits into the wait the
  input-gradient chain leaves; ZB-H1's ``F = I = W`` is the edge of that range) and chunks >= PP.
- DualPipe (``PP`` = ranks, even) and DualPipeV (``PP`` = 2 x ranks, its stage count),
  ``(PP/2-1)(F&B+B-3W)``: ``F = B-W`` (a forward costs what an input-gradient backward costs, as in the
  report's figure), ``W <= F`` and ``B <= F&B <= F+B`` (an overlapped pair costs at least its longer half
  and at most both), any chunk count the schedule accepts. The formula is then the largest idle time of any
  rank, reached on the ranks where the two directions meet (DualPipe's middle ranks, DualPipeV's last
  rank); with ``F&B = F+B`` every rank idles exactly that. Outside this regime it is only an estimate.
- Interleaved 1F1B with ``v`` modules per rank (Megatron-LM's virtual stages), ``(PP-1)(F+B)/v`` on every
  rank, ``F`` and ``B`` the costs of a full stage (a module costs ``F/v`` and ``B/v``): any costs (its
  backwards are full, so ``W`` plays no part), chunks a multiple of PP.
- ZBV with ``PP`` ranks and ``m`` micro-batches (the zero-bubble papers' table, as a share of the step),
  ``(PP-1) / (PP-1 + 6m)``: this ``bubble_fraction``, exactly, with ``F = B-W = W`` (the papers' equal costs;
  ``F&B = F + B``) and chunks >= 2 x ranks. The two are one definition here: every rank is busy ``6m F``
  (F, I and W of its two modules per micro-batch), so ``bubble_fraction = 1 - 6m F / makespan``, and the
  table's figure is a makespan of ``(6m + PP-1) F``: only the last rank's wait for the first forward.
  V-Half and V-Min are greedy, with no closed form (about ``2 PP`` and ``4 PP`` idle ``F`` per rank).


Activations (chunks >= PP): 1F1B and ZB1P peak at ``PP`` on rank 0 (``PP-r`` on rank r); DualPipe at
``PP+1`` on its middle ranks and ``PP`` elsewhere; DualPipeV at ``2 x ranks + 1`` modules on its last rank
(``PP+1`` with PP its stage count, ``ranks + 1/2`` in stages) and ``2 x ranks`` elsewhere; interleaved 1F1B
at ``PP + (PP-1)/v`` stages on rank 0 (chunks >= 2 PP); ZBV at ``PP`` stages (1F1B's), V-Half within
``PP/2 + 1`` and V-Min within ``ceil((PP+4)/3)`` on every rank (PP = ranks; a V module is half a stage).
Parameter copies: 2 for DualPipe (every stage held twice), 1 otherwise.

Sends are timed where the schedule issues them, right after the compute before them. That is the producing
compute everywhere except at the turn (DualPipe's middle ranks, DualPipeV's last rank), where the reference
holds a send back by one compute; on these schedules that never moves the makespan.

Run ``python -m dualpipe.simulate --help`` for the command line; ``--compare`` times every registered schedule
with and without overlap side by side (:mod:`dualpipe.compare`).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

from dualpipe.checks import DeadlockError, MessageKey, message_key, needed_receives
from dualpipe.schedule import DEFAULT_SCHEDULE, SCHEDULES, Action, Op, Schedule, build_schedule

__all__ = ["Costs", "SimResult", "Span", "main", "render_png", "simulate", "stage_share"]


@dataclass(kw_only=True, slots=True)
class Costs:
    """Per-action costs, in any time unit (the paper's notation)."""

    F: float = 1.0
    """Forward of one chunk (one local module, one micro-batch)."""
    B: float = 2.0
    """Full backward of one chunk: input and weight gradients. An ``I`` action costs ``B - W``."""
    W: float = 1.0
    """Weight-gradient part of ``B``: the cost of one ``W`` action."""
    FB: float | None = None
    """An overlapped forward/backward pair (the paper's ``F&B``); ``None`` means ``F + B`` (no overlap)."""
    latency: float = 0.0
    """Point-to-point latency: from the send (right after the producing compute) to the consumer."""

    def __post_init__(self) -> None:
        if self.FB is None:
            self.FB = self.F + self.B
        for name in ("F", "B", "W", "FB", "latency"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"cost {name} must be a finite number >= 0 (got {value})")
        if self.W > self.B:
            raise ValueError(f"W (weight-grad part) must not exceed the full backward B (got W={self.W}, B={self.B})")

    def of(self, action: Action) -> float:
        """Cost of one compute action (a ``deferred`` ``FB`` leaves its backward half's ``W`` for later)."""
        cost = self.table()[action.op]
        return cost - self.W if action.op is Op.FB and action.deferred else cost

    def table(self) -> dict[Op, float]:
        """Cost of each compute op."""
        return {Op.F: self.F, Op.B: self.B, Op.I: self.B - self.W, Op.W: self.W, Op.FB: self.FB}


class Span(NamedTuple):
    """One compute action placed on its rank's timeline."""

    start: float
    end: float
    label: str
    op: str


@dataclass(frozen=True, slots=True)
class SimResult:
    """What :func:`simulate` computes; every per-rank field is indexed by pipeline rank."""

    schedule: str
    num_ranks: int
    num_chunks: int
    costs: Costs
    timelines: tuple[tuple[Span, ...], ...]
    makespan: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    """``makespan - busy``: the bubble of each rank within one step."""
    bubble_fraction: float
    """Idle time of all ranks over ``num_ranks * makespan``."""
    peak_activations: tuple[int, ...]
    """Peak live activations in modules (one local module, one micro-batch)."""
    peak_activation_stages: tuple[float, ...]
    """The same in 1F1B stages (a DualPipeV module is half a stage)."""
    parameter_copies: float
    """Weights per rank in units of one 1F1B rank's stage: 2 for DualPipe, 1 otherwise."""

    def to_dict(self) -> dict:
        """JSON-ready summary (timelines as ``[start, end, label]`` lists)."""
        out = {k: getattr(self, k) for k in self.__slots__ if k not in ("costs", "timelines")}
        out["costs"] = asdict(self.costs)
        out["timelines"] = [[[s.start, s.end, s.label] for s in spans] for spans in self.timelines]
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


def stage_share(schedule: Schedule) -> float:
    """Share of a 1F1B stage held by one module: ranks over stages per path (DualPipeV: 1/2)."""
    return schedule.layout.num_ranks / len(schedule.layout.paths[0])


class _Static(NamedTuple):
    """What timing a schedule needs of it beyond the costs, computed once per schedule (the planner times one
    schedule many times)."""

    messages: tuple[tuple[tuple[MessageKey | None, tuple[MessageKey, ...] | None], ...], ...]
    """Per rank and action: (the message a send sends, None), (None, the messages a compute consumes), or
    (None, None) for a receive."""
    names: tuple[tuple[tuple[str, str], ...], ...]
    """Per rank and action, its span's label and op."""
    computes: tuple[int, ...]
    """Compute actions per rank."""
    peaks: tuple[int, ...]
    """Per rank, the most modules' activations live at once (:func:`_peak_activations`)."""


@functools.lru_cache(maxsize=64)
def _static(schedule: Schedule) -> _Static:
    messages = []
    for rank, actions in enumerate(schedule.ranks):
        row: list[tuple[MessageKey | None, tuple[MessageKey, ...] | None]] = []
        for a in actions:
            if a.op in (Op.SEND_F, Op.SEND_B):
                row.append((message_key(schedule, rank, a), None))
            elif a.op.is_compute:
                row.append((None, tuple(needed_receives(schedule, rank, a))))
            else:
                row.append((None, None))
        messages.append(tuple(row))
    return _Static(
        messages=tuple(messages),
        names=tuple(tuple((str(a), a.op.value) for a in actions) for actions in schedule.ranks),
        computes=tuple(sum(1 for a in actions if a.op.is_compute) for actions in schedule.ranks),
        peaks=tuple(_peak_activations(actions) for actions in schedule.ranks),
    )


def _timelines(
    schedule: Schedule, costs: Costs, durations: Sequence[Sequence[float]] | None, ready: Sequence[float] | None
) -> list[list[Span]]:
    """Place every compute action; the rank order is fixed, a compute waits for its messages."""
    n = len(schedule.ranks)
    done = [0] * n  # compute actions placed per rank: the index into ``durations``
    pos = [0] * n
    clock = [0.0] * n if ready is None else [float(t) for t in ready]
    arrival: dict[tuple, float] = {}
    spans: list[list[Span]] = [[] for _ in range(n)]
    static = _static(schedule)
    messages, names = static.messages, static.names
    while any(pos[r] < len(schedule.ranks[r]) for r in range(n)):
        progress = False
        for rank, actions in enumerate(schedule.ranks):
            while pos[rank] < len(actions):
                a = actions[pos[rank]]
                sent, keys = messages[rank][pos[rank]]
                if sent is not None:
                    arrival[sent] = clock[rank] + costs.latency
                elif keys is not None:
                    if any(k not in arrival for k in keys):
                        break  # its input is not sent yet: let the other ranks catch up
                    start = max([clock[rank], *(arrival[k] for k in keys)])
                    clock[rank] = start + (costs.of(a) if durations is None else durations[rank][done[rank]])
                    done[rank] += 1
                    spans[rank].append(Span(start, clock[rank], *names[rank][pos[rank]]))
                pos[rank] += 1  # receives take no rank time in the async model
                progress = True
        if not progress:
            stuck = {r: str(schedule.ranks[r][pos[r]]) for r in range(n) if pos[r] < len(schedule.ranks[r])}
            raise DeadlockError(f"simulation cannot progress; waiting at {stuck}")
    return spans


_LIVE = {Op.F: 1, Op.B: -1, Op.I: -1}
"""Modules an action adds to the live activations (``FB`` adds one and frees one)."""


def _peak_activations(actions: Sequence[Action]) -> int:
    live = peak = 0
    for a in actions:
        live += _LIVE.get(a.op, 0)
        peak = max(peak, live)
    return peak


def _check_durations(schedule: Schedule, durations: Sequence[Sequence[float]]) -> None:
    if len(durations) != len(schedule.ranks):
        raise ValueError(f"durations: one list per rank expected ({len(schedule.ranks)}), got {len(durations)}")
    for rank, (computes, times) in enumerate(zip(_static(schedule).computes, durations, strict=True)):
        if len(times) != computes:
            raise ValueError(f"durations: rank {rank} runs {computes} compute actions, got {len(times)} durations")
        bad = [t for t in times if not math.isfinite(t) or t < 0]
        if bad:
            raise ValueError(f"durations: rank {rank} has durations that are not finite numbers >= 0: {bad[:3]}")


def simulate(
    schedule: Schedule,
    costs: Costs | None = None,
    *,
    durations: Sequence[Sequence[float]] | None = None,
    ready: Sequence[float] | None = None,
) -> SimResult:
    """Time ``schedule`` under ``costs`` (defaults: F=1, B=2, W=1, F&B=F+B, no latency).

    ``durations`` replaces the per-kind costs by one cost per compute action: ``durations[r][i]`` is what
    rank ``r``'s ``i``-th compute action takes (e.g. measured in a run, so the prediction sees per-stage and
    per-micro-batch differences that a mean per kind hides). ``costs`` then only gives the latency.
    ``ready[r]`` is when rank ``r`` can start (default: every rank at 0); the time before it is idle.
    """
    costs = costs if costs is not None else Costs()
    if durations is not None:
        _check_durations(schedule, durations)
    if ready is not None and (len(ready) != len(schedule.ranks) or any(not math.isfinite(t) or t < 0 for t in ready)):
        raise ValueError(f"ready: one finite time >= 0 per rank expected ({len(schedule.ranks)}), got {list(ready)}")
    spans = _timelines(schedule, costs, durations, ready)
    makespan = max((s[-1].end for s in spans if s), default=0.0)
    busy = tuple(sum(x.end - x.start for x in s) for s in spans)
    idle = tuple(makespan - b for b in busy)
    peaks = _static(schedule).peaks
    fraction = stage_share(schedule)
    return SimResult(
        schedule=schedule.name,
        num_ranks=len(schedule.ranks),
        num_chunks=schedule.num_chunks,
        costs=costs,
        timelines=tuple(tuple(s) for s in spans),
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_fraction=sum(idle) / (len(spans) * makespan) if makespan > 0 else 0.0,
        peak_activations=peaks,
        peak_activation_stages=tuple(p * fraction for p in peaks),
        parameter_copies=schedule.layout.modules_per_rank * fraction,
    )


_COLORS = {"F": "#4c72b0", "B": "#55a868", "I": "#8fd19e", "W": "#dd8452", "FB": "#8172b3"}


def render_png(result: SimResult, path: str) -> None:
    """Draw the rank-by-time picture (one row per rank, one box per compute action) into ``path``."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global backend state is touched
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError("render_png needs matplotlib: pip install dualpipe-moe[plot]") from exc
    per_rank = sum(len(s) for s in result.timelines) / max(result.num_ranks, 1)
    # A cluster-sized step (hundreds of actions per rank) gets no labels or outlines: they would only blur
    # into a multi-megabyte picture.
    detailed = per_rank <= 80
    width = max(6.0, min(40.0 if detailed else 16.0, 0.4 * per_rank))
    fig = Figure(figsize=(width, min(0.5 * result.num_ranks, 12.0) + 1.2))
    ax = fig.add_subplot()
    for rank, spans in enumerate(result.timelines):
        for s in spans:
            ax.barh(rank, s.end - s.start, left=s.start, height=0.8, color=_COLORS[s.op],
                    edgecolor="black", lw=0.3 if detailed else 0)  # fmt: skip
            if detailed:
                ax.text((s.start + s.end) / 2, rank, s.label, ha="center", va="center", fontsize=5, clip_on=True)
    ax.set_yticks(range(result.num_ranks), [f"rank {r}" for r in range(result.num_ranks)])
    ax.invert_yaxis()
    ax.set_xlim(0, result.makespan or 1.0)
    ax.set_xlabel("time")
    ax.set_title(
        f"{result.schedule}: {result.num_ranks} ranks, {result.num_chunks} chunks, "
        f"makespan {result.makespan:g}, bubble {result.bubble_fraction:.1%}"
    )
    ax.legend(
        handles=[Patch(color=c, label=k) for k, c in _COLORS.items()],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=6,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=150 if detailed else 100)


def _summary(result: SimResult) -> str:
    lines = [
        f"{result.schedule}: {result.num_ranks} ranks, {result.num_chunks} chunks, costs {asdict(result.costs)}",
        f"makespan {result.makespan:g}, bubble fraction {result.bubble_fraction:.4f}, "
        f"parameter copies {result.parameter_copies:g}",
        "rank      busy      idle  peak activations (modules / stages)",
    ]
    for r in range(result.num_ranks):
        lines.append(
            f"{r:>4} {result.busy[r]:>9g} {result.idle[r]:>9g}  "
            f"{result.peak_activations[r]} / {result.peak_activation_stages[r]:g}"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dualpipe.simulate", description=__doc__.split("\n")[0])
    p.add_argument("--schedule", choices=sorted(SCHEDULES), help=f"the schedule to time (default {DEFAULT_SCHEDULE})")
    p.add_argument(
        "--compare",
        action="store_true",
        help="every registered schedule side by side, with and without overlap (dualpipe.compare): costs per full "
        "stage, --chunks default the fewest every schedule accepts",
    )
    p.add_argument("--ranks", type=int, default=4, help="pipeline ranks")
    p.add_argument("--chunks", type=int, default=None, help="micro-batches in total (default 10)")
    p.add_argument(
        "--modules-per-rank",
        type=int,
        default=None,
        help="model chunks per rank, for schedules that take any number (interleaved-1f1b's v; default 2)",
    )
    p.add_argument(
        "--extra-warmup",
        type=int,
        default=0,
        metavar="N",
        help="warm-up forwards added on every rank by the schedules with a warm-up rule (1F1B, ZB1P, interleaved "
        "1F1B; Kimi K2's extra micro-batches: 1F1B and ZB1P pair only with at least 1)",
    )
    p.add_argument("--F", type=float, default=1.0, help="forward of one chunk")
    p.add_argument("--B", type=float, default=2.0, help="full backward of one chunk (input + weight grad)")
    p.add_argument("--W", type=float, default=1.0, help="weight-grad part of B")
    p.add_argument("--FB", type=float, default=None, help="overlapped forward+backward pair (default F+B)")
    p.add_argument(
        "--a2a",
        type=float,
        default=0.0,
        help="with --compare: all-to-all time of one forward (and one backward) chunk, on top of its compute",
    )
    p.add_argument("--latency", type=float, default=0.0, help="point-to-point latency")
    p.add_argument("--early-receives", action="store_true", help="post receives one compute earlier")
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="FILE",
        help="write a JSON object (--compare: the table's rows) into FILE; alone: print it instead of the summary",
    )
    p.add_argument(
        "--png",
        metavar="PATH",
        help="draw the timeline into a PNG (needs matplotlib); with --compare two, PATH's name ending in the "
        "schedule: the fastest overlapped 1F1B-family row and DualPipeV",
    )
    return p


def _draw(result: SimResult, path: str) -> None:
    try:
        render_png(result, path)
    except ImportError as exc:
        raise SystemExit(f"error: {exc}") from exc


def _compare(args: argparse.Namespace, costs: Costs) -> int:
    from dualpipe import compare as cmp  # it builds on this module

    if args.schedule is not None:
        raise SystemExit("error: --compare runs every registered schedule: drop --schedule")
    try:
        results = cmp.compare(
            args.ranks, costs, a2a=args.a2a, num_chunks=args.chunks, modules_per_rank=args.modules_per_rank,
            early_receives=args.early_receives, extra_warmup=args.extra_warmup,
        )  # fmt: skip
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    rows = [row for row, _ in results]
    if args.json != "-":
        print(cmp.compare_table(rows, costs, args.a2a))
    if args.json:
        cmp.write_json(args.json, rows, costs, args.a2a)
    if args.png:
        path = Path(args.png)
        for result in cmp.pictured(results, args.modules_per_rank):
            out = path.with_name(f"{path.stem}-{result.schedule}{path.suffix or '.png'}")
            _draw(result, str(out))
            if args.json != "-":
                print(f"wrote {out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        costs = Costs(F=args.F, B=args.B, W=args.W, FB=args.FB, latency=args.latency)
        if args.compare:
            return _compare(args, costs)
        if args.a2a:
            raise ValueError("--a2a needs --compare (a single schedule's summary has no all-to-all)")
        name = args.schedule or DEFAULT_SCHEDULE
        chunks = 10 if args.chunks is None else args.chunks
        schedule = build_schedule(
            name, args.ranks, chunks, args.early_receives, args.modules_per_rank, args.extra_warmup
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    result = simulate(schedule, costs)
    text = json.dumps(result.to_dict())
    if args.json and args.json != "-":
        Path(args.json).write_text(text + "\n")
    print(text if args.json == "-" else _summary(result))
    if args.png:
        _draw(result, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

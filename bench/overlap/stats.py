"""Pure functions of the overlap benchmark: spans from recorded events, hidden all-to-all, bubbles, trace.

An event is ``[name, direction, layer, edge, seconds]`` (see :mod:`bench.overlap.run`): compute sub-stages
``begin``/``end``, all-to-alls ``start``/``wait``, pipeline actions (direction ``"action"``, layer = nesting
depth) ``begin``/``end``, waits for pipeline messages (direction ``"p2p"``) and the executor issuing
sends and receives between actions (direction ``"post"``) ``begin``/``end``, and the step's
``begin``/``end``.

All-to-all accounting. A communication is *in flight* from its ``start`` to its ``wait`` (recorded right
after the wait returned). The *hidden fraction* is the project's one metric,
:func:`dualpipe.events.hidden_fraction`: per rank, the part of the union of the in-flight intervals that
lies under the union of compute sub-stages that did work (a span closed by ``empty``, a dW with nothing to
run, is none), over that union; pooled over ranks by adding the seconds. A blocking all-to-all hides
nothing; one that the other micro-batch's compute outlasts hides all of it; time the rank spends on other
host work while a transfer is in flight (issuing, bookkeeping, waiting for something else) hides nothing.
The rank is *blocked* in the wait from the previous event it recorded (the end of the compute before the
wait) to the ``wait``; that is the *exposed* part, which the breakdown by kind and peer splits.

Where the exposed time comes from. Each all-to-all has a *kind*, its recorded name and direction
(:data:`COMM_KINDS`): the forward and backward dispatch and combine, and ``counts.fwd``, the row-count
exchange a dispatch waits for first (``Route.wait_counts``). *Peer skew*: the ranks of one
expert-parallel group issue the same all-to-alls in the same order, so the i-th one each rank issued
(by start time) is one collective. Its skew is the spread of the ranks' start times; the exposed time a
rank spends before the last rank has started it is the rank ahead waiting for its peer to join. This
needs one clock for all ranks, which ``time.perf_counter`` is on one machine.

Bubble: within the step window a rank is idle while it waits for a pipeline message (the executor
completes a receive inside the action that consumes it) and after its work is done (its last action and
the sends and receives it issues after it; the end-of-step wait for its sends to be taken is idle). Every
other moment, from its own step begin on, is busy: compute actions with their all-to-all waits, and the
executor's own work between them (issuing sends and receives, bookkeeping). ``bubble fraction = idle time
of all ranks / (ranks x step time)``, the simulator's definition.

Prediction: the simulator times the same schedule from the costs measured in the same step, in two ways.
*Replayed*: every compute action costs the busy time from its start to the next action's start (its own
span less the pipeline-message waits in it, plus the executor's work after it; the first action also takes
the work before it, the last what it issues after it). Per-stage differences (the embedding and the head
live on some stages only) and per-micro-batch noise are kept, and a send leaves at the end of its
producer's replayed cost, as it did in the step; what the measurement adds on top is the time pipeline
messages take to arrive. *Mean*: one cost per action kind (the mean of the actions' own spans, less
their waits), the published formulas' model.
"""

from __future__ import annotations

import itertools
import math
import re
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dualpipe.events import HiddenFraction, hidden_fraction, interval_overlap, interval_union
from dualpipe.schedule import Schedule, build_schedule
from dualpipe.simulate import Costs, simulate

__all__ = [
    "COMM_KINDS",
    "ActionSpan",
    "CommSpan",
    "ComputeSpan",
    "HostSpan",
    "PeerSkew",
    "RankSteps",
    "StepParts",
    "action_durations",
    "chrome_trace",
    "comm_by_kind",
    "comm_kind",
    "comm_totals",
    "measured_bubble",
    "measured_costs",
    "op_of",
    "parse_events",
    "peer_skews",
    "pipelines",
    "predicted_bubble",
    "rank_hidden",
    "replayed_bubble",
    "step_parts",
]

Event = Sequence  # [name, direction, layer, edge, seconds]


@dataclass(frozen=True, slots=True)
class ComputeSpan:
    name: str
    direction: str
    layer: int
    start: float
    end: float
    work: bool = True
    """False: the piece ran with nothing to compute (its span ended ``empty``)."""


@dataclass(frozen=True, slots=True)
class CommSpan:
    name: str
    direction: str
    layer: int
    start: float
    """Issued."""
    wait: float
    """Its result consumed (the wait returned)."""
    blocked_from: float
    """When the rank started blocking on it: the previous recorded event, not before ``start``."""

    @property
    def in_flight(self) -> float:
        return self.wait - self.start

    @property
    def exposed(self) -> float:
        return self.wait - self.blocked_from


@dataclass(frozen=True, slots=True)
class ActionSpan:
    label: str
    depth: int
    start: float
    end: float

    @property
    def op(self) -> str:
        return op_of(self.label)


@dataclass(frozen=True, slots=True)
class HostSpan:
    """A labelled interval of a rank's host time: a wait for a pipeline message, or the executor issuing
    sends and receives."""

    label: str
    start: float
    end: float


@dataclass(slots=True)
class RankSteps:
    """One rank's spans in one step."""

    begin: float
    end: float
    compute: list[ComputeSpan]
    comm: list[CommSpan]
    actions: list[ActionSpan]
    waits: list[HostSpan] = field(default_factory=list)
    """Blocked on a pipeline message (inside the consuming action)."""
    posts: list[HostSpan] = field(default_factory=list)
    """Issuing sends and receives (between actions)."""

    def waited(self, t0: float, t1: float) -> float:
        """Time spent waiting for pipeline messages within ``[t0, t1]``."""
        return sum(max(0.0, min(w.end, t1) - max(w.start, t0)) for w in self.waits)

    def work_end(self) -> float:
        """End of the rank's last action or communication issue (its step begin if there is none)."""
        return max([self.begin, *(a.end for a in self.actions), *(p.end for p in self.posts)])

    def top_level(self) -> list[ActionSpan]:
        return [a for a in self.actions if a.depth == 0]


_OP = re.compile(r"^\((F)|^(F|B|I|W)")


def op_of(label: str) -> str:
    """``"F0.3"`` -> F, ``"(F0.4&B1.1)"`` -> FB, ``"I1.0"`` -> I, ``"W"`` -> W, ``"B2.5"`` -> B."""
    m = _OP.match(label)
    if m is None:
        raise ValueError(f"not a compute action label: {label!r}")
    return "FB" if m.group(1) else m.group(2)


def parse_events(events: Iterable[Event]) -> RankSteps:
    """Pair the edges of one rank's step into spans (events in program order)."""
    begin = end = math.nan
    compute: list[ComputeSpan] = []
    comm: list[CommSpan] = []
    actions: list[ActionSpan] = []
    host: dict[str, list[HostSpan]] = {"p2p": [], "post": []}
    open_compute: dict[tuple, float] = {}
    open_comm: dict[tuple, float] = {}
    open_spans: dict[tuple, float] = {}
    previous = math.nan
    for name, direction, layer, edge, t in events:
        key = (name, direction, layer)
        if name == "step":
            begin, end = (t, end) if edge == "begin" else (begin, t)
        elif direction == "action":
            if edge == "begin":
                open_spans[key] = t
            else:
                actions.append(ActionSpan(name, layer, open_spans.pop(key), t))
        elif direction in host:
            if edge == "begin":
                open_spans[key] = t
            else:
                host[direction].append(HostSpan(name, open_spans.pop(key), t))
        elif edge == "begin":
            open_compute[key] = t
        elif edge in ("end", "empty"):
            compute.append(ComputeSpan(name, direction, layer, open_compute.pop(key), t, work=edge == "end"))
        elif edge == "start":
            open_comm[key] = t
        elif edge == "wait":
            start = open_comm.pop(key)
            comm.append(CommSpan(name, direction, layer, start, t, max(start, previous)))
        previous = t
    return RankSteps(begin, end, compute, comm, actions, host["p2p"], host["post"])


def rank_hidden(r: RankSteps, within: str | None = None) -> HiddenFraction:
    """:func:`dualpipe.events.hidden_fraction` of one rank's step. ``within="FB"``: only the all-to-alls
    inside overlapped pairs (top-level F&B actions) count, under the same compute."""
    rows: list[tuple] = []
    for c in r.compute:
        rows += [(c.name, c.direction, c.layer, "begin", c.start)]
        rows += [(c.name, c.direction, c.layer, "end" if c.work else "empty", c.end)]
    for c in r.comm if within is None else _inside(r, within):
        rows += [(c.name, c.direction, c.layer, "start", c.start), (c.name, c.direction, c.layer, "wait", c.wait)]
    return hidden_fraction(rows)


def comm_totals(ranks: Sequence[RankSteps], within: str | None = None) -> tuple[float, float, float]:
    """``(in flight, exposed, hidden fraction)`` over the ranks of one step: in-flight and exposed seconds
    summed over the all-to-alls, the hidden fraction pooled over the ranks (:func:`rank_hidden`).

    ``within="FB"`` counts only the all-to-alls inside overlapped pairs (top-level F&B actions): what the
    overlap itself hides, without the schedule's unpaired warm-up and cool-down chunks.
    """
    comms = [c for r in ranks for c in (r.comm if within is None else _inside(r, within))]
    in_flight = sum(c.in_flight for c in comms)
    exposed = sum(c.exposed for c in comms)
    return in_flight, exposed, sum((rank_hidden(r, within) for r in ranks), HiddenFraction()).fraction


def _inside(r: RankSteps, op: str) -> list[CommSpan]:
    spans = [(a.start, a.end) for a in r.actions if a.depth == 0 and a.op == op]
    return [c for c in r.comm if any(t0 <= c.start and c.wait <= t1 for t0, t1 in spans)]


COMM_KINDS = {
    "dispatch.fwd": "forward dispatch",
    "combine.fwd": "forward combine",
    "dispatch.bwd": "backward dispatch",
    "combine.bwd": "backward combine",
    "counts.fwd": "row-count exchange",
}
"""The all-to-all kinds :mod:`moe.models.block` records (``name.direction``), in the order reports list them."""


def comm_kind(c: CommSpan) -> str:
    """``"dispatch.fwd"``, ``"counts.fwd"``, ...: the recorded name and direction."""
    return f"{c.name}.{c.direction}"


def comm_by_kind(ranks: Sequence[RankSteps]) -> dict[str, tuple[int, float, float]]:
    """kind -> ``(count, in flight, exposed)`` summed over ``ranks`` (seconds), kinds in first-seen order."""
    out: dict[str, tuple[int, float, float]] = {}
    for r in ranks:
        for c in r.comm:
            n, in_flight, exposed = out.get(comm_kind(c), (0, 0.0, 0.0))
            out[comm_kind(c)] = (n + 1, in_flight + c.in_flight, exposed + c.exposed)
    return out


@dataclass(frozen=True, slots=True)
class PeerSkew:
    """One all-to-all of an expert-parallel group, its ranks' spans matched by issue order."""

    kind: str
    skew: float
    """The last rank's start minus the first rank's."""
    peer_wait: float
    """Exposed time, summed over the group's ranks, before the last rank started it."""


def pipelines(ranks: dict[int, RankSteps], pp: int) -> list[list[RankSteps]]:
    """Each expert-parallel rank's pipeline, in pipeline-rank order (global rank ``ep_rank * pp + pp_rank``,
    :func:`bench.overlap.run.ep_major_layout`). Its transpose is the expert-parallel groups."""
    return [[ranks[e * pp + p] for p in range(pp)] for e in range(len(ranks) // pp)]


def peer_skews(group: Sequence[RankSteps]) -> list[PeerSkew]:
    """Every all-to-all of one step of one expert-parallel group (its ranks' spans, on one clock), in issue
    order. The ranks must have recorded the same all-to-alls in the same order."""
    issued = [sorted(r.comm, key=lambda c: c.start) for r in group]
    if len({len(spans) for spans in issued}) > 1:
        raise ValueError(f"the group's ranks recorded {[len(s) for s in issued]} all-to-alls")
    out = []
    for i, spans in enumerate(zip(*issued)):
        names = [(c.name, c.direction, c.layer) for c in spans]
        if len(set(names)) > 1:
            raise ValueError(f"all-to-all {i} differs across the group's ranks: {names}")
        first, last = min(c.start for c in spans), max(c.start for c in spans)
        wait = sum(max(0.0, min(c.wait, last) - c.blocked_from) for c in spans)
        out.append(PeerSkew(comm_kind(spans[0]), last - first, wait))
    return out


@dataclass(frozen=True, slots=True)
class StepParts:
    """Where one rank's step went on its compute thread (seconds; they add up to the step)."""

    compute: float
    """Inside compute pieces that did work (their union)."""
    a2a_blocked: float
    """Blocked waiting for an all-to-all (its ``exposed`` time)."""
    p2p_blocked: float
    """Blocked waiting for a pipeline message."""
    host: float
    """The rest: the runtime and the model between pieces (issuing transfers, routing metadata, the
    executor's bookkeeping), and empty pieces. NaN for a rank that recorded no pieces (a plain autograd
    graph, torch's schedule as users get it): its ``compute`` is then all the time it did not wait."""


def step_parts(r: RankSteps) -> StepParts:
    """:class:`StepParts` of one rank's step (compute spans and waits clipped to the step)."""
    step = [(r.begin, r.end)]
    a2a = interval_overlap(interval_union((c.blocked_from, c.wait) for c in r.comm), step)
    p2p = interval_overlap(interval_union((w.start, w.end) for w in r.waits), step)
    rest = max(0.0, (r.end - r.begin) - a2a - p2p)
    if not r.compute:
        return StepParts(rest, a2a, p2p, math.nan)
    compute = interval_overlap(interval_union((c.start, c.end) for c in r.compute if c.work), step)
    return StepParts(compute, a2a, p2p, max(0.0, rest - compute))


def step_window(ranks: Sequence[RankSteps]) -> tuple[float, float]:
    """The step as the slowest rank sees it: first begin (after the barrier) to last end."""
    return min(r.begin for r in ranks), max(r.end for r in ranks)


def measured_bubble(ranks: Sequence[RankSteps]) -> float:
    """Idle time (waiting for pipeline messages, or outside the rank's own work) over ``ranks x step time``."""
    t0, t1 = step_window(ranks)
    span = t1 - t0
    if span <= 0:
        return math.nan
    busy = 0.0
    for r in ranks:
        lo, hi = max(r.begin, t0), min(r.work_end(), t1)
        busy += max(0.0, hi - lo) - r.waited(lo, hi)
    return (len(ranks) * span - busy) / (len(ranks) * span)


def _net(r: RankSteps, a: ActionSpan) -> float:
    return a.end - a.start - r.waited(a.start, a.end)


def _mean(xs: list[float]) -> float | None:
    return statistics.fmean(xs) if xs else None


def measured_costs(ranks: Sequence[RankSteps]) -> Costs:
    """Mean cost of each action kind over all ranks (every nesting level, pipeline-message waits cut out), in
    seconds.

    ``B`` is the full backward: measured where the schedule runs full backwards, else input-gradient plus
    weight-gradient parts. ``FB`` is the pair as run (``F + B`` when nothing runs paired).
    """
    by_op: dict[str, list[float]] = {}
    for r in ranks:
        for a in r.actions:
            by_op.setdefault(a.op, []).append(_net(r, a))
    f = _mean(by_op.get("F", [])) or 0.0
    w = _mean(by_op.get("W", [])) or 0.0
    b = _mean(by_op.get("B", []))
    if b is None:
        b = (_mean(by_op.get("I", [])) or 0.0) + w
    fb = _mean(by_op.get("FB", []))
    return Costs(F=f, B=b, W=min(w, b), FB=f + b if fb is None else fb)


def predicted_bubble(
    schedule: str, num_ranks: int, chunks: int, costs: Costs, extra_warmup: int = 0, overlap: bool = True
) -> float:
    """The simulator's bubble fraction for ``schedule`` under ``costs`` (one cost per action kind), as run with
    or without ``overlap``."""
    built = build_schedule(schedule, num_ranks, chunks, extra_warmup=extra_warmup, overlap=overlap)
    return simulate(built, costs).bubble_fraction


def action_durations(schedule: Schedule, ranks: Sequence[RankSteps]) -> list[list[float]]:
    """Each rank's top-level compute actions as measured, in the order of ``schedule``'s compute actions on
    that rank, which they must match label by label: the busy time from an action's start to the next
    one's (the pipeline-message waits in between cut out), the first from the rank's step begin, the last
    to the end of its work."""
    if len(ranks) != len(schedule.ranks):
        raise ValueError(f"{len(ranks)} ranks measured, the schedule has {len(schedule.ranks)}")
    out = []
    for rank, (r, actions) in enumerate(zip(ranks, schedule.ranks, strict=True)):
        want = [str(a) for a in actions if a.op.is_compute]
        got = r.top_level()
        if [a.label for a in got] != want:
            raise ValueError(f"rank {rank}: measured actions {[a.label for a in got]} are not the schedule's {want}")
        # what the executor issues after an action (its sends, the next receives) is charged to it, so a
        # send leaves at the end of its producer's replayed cost, as it did in the step
        edges = [r.begin, *(a.start for a in got[1:]), r.work_end()] if got else []
        out.append([hi - lo - r.waited(lo, hi) for lo, hi in itertools.pairwise(edges)])
    return out


def replayed_bubble(
    schedule: str,
    pipelines: Sequence[Sequence[RankSteps]],
    chunks: int,
    latency: float = 0.0,
    extra_warmup: int = 0,
    overlap: bool = True,
) -> float:
    """The simulator's bubble fraction for ``schedule`` (as run with or without ``overlap``) when every compute
    action costs what it took in the measured step (:func:`action_durations`) and every rank starts at its
    measured step begin.
    ``pipelines`` holds each pipeline's ranks in pipeline-rank order (one pipeline per expert-parallel
    rank); as in :func:`measured_bubble`, every rank's idle time counts within one window, from the first
    begin to the end of the slowest pipeline."""
    t0 = min((r.begin for ranks in pipelines for r in ranks), default=math.nan)
    results = []
    for ranks in pipelines:
        sched = build_schedule(schedule, len(ranks), chunks, extra_warmup=extra_warmup, overlap=overlap)
        durations = action_durations(sched, ranks)
        results.append(
            simulate(sched, Costs(latency=latency), durations=durations, ready=[r.begin - t0 for r in ranks])
        )
    if not results:
        return math.nan
    makespan = max(r.makespan for r in results)
    if makespan <= 0:
        return math.nan
    busy = [b for r in results for b in r.busy]
    return (len(busy) * makespan - sum(busy)) / (len(busy) * makespan)


# ------------------------------------------------------------------------------------------------ trace

TRACKS = {"compute": 0, "comm fwd": 1, "comm bwd": 2}


def chrome_trace(steps: Sequence[tuple[str, int, dict[int, RankSteps]]], names: dict[int, str]) -> dict:
    """One Chrome/Perfetto trace: a process per rank, a thread per stream (compute, comm fwd, comm bwd).

    ``steps``: ``(mode, step, {rank: spans})``; ``names``: rank -> process label. Times in microseconds
    from the earliest event. Compute spans nest (step > action > sub-stage or wait for a pipeline message);
    each comm thread holds one direction, whose all-to-alls never overlap.
    """
    origin = min((r.begin for _, _, ranks in steps for r in ranks.values()), default=0.0)
    out: list[dict] = []
    for rank, name in sorted(names.items()):
        out.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": name}})
        out.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        for track, tid in TRACKS.items():
            out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": track}})

    def x(name: str, rank: int, tid: int, t0: float, t1: float, **args) -> dict:
        # 0.1 us resolution: far below what the host clock resolves here, and it keeps the file small
        ts, dur = round((t0 - origin) * 1e6, 1), round((t1 - t0) * 1e6, 1)
        return {"ph": "X", "name": name, "pid": rank, "tid": tid, "ts": ts, "dur": dur, "args": args}

    for mode, step, ranks in steps:
        for rank, r in ranks.items():
            out.append(x(f"{mode} step {step}", rank, 0, r.begin, r.end, mode=mode))
            out += [x(a.label, rank, 0, a.start, a.end, op=a.op, mode=mode) for a in r.actions]
            out += [
                x(f"{c.name}.{c.direction} L{c.layer}{'' if c.work else ' (empty)'}", rank, 0, c.start, c.end)
                for c in r.compute
            ]
            out += [x(f"wait {w.label}", rank, 0, w.start, w.end, mode=mode) for w in r.waits]
            out += [x(p.label, rank, 0, p.start, p.end, mode=mode) for p in r.posts]
            for c in r.comm:
                exposed_ms = round(c.exposed * 1e3, 4)
                tid = TRACKS["comm bwd" if c.direction == "bwd" else "comm fwd"]
                out.append(x(f"{c.name} L{c.layer}", rank, tid, c.start, c.wait, exposed_ms=exposed_ms, mode=mode))
    return {"traceEvents": out, "displayTimeUnit": "ms"}

"""Every registered schedule side by side, each with and without overlap: ``python -m dualpipe.simulate --compare``.

Each schedule of :data:`dualpipe.schedule.SCHEDULES` runs the same model on the same pipeline ranks with the
same micro-batches and is timed by :func:`dualpipe.simulate.simulate` twice: *with overlap* every ``FB`` pair
of its action lists costs one ``F&B``; *without* the pair runs its forward, then its backward (what the
executor does with ``overlap=False``: the same action lists, the pair's sends after both halves). A schedule
that emits no pair gives the same row twice; the table says so. The pairs are counted in the generated
action lists, so a schedule that starts pairing shows it here without a change to this module.

Costs
-----
``F``, ``B`` (full backward), ``W`` (its weight-gradient part) and ``F&B`` are the compute of one full 1F1B
stage for one micro-batch, and ``a2a`` the all-to-all time one forward chunk of that stage moves (its backward
moves as much). A schedule whose module holds a share ``s`` of a stage (:func:`dualpipe.simulate.stage_share`:
DualPipeV ``1/2``, interleaved 1F1B ``1/v``) gets ``s`` times each, so every schedule runs the same model.

Exposed all-to-all
------------------
The planner's rule (:class:`moe.plan.pair.ChunkTimes`): an action's exposed all-to-all is its duration minus
its compute. A lone chunk waits for its own all-to-all (the planner's lone forward and its input-gradient-only
backward do; its full backward hides part under its weight gradients, which scalar costs cannot place, so
here it hides none): a lone ``F``, ``B`` or ``I`` lasts its compute plus ``a2a`` and exposes ``a2a``; a ``W``
moves nothing. An overlapped pair lasts ``F&B`` and computes ``F + B``: it exposes
``min(2 a2a, max(0, F&B - F - B))`` of its ``2 a2a``. So ``F&B = F + B`` (the default) hides the pair's whole
all-to-all (DeepSeek-V3's premise) and ``F&B = F + B + 2 a2a`` hides none. Without overlap the pair is a
lone ``F`` and a lone ``B``: ``2 a2a`` exposed. The table gives the exposed all-to-all per rank (the mean over
ranks, in the costs' unit) and its share of all the step's all-to-all, the planner's ``exposed a2a``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from dualpipe.schedule import DEFAULT_SCHEDULE, SCHEDULES, Op, Schedule, build_schedule, schedule_spec
from dualpipe.simulate import Costs, SimResult, simulate, stage_share

__all__ = [
    "Row",
    "common_chunks",
    "compare",
    "compare_table",
    "exposed_a2a",
    "loops",
    "pictured",
    "step_costs",
    "write_json",
]


@dataclass(frozen=True, slots=True)
class Row:
    """One schedule, with or without overlap; the figures are ``None`` where the schedule refuses the shape."""

    schedule: str
    overlap: bool
    ranks: int
    chunks: int
    extra_warmup: int = 0
    """Warm-up forwards added on every rank (the 1F1B family's option; the table names the row ``NAME+wN``)."""
    pairs: int | None = None
    """Overlapped forward/backward pairs (``FB`` actions) per step, all ranks."""
    step_time: float | None = None
    bubble_fraction: float | None = None
    peak_activations: float | None = None
    """Peak live activations of the fullest rank, in micro-batches of one 1F1B stage."""
    copies: float | None = None
    """Parameter (and gradient) copies: the model's weights per rank over one 1F1B rank's (DualPipe: 2)."""
    exposed_a2a: float | None = None
    """Exposed all-to-all per rank (the mean over ranks) in the costs' unit."""
    exposed_a2a_fraction: float | None = None
    """Exposed over all all-to-all time of the step."""
    note: str = ""


def common_chunks(num_ranks: int, modules_per_rank: int | None = None) -> int:
    """The fewest micro-batches every registered schedule accepts at ``num_ranks`` (those that refuse the
    ranks themselves, DualPipe at an odd count, are left out)."""
    specs = []
    for spec in SCHEDULES.values():
        try:
            spec.check_ranks(num_ranks)
        except ValueError:
            continue
        specs.append(spec)
    n = max((s.min_chunks(num_ranks) for s in specs), default=1)
    while True:
        if all(_accepts(s.name, num_ranks, n, modules_per_rank) for s in specs):
            return n
        n += 1


def _accepts(name: str, num_ranks: int, num_chunks: int, modules_per_rank: int | None) -> bool:
    try:
        schedule_spec(name).validate(num_ranks, num_chunks, _modules(name, modules_per_rank))
    except ValueError:
        return False
    return True


def _modules(name: str, modules_per_rank: int | None) -> int | None:
    """``modules_per_rank`` for a schedule that takes any number, else its own."""
    return modules_per_rank if schedule_spec(name).flexible_modules else None


def step_costs(schedule: Schedule, stage: Costs, a2a: float, overlap: bool) -> Costs:
    """The durations :func:`dualpipe.simulate.simulate` takes for ``schedule``'s actions: ``stage``'s compute and
    ``a2a`` (per full stage) scaled to its modules, a lone chunk waiting for its all-to-all, a pair costing
    ``F&B`` with ``overlap`` and a lone ``F`` plus a lone ``B`` without (see the module docstring)."""
    s = stage_share(schedule)
    f, b, w, x = s * stage.F, s * stage.B, s * stage.W, s * a2a
    pair = s * stage.FB if overlap else f + b + 2 * x
    return Costs(F=f + x, B=b + x, W=w, FB=pair, latency=stage.latency)


def exposed_a2a(schedule: Schedule, stage: Costs, a2a: float, overlap: bool) -> tuple[list[float], float]:
    """Per rank, the all-to-all its actions leave exposed (the module docstring's rule), and the step's total
    all-to-all over all ranks."""
    s = stage_share(schedule)
    x = s * a2a
    pair = min(2 * x, max(0.0, s * (stage.FB - stage.F - stage.B))) if overlap else 2 * x
    exposed = {Op.F: x, Op.B: x, Op.I: x, Op.W: 0.0, Op.FB: pair}
    moved = {Op.F: x, Op.B: x, Op.I: x, Op.W: 0.0, Op.FB: 2 * x}
    per_rank = [sum(exposed[a.op] for a in actions if a.op.is_compute) for actions in schedule.ranks]
    total = sum(moved[a.op] for actions in schedule.ranks for a in actions if a.op.is_compute)
    return per_rank, total


def compare(
    num_ranks: int,
    stage: Costs,
    *,
    a2a: float = 0.0,
    num_chunks: int | None = None,
    modules_per_rank: int | None = None,
    early_receives: bool = False,
    extra_warmup: int = 0,
) -> list[tuple[Row, SimResult | None]]:
    """Two rows per registered schedule (with overlap, then without) at ``num_ranks`` and ``num_chunks``
    micro-batches (default :func:`common_chunks`), each with the simulation behind it (``None`` for a
    schedule that refuses the shape: its row's ``note`` says why). ``extra_warmup``: the warm-up forwards the
    schedules with a warm-up rule (the 1F1B family) add on every rank; their rows are named ``NAME+wN``."""
    if a2a < 0:
        raise ValueError(f"a2a must be >= 0 (got {a2a})")
    chunks = common_chunks(num_ranks, modules_per_rank) if num_chunks is None else num_chunks
    out: list[tuple[Row, SimResult | None]] = []
    for name, spec in SCHEDULES.items():
        extra = extra_warmup if spec.warmup is not None else 0
        try:
            modules = _modules(name, modules_per_rank)
            schedule = build_schedule(name, num_ranks, chunks, early_receives, modules, extra)
        except ValueError as exc:
            row = Row(name, True, num_ranks, chunks, extra_warmup=extra, note=f"refuses: {exc}")
            out += [(row, None), (replace(row, overlap=False), None)]
            continue
        pairs = sum(a.op is Op.FB for actions in schedule.ranks for a in actions)
        for overlap in (True, False):
            if not overlap:  # as run without overlap (the V family then leaves its passes unpaired)
                schedule = build_schedule(name, num_ranks, chunks, early_receives, modules, extra, overlap=False)
            result = simulate(schedule, step_costs(schedule, stage, a2a, overlap))
            per_rank, total = exposed_a2a(schedule, stage, a2a, overlap)
            row = Row(
                schedule=name,
                extra_warmup=extra,
                overlap=overlap,
                ranks=num_ranks,
                chunks=chunks,
                pairs=pairs if overlap else 0,
                step_time=result.makespan,
                bubble_fraction=result.bubble_fraction,
                peak_activations=max(result.peak_activation_stages),
                copies=result.parameter_copies,
                exposed_a2a=sum(per_rank) / num_ranks,
                exposed_a2a_fraction=sum(per_rank) / total if total > 0 else 0.0,
                note="" if pairs else "no FB pairs: both rows the same",
            )
            out.append((row, result))
    return out


_HEADER = ("schedule", "overlap", "pairs", "step", "bubble", "peak act", "copies", "exposed a2a", "exposed", "note")


def _cells(r: Row) -> list[str]:
    name = f"{r.schedule}+w{r.extra_warmup}" if r.extra_warmup else r.schedule
    if r.step_time is None:
        return [name, "yes" if r.overlap else "no", *["-"] * 7, r.note]
    return [
        name,
        "yes" if r.overlap else "no",
        str(r.pairs),
        f"{r.step_time:g}",
        f"{r.bubble_fraction:.1%}",
        f"{r.peak_activations:g}",
        f"{r.copies:g}",
        f"{r.exposed_a2a:g}",
        f"{r.exposed_a2a_fraction:.0%}",
        r.note,
    ]


def compare_table(rows: Sequence[Row], stage: Costs, a2a: float) -> str:
    """The rows as an aligned text table under one line naming the shape and the costs."""
    cells = [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in [list(_HEADER), *cells]) for i in range(len(_HEADER))]

    def line(values: Sequence[str]) -> str:
        # names and notes left, figures right
        out = [v.ljust(w) if i in (0, len(values) - 1) else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths))]
        return "  ".join(out).rstrip()

    first = rows[0] if rows else None
    head = (
        f"{first.ranks if first else '?'} ranks, {first.chunks if first else '?'} micro-batches; per full stage "
        f"F={stage.F:g} B={stage.B:g} W={stage.W:g} F&B={stage.FB:g} a2a={a2a:g} (latency {stage.latency:g}); "
        "peak act in micro-batches of one stage, the fullest rank; exposed a2a per rank"
    )
    return "\n".join([head, line(_HEADER), *(line(c) for c in cells)])


def write_json(path: str, rows: Sequence[Row], stage: Costs, a2a: float) -> None:
    """The rows and their inputs as JSON (``-``: stdout)."""
    doc = {"costs": {**asdict(stage), "a2a": a2a}, "rows": [asdict(r) for r in rows]}
    text = json.dumps(doc, indent=1)
    if path == "-":
        print(text)
    else:
        Path(path).write_text(text + "\n")


def loops(schedule: Schedule) -> bool:
    """Whether ``schedule`` is of the 1F1B family: one path that visits the ranks in order, looping back to rank
    0 after the last (1F1B, ZB1P; interleaved 1F1B loops ``v`` times)."""
    layout = schedule.layout
    return len(layout.paths) == 1 and all(r == pos % layout.num_ranks for pos, (r, _) in enumerate(layout.paths[0]))


def pictured(results: Sequence[tuple[Row, SimResult | None]], modules_per_rank: int | None = None) -> list[SimResult]:
    """The timelines worth drawing: the fastest overlapped row of the 1F1B family (:func:`loops`) and the
    product's schedule (:data:`dualpipe.schedule.DEFAULT_SCHEDULE`, DualPipeV) with overlap."""
    ran = [(row, sim) for row, sim in results if sim is not None and row.overlap]
    family = [
        (row, sim)
        for row, sim in ran
        if loops(build_schedule(row.schedule, row.ranks, row.chunks, False, _modules(row.schedule, modules_per_rank)))
    ]
    out = [min(family, key=lambda rs: rs[0].step_time)[1]] if family else []
    return out + [sim for row, sim in ran if row.schedule == DEFAULT_SCHEDULE]

"""Every layout a cluster can run, timed by the schedule simulator and ranked.

A :class:`Candidate` is a schedule of the registry with its pipeline ranks ``pp``, data-parallel ranks
``dp = gpus / pp``, expert-parallel ranks ``ep`` (dividing ``dp`` and the expert count), micro-batches per
step, communication SMs and a recompute granularity (:data:`moe.plan.costs.RECOMPUTE`). :func:`predict`
turns one into a :class:`Prediction`:

1. the per-block sub-stage times of the cost model (:class:`CostModel`) give each pipeline stage's blocks
   (the last stage's include its MTP modules' blocks, layers ``num_layers ..``);
2. :func:`moe.plan.pair.chunk_times` times each (forward stage, backward stage) combination the schedule
   runs, alone and overlapped, on a compute and a communication stream;
3. :func:`dualpipe.simulate.simulate` places every action of the schedule with those durations (P2P as the
   message latency), which gives the step's makespan and bubble;
4. the data-parallel gradient reduction follows the pipeline (not overlapped with it: an upper bound);
5. memory per GPU from the cost model's footprint, and whether it fits.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from dualpipe.schedule import SCHEDULES, Op, Schedule, ScheduleSpec, build_schedule, schedule_spec
from dualpipe.simulate import Costs, SimResult, simulate
from moe.pipeline_layout import AUTO, StagePlan, expand
from moe.plan.costs import RECOMPUTE, recompute_granularity
from moe.plan.offload import with_copies
from moe.plan.pair import BlockTimes, ChunkTimes, chunk_times

__all__ = [
    "EXTRA_WARMUP",
    "Candidate",
    "CostModel",
    "Prediction",
    "StageTimes",
    "candidates",
    "predict",
    "rank_predictions",
    "seconds",
    "step_bound",
    "why_worse",
]


@dataclass(frozen=True, slots=True, order=True)
class Candidate:
    """One way to run the step."""

    schedule: str
    pp: int
    dp: int
    ep: int
    num_chunks: int
    """Micro-batches per step, per data-parallel rank: global batch / (dp x micro-batch size)."""
    comm_sms: int
    recompute: str
    """A granularity of :data:`moe.plan.costs.RECOMPUTE` (a bool reads as ``full`` / ``none``)."""
    pipeline_layout: str = AUTO
    """What each stage holds (:mod:`moe.pipeline_layout`); ``auto``: stages balanced by cost."""
    extra_warmup: int = 0
    """Warm-up forwards added on every rank (schedules with a warm-up rule, :attr:`dualpipe.schedule.ScheduleSpec.
    warmup`): what pairs the 1F1B family's remaining steady steps (Kimi K2's extra warm-up micro-batches)."""
    overlap: bool = True
    """Run its pairs overlapped (the trainer's ``--overlap``). Off, a schedule whose pairs exist only to be
    overlapped (:attr:`dualpipe.schedule.ScheduleSpec.pairs_for_overlap`, the V family) runs its plan unpaired,
    which can be the faster of the two (``--no-overlap``)."""
    offload: str = ""
    """Saved activations moved to host memory between each forward and its backward (the trainer's
    ``--offload``, :mod:`moe.plan.offload`); the search tries it where a candidate does not fit without."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", recompute_granularity(self.recompute))

    @property
    def edp(self) -> int:
        return self.dp // self.ep

    @property
    def label(self) -> str:
        """The schedule's name, ``+wK`` with ``K`` extra warm-up forwards (``1f1b+w1``), then the trainer's flags
        it runs with besides: `` --no-overlap`` without overlap, `` --offload P`` with offloading."""
        name = f"{self.schedule}+w{self.extra_warmup}" if self.extra_warmup else self.schedule
        off = "" if self.overlap else " --no-overlap"
        moved = f" --offload {self.offload}" if self.offload else ""
        return f"{name}{off}{moved}"

    def describe(self) -> str:
        rc = "" if self.recompute == "none" else f" recompute={self.recompute}"
        lay = "" if self.pipeline_layout == AUTO else f" layout={self.pipeline_layout}"
        warm = f" extra_warmup={self.extra_warmup}" if self.extra_warmup else ""
        off = "" if self.overlap else " overlap=off"
        moved = f" offload={self.offload}" if self.offload else ""
        return (
            f"{self.schedule} pp={self.pp} dp={self.dp} ep={self.ep} chunks={self.num_chunks} "
            f"comm_sms={self.comm_sms}{rc}{lay}{warm}{off}{moved}"
        )


class CostModel(Protocol):
    """What the planner needs to know of one candidate, in seconds and bytes (:mod:`moe.plan.costs`)."""

    def block(self, layer: int) -> BlockTimes:
        """Sub-stage times of block ``layer`` (dense or MoE; an MTP module's from ``num_layers`` on) for one
        micro-batch."""

    def embed(self) -> tuple[float, float]:
        """(forward, backward) seconds of the embedding for one micro-batch."""

    def head(self) -> tuple[float, float]:
        """(forward, backward) seconds of the output head and loss for one micro-batch (and the MTP
        modules' work around their blocks)."""

    def p2p(self) -> float:
        """Seconds one stage boundary's activation takes to reach the next pipeline rank."""

    def dp_reduce(self) -> float:
        """Seconds of the data-parallel gradient reduction of one step, on the slowest rank."""

    def offload_seconds(self, rank: int) -> Sequence[float]:
        """Per local module of pipeline rank ``rank``, the seconds one micro-batch's offloaded activations take
        over the host link, one direction (asked only of a candidate with ``offload``)."""

    def memory(self) -> object:
        """Memory per GPU on the fullest rank (an object with ``total`` bytes)."""

    def fits(self) -> bool:
        """Whether :meth:`memory` fits the GPU."""

    def model_flops(self) -> float:
        """Model FLOPs of one step of the global batch (no recompute), for MFU."""

    def shared_cores(self) -> tuple[float, float, float] | None:
        """``(cores per rank, cpu share, communication CPU seconds per block)`` of a machine whose ranks share
        its cores (:func:`cpu_bound`), or None (a GPU: every rank has its own)."""


@dataclass(frozen=True, slots=True)
class Prediction:
    """What :func:`predict` says of one candidate."""

    candidate: Candidate
    step_time: float
    pipeline_time: float
    dp_reduce_time: float
    tokens_per_s_per_gpu: float
    mfu: float
    bubble_fraction: float
    exposed_a2a_fraction: float
    """All-to-all time left exposed (not under compute), over all all-to-all time of the step."""
    a2a_per_rank: float
    """All-to-all seconds of one step, per pipeline rank on average (hidden or not)."""
    memory: object
    fits: bool
    sim: SimResult = field(repr=False, compare=False)
    hidden_in_flight: float = 0.0
    """All-to-all hidden as a recorded run measures it (:func:`dualpipe.events.hidden_fraction`): of the time
    the transfers are in flight (issue to use), the share under compute (:meth:`moe.plan.pair.in_flight`)."""
    cpu_bound: float = 0.0
    """The least pipeline time the cores of a machine whose ranks share them allow (:func:`cpu_bound`; 0: none)."""

    def to_dict(self) -> dict:
        c = self.candidate
        memory = {k: getattr(self.memory, k) for k in _MEMORY_FIELDS if hasattr(self.memory, k)}
        return {
            "schedule": c.schedule,
            "pp": c.pp,
            "dp": c.dp,
            "ep": c.ep,
            "edp": c.edp,
            "num_chunks": c.num_chunks,
            "comm_sms": c.comm_sms,
            "recompute": c.recompute,
            "pipeline_layout": c.pipeline_layout,
            "extra_warmup": c.extra_warmup,
            "overlap": c.overlap,
            "offload": c.offload,
            "memory_options": dict(getattr(self.memory, "options", {}) or {"recompute": c.recompute}),
            "step_time_s": self.step_time,
            "pipeline_time_s": self.pipeline_time,
            "dp_reduce_time_s": self.dp_reduce_time,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "mfu": self.mfu,
            "bubble_fraction": self.bubble_fraction,
            "exposed_a2a_fraction": self.exposed_a2a_fraction,
            "memory_bytes": memory,
            "fits": self.fits,
        }


_MEMORY_FIELDS = ("params", "grads", "optimizer", "activations", "all_to_all_buffers", "total", "host")


EXTRA_WARMUP = (0, 1)
"""Extra warm-up forwards :func:`candidates` tries for the 1F1B family: one pairs every steady step of interleaved
1F1B and the last rank's of 1F1B and ZB1P (Megatron-Core's combined 1F1B adds one); more only add memory."""


OFFLOAD_TRIES = ("fraction=0.5", "all")
"""Activation-offload policies the search tries on a candidate that does not fit without, fewest bytes moved
first: the saved tensors of each stage's first half of its blocks (their backward comes last, so they stay
away longest; PipeOffload reports at least half of the activations offloadable at little cost), then all."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    *,
    num_gpus: int,
    num_layers: int,
    num_experts: int,
    global_batch: int,
    micro_batch: int,
    schedules: Sequence[str] | None = None,
    comm_sms: Sequence[int] = (20,),
    recompute: Sequence[str | bool] = RECOMPUTE,
    max_pp: int | None = None,
    pipeline_layout: str = AUTO,
    extra_warmup: Sequence[int] = EXTRA_WARMUP,
) -> Iterator[Candidate]:
    """Every valid candidate: the schedule accepts the ranks and micro-batches, the stages fit the layers,
    ep divides dp and the experts, the global batch splits evenly. At ep == 1 no SMs are reserved. A
    ``pipeline_layout`` other than ``auto`` keeps the candidates whose schedule has as many stages as it
    lists (the others are not generated); each candidate carries it. A schedule with a warm-up rule (the 1F1B
    family) is tried with each of ``extra_warmup`` extra warm-up forwards the batch holds, where ep > 1 (the
    pairs they add hide all-to-all; at ep == 1 there is none, and they would only cost memory). A schedule whose
    pairs exist only to be overlapped (the V family) is tried with overlap and without (its plan unpaired) where
    ep > 1, and only without at ep == 1 (no all-to-all to hide: its pairs would only hold sends back)."""
    layout_stages = None if pipeline_layout == AUTO else len(expand(pipeline_layout).split("|"))
    for name in schedules or sorted(SCHEDULES):
        spec = schedule_spec(name)
        for pp in _divisors(num_gpus):
            if max_pp is not None and pp > max_pp:
                continue
            dp = num_gpus // pp
            if global_batch % (dp * micro_batch):
                continue
            chunks = global_batch // (dp * micro_batch)
            try:
                spec.validate(pp, chunks)
            except ValueError:
                continue
            num_stages = spec.stage_layout(pp).num_stages
            if num_stages > num_layers or layout_stages not in (None, num_stages):
                continue
            warmups = [0] if spec.warmup is None else [e for e in extra_warmup if _holds(spec, pp, chunks, e)]
            for ep in _divisors(dp):
                if num_experts % ep:
                    continue
                overlaps = ((False,) if ep == 1 else (True, False)) if spec.pairs_for_overlap else (True,)
                for e in [0] if ep == 1 else warmups:
                    for sms in sorted({0} if ep == 1 else set(comm_sms)):
                        for rc, overlap in itertools.product(recompute, overlaps):
                            yield Candidate(name, pp, dp, ep, chunks, sms, rc, pipeline_layout, e, overlap)


def _holds(spec: ScheduleSpec, pp: int, chunks: int, extra_warmup: int) -> bool:
    """The batch holds ``extra_warmup`` more warm-up forwards (:meth:`dualpipe.schedule.ScheduleSpec.validate`)."""
    try:
        spec.validate(pp, chunks, extra_warmup=extra_warmup)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=4096)
def _chunk_times(
    f_blocks: tuple[BlockTimes, ...], b_blocks: tuple[BlockTimes, ...], extra_f: float, extra_b: float
) -> ChunkTimes:
    """:func:`moe.plan.pair.chunk_times` by value: candidates that differ in what leaves a stage's blocks alone
    (dp, chunks, offload, overlap) time the same chunks."""
    return chunk_times(f_blocks, b_blocks, extra_f=extra_f, extra_b=extra_b)


class StageTimes:
    """Chunk times per (forward stage, backward stage), computed once each. Each stage runs the blocks of its
    plan (:func:`moe.plan.params.stage_plans`): its layers, then its MTP blocks (layers ``num_layers ..``);
    the embedding on the first, the head on the last."""

    def __init__(self, model: CostModel, plans: Sequence[StagePlan]) -> None:
        self.plans = list(plans)
        num_layers = sum(len(p.layers) for p in self.plans)
        self.blocks = [
            [model.block(i) for i in (*p.layers, *range(num_layers, num_layers + p.mtp))] for p in self.plans
        ]
        emb, head = model.embed(), model.head()
        self.extra = [(emb[0] * p.first + head[0] * p.last, emb[1] * p.first + head[1] * p.last) for p in self.plans]
        self._cache: dict[tuple[int, int], ChunkTimes] = {}

    def pair(self, f_stage: int, b_stage: int) -> ChunkTimes:
        key = (f_stage, b_stage)
        if key not in self._cache:
            self._cache[key] = _chunk_times(
                tuple(self.blocks[f_stage]), tuple(self.blocks[b_stage]), self.extra[f_stage][0], self.extra[b_stage][1]
            )
        return self._cache[key]

    def alone(self, stage: int) -> ChunkTimes:
        return self.pair(stage, stage)

    def half_blocks(self, stage: int) -> float:
        """Half the blocks of ``stage``: a forward's (or a backward's) share of a micro-batch's pass."""
        return len(self.blocks[stage]) / 2


@dataclass(slots=True)
class _Tally:
    """What :func:`_durations` adds up over a schedule's compute actions."""

    durations: list[list[float]] = field(default_factory=list)
    """Per rank, each compute action's seconds."""
    exposed: float = 0.0
    """All-to-all seconds left exposed, the step's (:attr:`Prediction.exposed_a2a_fraction`)."""
    total: float = 0.0
    """All-to-all seconds, the step's."""
    flight: float = 0.0
    """All-to-all in flight and, of it, under compute (:attr:`moe.plan.pair.ChunkTimes.flight`)."""
    covered: float = 0.0
    busy: list[float] = field(default_factory=list)
    """Per rank, its compute stream's busy seconds (compute and host work, no waits)."""
    blocks: list[float] = field(default_factory=list)
    """Per rank, the blocks it runs a micro-batch through, forward and backward each counting a half."""


_Key = tuple[Op, int, int, bool]
"""A compute action as :func:`_durations` times it: its op, its stage, its backward stage (``FB``; a ``W``'s:
the stage whose weight gradient it runs), whether it defers its weight gradient."""


@functools.lru_cache(maxsize=64)
def _action_keys(schedule: Schedule) -> tuple[tuple[_Key, ...], ...]:
    """Per rank, each compute action's :data:`_Key` (once per schedule: the search times one many times)."""
    layout = schedule.layout
    out = []
    for rank, actions in enumerate(schedule.ranks):
        deferred: list[int] = []  # stages whose weight gradients an I left for a W (FIFO)
        keys = []
        for a in actions:
            if not a.op.is_compute:
                continue
            stage = layout.stage_of(rank, a.module) if a.module >= 0 else -1
            if a.op is Op.W:
                keys.append((Op.W, -1, deferred.pop(0), False))
                continue
            b_stage = layout.stage_of(rank, a.b_module) if a.op is Op.FB else -1
            if a.op is Op.I or (a.op is Op.FB and a.deferred):
                deferred.append(stage if a.op is Op.I else b_stage)
            keys.append((a.op, stage, b_stage, a.op is Op.FB and a.deferred))
        out.append(tuple(keys))
    return tuple(out)


def _action_terms(key: _Key, times: StageTimes, overlap: bool) -> tuple[float, ...]:
    """One action's (duration, exposed, total, flight, covered, busy, blocks): :class:`_Tally`'s terms."""
    op, stage, b_stage, deferred = key
    if op is Op.W:
        w = times.alone(b_stage).W
        return w, 0.0, 0.0, 0.0, 0.0, w, 0.0
    if op is Op.F:
        t = times.alone(stage)
        return t.F, t.exposed_f, t.comm_f, t.flight[0], t.covered[0], t.F - t.exposed_f, times.half_blocks(stage)
    if op in (Op.B, Op.I):  # an I: dX alone, the dW that would hide part of its transfers comes later
        t = times.alone(stage)
        full = op is Op.B
        exposed = t.exposed_b if full else t.comm_f
        busy = t.B - t.exposed_b - (0.0 if full else t.W)
        return t.B if full else t.B - t.W, exposed, t.comm_f, t.flight[1], t.covered[1], busy, times.half_blocks(stage)
    # FB; a deferred one's backward half is an I: its W comes later, its transfers count as an I's
    f, b = times.alone(stage), times.alone(b_stage)
    w = b.W if deferred else 0.0
    blocks = times.half_blocks(stage) + times.half_blocks(b_stage)
    if overlap:
        t = times.pair(stage, b_stage)
        exposed = min(t.exposed_fb + b.comm_f, f.comm_f + b.comm_f) if deferred else t.exposed_fb
        busy = t.FB - t.exposed_fb - w
        return t.FB - w, exposed, f.comm_f + b.comm_f, t.flight[2], t.covered[2], busy, blocks
    exposed = f.exposed_f + (b.comm_f if deferred else b.exposed_b)
    flight, covered = f.flight[0] + b.flight[1], f.covered[0] + b.covered[1]
    busy = f.F - f.exposed_f + b.B - b.exposed_b - w
    return f.F + b.B - w, exposed, f.comm_f + b.comm_f, flight, covered, busy, blocks


def _durations(schedule: Schedule, times: StageTimes, overlap: bool = True) -> _Tally:
    """Per rank, the duration of each compute action; and the step's all-to-all terms (:class:`_Tally`).
    Without ``overlap`` a pair runs as a lone forward, then a lone backward (``overlap=False`` in the executor).
    A ``deferred`` pair (ZB1P's) costs the pair less its backward stage's ``W`` and queues that ``W`` as an
    ``I`` does; its backward half's all-to-all counts as exposed, as an ``I``'s does (at most all of the pair's).
    Each distinct action is timed once (:func:`_action_terms`)."""
    out = _Tally()
    terms: dict[_Key, tuple[float, ...]] = {}
    for keys in _action_keys(schedule):
        mine = []
        busy = blocks = 0.0
        for key in keys:
            got = terms.get(key)
            if got is None:
                got = terms[key] = _action_terms(key, times, overlap)
            mine.append(got[0])
            out.exposed += got[1]
            out.total += got[2]
            out.flight += got[3]
            out.covered += got[4]
            busy += got[5]
            blocks += got[6]
        out.durations.append(mine)
        out.busy.append(busy)
        out.blocks.append(blocks)
    return out


@functools.lru_cache(maxsize=64)
def _schedule(name: str, pp: int, chunks: int, extra_warmup: int, overlap: bool) -> Schedule:
    """:func:`dualpipe.schedule.build_schedule`, once per shape: candidates that differ in ep, recompute, SMs or
    layout run the same schedule (a :class:`Schedule` is immutable, so they can share it)."""
    return build_schedule(name, pp, chunks, extra_warmup=extra_warmup, overlap=overlap)


class Timed(NamedTuple):
    """What timing a candidate's schedule takes (:func:`time_actions`): the schedule, its :class:`_Tally` and each
    compute action's duration (offload copies in)."""

    schedule: Schedule
    tally: _Tally
    durations: list[list[float]]


def time_actions(
    candidate: Candidate, model: CostModel, *, plans: Sequence[StagePlan], overlap: bool | None = None
) -> Timed:
    """``candidate``'s schedule and its actions timed (``overlap``: :func:`predict`'s), before any simulation:
    what :func:`busy_bound` and :func:`predict` share, so that a search bounding a candidate and then timing it
    does this once."""
    overlap = candidate.overlap if overlap is None else overlap
    schedule = _schedule(candidate.schedule, candidate.pp, candidate.num_chunks, candidate.extra_warmup, overlap)
    tally = _durations(schedule, StageTimes(model, plans), overlap)
    durations = tally.durations
    if candidate.offload:
        durations = with_copies(schedule, durations, [model.offload_seconds(r) for r in range(candidate.pp)])
    return Timed(schedule, tally, durations)


def busy_bound(
    candidate: Candidate, model: CostModel, *, plans: Sequence[StagePlan], timed: Timed | None = None
) -> float:
    """A lower bound on :func:`predict`'s step time without simulating the schedule: the busiest rank runs
    its compute actions one after another at their durations (exposed all-to-all and offload copies in; no
    wait for a pipeline message), and the cores of a machine whose ranks share them allow no less either;
    plus the data-parallel reduction. Tighter than :func:`step_bound`, dearer: the schedule is built (``timed``:
    :func:`time_actions`'s, if already at hand)."""
    _, tally, durations = timed or time_actions(candidate, model, plans=plans)
    pipeline = max(max(sum(d) for d in durations), cpu_bound(model, tally))
    return (pipeline + model.dp_reduce()) * (1 - 1e-9)  # a hair under, as step_bound


def predict(
    candidate: Candidate,
    model: CostModel,
    *,
    plans: Sequence[StagePlan],
    tokens_per_step: int,
    num_gpus: int,
    peak_flops: float,
    overlap: bool | None = None,
    timed: Timed | None = None,
) -> Prediction:
    """Time and size ``candidate`` with ``model`` (see the module docstring), its stages as ``plans`` say
    (:func:`moe.plan.params.stage_plans` of its ``pipeline_layout``); without ``overlap`` (default: the
    candidate's) each pair runs as its forward, then its backward, and the V family runs its plan unpaired.
    ``timed``: :func:`time_actions`'s result for the same ``overlap``, if already at hand."""
    schedule, tally, durations = timed or time_actions(candidate, model, plans=plans, overlap=overlap)
    exposed, total = tally.exposed, tally.total
    sim = simulate(schedule, Costs(latency=model.p2p()), durations=durations)
    cpu = cpu_bound(model, tally)
    pipeline = max(sim.makespan, cpu)
    reduce = model.dp_reduce()
    step = pipeline + reduce
    memory = model.memory()
    return Prediction(
        candidate=candidate,
        step_time=step,
        pipeline_time=pipeline,
        dp_reduce_time=reduce,
        tokens_per_s_per_gpu=tokens_per_step / step / num_gpus,
        mfu=model.model_flops() / (step * num_gpus * peak_flops),
        bubble_fraction=sim.bubble_fraction,
        exposed_a2a_fraction=exposed / total if total > 0 else 0.0,
        a2a_per_rank=total / candidate.pp,
        memory=memory,
        fits=model.fits(),
        sim=sim,
        hidden_in_flight=_hidden_in_flight(tally, sim, cpu),
        cpu_bound=cpu,
    )


def _hidden_in_flight(tally: _Tally, sim: SimResult, cpu: float) -> float:
    """The share of the all-to-all in flight that compute covers (:attr:`Prediction.hidden_in_flight`). Where
    the cores, not the critical path, set the step (``cpu`` above the makespan), the pieces already carry the
    sharing they were measured under; the time the cores add is time the ranks wait, for their peers'
    all-to-alls and for their pipeline neighbours, in the proportion the timeline waits for each."""
    flight = tally.flight
    ranks = len(tally.busy)
    extra = max(0.0, cpu - sim.makespan) * ranks
    if extra > 0 and tally.exposed + sum(sim.idle) > 0:
        flight += extra * tally.exposed / (tally.exposed + sum(sim.idle))
    return tally.covered / flight if flight > 0 else 0.0


def cpu_bound(model: CostModel, tally: _Tally) -> float:
    """The least step a machine whose ranks share its cores allows (0 where they do not: a GPU, or a costs file
    without the machine's cores): every rank's compute thread and its communication threads together use
    at most the cores there are, ``cores_per_rank`` each on average. A rank's compute thread uses
    ``cpu_share`` of a core while it is busy (as measured: under the calibration's sharing); its
    communication threads ``comm_cpu`` a block's forward and backward."""
    shared = model.shared_cores()
    if shared is None:
        return 0.0
    cores_per_rank, share, comm_cpu = shared
    demand = [busy * share + blocks * comm_cpu for busy, blocks in zip(tally.busy, tally.blocks)]
    return sum(demand) / len(demand) / cores_per_rank


def step_bound(candidate: Candidate, model: CostModel, *, plans: Sequence[StagePlan]) -> float:
    """A lower bound on :func:`predict`'s step time from compute alone, without building or simulating the
    schedule: the busiest rank's compute (each of its modules runs every micro-batch of its path forward and
    backward; a pair, an ``I`` with its ``W``, an offload copy take at least their compute on the one compute
    stream), after the forward compute of the stages before its nearest module (the first micro-batch's way
    there: the pipeline's fill), plus the data-parallel reduction. No other bubble, no exposed all-to-all, no P2P:
    a candidate whose bound exceeds a step already predicted cannot beat it."""
    layout = schedule_spec(candidate.schedule).stage_layout(candidate.pp)
    num_layers = sum(len(p.layers) for p in plans)
    (ef, eb), (hf, hb) = model.embed(), model.head()
    forward, stage = [], []
    for p in plans:
        blocks = [model.block(i) for i in (*p.layers, *range(num_layers, num_layers + p.mtp))]
        forward.append(sum(b.compute_f for b in blocks) + ef * p.first + hf * p.last)
        stage.append(forward[-1] + sum(b.compute_b for b in blocks) + eb * p.first + hb * p.last)
    per_path = candidate.num_chunks // len(layout.paths)

    def rank(r: int) -> float:
        # idle until a first micro-batch has come through the stages before one of its modules (its first compute
        # holds a forward), then busy with its own compute
        sids = [layout.stage_of(r, m) for m in range(layout.modules_per_rank)]
        return min(sum(forward[:sid]) for sid in sids) + per_path * sum(stage[sid] for sid in sids)

    # a hair under: the simulator sums the same seconds in another order, and a bound equal to the step (one
    # rank, no bubble) must not come out an ulp above it
    return (max(rank(r) for r in range(candidate.pp)) + model.dp_reduce()) * (1 - 1e-9)


def rank_predictions(predictions: Sequence[Prediction]) -> list[Prediction]:
    """Fitting candidates first, then by step time (fastest first)."""
    return sorted(predictions, key=lambda p: (not p.fits, p.step_time, p.candidate))


def seconds(t: float) -> str:
    """``t`` seconds in a readable unit (s, ms or us)."""
    if t >= 1.0:
        return f"{t:.2f} s"
    return f"{t * 1e3:.1f} ms" if t >= 1e-3 else f"{t * 1e6:.0f} us"


LOSS_CLASSES = {
    "memory": "do not fit in memory",
    "bubble": "lose mainly to the pipeline bubble",
    "comm": "lose mainly to busy time (exposed all-to-all, recompute)",
    "dp": "lose mainly to the data-parallel reduction",
    "close": "are within 0.5% of the best",
}
"""Why a candidate loses to the best, by class (:func:`loss_class`): the planner's one line per class."""


def _losses(p: Prediction, best: Prediction) -> list[tuple[float, str, str]]:
    """(seconds lost, class of :data:`LOSS_CLASSES`, words) of each way a fitting ``p`` is slower than ``best``
    by more than 0.5% of its step, largest first."""
    reasons: list[tuple[float, str, str]] = []

    def add(extra: float, kind: str, text: str) -> None:
        if extra > 0.005 * best.step_time:
            reasons.append((extra, kind, text))

    b_bubble = best.bubble_fraction * best.pipeline_time
    add(
        p.bubble_fraction * p.pipeline_time - b_bubble,
        "bubble",
        f"bubble {p.bubble_fraction:.1%} vs {best.bubble_fraction:.1%}",
    )
    add(
        p.dp_reduce_time - best.dp_reduce_time,
        "dp",
        f"dp reduction {seconds(p.dp_reduce_time)} vs {seconds(best.dp_reduce_time)}",
    )
    busy = p.pipeline_time * (1 - p.bubble_fraction) - best.pipeline_time * (1 - best.bubble_fraction)
    why = [f"all-to-all {seconds(p.a2a_per_rank)} vs {seconds(best.a2a_per_rank)} per rank"]
    if p.exposed_a2a_fraction != best.exposed_a2a_fraction:
        why.append(f"{p.exposed_a2a_fraction:.0%} vs {best.exposed_a2a_fraction:.0%} exposed")
    if p.candidate.recompute != best.candidate.recompute:
        why.append(f"recompute {p.candidate.recompute} vs {best.candidate.recompute}")
    if p.candidate.schedule == best.candidate.schedule and p.candidate.extra_warmup != best.candidate.extra_warmup:
        why.append(f"extra warm-up {p.candidate.extra_warmup} vs {best.candidate.extra_warmup}")
    if p.candidate.schedule == best.candidate.schedule and p.candidate.overlap != best.candidate.overlap:
        why.append(f"overlap {'on' if p.candidate.overlap else 'off'} vs {'on' if best.candidate.overlap else 'off'}")
    add(busy, "comm", f"busy time per rank +{seconds(busy)} ({', '.join(why)})")
    return sorted(reasons, reverse=True)


def loss_class(p: Prediction, best: Prediction) -> str:
    """The key of :data:`LOSS_CLASSES` that says why ``p`` loses to ``best``: its largest loss."""
    if not p.fits:
        return "memory"
    losses = _losses(p, best)
    return losses[0][1] if losses else "close"


def why_worse(p: Prediction, best: Prediction) -> str:
    """The main reasons ``p`` loses to ``best``, largest first, in words with numbers."""
    if not p.fits:
        return f"does not fit: {p.memory.total / 2**30:.1f} GiB per GPU"
    reasons = _losses(p, best)
    if not reasons:
        return f"step {p.step_time / best.step_time - 1:+.1%}"
    return f"step {p.step_time / best.step_time - 1:+.1%}: " + "; ".join(text for _, _, text in reasons[:2])

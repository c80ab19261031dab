"""Pipeline schedules as data.

A schedule is, per rank, a list of :class:`Action` s built by a pure function. One executor
(:mod:`dualpipe.executor`) runs any of them and one simulator (:mod:`dualpipe.simulate`) times any of them.
Adding a schedule adds a generator (written with :class:`dualpipe.authoring.Emitter`) and a registry entry,
never another execution loop.

Vocabulary
----------
- *path*: one direction of data flow through the stages. 1F1B, ZB1P and DualPipeV have one path; DualPipe
  has two (one entering at rank 0, one entering at rank N-1).
- *position*: the index of a stage along its path. A :class:`Layout` maps (path, position) to
  (rank, local module index) and back.
- *chunk*: a micro-batch, numbered from 0 per path (the reference's notation: ``F0.3`` is the forward of
  micro-batch 3 through local module 0).

Compute actions: ``F`` forward, ``B`` full backward, ``I`` backward whose weight gradients are deferred to
the weight-grad store, ``W`` one deferred weight-gradient batch, ``FB`` an overlapped forward/backward pair
(handed to ``overlapped_forward_backward`` when the stage class has it; its backward half defers its weight
gradients like ``I`` when the pair is ``deferred``: ZB1P's steady pairs). Communication actions: ``SEND_F`` /
``RECV_F`` (activations, in path direction) and ``SEND_B`` / ``RECV_B`` (gradients, against it). A run of
consecutive communication actions is one batch: the executor issues it as one group (one NCCL group on
CUDA), which is what keeps NCCL's in-order matching free of deadlock.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from dualpipe.registry import Registry

__all__ = [
    "DEFAULT_SCHEDULE",
    "SCHEDULES",
    "Action",
    "Layout",
    "Op",
    "Schedule",
    "ScheduleSpec",
    "build_schedule",
    "compute_order",
    "post_receives_early",
    "register_schedule",
    "schedule_spec",
    "unregister_schedule",
]


class Op(enum.Enum):
    F = "F"
    B = "B"
    I = "I"  # noqa: E741 (the paper's name for the input-gradient-only backward)
    W = "W"
    FB = "FB"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"

    @property
    def is_comm(self) -> bool:
        return self in _COMM_OPS

    @property
    def is_compute(self) -> bool:
        return self not in _COMM_OPS


_COMM_OPS = frozenset({Op.SEND_F, Op.RECV_F, Op.SEND_B, Op.RECV_B})


@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank.

    ``module``/``chunk`` name the local module and micro-batch (for ``FB`` they are the forward half and
    ``b_module``/``b_chunk`` the backward half; ``deferred``: that backward half is an ``I``, its weight
    gradients one deferred batch). ``peer`` is the pipeline rank of the other side of a communication action.
    ``W`` carries no operands: it pops the oldest deferred batch (FIFO).
    """

    op: Op
    module: int = -1
    chunk: int = -1
    b_module: int = -1
    b_chunk: int = -1
    peer: int = -1
    deferred: bool = False

    @property
    def b_op(self) -> Op:
        """What the backward half of an ``FB`` runs as: ``I`` when ``deferred``, else ``B``."""
        return Op.I if self.deferred else Op.B

    @property
    def defers_weights(self) -> bool:
        """The action queues one deferred weight-gradient batch (``I``, or a ``deferred`` ``FB``)."""
        return self.op is Op.I or (self.op is Op.FB and self.deferred)

    def __str__(self) -> str:
        if self.op is Op.W:
            return "W"
        if self.op is Op.FB:
            return f"(F{self.module}.{self.chunk}&{self.b_op.value}{self.b_module}.{self.b_chunk})"
        if self.op.is_comm:
            arrow = ">" if self.op.name.startswith("SEND") else "<"
            return f"{self.op.value}{self.module}.{self.chunk}{arrow}{self.peer}"
        return f"{self.op.value}{self.module}.{self.chunk}"


@dataclass(frozen=True, slots=True)
class Layout:
    """Where the stages live: ``paths[p][pos] == (rank, module)``.

    Every (rank, module) pair hosts exactly one (path, position). Consecutive positions on the same rank
    (DualPipeV's turn at the last rank) hand tensors over locally instead of through communication.
    """

    name: str
    num_ranks: int
    modules_per_rank: int
    paths: tuple[tuple[tuple[int, int], ...], ...]
    _where: dict[tuple[int, int], tuple[int, int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        where = {loc: (p, pos) for p, path in enumerate(self.paths) for pos, loc in enumerate(path)}
        expected = {(r, m) for r in range(self.num_ranks) for m in range(self.modules_per_rank)}
        if set(where) != expected or len(where) != sum(len(p) for p in self.paths):
            raise ValueError(f"layout {self.name!r} must place exactly one stage on every (rank, module)")
        object.__setattr__(self, "_where", where)

    @staticmethod
    def linear(num_ranks: int) -> Layout:
        """1F1B / ZB1P: stage r on rank r, one module per rank."""
        return Layout("linear", num_ranks, 1, (tuple((r, 0) for r in range(num_ranks)),))

    @staticmethod
    def bidirectional(num_ranks: int) -> Layout:
        """DualPipe: path 0 enters at rank 0 (module 0), path 1 enters at rank N-1 (module 1).

        Rank r holds stage r of path 0 and stage N-1-r of path 1: the same weights twice, one copy per
        direction, so mirrored gradients must be summed (:func:`dualpipe.grads.sum_mirrored_grads`).
        """
        n = num_ranks
        if n % 2 != 0:
            raise ValueError(
                f"DualPipe needs an even number of pipeline ranks (got {n}); use DualPipeV for an odd number"
            )
        down = tuple((r, 0) for r in range(n))
        up = tuple((n - 1 - s, 1) for s in range(n))
        return Layout("bidirectional", n, 2, (down, up))

    @staticmethod
    def v_shape(num_ranks: int) -> Layout:
        """DualPipeV: stage s < N on rank s (module 0), stage s >= N on rank 2N-1-s (module 1)."""
        n = num_ranks
        stages = tuple((s, 0) for s in range(n)) + tuple((2 * n - 1 - s, 1) for s in range(n, 2 * n))
        return Layout("v_shape", n, 2, (stages,))

    def locate(self, rank: int, module: int) -> tuple[int, int]:
        """(path, position) of local module ``module`` on ``rank``."""
        return self._where[(rank, module)]

    def prev(self, rank: int, module: int) -> tuple[int, int] | None:
        """(rank, module) of the stage feeding this one, or None for a first stage."""
        p, pos = self.locate(rank, module)
        return self.paths[p][pos - 1] if pos > 0 else None

    def next(self, rank: int, module: int) -> tuple[int, int] | None:
        """(rank, module) of the stage this one feeds, or None for a last stage."""
        p, pos = self.locate(rank, module)
        return self.paths[p][pos + 1] if pos + 1 < len(self.paths[p]) else None

    def is_first(self, rank: int, module: int) -> bool:
        return self.prev(rank, module) is None

    def is_last(self, rank: int, module: int) -> bool:
        return self.next(rank, module) is None

    def path_of(self, rank: int, module: int) -> int:
        return self.locate(rank, module)[0]

    def stage_of(self, rank: int, module: int) -> int:
        """The model stage local module ``module`` of ``rank`` runs: its position along its path."""
        return self.locate(rank, module)[1]

    @property
    def num_stages(self) -> int:
        """Distinct model stages (every path runs all of them, in order)."""
        return len(self.paths[0])

    @property
    def mirrored(self) -> bool:
        """Every stage is held once per path: with two paths (DualPipe) each stage's weights live twice."""
        return len(self.paths) > 1

    def mirror(self, rank: int, module: int) -> tuple[int, int] | None:
        """The other (rank, module) holding the same stage as ``(rank, module)``, or None if it is held once."""
        path, stage = self.locate(rank, module)
        others = [p[stage] for q, p in enumerate(self.paths) if q != path]
        return others[0] if others else None

    def boundary(self, rank: int, module: int, towards_next: bool) -> int:
        """The stage boundary a message of ``(rank, module)`` crosses, named by the stage before it: to or from
        the next stage (activations out, gradients in) or the previous one. Both ends compute the same."""
        stage = self.stage_of(rank, module)
        return stage if towards_next else stage - 1

    def entries(self, rank: int) -> list[int]:
        """Local modules of ``rank`` that run a first stage: where micro-batch inputs enter."""
        return [m for m in range(self.modules_per_rank) if self.is_first(rank, m)]

    def exits(self, rank: int) -> list[int]:
        """Local modules of ``rank`` that run a last stage: where the loss comes out."""
        return [m for m in range(self.modules_per_rank) if self.is_last(rank, m)]


@dataclass(frozen=True, slots=True)
class Schedule:
    """A whole step: per-rank action lists over a layout, ``chunks_per_path`` micro-batches per path."""

    name: str
    layout: Layout
    num_chunks: int
    chunks_per_path: int
    ranks: tuple[tuple[Action, ...], ...]
    extra_warmup: int = 0
    """Warm-up forwards added on every rank (:attr:`ScheduleSpec.warmup`)."""
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.ranks) != self.layout.num_ranks:
            raise ValueError("one action list per rank is required")
        # hashed once: the simulator's per-schedule caches look a schedule up every time they time it
        fields = (self.name, self.layout, self.num_chunks, self.chunks_per_path, self.ranks, self.extra_warmup)
        object.__setattr__(self, "_hash", hash(fields))

    def __hash__(self) -> int:
        return self._hash


# ---------------------------------------------------------------------------------------------------
# The registry: one spec per schedule carries everything the rest of the code asks about it.
# ---------------------------------------------------------------------------------------------------

Generator = Callable[..., list[Action]]
"""``generate(layout, rank, num_chunks) -> actions``: one rank's action list (schedules with a ``warmup`` rule
also take ``extra_warmup=``, those with ``pairs_for_overlap`` ``pairs=``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleSpec:
    """One schedule: how to generate it and every rule and fact about it the rest of the code needs.

    Derived elsewhere from this alone: the pipeline class (:data:`dualpipe.PIPELINES`), training's
    ``--schedule`` choices and checks, stage placement (:attr:`Layout.paths`), mirrored-gradient summing
    (:meth:`Layout.mirror`), the benchmarks' mode lists and the tests' parameter lists.
    """

    name: str
    """Registry key, the ``--schedule`` value (``"dualpipev"``)."""
    title: str
    """The name in messages (``"DualPipeV"``)."""
    class_name: str
    """Name of the :class:`dualpipe.Pipeline` subclass that runs it (``"DualPipeV"``)."""
    summary: str
    """One line for ``--help`` and docs."""
    generate: Generator
    layout: Callable[[int, int], Layout]
    """``layout(num_ranks, modules_per_rank) -> Layout``: where every stage lives."""
    modules_per_rank: int = 1
    """Local modules (model chunks) per rank; for ``flexible_modules`` the default."""
    flexible_modules: bool = False
    """The caller picks ``modules_per_rank >= 2`` (interleaved schedules' virtual stages)."""
    even_ranks: bool = False
    rank_hint: str = ""
    """What to do instead when ``even_ranks`` is not met."""
    chunks_per_rank: int = 0
    """``num_chunks >= chunks_per_rank * ranks`` (0: at least one micro-batch)."""
    even_chunks: bool = False
    """``num_chunks`` must be even (DualPipe feeds half of them at each end)."""
    chunks_multiple_of_ranks: bool = False
    """``num_chunks`` must be a multiple of the rank count (micro-batches in groups of pp)."""
    chunk_hint: str = ""
    overlaps: bool = False
    """The schedule emits overlapped forward/backward pairs (``FB``) for ``overlapped_forward_backward``."""
    pairs_for_overlap: bool = False
    """Its pairs are made only to be overlapped, and its generator takes ``pairs=False`` (what
    :func:`build_schedule` passes without overlap): its order without them, where run one half after the other
    they would only hold sends back (the V family, whose pairs fold passes its plan keeps apart; DualPipe's and
    the 1F1B family's pairs are their order)."""
    warmup: Callable[[int, int, int], int] | None = None
    """``warmup(num_ranks, modules_per_rank, rank)``: forwards a rank runs before its first backward (before
    the batch bounds them). Set for the 1F1B family, whose generators then take ``extra_warmup=k``: ``k``
    more warm-up forwards on every rank (Kimi K2's extra warm-up micro-batches, Megatron-Core's one extra
    for its combined 1F1B), so that a steady step's forward and backward are of different micro-batches."""

    def resolve_modules(self, modules_per_rank: int | None = None) -> int:
        """Local modules per rank: ``modules_per_rank`` if this schedule lets the caller choose, else its own."""
        if modules_per_rank is None or modules_per_rank == self.modules_per_rank:
            return self.modules_per_rank
        if not self.flexible_modules:
            raise ValueError(f"{self.title} takes {self.modules_per_rank} module(s) per rank, got {modules_per_rank}")
        if modules_per_rank < 2:
            raise ValueError(f"{self.title} takes at least 2 modules per rank, got {modules_per_rank}")
        return modules_per_rank

    def check_ranks(self, num_ranks: int) -> None:
        if num_ranks < 1:
            raise ValueError(f"need at least one pipeline rank (got {num_ranks})")
        if self.even_ranks and num_ranks % 2 != 0:
            hint = f"; {self.rank_hint}" if self.rank_hint else ""
            raise ValueError(f"{self.title} needs an even number of pipeline ranks (got {num_ranks}){hint}")

    def min_chunks(self, num_ranks: int) -> int:
        lowest = max(1, self.chunks_per_rank * num_ranks)
        if self.chunks_multiple_of_ranks:
            lowest = -(-lowest // num_ranks) * num_ranks
        return lowest + (lowest % 2 if self.even_chunks else 0)

    def default_chunks(self, num_ranks: int) -> int:
        """The fewest micro-batches this schedule accepts that also fill a DualPipe(V) (``2 x ranks``)."""
        n = max(2 * num_ranks, 2, self.min_chunks(num_ranks))
        while not self._chunks_ok(num_ranks, n):
            n += 1
        return n

    def _chunks_ok(self, num_ranks: int, num_chunks: int) -> bool:
        return (
            num_chunks >= self.min_chunks(num_ranks)
            and not (self.even_chunks and num_chunks % 2)
            and not (self.chunks_multiple_of_ranks and num_chunks % num_ranks)
        )

    def validate(
        self, num_ranks: int, num_chunks: int, modules_per_rank: int | None = None, extra_warmup: int = 0
    ) -> None:
        """Raise ``ValueError`` (saying what to change) unless this schedule runs on these numbers."""
        self.check_ranks(num_ranks)
        modules = self.resolve_modules(modules_per_rank)
        if self._chunks_ok(num_ranks, num_chunks):
            self._check_extra_warmup(num_ranks, num_chunks, modules, extra_warmup)
            return
        if not self.chunks_per_rank and not self.even_chunks and not self.chunks_multiple_of_ranks:
            raise ValueError(f"num_chunks must be >= 1 (got {num_chunks})")
        rule = "an even num_chunks" if self.even_chunks else "num_chunks"
        bounds = []
        if self.chunks_per_rank:
            bounds.append(f">= {self.chunks_per_rank} * ranks = {self.chunks_per_rank * num_ranks}")
        if self.chunks_multiple_of_ranks:
            bounds.append(f"a multiple of ranks = {num_ranks}")
        hint = f"; {self.chunk_hint}" if self.chunk_hint else ""
        raise ValueError(f"{self.title} needs {rule} {' and '.join(bounds)} (got {num_chunks}){hint}")

    def _check_extra_warmup(self, num_ranks: int, num_chunks: int, modules: int, extra: int) -> None:
        """The extra warm-up must leave rank 0 (the longest warm-up) at least one steady forward/backward step."""
        if extra == 0:
            return
        if extra < 0:
            raise ValueError(f"extra_warmup must be >= 0 (got {extra})")
        if self.warmup is None:
            takes = [s.name for s in SCHEDULES.values() if s.warmup is not None]
            raise ValueError(f"{self.title} takes no extra warm-up (extra_warmup applies to {', '.join(takes)})")
        forwards = self.warmup(num_ranks, modules, 0) + extra
        if forwards < num_chunks * modules:
            return
        enough = num_chunks + 1
        while forwards >= enough * modules or not self._chunks_ok(num_ranks, enough):
            enough += 1
        raise ValueError(
            f"extra_warmup={extra}: {self.title}'s rank 0 would run all {num_chunks * modules} of its forwards in "
            f"the warm-up ({forwards}), leaving no steady step to pair; use num_chunks >= {enough} or a smaller "
            "extra_warmup"
        )

    def stage_layout(self, num_ranks: int, modules_per_rank: int | None = None) -> Layout:
        """Where the stages live at ``num_ranks`` pipeline ranks (validated)."""
        self.check_ranks(num_ranks)
        return self.layout(num_ranks, self.resolve_modules(modules_per_rank))


SCHEDULES: Registry[ScheduleSpec] = Registry("schedule")
"""Every schedule by name. Built-in ones register in :mod:`dualpipe.generators`, which the package imports
first (generators import this module, never the other way)."""

DEFAULT_SCHEDULE = "dualpipev"
"""What the trainer, the layout and the simulator run unless told otherwise: the product's schedule."""


def register_schedule(spec: ScheduleSpec) -> ScheduleSpec:
    """Add ``spec`` to :data:`SCHEDULES`; the executor, trainer, benchmarks and tests pick it up from there."""
    return SCHEDULES.register(spec)


def unregister_schedule(name: str) -> ScheduleSpec:
    """Remove a schedule (tests that register their own), and every schedule built from it."""
    build_schedule.cache_clear()
    return SCHEDULES.unregister(name)


def schedule_spec(name: str) -> ScheduleSpec:
    """The spec of ``name``; an unknown name is a ``ValueError`` listing the registered ones."""
    return SCHEDULES.lookup(name)


@functools.lru_cache(maxsize=256)
def build_schedule(
    name: str,
    num_ranks: int,
    num_chunks: int,
    early_receives: bool = False,
    modules_per_rank: int | None = None,
    extra_warmup: int = 0,
    overlap: bool = True,
) -> Schedule:
    """Per-rank action lists of schedule ``name`` for ``num_ranks`` pipeline ranks and ``num_chunks``
    micro-batches in total (``modules_per_rank`` only for schedules that let the caller choose it,
    ``extra_warmup`` only for those with a warm-up rule: :attr:`ScheduleSpec.warmup`), as run with or
    without ``overlap``: without, a schedule whose pairs exist only to be overlapped
    (:attr:`ScheduleSpec.pairs_for_overlap`) leaves its passes unpaired; the others' pairs stay, run one half
    after the other.

    With ``early_receives`` every receive is moved in front of the compute action that precedes its
    consumer (see :func:`post_receives_early`), so the transfer overlaps that compute.
    """
    spec = schedule_spec(name)
    spec.validate(num_ranks, num_chunks, modules_per_rank, extra_warmup)  # ranks and modules included
    layout = spec.layout(num_ranks, spec.resolve_modules(modules_per_rank))
    extra: dict[str, int | bool] = {"extra_warmup": extra_warmup} if extra_warmup else {}
    if spec.pairs_for_overlap and not overlap:
        extra["pairs"] = False
    ranks = []
    for rank in range(num_ranks):
        actions = spec.generate(layout, rank, num_chunks, **extra)
        if early_receives:
            actions = post_receives_early(actions)
        ranks.append(tuple(actions))
    return Schedule(name, layout, num_chunks, num_chunks // len(layout.paths), tuple(ranks), extra_warmup)


def post_receives_early(actions: Sequence[Action]) -> list[Action]:
    """Move every receive one compute action earlier, into the communication batch before it.

    The reference posts a receive just before the compute that consumes it, so the transfer cannot overlap
    anything on the receiving side. Posting it one compute earlier lets the previous compute hide it.
    Sends stay right after the compute that produces them.
    """
    blocks: list[list[Action]] = [[]]  # blocks[i]: comm actions before compute i
    computes: list[Action] = []
    for a in actions:
        if a.op.is_comm:
            blocks[-1].append(a)
        else:
            computes.append(a)
            blocks.append([])
    moved: list[list[Action]] = [[a for a in blk if not a.op.name.startswith("RECV")] for blk in blocks]
    for i, blk in enumerate(blocks):
        recvs = [a for a in blk if a.op.name.startswith("RECV")]
        moved[max(i - 1, 0)].extend(recvs)
    out: list[Action] = []
    for i, c in enumerate(computes):
        out.extend(moved[i])
        out.append(c)
    out.extend(moved[len(computes)])
    return out


def compute_order(actions: Iterable[Action]) -> list[str]:
    """The compute actions of one rank in the reference fixtures' notation (communication dropped)."""
    return [str(a) for a in actions if a.op.is_compute]

"""Pipeline schedules as data.

A schedule is, per rank, a list of :class:`Action` s built by a pure function. One executor
(:mod:`dualpipe.executor`) runs any of them and one simulator (:mod:`dualpipe.simulate`) times any of them.
Adding a schedule adds a generator here, never another execution loop.

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
(handed to ``overlapped_forward_backward`` when the stage class has it). Communication actions: ``SEND_F`` /
``RECV_F`` (activations, in path direction) and ``SEND_B`` / ``RECV_B`` (gradients, against it). A run of
consecutive communication actions is one batch: the executor issues it as one group (one NCCL group on
CUDA), which is what keeps NCCL's in-order matching free of deadlock.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "SCHEDULES",
    "Action",
    "Layout",
    "Op",
    "Schedule",
    "build_schedule",
    "compute_order",
    "post_receives_early",
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
    ``b_module``/``b_chunk`` the backward half). ``peer`` is the pipeline rank of the other side of a
    communication action. ``W`` carries no operands: it pops the oldest deferred batch (FIFO).
    """

    op: Op
    module: int = -1
    chunk: int = -1
    b_module: int = -1
    b_chunk: int = -1
    peer: int = -1

    def __str__(self) -> str:
        if self.op is Op.W:
            return "W"
        if self.op is Op.FB:
            return f"(F{self.module}.{self.chunk}&B{self.b_module}.{self.b_chunk})"
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


@dataclass(frozen=True, slots=True)
class Schedule:
    """A whole step: per-rank action lists over a layout, ``chunks_per_path`` micro-batches per path."""

    name: str
    layout: Layout
    num_chunks: int
    chunks_per_path: int
    ranks: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        if len(self.ranks) != self.layout.num_ranks:
            raise ValueError("one action list per rank is required")


class _Emitter:
    """Emits one rank's actions while tracking per-module counters the way the reference does.

    The helper names mirror the reference's methods (``forward_chunk``, ``backward_chunk``, ...), so a
    generator reads like the paper's pseudo-code; every call appends data, nothing runs.
    """

    def __init__(self, layout: Layout, rank: int) -> None:
        self.layout = layout
        self.rank = rank
        m = layout.modules_per_rank
        self.actions: list[Action] = []
        self._f = [0] * m
        self._b = [0] * m
        self._send_f = [0] * m
        self._send_b = [0] * m
        self._recv_f = [0] * m
        self._recv_b = [0] * m

    # -- communication ------------------------------------------------------------------------------
    def _remote(self, loc: tuple[int, int] | None) -> int | None:
        if loc is None or loc[0] == self.rank:
            return None  # no neighbour, or a local hand-over (DualPipeV's turn)
        return loc[0]

    def _comm(self, op: Op, m: int, neighbour: tuple[int, int] | None, counter: list[int]) -> None:
        peer = self._remote(neighbour)
        if peer is not None:
            self.actions.append(Action(op, m, counter[m], peer=peer))
            counter[m] += 1

    def recv_forward(self, m: int) -> None:
        self._comm(Op.RECV_F, m, self.layout.prev(self.rank, m), self._recv_f)

    def send_forward(self, m: int) -> None:
        self._comm(Op.SEND_F, m, self.layout.next(self.rank, m), self._send_f)

    def recv_backward(self, m: int) -> None:
        self._comm(Op.RECV_B, m, self.layout.next(self.rank, m), self._recv_b)

    def send_backward(self, m: int) -> None:
        self._comm(Op.SEND_B, m, self.layout.prev(self.rank, m), self._send_b)

    # -- compute ------------------------------------------------------------------------------------
    def forward(self, m: int) -> None:
        self.actions.append(Action(Op.F, m, self._f[m]))
        self._f[m] += 1

    def backward(self, m: int, defer_weights: bool = False) -> None:
        self.actions.append(Action(Op.I if defer_weights else Op.B, m, self._b[m]))
        self._b[m] += 1

    def forward_backward(self, m_f: int, m_b: int) -> None:
        self.actions.append(Action(Op.FB, m_f, self._f[m_f], b_module=m_b, b_chunk=self._b[m_b]))
        self._f[m_f] += 1
        self._b[m_b] += 1

    def weight(self) -> None:
        self.actions.append(Action(Op.W))

    # -- the reference's composite steps ------------------------------------------------------------
    def forward_chunk(self, m: int, recv: bool = True, send: bool = True) -> None:
        if recv:
            self.recv_forward(m)
        self.forward(m)
        if send:
            self.send_forward(m)

    def backward_chunk(self, m: int, defer_weights: bool = False, recv: bool = True, send: bool = True) -> None:
        if recv:
            self.recv_backward(m)
        self.backward(m, defer_weights)
        if send:
            self.send_backward(m)

    def forward_backward_chunk(self, m_f: int, m_b: int, recv_f: bool = True) -> None:
        if recv_f:
            self.recv_forward(m_f)
        self.recv_backward(m_b)
        self.forward_backward(m_f, m_b)
        self.send_forward(m_f)
        self.send_backward(m_b)


# ---------------------------------------------------------------------------------------------------
# Generators. Each returns one rank's action list; ``build_schedule`` validates input and assembles.
# ---------------------------------------------------------------------------------------------------


def _dual_phases(e: _Emitter, n: int, r: int, c: int, turning: bool, module: Callable[[int], int]) -> None:
    """The eight phases shared by DualPipe and DualPipeV.

    ``n`` ranks per half (DualPipe: N/2; DualPipeV: N), ``r`` this rank's index within its half, ``c``
    chunks per direction (DualPipe: chunks/2; DualPipeV: chunks), ``turning``: this rank is where the two
    directions meet (DualPipe's middle ranks, DualPipeV's last rank). ``module(phase)`` maps the schedule's
    phase (0 = the direction this half sees first) to the local module index.
    """
    m0, m1 = module(0), module(1)

    # step 1: nF0
    for _ in range((n - r - 1) * 2):
        e.forward_chunk(m0)

    # step 2: nF0F1
    step_2 = r + 1
    e.recv_forward(m0)
    for i in range(step_2):
        e.forward_chunk(m0, recv=False, send=turning)
        e.recv_forward(m0)
        e.forward_chunk(m1, send=(not turning) or (i < step_2 - 1))
        if not turning:
            e.send_forward(m0)

    # step 3: nB1W1F1 (zero bubble: weight gradients deferred, run one W per B)
    for _ in range(n - r - 1):
        e.backward_chunk(m1, defer_weights=True)
        e.recv_forward(m1)
        e.weight()
        e.forward_chunk(m1, recv=False)

    # step 4 (main): nF0B1F1B0
    for i in range(c - 2 * n + r + 1):
        if i == 0 and turning:
            # Not overlapped: running this forward alone lets its output leave one chunk earlier.
            e.forward_chunk(m0, recv=False, send=False)
            e.send_forward(m1)
            e.backward_chunk(m1, send=False)
            e.send_forward(m0)
            e.send_backward(m1)
        else:
            e.forward_backward_chunk(m0, m1, recv_f=i != 0)
        e.forward_backward_chunk(m1, m0)

    # step 5: nB1F1B0
    for _ in range(n - r - 1):
        e.backward_chunk(m1)
        e.forward_backward_chunk(m1, m0)

    # step 6: nB1B0 (the second half of these backwards defer their weight gradients)
    step_6 = r + 1
    defer = False
    for i in range(step_6):
        if i == step_6 // 2 and r % 2 == 1:
            defer = True
        e.backward_chunk(m1, defer_weights=defer)
        if i == step_6 // 2 and r % 2 == 0:
            defer = True
        e.backward_chunk(m0, defer_weights=defer)

    # step 7: nWB0 (zero bubble)
    for _ in range(n - r - 1):
        e.weight()
        e.backward_chunk(m0, defer_weights=True)

    # step 8: nW
    for _ in range(r + 1):
        e.weight()


def _dualpipe(layout: Layout, rank: int, num_chunks: int) -> list[Action]:
    n = layout.num_ranks
    second_half = rank >= n // 2
    e = _Emitter(layout, rank)
    turning = rank in (n // 2 - 1, n // 2)
    # For the second half the direction seen first is path 1 (module 1): phase ^ second_half.
    _dual_phases(e, n // 2, min(rank, n - 1 - rank), num_chunks // 2, turning, lambda ph: ph ^ second_half)
    return e.actions


def _dualpipev(layout: Layout, rank: int, num_chunks: int) -> list[Action]:
    n = layout.num_ranks
    e = _Emitter(layout, rank)
    _dual_phases(e, n, rank, num_chunks, rank == n - 1, lambda ph: ph)
    return e.actions


def _one_f_one_b(layout: Layout, rank: int, num_chunks: int) -> list[Action]:
    """Classic 1F1B: N-1-r warm-up forwards, steady forward/backward pairs, cool-down backwards."""
    n = layout.num_ranks
    e = _Emitter(layout, rank)
    warmup = min(n - 1 - rank, num_chunks)
    for _ in range(warmup):
        e.forward_chunk(0)
    for _ in range(num_chunks - warmup):
        e.forward_chunk(0)
        e.backward_chunk(0)
    for _ in range(warmup):
        e.backward_chunk(0)
    return e.actions


def _zb1p(layout: Layout, rank: int, num_chunks: int) -> list[Action]:
    """ZB-H1 (zero bubble, 1F1B memory): backward split into I (input grad) and W (weight grad).

    Same F/I order as 1F1B, so the same activation memory. Rank r keeps r weight-gradient batches pending
    and runs one W after each further I; the last r+1 W run at the end. The chain of input gradients down
    the pipeline (I only, no W) then reaches rank 0 sooner, and each rank's cool-down wait is filled by
    the W it deferred: bubble (N-1)(F+B-2W) instead of 1F1B's (N-1)(F+B) when F = I = W (the
    zero-bubble paper's ZB-H1 costs; see dualpipe.simulate). Deferring on the *later* ranks is what
    works: rank 0 finishes its last I last, so it must not be left with more than one W after it.
    """
    n = layout.num_ranks
    e = _Emitter(layout, rank)
    warmup = min(n - 1 - rank, num_chunks)
    lag = rank
    pending = 0
    for _ in range(warmup):
        e.forward_chunk(0)
    for _ in range(num_chunks - warmup):
        e.forward_chunk(0)
        e.backward_chunk(0, defer_weights=True)
        pending += 1
        if pending > lag:
            e.weight()
            pending -= 1
    for _ in range(warmup):
        e.backward_chunk(0, defer_weights=True)
        pending += 1
        if pending > lag:
            e.weight()
            pending -= 1
    for _ in range(pending):
        e.weight()
    return e.actions


@dataclass(frozen=True, slots=True)
class _Spec:
    layout: Callable[[int], Layout]
    generate: Callable[[Layout, int, int], list[Action]]
    validate: Callable[[int, int], None]
    chunks_per_path: Callable[[int], int]


def _check_dualpipe(num_ranks: int, num_chunks: int) -> None:
    if num_ranks % 2 != 0:
        raise ValueError(
            f"DualPipe needs an even number of pipeline ranks (got {num_ranks}); "
            "use DualPipeV for an odd number of ranks"
        )
    if num_chunks % 2 != 0 or num_chunks < 2 * num_ranks:
        raise ValueError(
            f"DualPipe needs an even num_chunks >= 2 * ranks = {2 * num_ranks} (got {num_chunks}); "
            f"half of the micro-batches enter at each end"
        )


def _check_dualpipev(num_ranks: int, num_chunks: int) -> None:
    if num_chunks < 2 * num_ranks:
        raise ValueError(f"DualPipeV needs num_chunks >= 2 * ranks = {2 * num_ranks} (got {num_chunks})")


def _check_linear(num_ranks: int, num_chunks: int) -> None:
    if num_chunks < 1:
        raise ValueError(f"num_chunks must be >= 1 (got {num_chunks})")


SCHEDULES: dict[str, _Spec] = {
    "dualpipe": _Spec(Layout.bidirectional, _dualpipe, _check_dualpipe, lambda c: c // 2),
    "dualpipev": _Spec(Layout.v_shape, _dualpipev, _check_dualpipev, lambda c: c),
    "1f1b": _Spec(Layout.linear, _one_f_one_b, _check_linear, lambda c: c),
    "zb1p": _Spec(Layout.linear, _zb1p, _check_linear, lambda c: c),
}


@functools.lru_cache(maxsize=256)
def build_schedule(name: str, num_ranks: int, num_chunks: int, early_receives: bool = False) -> Schedule:
    """Per-rank action lists of schedule ``name`` for ``num_ranks`` pipeline ranks and ``num_chunks``
    micro-batches in total.

    With ``early_receives`` every receive is moved in front of the compute action that precedes its
    consumer (see :func:`post_receives_early`), so the transfer overlaps that compute.
    """
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}")
    if num_ranks < 1:
        raise ValueError(f"need at least one pipeline rank (got {num_ranks})")
    spec = SCHEDULES[name]
    spec.validate(num_ranks, num_chunks)
    layout = spec.layout(num_ranks)
    ranks = []
    for rank in range(num_ranks):
        actions = spec.generate(layout, rank, num_chunks)
        if early_receives:
            actions = post_receives_early(actions)
        ranks.append(tuple(actions))
    return Schedule(name, layout, num_chunks, spec.chunks_per_path(num_chunks), tuple(ranks))


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

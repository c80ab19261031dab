"""The built-in schedules: one generator each, plus its registry entry.

A generator is a pure function ``(layout, rank, num_chunks) -> [Action]`` written with
:class:`dualpipe.authoring.Emitter`'s helpers, so it reads like the paper's pseudo-code. Adding a schedule is a
generator here plus a :func:`~dualpipe.schedule.register_schedule` call; everything else (the pipeline class,
training's ``--schedule`` choices and checks, stage placement, the benchmarks, the tests' parameter lists)
reads the registry.
"""

from __future__ import annotations

from collections.abc import Callable

from dualpipe.authoring import Emitter
from dualpipe.schedule import Action, Layout, ScheduleSpec, register_schedule

__all__: list[str] = []  # nothing to import from here: use dualpipe.schedule.SCHEDULES / build_schedule


def _dual_phases(e: Emitter, n: int, r: int, c: int, turning: bool, module: Callable[[int], int]) -> None:
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
    e = Emitter(layout, rank)
    turning = rank in (n // 2 - 1, n // 2)
    # For the second half the direction seen first is path 1 (module 1): phase ^ second_half.
    _dual_phases(e, n // 2, min(rank, n - 1 - rank), num_chunks // 2, turning, lambda ph: ph ^ second_half)
    return e.actions


def _dualpipev(layout: Layout, rank: int, num_chunks: int) -> list[Action]:
    n = layout.num_ranks
    e = Emitter(layout, rank)
    _dual_phases(e, n, rank, num_chunks, rank == n - 1, lambda ph: ph)
    return e.actions


def _linear_warmup(num_ranks: int, modules_per_rank: int, rank: int) -> int:
    """1F1B / ZB1P: N-1-r forwards before the first backward."""
    return num_ranks - 1 - rank


def _one_f_one_b(layout: Layout, rank: int, num_chunks: int, extra_warmup: int = 0) -> list[Action]:
    """Classic 1F1B: N-1-r warm-up forwards (``extra_warmup`` more), steady forward/backward steps, cool-down
    backwards.

    Overlapped pairs: only the last rank's steady steps, and only with an extra warm-up (without one, each of
    its steps is the forward and backward of one micro-batch, the backward starting from that forward's loss).
    Another rank's pair would send its forward's output only when the pair ends, after the backward; the next
    rank needs that output one step later for the step whose input gradient this rank's next backward waits
    for, so each step would wait for the one before on the neighbour: the steady step would take two pairs'
    time. Interleaved 1F1B's warm-up (two more forwards per rank upstream) leaves that step of slack.
    """
    n = layout.num_ranks
    e = Emitter(layout, rank)
    warmup = min(_linear_warmup(n, 1, rank) + extra_warmup, num_chunks)
    last = layout.is_last(rank, 0)
    for _ in range(warmup):
        e.forward_chunk(0)
    for _ in range(num_chunks - warmup):
        if last and e.pairable(0, 0):
            e.forward_backward_chunk(0, 0)  # step (main): nF&B
        else:
            e.forward_chunk(0)
            e.backward_chunk(0)
    for _ in range(warmup):
        e.backward_chunk(0)
    return e.actions


def _zb1p(layout: Layout, rank: int, num_chunks: int, extra_warmup: int = 0) -> list[Action]:
    """ZB-H1 (zero bubble, 1F1B memory): backward split into I (input grad) and W (weight grad).

    Same F/I order as 1F1B, so the same activation memory. Rank r keeps r weight-gradient batches pending
    and runs one W after each further I; the last r+1 W run at the end. The chain of input gradients down
    the pipeline (I only, no W) then reaches rank 0 sooner, and each rank's cool-down wait is filled by
    the W it deferred: bubble (N-1)(F+B-2W) instead of 1F1B's (N-1)(F+B) when F = I = W (the
    zero-bubble paper's ZB-H1 costs; see dualpipe.simulate). Deferring on the *later* ranks is what
    works: rank 0 finishes its last I last, so it must not be left with more than one W after it.
    Overlapped pairs as 1F1B's (the last rank's steady steps, given an extra warm-up); a pair's backward
    half defers its weight gradients like the I it replaces.
    """
    n = layout.num_ranks
    e = Emitter(layout, rank)
    warmup = min(_linear_warmup(n, 1, rank) + extra_warmup, num_chunks)
    last = layout.is_last(rank, 0)
    lag = rank
    pending = 0
    for _ in range(warmup):
        e.forward_chunk(0)
    for _ in range(num_chunks - warmup):
        if last and e.pairable(0, 0):
            e.forward_backward_chunk(0, 0, defer_weights=True)  # step (main): nF&IW
        else:
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


def _interleaved_layout(num_ranks: int, modules_per_rank: int) -> Layout:
    """Virtual pipeline stages: stage s on rank s % N as local module s // N (one path, v loops over ranks)."""
    n, v = num_ranks, modules_per_rank
    return Layout("interleaved", n, v, (tuple((s % n, s // n) for s in range(n * v)),))


def _interleaved_warmup(num_ranks: int, modules_per_rank: int, rank: int) -> int:
    """Megatron's interleaved warm-up: 2(N-1-r) + (v-1)N forwards."""
    return 2 * (num_ranks - 1 - rank) + (modules_per_rank - 1) * num_ranks


def _interleaved_1f1b(layout: Layout, rank: int, num_chunks: int, extra_warmup: int = 0) -> list[Action]:
    """Interleaved 1F1B (Megatron's virtual pipeline stages): ``v`` modules per rank, micro-batches in groups
    of N.

    The rank runs ``num_chunks * v`` module-chunks. The k-th forward goes to module ``(k // N) % v``, the k-th
    backward to module ``v - 1 - (k // N) % v``: N micro-batches pass through one module before the rank
    turns to its next module. Warm-up is ``2(N-1-r) + (v-1)N`` forwards (``extra_warmup`` more; all of them
    when that is more); then one forward, one backward; then the remaining backwards. Bubble
    ``(N-1)(F+B)/v`` in full-stage costs (see :mod:`dualpipe.simulate`).

    Every steady step is one overlapped pair (``FB``) but where its forward and backward are of the same
    micro-batch through the last stage (the backward starts from that forward's loss): the last rank's first
    N steps of every N*v without extra warm-up, none with one (Megatron-Core's combined 1F1B adds that one).
    The step's sends leave after both halves either way, so pairing moves no message.
    """
    n, v = layout.num_ranks, layout.modules_per_rank
    total = num_chunks * v

    def f_module(k: int) -> int:
        return (k // n) % v

    def b_module(k: int) -> int:
        return v - 1 - (k // n) % v

    e = Emitter(layout, rank)
    warmup = min(_interleaved_warmup(n, v, rank) + extra_warmup, total)
    steady = total - warmup
    # Each step's sends and the next step's receives form one batch, as Megatron's combined send-and-receive
    # calls do: issued one by one, NCCL's in-order matching deadlocks (dualpipe.checks' "grouped" model).
    e.recv_forward(f_module(0))
    for k in range(warmup):  # nF: warm-up
        e.forward_chunk(f_module(k), recv=False)
        if k + 1 < total:
            e.recv_forward(f_module(k + 1))
    if steady:
        e.recv_backward(b_module(0))
    for k in range(steady):  # nF&B: steady 1F1B
        m_f, m_b = f_module(warmup + k), b_module(k)
        if e.pairable(m_f, m_b):
            e.forward_backward(m_f, m_b)
        else:
            e.forward(m_f)
            e.backward(m_b)
        e.send_forward(f_module(warmup + k))
        e.send_backward(b_module(k))
        if warmup + k + 1 < total:
            e.recv_forward(f_module(warmup + k + 1))
        e.recv_backward(b_module(k + 1))
    for k in range(steady, total):  # nB: cool-down
        if k == 0:
            e.recv_backward(b_module(0))
        e.backward_chunk(b_module(k), recv=False)
        if k + 1 < total:
            e.recv_backward(b_module(k + 1))
    return e.actions


def _fixed(layout: Callable[[int], Layout]) -> Callable[[int, int], Layout]:
    return lambda num_ranks, modules_per_rank: layout(num_ranks)


register_schedule(
    ScheduleSpec(
        name="dualpipe",
        title="DualPipe",
        class_name="DualPipe",
        summary="bidirectional DualPipe: every stage twice (one copy per direction), half the batch at each end",
        generate=_dualpipe,
        layout=_fixed(Layout.bidirectional),
        modules_per_rank=2,
        even_ranks=True,
        rank_hint="use DualPipeV for an odd number of ranks",
        chunks_per_rank=2,
        even_chunks=True,
        chunk_hint="half of the micro-batches enter at each end",
        overlaps=True,
    )
)
register_schedule(
    ScheduleSpec(
        name="dualpipev",
        title="DualPipeV",
        class_name="DualPipeV",
        summary="V-shaped DualPipe: stages r and 2N-1-r on rank r, inputs and loss at rank 0",
        generate=_dualpipev,
        layout=_fixed(Layout.v_shape),
        modules_per_rank=2,
        chunks_per_rank=2,
        overlaps=True,
    )
)
register_schedule(
    ScheduleSpec(
        name="1f1b",
        title="1F1B",
        class_name="OneFOneB",
        summary="classic 1F1B: stage r on rank r",
        generate=_one_f_one_b,
        layout=_fixed(Layout.linear),
        overlaps=True,
        warmup=_linear_warmup,
    )
)
register_schedule(
    ScheduleSpec(
        name="zb1p",
        title="ZB1P",
        class_name="ZeroBubble1P",
        summary="ZB-H1: 1F1B order with weight gradients deferred into the cool-down bubbles",
        generate=_zb1p,
        layout=_fixed(Layout.linear),
        overlaps=True,
        warmup=_linear_warmup,
    )
)
register_schedule(
    ScheduleSpec(
        name="interleaved-1f1b",
        title="interleaved 1F1B",
        class_name="InterleavedOneFOneB",
        summary="interleaved 1F1B: v virtual stages per rank (stage s on rank s % N), micro-batches in groups of N",
        generate=_interleaved_1f1b,
        layout=_interleaved_layout,
        modules_per_rank=2,
        flexible_modules=True,
        chunks_multiple_of_ranks=True,
        chunk_hint="micro-batches go through each rank's modules in groups of ranks",
        overlaps=True,
        warmup=_interleaved_warmup,
    )
)

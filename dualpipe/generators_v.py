"""The zero-bubble V family: ``zbv``, ``v-half`` and ``v-min``, one generator and one registry entry each.

All three run on the V layout (:meth:`~dualpipe.schedule.Layout.v_shape`: rank r holds stage r and stage
2N-1-r, so a micro-batch passes every rank once on its way down and once on its way back, and inputs and
loss are at rank 0), split every backward into ``I`` (input gradient) and a deferred ``W`` (weight gradient),
and differ in the activation memory a rank may hold (Qi et al., "Zero Bubble Pipeline Parallelism", ZB-V;
"Pipeline Parallelism with Controllable Memory", 2024, V-Half and V-Min). With ``F = I = W`` per module
pass, N ranks and m micro-batches, in full-rank micro-batches (a module holds half of a rank's layers)::

    schedule   peak activations per rank        bubble (idle / step)
    zbv        N, as 1F1B                       (N-1) / (N-1 + 6m): only the first forward's fill
    v-half     at most N/2 + 1                  about 2N passes' time per rank (no closed form)
    v-min      at most ceil((N+4)/3), ~N/3      about 4N passes' time per rank

All three are planned for the whole pipeline at once in unit slots (one per module pass, the papers'
``F = I = W``); each rank's order is then emitted with its communication (:func:`_emit`). The executor and
the simulator run that order as early as inputs allow ("squeezing"), so only the order is the schedule:

- ``zbv`` (:func:`_list_schedule`): greedy list scheduling. In every slot each rank runs, of the passes it
  can, the first by (``I`` before ``F`` before ``W``; oldest micro-batch; second leg first). A forward runs
  only while the rank holds fewer than 2N live modules, one of them always left to the second leg (so the
  oldest micro-batch can always turn). ``W`` fills the waits, and goes first once 3N-2 of them are queued:
  the queue the cool-down needs, and no more (the weight-gradient inputs a ``W`` keeps are memory too).
- ``v-half`` / ``v-min`` (:func:`_block_schedule`): the controllable-memory building block. One
  micro-batch's four passes on every rank are laid out once (:func:`_v_block`) and repeated every 6 slots;
  the ``W`` s take the two free slots of each period. How long the block keeps a micro-batch on a rank
  fixes the memory. Then the warm-up and the cool-down are compacted greedily, memory-limited: each of their
  passes moves to the earliest free slot its inputs allow, a forward only where the rank stays within the
  block's own peak. The steady phase keeps the block's slots.

Overlapped pairs (``FB``, for ``overlapped_forward_backward``; :func:`_pair`). The rule: on a rank, a
forward and the input gradient next to it in the rank's order (``W`` s between them skipped), of two
micro-batches, become one pair whenever both inputs are there when the first starts and the whole step, run
in unit slots with the pair costing ``F + B`` (its backward is a full ``B``: one ``W`` fewer) and its sends
leaving only when it ends, still ends by the unpaired plan's last slot (and is back on the unpaired run's
track within ``_REJOIN`` slots a rank, which bounds the planning time). Every such pair is made, greedily, in
the order the unpaired plan starts them. The slack that pays for them is the ``W`` s': a consumer the pair
delays runs weight gradients meanwhile, so the plan is timed twice, with the ``W`` s where the planner put
them and with the ``W`` s filling each rank's waits (a ``W`` first once the rank queues as many as the
unpaired plan's peak, so the weight-gradient inputs held never grow), and the one with more pairs is kept.
So at ``F&B = F + B`` the step takes as long as unpaired, the peak activation count cannot grow (a pair adds
one module and frees one) and every pair with ``F&B < F + B`` can only shorten it (at unit costs: where the
input gradient costs more than the forward or the ``W``, a pair can still end the step a little later,
docs/schedules.md). ``pairs_per_step`` counts them (docs/pipeline.md has the table and its command). The
pairs exist only to be overlapped: built without overlap (``pairs=False``), a schedule runs its plan
unpaired.

Communication is placed by :func:`_emit`, not by :class:`dualpipe.authoring.Emitter` (which sends right
after the producing compute): a plan decides when each message is needed, and the sends follow that.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable

from dualpipe.schedule import Action, Layout, Op, ScheduleSpec, build_schedule, register_schedule, schedule_spec

__all__ = ["pairs_per_step"]  # the schedules themselves: dualpipe.schedule.SCHEDULES / build_schedule

Plan = tuple[tuple[Action, ...], ...]
"""Per rank, the compute actions in order (``F``, ``I``, ``W``, ``FB``); communication comes at emission."""

Pass = tuple[Op, int, int]
"""One module pass of the plan: (``Op.F`` or ``Op.I``, stage, micro-batch)."""

_PERIOD = 6
"""Slots per micro-batch and rank in the steady state: two modules, each with F, I and W."""


def _stage(n: int, rank: int, module: int) -> int:
    """The V layout: module 0 of rank r runs stage r, module 1 stage 2N-1-r."""
    return rank if module == 0 else 2 * n - 1 - rank


def _input_of(op: Op, stage: int, chunk: int, n: int) -> Pass | None:
    """The pass whose output a forward or input-gradient pass consumes (None: the batch itself)."""
    if op is Op.F:
        return (Op.F, stage - 1, chunk) if stage > 0 else None
    return (Op.F, stage, chunk) if stage == 2 * n - 1 else (Op.I, stage + 1, chunk)


def _output_to(op: Op, stage: int, chunk: int, n: int) -> Pass | None:
    """The pass that consumes the output of a forward or input-gradient pass (None: stage 0's I)."""
    if op is Op.F:
        return (Op.F, stage + 1, chunk) if stage < 2 * n - 1 else (Op.I, stage, chunk)
    return (Op.I, stage - 1, chunk) if stage > 0 else None


def _passes(n: int, rank: int, a: Action) -> list[Pass]:
    """The module passes of a compute action (a pair has two, ``W`` none)."""
    if a.op is Op.FB:
        return [(Op.F, _stage(n, rank, a.module), a.chunk), (Op.I, _stage(n, rank, a.b_module), a.b_chunk)]
    return [(a.op, _stage(n, rank, a.module), a.chunk)] if a.op in (Op.F, Op.I) else []


# -- zbv: greedy list scheduling ------------------------------------------------------------------------


def _list_schedule(n: int, m: int, cap: int, backlog: int) -> Plan:
    """Unit-slot list scheduling: at most ``cap`` live modules per rank (one left to the second leg), a
    ``W`` ahead of everything once ``backlog`` are queued on the rank (see the module docstring)."""
    last = 2 * n - 1
    f_end: list[list[int]] = [[] for _ in range(2 * n)]  # f_end[stage][chunk]: the slot its forward ends
    i_end: list[list[int]] = [[] for _ in range(2 * n)]
    queued_w = [0] * n
    orders: list[list[Action]] = [[] for _ in range(n)]
    remaining = 6 * n * m  # F, I and W of two modules per micro-batch per rank
    t = 0
    while remaining:
        progressed = False
        for r in range(n):
            stages = (_stage(n, r, 0), _stage(n, r, 1))
            live = [len(f_end[s]) - len(i_end[s]) for s in stages]
            ready: list[tuple[tuple[int, int, int], Action]] = []  # (priority: I first, oldest, second leg first)
            for module, s in enumerate(stages):
                k = len(i_end[s])
                src = f_end[s] if s == last else i_end[s + 1]
                if k < len(f_end[s]) and k < len(src) and src[k] <= t:
                    ready.append(((0, k, -s), Action(Op.I, module, k)))
                k = len(f_end[s])
                room = sum(live) < cap and (module == 1 or live[0] < cap - 1)
                if k < m and room and (s == 0 or (k < len(f_end[s - 1]) and f_end[s - 1][k] <= t)):
                    ready.append(((1, k, -s), Action(Op.F, module, k)))
            if queued_w[r] and (queued_w[r] >= backlog or not ready):
                queued_w[r] -= 1
                orders[r].append(Action(Op.W))
            elif ready:
                a = min(ready, key=_key)[1]
                (f_end if a.op is Op.F else i_end)[_stage(n, r, a.module)].append(t + 1)
                queued_w[r] += a.op is Op.I
                orders[r].append(a)
            else:
                continue
            remaining -= 1
            progressed = True
        if not progressed:  # every pass takes one slot: nothing started now, nothing ever will
            raise AssertionError(f"V list schedule stuck at slot {t} (N={n}, m={m})")  # a bug
        t += 1
    return tuple(tuple(o) for o in orders)


def _key(entry: tuple[tuple[int, int, int], Action]) -> tuple[int, int, int]:
    """Sort (key, action) entries by their key only."""
    return entry[0]


# -- v-half, v-min: the controllable-memory building block ----------------------------------------------

_BLOCK_PASSES = ((Op.F, 0), (Op.F, 1), (Op.I, 1), (Op.I, 0))
"""A rank's passes of one micro-batch, (op, module), in the order :func:`_v_block` gives their slots."""


def _v_block(n: int, memory: str) -> tuple[tuple[int, int, int, int], ...]:
    """Micro-batch 0's slots on every rank: (first-leg F, second-leg F, second-leg I, first-leg I).

    ``"min"``: every pass hands on at once, one slot per stage down, back up, and down again, so a
    micro-batch stays about 4N slots on a rank: 4N/6 = 2N/3 modules. ``"half"``: the first leg's forwards
    and the second leg's backwards advance one stage every two slots (the others one per slot), about 6N
    slots: N modules. The backward turns at rank 0 right after the last forward, two slots later (``"min"``,
    when 3 divides N) or three (``"half"``, N even) where two of a rank's passes would otherwise share a slot
    of the period: repeated every 6 slots, the four passes must fall on four distinct slots mod 6 (the two
    ``W`` s take the others).
    """
    out = []
    for r in range(n):
        if memory == "min":
            gap = 2 if n % 3 == 0 else 0
            slots = (r, 2 * n - 1 - r, 2 * n + gap + r, 4 * n + gap - 1 - r)
        else:
            gap = 3 if n % 2 == 0 else 0
            slots = (2 * r, 3 * n - 2 - r, 3 * n - 1 + gap + 2 * r, 6 * n - 2 + gap - r)
        if len({s % _PERIOD for s in slots}) != len(slots):
            raise AssertionError(f"V-{memory} block collides on rank {r} of {n}: {slots}")  # a bug
        out.append(slots)
    return tuple(out)


def _block_schedule(n: int, m: int, memory: str) -> Plan:
    """Repeat the building block every 6 slots, compact warm-up and cool-down within its peak, fill in W."""
    block = _v_block(n, memory)
    passes = sorted(
        (slot + _PERIOD * k, r, op, module, k)
        for r, slots in enumerate(block)
        for k in range(m)
        for (op, module), slot in zip(_BLOCK_PASSES, slots, strict=True)
    )
    horizon = passes[-1][0] + 1
    live = [[0] * horizon for _ in range(n)]  # live[r][t]: modules rank r holds after slot t
    for slot, r, op, _, _ in passes:
        live[r][slot] += 1 if op is Op.F else -1
    for row in live:
        for t in range(1, horizon):
            row[t] += row[t - 1]
    cap = max(max(row) for row in live)  # the memory limit: the block's own peak
    steady = (block[0][3], _PERIOD * (m - 1))  # rank 0's first stage-0 backward .. its last stage-0 forward
    slots: list[dict[int, Action]] = [{} for _ in range(n)]
    end: dict[Pass, int] = {}  # pass -> the slot after it
    for slot, r, op, module, k in passes:
        s = _stage(n, r, module)
        new = slot
        if not steady[0] <= slot <= steady[1]:
            need = _input_of(op, s, k, n)
            ready = max(end[need] if need else 0, end.get((op, s, k - 1), 0))  # a stage keeps micro-batch order
            if op is Op.F:  # earliest slot from which holding one more module stays within the limit
                while ready < slot and max(live[r][ready:slot]) >= cap:
                    ready = next(t for t in range(slot - 1, ready - 1, -1) if live[r][t] >= cap) + 1
            new = next((t for t in range(ready, slot) if t not in slots[r]), slot)
            for t in range(new, slot):
                live[r][t] += 1 if op is Op.F else -1
        slots[r][new] = Action(op, module, k)
        end[(op, s, k)] = new + 1
    orders = []
    for r in range(n):
        order: list[Action] = []
        queued = 0
        for t in range(max(slots[r]) + 1):
            if t in slots[r]:
                order.append(slots[r][t])
                queued += slots[r][t].op is Op.I
            elif queued:
                order.append(Action(Op.W))
                queued -= 1
        orders.append(tuple(order + [Action(Op.W)] * queued))
    return tuple(orders)


# -- overlapped pairs -------------------------------------------------------------------------------------


def _queue_peaks(plan: Plan) -> list[int]:
    """Per rank, the most deferred weight gradients (``I`` not yet popped by a ``W``) it ever holds."""
    peaks = []
    for order in plan:
        queued = peak = 0
        for a in order:
            queued += (a.op is Op.I) - (a.op is Op.W)
            peak = max(peak, queued)
        peaks.append(peak)
    return peaks


_NEVER = 1 << 30  # the end (and start) of a pass not yet run


class _Since(dict):
    """The end slots of a trial run (:meth:`_Squeeze.resume`): its own, written here, over ``base`` 's for the
    passes the producing rank had begun in ``base`` before the trial took it over (``since``; a rank not taken
    over still runs as in ``base``, so all of ``base`` 's passes of it count); the others have not run yet
    (``_NEVER``). Reading through saves copying every pass's clock for each trial pair (quadratic in the plan's
    length)."""

    __slots__ = ("base_began", "base_end", "rank_of", "since")

    def __init__(self, base: _Squeeze, since: list[int]) -> None:
        super().__init__()
        self.base_end, self.base_began, self.since, self.rank_of = base.end, base.began, since, base.rank_of

    def __missing__(self, x: int) -> int:
        return self.base_end[x] if self.base_began[x] < self.since[self.rank_of[x]] else _NEVER


_REJOIN = 4
"""A trial pair must put the run back on the track of the run without it (the same state at the same slot),
or end the step, within this many slots per rank. Refusing the others costs pairs, never time; being greedy,
the search even finds more at p=16 with 128 micro-batches (zbv 743 -> 932, v-half 278 -> 282), in a third of
the time (v-half 13 -> 5 s)."""
_W = Action(Op.W)


def _slots(a: Action) -> int:
    """Unit slots a compute action takes: a pair is ``F + I + W`` (its backward is a full ``B``)."""
    return 3 if a.op is Op.FB else 1


class _Squeeze:
    """Run per-rank orders of ``F``, ``I`` and ``FB`` in unit slots, each as early as its inputs allow, with
    the ``W`` s filling the waits: a rank runs a ``W`` when its next pass cannot start yet, or first once
    ``backlog[r]`` are queued (so the weight-gradient inputs a rank holds never exceed the unpaired plan's).
    Passes are numbered (``ids``, shared by a run and its trials) so the clocks are lists, not dicts.

    A trial (:meth:`resume`: another run's orders but one rank's, from a slot of that run on) runs only the
    ranks it has taken over (``woken``): the changed rank, then each rank whose next pass has an input that
    is ready at another slot than in the other run. Every other rank does what it did there, slot for slot (its
    state and its inputs are the same), so its state is read from that run (:meth:`blend`), not recomputed.
    """

    def __init__(
        self, n: int, orders: list[list[Action]], backlog: list[int] | None, ids: dict[Pass, int] | None = None
    ) -> None:
        self.n, self.orders, self.backlog = n, orders, backlog
        self.ids = {} if ids is None else ids
        self.rank_of: dict[int, int] = {}  # pass id -> the rank that runs it
        self.info = [[self.describe(r, a) for a in order] for r, order in enumerate(orders)]
        self.work = [self.remaining(row) for row in self.info]
        # per rank, the other ranks that wait for its passes
        fed: list[set[int]] = [set() for _ in range(n)]
        for q, row in enumerate(self.info):
            for x in (x for entry in row for x in entry[1]):
                fed[self.rank_of[x]].add(q)
        self.feeds = [sorted(f - {p}) for p, f in enumerate(fed)]
        self.reset()

    def describe(self, r: int, a: Action) -> tuple[tuple[int, ...], tuple[int, ...], int, bool]:
        """An action's pass ids, the ids of the inputs it waits for, its slots and whether it is an ``I``."""
        mine = _passes(self.n, r, a)
        needs = [x for x in (_input_of(*p, self.n) for p in mine) if x is not None and x not in mine]
        number = self.ids.setdefault
        own = tuple(number(p, len(self.ids)) for p in mine)
        for x in own:
            self.rank_of[x] = r
        return own, tuple(number(x, len(self.ids)) for x in needs), _slots(a), a.op is Op.I

    def remaining(self, row: list[tuple]) -> list[int]:
        """The slots a rank still has to run from each order index on: its passes and one ``W`` per ``I``."""
        work = [0] * (len(row) + 1)
        for i in range(len(row) - 1, -1, -1):
            work[i] = work[i + 1] + row[i][2] + (row[i][3] and self.backlog is not None)
        return work

    def reset(self) -> None:
        n = self.n
        self.pos, self.queued, self.free, self.last = [0] * n, [0] * n, [0] * n, [0] * n
        self.end = [_NEVER] * len(self.ids)  # pass id -> the slot after it
        self.began = [_NEVER] * len(self.end)
        self.t, self.left = 0, sum(map(len, self.orders))  # the order actions not started yet
        self.plan: list[list[Action]] = [[] for _ in range(n)]
        self.starts: list[list[int]] = [[] for _ in range(n)]
        self.lazy = False

    def variant(self, r: int, order: list[Action], pair: Action, keep: list[int]) -> _Squeeze:
        """A run of the same orders but rank ``r``'s, ``order`` (``keep``: the index of each of its actions in
        the old order, -1 for ``pair``), not yet started."""
        new = object.__new__(_Squeeze)
        new.n, new.backlog, new.ids, new.rank_of, new.feeds = self.n, self.backlog, self.ids, self.rank_of, self.feeds
        new.orders = [*self.orders[:r], order, *self.orders[r + 1 :]]
        row = [self.describe(r, pair) if o < 0 else self.info[r][o] for o in keep]
        new.info = [*self.info[:r], row, *self.info[r + 1 :]]
        new.work = [*self.work[:r], new.remaining(row), *self.work[r + 1 :]]
        return new

    def resume(self, base: _Squeeze, state: tuple, t0: int, r: int) -> None:
        """Start at slot ``t0`` with everything before it as ``base`` ran it (``state``: base's at ``t0``),
        running rank ``r`` (the one whose order differs) and, lazily, the ranks it delays or hastens."""
        n = self.n
        self.pos, self.queued, self.free, self.last = (list(state[k * n : (k + 1) * n]) for k in range(4))
        self.t, self.left, self.base, self.lazy = t0, 0, base, True
        self.since = [_NEVER] * n  # the slot each rank was taken over at
        # no copy of every pass's clock (a trial runs a few slots): the passes this run starts are kept apart,
        # and the others read as ``base`` had them (:class:`_Since`)
        self.end, self.began = _Since(base, self.since), {}
        self.plan: list[list[Action]] = [None] * n  # type: ignore[list-item]  # a rank's own once taken over
        self.starts: list[list[int]] = [None] * n  # type: ignore[list-item]
        self.synced = [t0] * n  # a rank let go: the slot from which it ran as in base again
        self.woken: list[int] = []
        self.wake(r, state)

    def wake(self, q: int, state: tuple) -> None:
        """Take rank ``q`` over at slot ``t`` (``state``: ``base`` 's then, which is this run's for ``q``)."""
        n, t, base = self.n, self.t, self.base
        self.pos[q], self.queued[q], self.free[q], self.last[q] = state[q::n]
        self.since[q] = t
        c = bisect.bisect_left(base.starts[q], t)
        if self.plan[q] is None:
            self.plan[q], self.starts[q] = base.plan[q][:c], base.starts[q][:c]
        else:  # let go before (:meth:`let_go`): as base ran it since
            b = bisect.bisect_left(base.starts[q], self.synced[q])
            self.plan[q] += base.plan[q][b:c]
            self.starts[q] += base.starts[q][b:c]
        bisect.insort(self.woken, q)

    def let_go(self, state: tuple, r: int) -> None:
        """Stop running the taken-over ranks but ``r`` whose state is ``base`` 's at slot ``t`` again
        (``state``): from there on they do what they did in ``base`` (their passes so far have ended, or end
        when base's did, so they are ready for the ranks they feed as in base)."""
        n, t, since, synced = self.n, self.t, self.since, self.synced
        pos, queued, free, last = self.pos, self.queued, self.free, self.last
        keep = []
        for q in self.woken:
            if (
                q == r
                or pos[q] != state[q]
                or queued[q] != state[n + q]
                or free[q] != state[2 * n + q]
                or max(last[q], t) != state[3 * n + q]
            ):
                keep.append(q)
            else:
                since[q], synced[q] = _NEVER, t
        self.woken = keep

    def wake_all(self, state: tuple) -> None:
        """Take every rank over at slot ``t`` and run them all from now on (``state``: ``base`` 's then)."""
        for q in range(self.n):
            if self.since[q] == _NEVER:
                self.wake(q, state)
        self.lazy, self.left = False, sum(map(len, self.orders)) - sum(self.pos)

    def wake_next(self, state: tuple) -> None:
        """Take over, at slot ``t``, each rank a taken-over rank feeds whose next pass would find its inputs
        otherwise than it did in ``base`` (``state``: base's at ``t``); a rank busy then, or with the same
        inputs ready, does what it did in ``base``."""
        n, t, end, base_end = self.n, self.t, self.end, self.base.end
        for p in list(self.woken):
            for q in self.feeds[p]:
                if self.since[q] != _NEVER or state[2 * n + q] > t:
                    continue
                i, row = state[q], self.info[q]
                if i < len(row) and any((end[x] > t) != (base_end[x] > t) for x in row[i][1]):
                    self.wake(q, state)

    def snapshot(self) -> tuple:
        """What :meth:`blend` needs of slot ``t`` (kept until the trial is known to be taken)."""
        return self.t, tuple(self.woken), (*self.pos, *self.queued, *self.free, *self.last)

    def blend(self, state: tuple, snapshot: tuple) -> tuple[int, ...]:
        """This run's :meth:`state` at a slot: ``base`` 's then (``state``) but for the ranks taken over then
        (``snapshot``: :meth:`snapshot` 's then)."""
        n = self.n
        t, woken, mine = snapshot
        out = list(state)
        for q in woken:
            out[q], out[n + q], out[2 * n + q], e = mine[q::n]
            out[3 * n + q] = e if e > t else t
        return tuple(out)

    def back_on_track(self, state: tuple, r: int, shift: int) -> bool:
        """Whether this run's state at slot ``t`` is ``base`` 's (``state``), rank ``r`` ``shift`` actions
        behind, given that only the ranks taken over can differ."""
        n, t = self.n, self.t
        return (
            self.woken == [r]
            and self.pos[r] + shift == state[r]
            and self.queued[r] == state[n + r]
            and self.free[r] == state[2 * n + r]
            and max(self.last[r], t) == state[3 * n + r]
        )

    def adopt(self, base: _Squeeze, t: int, r: int, shift: int) -> None:
        """Finish as ``base`` does from slot ``t`` on (the state is the same there; rank ``r``'s order is
        ``shift`` actions shorter)."""
        for q in range(self.n):
            if self.plan[q] is None:  # never taken over: base's run throughout (base is dropped)
                self.plan[q], self.starts[q] = base.plan[q], base.starts[q]
                continue
            c = bisect.bisect_left(base.starts[q], t if self.since[q] != _NEVER else self.synced[q])
            self.plan[q] += base.plan[q][c:]
            self.starts[q] += base.starts[q][c:]
        self.settle(base)  # the passes base starts from t on are those this run has not started
        self.pos = [len(o) for o in self.orders]
        self.queued, self.free, self.last, self.t, self.left = [0] * self.n, list(base.free), list(base.last), base.t, 0
        self.states += [(*s[:r], s[r] - shift, *s[r + 1 :]) for s in base.states[t:]]
        self.final = base.final
        self.result = (tuple(map(tuple, self.plan)), self.starts, base.result[2])
        self.lazy = False

    def settle(self, base: _Squeeze) -> None:
        """Make the clocks of a resumed run whole lists again, taking over ``base`` 's (``base`` is dropped): the
        passes this run started since it resumed get their slots, every other keeps ``base`` 's (those started
        before the resume, and those ``base`` starts where this run rejoined it or has not reached)."""
        end, began = base.end, base.began
        for x, e in self.end.items():
            end[x] = e
        for x, b in self.began.items():
            began[x] = b
        self.end, self.began, self.base = end, began, None

    def state(self) -> tuple[int, ...]:
        """What decides the rest of the run at slot ``t``, flat: every rank's position, then its queued ``W`` s,
        the slot it is free at and the end of its last pass if after ``t`` (the passes before it have ended)."""
        t = self.t
        return (*self.pos, *self.queued, *self.free, *(e if e > t else t for e in self.last))

    def bound(self, state: tuple | None = None) -> int:
        """No rank can end before this slot (its own remaining work, back to back); from ``state`` if given
        (:meth:`state` 's layout)."""
        t, n = self.t, self.n
        pos, queued, free = (
            (self.pos, self.queued, self.free) if state is None else (state[:n], state[n:], state[2 * n :])
        )
        return max((f if f > t else t) + w[p] + q for f, w, p, q in zip(free, self.work, pos, queued))

    def step(self, ranks: list[int] | None = None) -> None:
        """Run slot ``t`` on every rank, or on ``ranks`` (a trial's, :meth:`wake`). A slot where no rank is busy
        and none starts anything is a deadlock (the orders wait on each other): ``AssertionError``."""
        t, end, began, backlog, info = self.t, self.end, self.began, self.backlog, self.info
        free, pos, queued, last = self.free, self.pos, self.queued, self.last
        started = busy = False
        for r in range(self.n) if ranks is None else ranks:
            row = info[r]
            if free[r] > t:
                busy = True
                continue
            i = pos[r]
            ready = i < len(row)
            if ready:
                for x in row[i][1]:
                    if end[x] > t:
                        ready = False
            q = queued[r]
            if backlog is not None and q and (q >= backlog[r] or not ready):
                a, slots = _W, 1
                queued[r] = q - 1
            elif ready:
                own, _, slots, is_i = row[i]
                a = self.orders[r][i]
                if is_i and backlog is not None:
                    queued[r] = q + 1
                pos[r] = i + 1
                self.left -= 1
                for p in own:
                    end[p] = t + slots
                    began[p] = t
                last[r] = t + slots
                started = True
            else:
                continue
            busy = True
            self.plan[r].append(a)
            self.starts[r].append(t)
            free[r] = t + slots
        if ranks is None and not started and not busy and self.left:
            raise AssertionError(f"V plan stuck at slot {t}")
        self.t = t + 1

    def run(self) -> tuple[Plan, list[list[int]], int, list[tuple]]:
        """Run to the end: the plan (``W`` s placed), every action's start, the makespan, the state per slot."""
        self.states = []
        while self.left:
            self.states.append(self.state())
            self.step()
        self.final = self.bound()
        self.result = self.finish()
        return (*self.result, self.states)

    def finish(self) -> tuple[Plan, list[list[int]], int]:
        """The ``W`` s still queued run at the end; the plan, every action's start and the makespan."""
        for r in range(self.n):
            self.plan[r] += [_W] * self.queued[r]
            self.starts[r] += range(self.free[r], self.free[r] + self.queued[r])
            self.free[r] += self.queued[r]
            self.queued[r] = 0
        makespan = max(s[-1] + 1 if s else 0 for s in self.starts)
        return tuple(map(tuple, self.plan)), self.starts, max(makespan, *self.free)


def _pair_at(order: list[Action], i: int) -> tuple[Action, int] | None:
    """The pair of ``order[i]`` and the next pass after it (``W`` s skipped), and that pass's index; None where
    they are not a forward and an input gradient of two micro-batches."""
    x = order[i]
    j = next((k for k in range(i + 1, len(order)) if order[k].op is not Op.W), None)
    if j is None or {x.op, order[j].op} != {Op.F, Op.I} or x.chunk == order[j].chunk:
        return None
    f, b = (x, order[j]) if x.op is Op.F else (order[j], x)
    return Action(Op.FB, f.module, f.chunk, b_module=b.module, b_chunk=b.chunk), j


def _fold(order: list[Action], i: int, pair: Action, j: int, fill: bool) -> tuple[list[Action], Action, list[int]]:
    """``order`` with ``order[i]`` and ``order[j]`` as ``pair`` (:func:`_pair_at`), the pair, and the index in
    ``order`` of each action kept (-1: the pair). Without ``fill`` the ``W`` that would have popped the input
    gradient's weight gradient goes too (the pair's full backward computes it)."""
    keep = [*range(i), -1, *range(i + 1, j), *range(j + 1, len(order))]
    if not fill:  # FIFO: the k-th I is popped by the k-th W
        k = sum(a.op is Op.I for a in order[: i if order[i].op is Op.I else j])
        del keep[[n for n, o in enumerate(keep) if o >= 0 and order[o].op is Op.W][k]]
    return [pair if o < 0 else order[o] for o in keep], pair, keep


def _unpaired(n: int, plan: Plan) -> tuple[Plan, list[list[int]]]:
    """``plan`` as it is and every action's start slot, each as early as its inputs allow."""
    return _Squeeze(n, [list(order) for order in plan], None).run()[:2]


def _pair(n: int, plan: Plan, lazy: bool = True) -> tuple[Plan, list[list[int]]]:
    """Fold adjacent forwards and input gradients of two micro-batches on a rank into overlapped pairs where
    the step still ends by the unpaired plan's last slot (see the module docstring), with the ``W`` s where
    the plan put them and with the ``W`` s filling the waits; the one with more pairs. Returns the plan and
    every action's start slot. ``lazy=False`` runs every rank of every trial (:func:`_fits`; the same plan,
    slower: the check of the lazy one)."""
    kept = _pair_orders(n, plan, fill=False, limit=None, lazy=lazy)
    filled = _pair_orders(n, plan, fill=True, limit=kept[2], lazy=lazy)
    return max(kept, filled, key=_pairs_within(kept[2]))[:2]


def _pairs_within(limit: int) -> Callable[[tuple[Plan, list[list[int]], int]], tuple[bool, int]]:
    """Rank paired plans: ending by ``limit`` first, then by their number of pairs."""

    def key(paired: tuple[Plan, list[list[int]], int]) -> tuple[bool, int]:
        return paired[2] <= limit, sum(a.op is Op.FB for order in paired[0] for a in order)

    return key


def _pair_orders(
    n: int, plan: Plan, fill: bool, limit: int | None, lazy: bool = True
) -> tuple[Plan, list[list[int]], int]:
    """Pair greedily, in the order the unpaired plan starts its passes, every forward or input gradient with
    the next pass on its rank where the step then still ends by ``limit`` (None: the unpaired step's end).
    Returns the plan, every action's start slot and the makespan in slots."""
    backlog = _queue_peaks(plan) if fill else None
    orders = [[a for a in order if a.op is not Op.W or not fill] for order in plan]
    base = _Squeeze(n, orders, backlog)
    run = base.run()
    limit = run[2] if limit is None else limit
    candidates = sorted(  # every forward and input gradient, in the order the unpaired plan starts them
        (base.began[row[k][0][0]], r, k) for r, row in enumerate(base.info) for k in range(len(row)) if row[k][0]
    )
    unpaired = orders
    at = [{id(a): i for i, a in enumerate(order)} for order in orders]  # action -> its index, while unfolded
    for _, r, k in candidates:
        i = at[r].get(id(unpaired[r][k]))
        if i is None:
            continue  # already folded into a pair
        t0 = base.began[base.info[r][i][0][0]]
        found = _pair_at(base.orders[r], i)  # the order is rebuilt only for a pair whose inputs are there
        if found is None or not _ready(base, r, base.describe(r, found[0]), t0):
            continue
        trial = base.variant(r, *_fold(base.orders[r], i, *found, fill))
        if _fits(trial, base, run, t0, limit, r, lazy):
            base, run = trial, (*trial.result, trial.states)
            at[r] = {id(a): i for i, a in enumerate(base.orders[r]) if a.op is not Op.FB}
    return run[0], run[1], run[2]


def _ready(base: _Squeeze, r: int, pair: tuple, t0: int) -> bool:
    """Whether both halves of ``pair`` (described, folded at the pass ``base`` starts at ``t0`` on rank ``r``)
    had their inputs then: a pair that would wait for one only delays both."""
    return all(base.end[x] <= t0 for x in pair[1])


def _fits(trial: _Squeeze, base: _Squeeze, run: tuple, t0: int, limit: int, r: int, lazy: bool = True) -> bool:
    """Whether ``trial`` (``base`` with one more pair, at the pass ``base`` starts at ``t0`` on rank ``r``)
    still ends by ``limit``: run from ``t0``, everything before it as in ``base``, until it ends or its state
    is ``base``'s at the same slot again (the rest is then ``base``'s), within ``_REJOIN`` slots a rank. On
    success ``trial`` holds its run. Only the ranks the pair changes are run (:class:`_Squeeze`), until
    ``base`` 's last slot, from which on every rank is (from the start without ``lazy``)."""
    states = run[3]
    trial.resume(base, states[t0], t0, r)
    if not lazy:
        trial.wake_all(states[t0])
    order, old = trial.orders[r], base.orders[r]
    shift = len(old) - len(order)
    same = 0  # the trial's order ends as the old one does for this many actions
    while same < len(order) and order[-1 - same] is old[-1 - same]:
        same += 1
    tail = len(order) - same
    trial.states = states[:t0]
    seen: list[tuple] = []  # the lazy slots' snapshots, blended into states once the trial is taken

    def blended() -> list[tuple]:
        return [trial.blend(states[snap[0]], snap) for snap in seen]

    total = sum(map(len, trial.orders))
    while True:
        t = trial.t
        if trial.lazy:
            trial.let_go(states[t], r)
            now = states[t]
            if (
                t >= len(states) - 1
                or (  # rank r is never let go: done only with it
                    trial.pos[r] == len(order)
                    and sum(now[: trial.n]) + sum(trial.pos[q] - now[q] for q in trial.woken) == total
                )
            ):
                # base's last slot, or done before base (whose state at t is still at hand): run every rank
                trial.states += blended()
                seen = []
                trial.wake_all(states[t])
        if not trial.lazy:
            if not trial.left:
                break
            state = trial.state()
            back = t < len(states) and (*state[:r], state[r] + shift, *state[r + 1 :]) == states[t]
        else:
            back = trial.back_on_track(states[t], r, shift)
        if back and trial.pos[r] > tail:
            if base.final > limit:  # rejoined: the rest is base's
                return False
            trial.states += blended()
            trial.adopt(base, t, r, shift)
            return True
        if t - t0 > _REJOIN * trial.n:  # not back on the base run's track: refused, as if it ended late
            return False
        if trial.lazy:
            seen.append(trial.snapshot())
            if (t - t0) % 8 == 7 and trial.bound(trial.blend(states[t], seen[-1])) > limit:
                return False  # the bound never falls: checked now and then
            trial.wake_next(states[t])
            trial.step(trial.woken)  # a stuck trial is never back on track: refused by the limits
            continue
        trial.states.append(state)
        if (t - t0) % 8 == 7 and trial.bound() > limit:
            return False
        try:
            trial.step()
        except AssertionError:
            return False
    trial.final = trial.bound()
    if trial.final > limit:
        return False
    trial.settle(base)
    trial.result = trial.finish()
    return True


# -- emission ---------------------------------------------------------------------------------------------


def _emit(layout: Layout, plan: Plan, starts: list[list[int]]) -> Plan:
    """Every rank's actions: each receive right before the compute that consumes it, each send in the
    sender's last communication batch at or before the time the consumer starts in the plan (the one after
    the sender's last compute that ends by then).

    NCCL matches the messages between two ranks in issue order, and a greedy plan can consume two messages of
    one link in another order than it makes them (a forward made before a gradient, the gradient needed
    first): sent at the consumer's time, both ends post them in one order. And on NCCL each batch is one
    group that holds back the rank's later batches until every peer has reached the partner batch: with both
    ends of every message in batches of the same time, each batch completes by the time its rank starts its
    next compute in the plan, so no batch ever waits on one issued later (``dualpipe.checks``' "grouped"
    model; a pair, three slots long, can make its rank's batch wait until a message it sends is due, at most
    two slots). A send never leaves later than its consumer starts: the simulated timeline is the plan's.
    """
    n = layout.num_ranks
    ends = [[t + (3 if a.op is Op.FB else 1) for a, t in zip(order, starts[r])] for r, order in enumerate(plan)]
    recvs: list[list[list[Action]]] = [[[] for _ in order] for order in plan]
    consumer: dict[Pass, tuple[int, int, int]] = {}  # a remote message by its producing pass -> (time, index, half)
    for r, order in enumerate(plan):
        for i, a in enumerate(order):
            for half, (op, s, k) in enumerate(_passes(n, r, a)):
                module = a.b_module if half else a.module
                source = layout.prev(r, module) if op is Op.F else layout.next(r, module)
                made_by = _input_of(op, s, k, n)
                if source is not None and source[0] != r and made_by is not None:
                    recvs[r][i].append(Action(Op.RECV_F if op is Op.F else Op.RECV_B, module, k, peer=source[0]))
                    consumer[made_by] = (starts[r][i], i, half)
    sends: list[list[list[tuple[tuple[int, int, int], Action]]]] = [[[] for _ in range(len(o) + 1)] for o in plan]
    for r, order in enumerate(plan):
        for a in order:
            for half, (op, s, k) in enumerate(_passes(n, r, a)):
                module = a.b_module if half else a.module
                target = layout.next(r, module) if op is Op.F else layout.prev(r, module)
                if target is not None and target[0] != r:
                    due = consumer[(op, s, k)]
                    send = Action(Op.SEND_F if op is Op.F else Op.SEND_B, module, k, peer=target[0])
                    sends[r][bisect.bisect_right(ends[r], due[0])].append((due, send))
    out = []
    for r, order in enumerate(plan):
        actions: list[Action] = []
        for i, a in enumerate(order):
            actions += [send for _, send in sorted(sends[r][i], key=_key)] + recvs[r][i]  # to one peer: its order
            actions.append(a)
        out.append(tuple(actions + [send for _, send in sorted(sends[r][-1], key=_key)]))
    return tuple(out)


# -- the registry entries ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=256)
def _actions(name: str, n: int, m: int, pairs: bool) -> Plan:
    """Every rank's action list for ``name`` (planned once per shape for all ranks: the plan is global), with
    its overlapped pairs or without (its unpaired plan, run as early as inputs allow)."""
    plan = _plan(name, n, m)
    return _emit(Layout.v_shape(n), *(_pair(n, plan) if pairs else _unpaired(n, plan)))


def _plan(name: str, n: int, m: int) -> Plan:
    """The unpaired plan of ``name``: every rank's F, I and W in order."""
    if name == "zbv":
        return _list_schedule(n, m, cap=2 * n, backlog=3 * n - 2)
    return _block_schedule(n, m, "half" if name == "v-half" else "min")


def _generator(name: str) -> Callable[..., list[Action]]:
    def generate(layout: Layout, rank: int, num_chunks: int, pairs: bool = True) -> list[Action]:
        return list(_actions(name, layout.num_ranks, num_chunks, pairs)[rank])

    generate.__name__ = generate.__qualname__ = f"_{name.replace('-', '_')}"
    return generate


def _v_layout(num_ranks: int, modules_per_rank: int) -> Layout:
    return Layout.v_shape(num_ranks)


def _register(name: str, title: str, class_name: str, summary: str) -> None:
    register_schedule(
        ScheduleSpec(
            name=name,
            title=title,
            class_name=class_name,
            summary=summary,
            generate=_generator(name),
            layout=_v_layout,
            modules_per_rank=2,
            overlaps=True,
            pairs_for_overlap=True,
        )
    )


_register("zbv", "ZBV", "ZeroBubbleV", "ZB-V: V-shaped zero bubble at 1F1B's activation memory, deferred W")
_register("v-half", "V-Half", "VHalf", "V-Half: controllable-memory V schedule, half of 1F1B's activation memory")
_register("v-min", "V-Min", "VMin", "V-Min: controllable-memory V schedule, a third of 1F1B's activation memory")


V_FAMILY = ("zbv", "v-half", "v-min")


def pairs_per_step(name: str, num_ranks: int, num_chunks: int | None = None) -> int:
    """Overlapped pairs (``FB`` actions, all ranks together) in one step of schedule ``name`` (any registered
    one) at ``num_chunks`` micro-batches (default: the schedule's own default for ``num_ranks``)."""
    chunks = schedule_spec(name).default_chunks(num_ranks) if num_chunks is None else num_chunks
    return sum(a.op is Op.FB for actions in build_schedule(name, num_ranks, chunks).ranks for a in actions)

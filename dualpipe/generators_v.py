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
leaving only when it ends, still ends by the unpaired plan's last slot. Every such pair is made, greedily, in
the order the unpaired plan starts them. The slack that pays for them is the ``W`` s': a consumer the pair
delays runs weight gradients meanwhile, so the plan is timed twice, with the ``W`` s where the planner put
them and with the ``W`` s filling each rank's waits (a ``W`` first once the rank queues as many as the
unpaired plan's peak, so the weight-gradient inputs held never grow), and the one with more pairs is kept.
So at ``F&B = F + B`` the step takes as long as unpaired, the peak activation count cannot grow (a pair adds
one module and frees one) and every pair with ``F&B < F + B`` can only shorten it. ``pairs_per_step`` counts
them (docs/pipeline.md has the table and its command).

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


def _slots(a: Action) -> int:
    """Unit slots a compute action takes: a pair is ``F + I + W`` (its backward is a full ``B``)."""
    return 3 if a.op is Op.FB else 1


class _Squeeze:
    """Run per-rank orders of ``F``, ``I`` and ``FB`` in unit slots, each as early as its inputs allow, with
    the ``W`` s filling the waits: a rank runs a ``W`` when its next pass cannot start yet, or first once
    ``backlog[r]`` are queued (so the weight-gradient inputs a rank holds never exceed the unpaired plan's).
    """

    def __init__(self, n: int, orders: list[list[Action]], backlog: list[int] | None) -> None:
        self.n, self.orders, self.backlog = n, orders, backlog
        self.passes = [[_passes(n, r, a) for a in order] for r, order in enumerate(orders)]
        # the slots each rank still has to run from order index i on: its passes and one W per I
        self.work = [[0] * (len(order) + 1) for order in orders]
        for r, order in enumerate(orders):
            for i in range(len(order) - 1, -1, -1):
                self.work[r][i] = self.work[r][i + 1] + _slots(order[i]) + (order[i].op is Op.I and backlog is not None)
        self.pos, self.queued, self.free = [0] * n, [0] * n, [0] * n
        self.end: dict[Pass, int] = {}  # pass -> the slot after it
        self.began: dict[Pass, int] = {}
        self.t = 0
        self.plan: list[list[Action]] = [[] for _ in range(n)]
        self.starts: list[list[int]] = [[] for _ in range(n)]

    def state(self) -> tuple[tuple[int, ...], ...]:
        return tuple(self.pos), tuple(self.queued), tuple(self.free)

    def done(self) -> bool:
        return all(p == len(o) for p, o in zip(self.pos, self.orders, strict=True))

    def bound(self) -> int:
        """No rank can end before this slot (its own remaining work, back to back)."""
        return max(max(self.t, f) + w[p] + q for f, w, p, q in zip(self.free, self.work, self.pos, self.queued))

    def step(self) -> list[Pass]:
        """Run slot ``t``; returns the passes started in it. A slot where no rank is busy and none starts
        anything is a deadlock (the orders wait on each other): ``AssertionError``."""
        started: list[Pass] = []
        t = self.t
        for r, order in enumerate(self.orders):
            if self.free[r] > t:
                continue
            i = self.pos[r]
            ready = i < len(order) and all(
                self.end.get(x, t + 1) <= t
                for x in (_input_of(*p, self.n) for p in self.passes[r][i])
                if x is not None and x not in self.passes[r][i]
            )
            if self.backlog is not None and self.queued[r] and (self.queued[r] >= self.backlog[r] or not ready):
                a = Action(Op.W)
                self.queued[r] -= 1
            elif ready:
                a = order[i]
                self.queued[r] += a.op is Op.I and self.backlog is not None
                self.pos[r] += 1
                self.end.update((p, t + _slots(a)) for p in self.passes[r][i])
                self.began.update((p, t) for p in self.passes[r][i])
                started += self.passes[r][i]
            else:
                continue
            self.plan[r].append(a)
            self.starts[r].append(t)
            self.free[r] = t + _slots(a)
        if not started and all(f <= t for f in self.free) and not self.done():
            raise AssertionError(f"V plan stuck at slot {t}")
        self.t += 1
        return started

    def run(self) -> tuple[Plan, list[list[int]], int, list[tuple]]:
        """Run to the end: the plan (``W`` s placed), every action's start, the makespan, the state per slot."""
        states = []
        while not self.done():
            states.append(self.state())
            self.step()
        for r in range(self.n):  # the W s still queued run at the end
            self.plan[r] += [Action(Op.W)] * self.queued[r]
            self.starts[r] += range(self.free[r], self.free[r] + self.queued[r])
        makespan = max(s[-1] + 1 if s else 0 for s in self.starts)
        return tuple(map(tuple, self.plan)), self.starts, max(makespan, *self.free), states


def _fold(order: list[Action], x: Action, fill: bool) -> tuple[list[Action], Action] | None:
    """``order`` with ``x`` and the next pass after it (``W`` s skipped) as one pair, and the pair; None where
    they are not a forward and an input gradient of two micro-batches. Without ``fill`` the ``W`` that would
    have popped the input gradient's weight gradient goes too (the pair's full backward computes it)."""
    i = order.index(x)
    j = next((k for k in range(i + 1, len(order)) if order[k].op is not Op.W), None)
    if j is None or {x.op, order[j].op} != {Op.F, Op.I} or x.chunk == order[j].chunk:
        return None
    f, b = (x, order[j]) if x.op is Op.F else (order[j], x)
    pair = Action(Op.FB, f.module, f.chunk, b_module=b.module, b_chunk=b.chunk)
    out = [*order[:i], pair, *order[i + 1 : j], *order[j + 1 :]]
    if not fill:  # FIFO: the k-th I is popped by the k-th W
        k = sum(a.op is Op.I for a in order[: order.index(b)])
        w = [n for n, a in enumerate(out) if a.op is Op.W][k]
        del out[w]
    return out, pair


def _pair(n: int, plan: Plan) -> tuple[Plan, list[list[int]]]:
    """Fold adjacent forwards and input gradients of two micro-batches on a rank into overlapped pairs where
    the step still ends by the unpaired plan's last slot (see the module docstring), with the ``W`` s where
    the plan put them and with the ``W`` s filling the waits; the one with more pairs. Returns the plan and
    every action's start slot."""
    kept = _pair_orders(n, plan, fill=False, limit=None)
    filled = _pair_orders(n, plan, fill=True, limit=kept[2])
    return max(kept, filled, key=_pairs_within(kept[2]))[:2]


def _pairs_within(limit: int) -> Callable[[tuple[Plan, list[list[int]], int]], tuple[bool, int]]:
    """Rank paired plans: ending by ``limit`` first, then by their number of pairs."""

    def key(paired: tuple[Plan, list[list[int]], int]) -> tuple[bool, int]:
        return paired[2] <= limit, sum(a.op is Op.FB for order in paired[0] for a in order)

    return key


def _pair_orders(n: int, plan: Plan, fill: bool, limit: int | None) -> tuple[Plan, list[list[int]], int]:
    """Pair greedily, in the order the unpaired plan starts its passes, every forward or input gradient with
    the next pass on its rank where the step then still ends by ``limit`` (None: the unpaired step's end).
    Returns the plan, every action's start slot and the makespan in slots."""
    backlog = _queue_peaks(plan) if fill else None
    orders = [[a for a in order if a.op is not Op.W or not fill] for order in plan]
    base = _Squeeze(n, orders, backlog)
    run = base.run()
    limit = run[2] if limit is None else limit
    candidates = sorted(  # every forward and input gradient, in the order the unpaired plan starts them
        (base.began[_passes(n, r, a)[0]], r, k)
        for r, order in enumerate(orders)
        for k, a in enumerate(order)
        if a.op is not Op.W
    )
    unpaired = orders
    for _, r, k in candidates:
        x = unpaired[r][k]
        if x not in orders[r]:
            continue  # already folded into a pair
        folded = _fold(orders[r], x, fill)
        if folded is None or not _ready(n, r, folded[1], x, base):
            continue
        trial = [*orders[:r], folded[0], *orders[r + 1 :]]
        if _fits(n, trial, base, run[3], limit, r, x):
            orders = trial
            base = _Squeeze(n, orders, backlog)
            run = base.run()
    return run[0], run[1], run[2]


def _ready(n: int, r: int, pair: Action, x: Action, base: _Squeeze) -> bool:
    """Whether both halves of ``pair`` (folded at ``x`` on rank ``r``) had their inputs when ``x`` started in
    ``base``: a pair that would wait for one only delays both."""
    t0 = base.began[_passes(n, r, x)[0]]
    return all(base.end.get(i, t0 + 1) <= t0 for p in _passes(n, r, pair) if (i := _input_of(*p, n)) is not None)


def _fits(
    n: int, orders: list[list[Action]], base: _Squeeze, states: list[tuple], limit: int, r: int, x: Action
) -> bool:
    """Whether ``orders`` (``base.orders`` with one more pair, at ``x`` on rank ``r``) still end by ``limit``:
    run from the slot ``x`` started in ``base``, everything before it as there."""
    t0 = base.began[_passes(n, r, x)[0]]
    trial = _Squeeze(n, orders, base.backlog)
    pos, queued, free = states[t0]
    trial.pos, trial.queued, trial.free, trial.t = list(pos), list(queued), list(free), t0
    trial.end = {p: e for p, e in base.end.items() if base.began[p] < t0}
    trial.began = {p: s for p, s in base.began.items() if s < t0}
    while not trial.done():
        if trial.bound() > limit:
            return False
        try:
            trial.step()
        except AssertionError:
            return False
    return trial.bound() <= limit


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


@functools.lru_cache(maxsize=64)
def _actions(name: str, n: int, m: int) -> Plan:
    """Every rank's action list for ``name`` (planned once per shape for all ranks: the plan is global)."""
    return _emit(Layout.v_shape(n), *_pair(n, _plan(name, n, m)))


def _plan(name: str, n: int, m: int) -> Plan:
    """The unpaired plan of ``name``: every rank's F, I and W in order."""
    if name == "zbv":
        return _list_schedule(n, m, cap=2 * n, backlog=3 * n - 2)
    return _block_schedule(n, m, "half" if name == "v-half" else "min")


def _generator(name: str) -> Callable[[Layout, int, int], list[Action]]:
    def generate(layout: Layout, rank: int, num_chunks: int) -> list[Action]:
        return list(_actions(name, layout.num_ranks, num_chunks)[rank])

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

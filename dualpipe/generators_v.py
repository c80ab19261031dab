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

Overlapped pairs (``FB``, for ``overlapped_forward_backward``; :func:`_pair`): where a rank runs a forward,
an input gradient and a ``W`` back to back (in any order, a forward and a backward of different
micro-batches, both inputs there when the first starts), the three become one pair whose backward is a
full ``B`` (the ``W`` folds into it): the same three slots with ``F&B = F + B``. The pair sends what its
halves made only when it ends, so it is made only where that is still no later than each consumer starts:
the bubble and every other pass stay where they were, and the peak activation count cannot grow (a pair
adds one module and frees one). With a real overlap (``F&B < F + B``) the pair ends earlier. These schedules
keep every message's consumer close behind it (a zero bubble leaves no slack), so they pair little: ``zbv``
one pair per micro-batch past 3N - 1 (m - 3N + 1 a step), ``v-half`` and ``v-min`` next to none. They are
the schedules to pick when memory, not hiding communication, is the limit.

Communication is placed by :func:`_emit`, not by :class:`dualpipe.authoring.Emitter` (which sends right
after the producing compute): a plan decides when each message is needed, and the sends follow that.
"""

from __future__ import annotations

import bisect
import functools
from collections.abc import Callable

from dualpipe.schedule import Action, Layout, Op, ScheduleSpec, register_schedule

__all__: list[str] = []  # nothing to import from here: use dualpipe.schedule.SCHEDULES / build_schedule

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


def _unit_starts(n: int, plan: Plan) -> list[list[int]]:
    """Start slot of every compute action, as early as its inputs allow in each rank's order (one slot per
    F, I and W, three per pair: ``F&B = F + B``)."""
    end: dict[Pass, int] = {}
    starts: list[list[int]] = [[] for _ in range(n)]
    clock = [0] * n
    while any(len(starts[r]) < len(plan[r]) for r in range(n)):
        progressed = False
        for r in range(n):
            while len(starts[r]) < len(plan[r]):
                a = plan[r][len(starts[r])]
                mine = _passes(n, r, a)
                needs = [x for x in (_input_of(*p, n) for p in mine) if x is not None and x not in mine]
                if any(x not in end for x in needs):
                    break
                t = max([clock[r], *(end[x] for x in needs)])
                clock[r] = t + (3 if a.op is Op.FB else 1)
                end.update((p, clock[r]) for p in mine)
                starts[r].append(t)
                progressed = True
        if not progressed:
            raise AssertionError("V plan cannot progress")  # a bug: the planners respect every dependency
    return starts


def _pair(n: int, plan: Plan) -> tuple[Plan, list[list[int]]]:
    """Fold back-to-back (F, I, W) triples into overlapped pairs where no consumer would start later (see
    the module docstring); returns the plan and every action's start slot (unchanged by the folding)."""
    starts = _unit_starts(n, plan)
    start_of = {p: t for r, order in enumerate(plan) for a, t in zip(order, starts[r]) for p in _passes(n, r, a)}
    sent = {p: t + 1 for p, t in start_of.items()}  # when each pass's output leaves (a pair's: when it ends)
    triples = sorted(
        (starts[r][i], r, i)
        for r, order in enumerate(plan)
        for i in range(len(order) - 2)
        if sorted(a.op.value for a in order[i : i + 3]) == ["F", "I", "W"] and starts[r][i + 2] == starts[r][i] + 2
    )
    pairs: list[dict[int, Action]] = [{} for _ in range(n)]  # per rank: first index of a folded triple -> pair
    for t, r, i in triples:
        if any(j in pairs[r] for j in range(i - 2, i + 3)):
            continue  # overlaps a triple already folded
        f, b = (next(a for a in plan[r][i : i + 3] if a.op is op) for op in (Op.F, Op.I))
        mine = [(Op.F, _stage(n, r, f.module), f.chunk), (Op.I, _stage(n, r, b.module), b.chunk)]
        if any(x is not None and sent[x] > t for x in (_input_of(*p, n) for p in mine)):
            continue  # an input arrives after the pair would start (or is made inside it)
        if any(x is not None and start_of[x] < t + 3 for x in (_output_to(*p, n) for p in mine)):
            continue  # a consumer would wait for the pair
        pairs[r][i] = Action(Op.FB, f.module, f.chunk, b_module=b.module, b_chunk=b.chunk)
        sent.update((p, t + 3) for p in mine)
    out, out_starts = [], []
    for r, order in enumerate(plan):
        skip = {j for i in pairs[r] for j in (i + 1, i + 2)}
        keep = [i for i in range(len(order)) if i not in skip]
        out.append(tuple(pairs[r].get(i, order[i]) for i in keep))
        out_starts.append([starts[r][i] for i in keep])
    return tuple(out), out_starts


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
    if name == "zbv":
        plan = _list_schedule(n, m, cap=2 * n, backlog=3 * n - 2)
    else:
        plan = _block_schedule(n, m, "half" if name == "v-half" else "min")
    return _emit(Layout.v_shape(n), *_pair(n, plan))


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

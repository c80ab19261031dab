"""Static checks on generated schedules: completeness, send/receive matching and freedom from deadlock.

These run on the action lists alone (no tensors, no processes), so they cover many (ranks, chunks) cases in
milliseconds and they run before a pipeline ever talks to its peers.

Two communication models are checked for deadlock:

- ``"async"`` (gloo, and NCCL with one stream per peer): every send and receive progresses on its own; a
  compute waits only for the receives that carry its inputs.
- ``"grouped"`` (NCCL's in-order semantics): each run of consecutive communication actions is one group;
  a rank's groups run one after another on its communication stream, and a group finishes only when every
  peer has reached the group holding the matching operation. A schedule that is safe here is safe on
  NCCL whatever the per-peer stream mapping.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import NamedTuple

from dualpipe.schedule import Action, Op, Schedule

__all__ = [
    "DeadlockError",
    "MessageKey",
    "ScheduleError",
    "check_complete",
    "check_matching",
    "check_schedule",
    "message_key",
    "needed_receives",
    "simulate_progress",
]


class ScheduleError(ValueError):
    """A generated schedule is inconsistent (a bug in a generator, never a user error)."""


class DeadlockError(ScheduleError):
    """No rank can make progress; the message lists where each rank is stuck."""


class MessageKey(NamedTuple):
    """Identity of one transfer, the same on both sides whatever their local module indices are."""

    kind: str  # "F" activations, "B" gradients
    path: int
    chunk: int
    src: int
    dst: int
    boundary: int  # the stage before the boundary it crosses (interleaved layouts share a rank pair)


def message_key(schedule: Schedule, rank: int, a: Action) -> MessageKey:
    """Identity of the message a communication action carries."""
    layout = schedule.layout
    path = layout.path_of(rank, a.module)
    kind = "F" if a.op in (Op.SEND_F, Op.RECV_F) else "B"
    boundary = layout.boundary(rank, a.module, towards_next=a.op in (Op.SEND_F, Op.RECV_B))
    if a.op in (Op.SEND_F, Op.SEND_B):
        return MessageKey(kind, path, a.chunk, rank, a.peer, boundary)
    return MessageKey(kind, path, a.chunk, a.peer, rank, boundary)


def needed_receives(schedule: Schedule, rank: int, a: Action) -> list[MessageKey]:
    """Message keys a compute action consumes from other ranks (empty for local hand-overs)."""
    layout = schedule.layout
    keys = []
    if a.op in (Op.F, Op.FB):
        prev = layout.prev(rank, a.module)
        if prev is not None and prev[0] != rank:
            path, stage = layout.locate(rank, a.module)
            keys.append(MessageKey("F", path, a.chunk, prev[0], rank, stage - 1))
    backward = (a.b_module, a.b_chunk) if a.op is Op.FB else (a.module, a.chunk)
    if a.op in (Op.B, Op.I, Op.FB):
        nxt = layout.next(rank, backward[0])
        if nxt is not None and nxt[0] != rank:
            path, stage = layout.locate(rank, backward[0])
            keys.append(MessageKey("B", path, backward[1], nxt[0], rank, stage))
    return keys


def check_complete(schedule: Schedule) -> None:
    """Every micro-batch of every local module is forwarded once, then backwarded once, and every deferred
    weight-gradient batch (one per ``I`` or deferred ``FB``) is popped by exactly one ``W`` after it was queued."""
    layout = schedule.layout
    for rank, actions in enumerate(schedule.ranks):
        fwd: Counter[tuple[int, int]] = Counter()
        bwd: Counter[tuple[int, int]] = Counter()
        pending = 0
        for a in actions:
            if a.op in (Op.F, Op.FB):
                fwd[(a.module, a.chunk)] += 1
            if a.op in (Op.B, Op.I, Op.FB):
                key = (a.b_module, a.b_chunk) if a.op is Op.FB else (a.module, a.chunk)
                if fwd[key] != 1:
                    raise ScheduleError(f"rank {rank}: backward of {key} before its forward ({a})")
                nxt = layout.next(rank, key[0])
                if nxt is not None and nxt[0] == rank and bwd[(nxt[1], key[1])] != 1:
                    raise ScheduleError(f"rank {rank}: {a} runs before the local backward feeding it")
                bwd[key] += 1
            if a.op is Op.F:
                prev = layout.prev(rank, a.module)
                if prev is not None and prev[0] == rank and fwd[(prev[1], a.chunk)] != 1:
                    raise ScheduleError(f"rank {rank}: {a} runs before the local forward feeding it")
            pending += a.defers_weights
            if a.op is Op.W:
                pending -= 1
                if pending < 0:
                    raise ScheduleError(f"rank {rank}: W with no deferred weight gradient queued")
        expected = {(m, c) for m in range(layout.modules_per_rank) for c in range(schedule.chunks_per_path)}
        for name, seen in (("forward", fwd), ("backward", bwd)):
            if set(seen) != expected or any(v != 1 for v in seen.values()):
                missing = sorted(expected - set(seen))
                raise ScheduleError(f"rank {rank}: {name} not run exactly once per micro-batch; missing {missing}")
        if pending != 0:
            raise ScheduleError(f"rank {rank}: {pending} deferred weight-gradient batches never popped")


def check_matching(schedule: Schedule) -> None:
    """Sends and receives pair up between neighbours, in the same order on both sides.

    Order matters on NCCL, which matches point-to-point operations between two ranks by issue order.
    Every message consumed by a compute must be received by it, before it.
    """
    sends: dict[tuple[int, int], list] = defaultdict(list)
    recvs: dict[tuple[int, int], list] = defaultdict(list)
    layout = schedule.layout
    for rank, actions in enumerate(schedule.ranks):
        received = set()
        for a in actions:
            if a.op in (Op.SEND_F, Op.SEND_B):
                target = layout.next(rank, a.module) if a.op is Op.SEND_F else layout.prev(rank, a.module)
                if target is None or target[0] != a.peer:
                    raise ScheduleError(f"rank {rank}: {a} goes to the wrong peer (expected {target})")
                sends[(rank, a.peer)].append(message_key(schedule, rank, a))
            elif a.op in (Op.RECV_F, Op.RECV_B):
                source = layout.prev(rank, a.module) if a.op is Op.RECV_F else layout.next(rank, a.module)
                if source is None or source[0] != a.peer:
                    raise ScheduleError(f"rank {rank}: {a} comes from the wrong peer (expected {source})")
                key = message_key(schedule, rank, a)
                recvs[(a.peer, rank)].append(key)
                received.add(key)
            else:
                for key in needed_receives(schedule, rank, a):
                    if key not in received:
                        raise ScheduleError(f"rank {rank}: {a} consumes {key} that was never received before it")
    for pair in set(sends) | set(recvs):
        if sends[pair] != recvs[pair]:
            raise ScheduleError(
                f"messages {pair[0]}->{pair[1]} differ between sender and receiver:\n"
                f"  sent     {sends[pair]}\n  received {recvs[pair]}"
            )


@dataclass(eq=False, slots=True)
class _Group:
    rank: int
    keys: list[MessageKey]
    index: int = -1  # position among its rank's groups, once issued
    done: bool = False
    unmatched: int = 0  # async: messages whose other end is not issued yet


def simulate_progress(schedule: Schedule, model: str = "async") -> None:
    """Run the schedule symbolically under a communication model; raise :class:`DeadlockError` if stuck.

    See the module docstring for the two models. Compute takes no time here; only ordering is checked.
    """
    if model not in ("async", "grouped"):
        raise ValueError(f"unknown communication model {model!r}")
    n = len(schedule.ranks)
    # Split each rank's list into (group, compute, the messages the compute consumes) steps.
    steps: list[list[tuple[_Group | None, Action, list[MessageKey]]]] = []
    for rank, actions in enumerate(schedule.ranks):
        seq: list[tuple[_Group | None, Action, list[MessageKey]]] = []
        pending: list[MessageKey] = []
        for a in actions:
            if a.op.is_comm:
                pending.append(message_key(schedule, rank, a))
            else:
                seq.append((_Group(rank, pending) if pending else None, a, needed_receives(schedule, rank, a)))
                pending = []
        if pending:
            seq.append((_Group(rank, pending), Action(Op.W, chunk=-2), []))  # trailing sends: a no-op marker
        steps.append(seq)

    pos = [0] * n  # index of the next step per rank
    issued: list[list[_Group]] = [[] for _ in range(n)]  # groups issued, in order
    finished = [0] * n  # grouped: groups finish in issue order, so the first `finished` ones are done
    group_of: dict[tuple[MessageKey, int], _Group] = {}  # (message, 0 sender / 1 receiver side) -> its group
    completed_keys: set[MessageKey] = set()

    def issue(g: _Group) -> None:
        g.index = len(issued[g.rank])
        issued[g.rank].append(g)
        for key in g.keys:
            side = 0 if key.src == g.rank else 1
            group_of[(key, side)] = g
            if model == "async":  # every operation on its own: a message completes once both ends are posted
                other = group_of.get((key, 1 - side))
                if other is None:
                    g.unmatched += 1
                else:
                    completed_keys.add(key)
                    other.unmatched -= 1
                    other.done = other.unmatched == 0
        g.done = model == "async" and g.unmatched == 0

    def reached(g: _Group) -> bool:  # grouped: a group runs once every earlier group of its rank finished
        return g.index <= finished[g.rank]

    def try_complete_groups() -> bool:
        if model == "async":
            return False  # messages complete as their ends are issued
        progress = False
        changed = True
        while changed:
            changed = False
            for rank in range(n):
                if finished[rank] == len(issued[rank]):
                    continue
                g = issued[rank][finished[rank]]
                partners = [group_of.get((key, 1 if key.src == rank else 0)) for key in g.keys]
                if all(p is not None and reached(p) for p in partners):
                    g.done = True
                    finished[rank] += 1
                    completed_keys.update(k for k in g.keys if k.dst == rank)
                    progress = changed = True
        return progress

    while True:
        progress = False
        for rank in range(n):
            while pos[rank] < len(steps[rank]):
                group, _, needed = steps[rank][pos[rank]]
                if group is not None and group.index < 0:
                    issue(group)
                    progress = True
                    try_complete_groups()
                if any(k not in completed_keys for k in needed):
                    break
                pos[rank] += 1
                progress = True
        progress |= try_complete_groups()
        if all(pos[r] == len(steps[r]) for r in range(n)):
            unfinished = [g for gs in issued for g in gs if not g.done]
            if not unfinished:
                return
            if not progress:
                raise DeadlockError(f"[{model}] step ends with unmatched communication: {unfinished[0].keys}")
        if not progress:
            stuck = {r: str(steps[r][pos[r]][1]) for r in range(n) if pos[r] < len(steps[r])}
            raise DeadlockError(f"[{model}] no rank can progress; waiting at {stuck}")


def check_schedule(schedule: Schedule, models: tuple[str, ...] = ("async",)) -> None:
    """All static checks: completeness, matching, and progress under each communication model."""
    check_complete(schedule)
    check_matching(schedule)
    for model in models:
        simulate_progress(schedule, model)

"""Chunk times on two resources: compute and communication, for lone chunks and overlapped pairs.

A chunk is one pipeline module for one micro-batch: a run of blocks, each attention -> dispatch -> MLP ->
combine. Compute sub-stages run on the compute stream, the all-to-alls on the communication stream (SMs
reserved for them), so the two overlap whenever the dependencies allow. :func:`chunk_times` places every
sub-stage of a lone forward, a lone backward and an overlapped forward/backward pair on the two streams,
each stream in issue order, each sub-stage starting when its stream is free and its inputs exist:

- a lone forward waits for every all-to-all it issues (the next compute needs its result); a lone backward
  hides what its weight gradients cover (dX, the transfer starts, dW runs under it);
- the overlapped pair follows the order the runtime runs, read from the same table
  (:data:`dualpipe.pair_order.PAIR_ORDER`; DeepSeek-V3 Figure 4): forward block i is paired with backward
  block L-1-i, computes run F.attn, B.shared, B.mlp, F.shared, F.mlp, B.attn, and each all-to-all starts as
  soon as its input exists (the forward dispatch, whose row counts are exchanged first, at the table's
  ``START_PREPARED``), so one micro-batch's transfer runs under the other's compute. What the pair's
  compute cannot cover stays exposed.

The results are the per-action costs :mod:`dualpipe.simulate` takes (``F``, ``B``, ``W``, ``F&B``) plus the
all-to-all time each hides and exposes, which the planner sums into the step's exposed fraction.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from dualpipe.events import interval_overlap, interval_union
from dualpipe.pair_order import FIRST, MAIN, PAIR_ORDER, SIDE, START_PREPARED, Step

__all__ = ["BlockTimes", "ChunkTimes", "chunk_times", "in_flight", "two_stream_schedule"]


@dataclass(frozen=True, slots=True)
class BlockTimes:
    """Seconds of one block's sub-stages for one micro-batch (forward; backward split into dX and dW)."""

    attn_f: float
    attn_dx: float
    attn_dw: float
    mlp_f: float
    """Router, permute, experts (routed and shared) and unpermute."""
    mlp_dx: float
    mlp_dw: float
    dispatch: float
    """One all-to-all in the dispatch direction: the forward dispatch, and in backward the combine's gradient
    (the output gradient sent back along the dispatch's routes, as many bytes: FP8 under FP8 dispatch)."""
    combine: float
    """One all-to-all in the combine direction: the forward combine, and in backward the dispatch's gradient."""
    shared_f: float = 0.0
    """The shared experts, when timed apart from ``mlp_*`` (the runtime's side piece; 0: inside ``mlp_*``)."""
    shared_dx: float = 0.0
    shared_dw: float = 0.0
    host_f: float = 0.0
    """Host work between the forward's pieces (issuing its transfers, routing metadata): the compute stream's
    time, half before each transfer the forward issues, and no compute (measured: ``bench.overlap
    --calibrate``; 0 in the analytic model, where the host runs ahead of the GPU)."""
    host_b: float = 0.0
    """The same for the backward."""
    counts: float = 0.0
    """The forward dispatch's row-count exchange, which the rank waits for before it issues the rows (a
    blocking collective: its latency and the wait for the group's last rank; measured, 0 in the analytic
    model, where ``dispatch`` holds it)."""

    @property
    def compute_f(self) -> float:
        """The compute stream's busy time of the forward: its compute and its host work."""
        return self.attn_f + self.shared_f + self.mlp_f + self.host_f

    @property
    def compute_b(self) -> float:
        return self.attn_dx + self.attn_dw + self.shared_dx + self.shared_dw + self.mlp_dx + self.mlp_dw + self.host_b

    @property
    def comm(self) -> float:
        return self.counts + self.dispatch + self.combine


@dataclass(frozen=True, slots=True)
class ChunkTimes:
    """Per-action costs of one chunk (seconds) and its all-to-all accounting."""

    F: float
    B: float
    """A full backward (input and weight gradients), alone."""
    W: float
    """The weight-gradient part of ``B`` (compute only)."""
    FB: float
    """The overlapped forward/backward pair."""
    comm_f: float
    """All-to-all time of one forward chunk (the backward moves as much)."""
    exposed_f: float
    """All-to-all time a lone forward leaves exposed: its duration minus its compute."""
    exposed_b: float
    """All-to-all time a lone backward leaves exposed (its dW hides some)."""
    exposed_fb: float
    """All-to-all time the pair leaves exposed: its duration minus its compute."""
    flight: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """The lone forward's, the lone backward's and the pair's all-to-all time in flight: the union of each
    transfer's interval from its issue to its result's use (the row counts: their whole wait), as
    :func:`dualpipe.events.hidden_fraction` takes it from a recorded run."""
    covered: tuple[float, float, float] = (0.0, 0.0, 0.0)
    """Of :attr:`flight`, the time under compute (host work and waits are none): the measured hidden
    fraction's numerator."""


@dataclass(frozen=True, slots=True)
class _Op:
    name: str
    stream: str  # "compute" or "comm"
    seconds: float
    after: tuple[str, ...] = ()
    work: bool = True
    """Compute (False: host work or a blocking wait on the compute stream)."""
    uses: str = ""
    """The transfer whose result this op consumes (its in-flight interval ends where this op starts)."""


def two_stream_schedule(ops: Sequence[_Op]) -> dict[str, tuple[float, float]]:
    """``{name: (start, end)}``: each op starts when its stream is free (streams run in list order) and every
    op it comes ``after`` has ended."""
    free = {"compute": 0.0, "comm": 0.0}
    placed: dict[str, tuple[float, float]] = {}
    for op in ops:
        start = max([free[op.stream], *(placed[d][1] for d in op.after)])
        placed[op.name] = (start, start + op.seconds)
        free[op.stream] = start + op.seconds
    return placed


def _host(p: str, name: str, seconds: float, after: str | None) -> list[_Op]:
    """The host work before a transfer's issue (none where it costs nothing: the analytic model)."""
    return [_Op(p + name, "compute", seconds, (after,) if after else (), work=False)] if seconds > 0 else []


def _forward_ops(blocks: Sequence[BlockTimes], tag: str) -> list[dict[str, list[_Op]]]:
    """Per block, its forward steps by name, each a list of ops in issue order; a block's attention needs the
    previous block's combine. ``issue`` is the host work before the dispatch and the row counts' exchange
    (measured costs only); ``prepared`` waits for the counts and starts the dispatch."""
    out, prev = [], None
    for i, b in enumerate(blocks):
        p = f"{tag}{i}."
        host_d = _host(p, "host_dispatch", b.host_f / 2, p + "attn")
        issued = host_d[-1].name if host_d else p + "attn"
        counts, waited = [], []
        if b.counts > 0:  # exchanged from the issue (after its host work) on, waited for where the rows start
            counts = [_Op(p + "counts", "comm", 0.0, (issued,))]
            waited = [_Op(p + "wait_counts", "compute", b.counts, (p + "counts",), work=False, uses=p + "counts")]
        host_c = _host(p, "host_combine", b.host_f / 2, p + "mlp")
        out.append(
            {
                "attn": [_Op(p + "attn", "compute", b.attn_f, (prev,) if prev else (), uses=prev or "")],
                "issue": host_d + counts,
                "prepared": [
                    *waited,
                    _Op(p + "dispatch", "comm", b.dispatch, (waited[-1].name if waited else issued,)),
                ],
                "shared": [_Op(p + "shared", "compute", b.shared_f, (p + "attn",))],
                "mlp": [_Op(p + "mlp", "compute", b.mlp_f, (p + "dispatch",), uses=p + "dispatch")],
                "combine": [
                    *host_c,
                    _Op(p + "combine", "comm", b.combine, (host_c[-1].name if host_c else p + "mlp",)),
                ],
            }
        )
        prev = p + "combine"
    return out


def _backward_ops(blocks: Sequence[BlockTimes], tag: str) -> list[dict[str, list[_Op]]]:
    """Per block, last block first, its backward steps by name (lists of ops in issue order). As the runtime
    runs a compute piece's backward: dX, then the transfer that needs it starts (after its host work), then dW
    (under that transfer). A block's combine gradient needs the block after it to have finished its attention
    dX."""
    out, prev = [], None
    for i in reversed(range(len(blocks))):
        b, p = blocks[i], f"{tag}{i}."
        host_c = _host(p, "host_combine", b.host_b / 2, prev)
        host_d = _host(p, "host_dispatch", b.host_b / 2, p + "mlp_dx")
        combine_after = host_c[-1].name if host_c else prev
        out.append(
            {
                # the combine's gradient travels in the dispatch direction, the dispatch's in the combine's
                "combine": [*host_c, _Op(p + "combine", "comm", b.dispatch, (combine_after,) if combine_after else ())],
                "mlp_dx": [_Op(p + "mlp_dx", "compute", b.mlp_dx, (p + "combine",), uses=p + "combine")],
                "dispatch": [
                    *host_d,
                    _Op(p + "dispatch", "comm", b.combine, (host_d[-1].name if host_d else p + "mlp_dx",)),
                ],
                "mlp_dw": [_Op(p + "mlp_dw", "compute", b.mlp_dw)],
                "shared_dx": [_Op(p + "shared_dx", "compute", b.shared_dx, (prev,) if prev else ())],
                "shared_dw": [_Op(p + "shared_dw", "compute", b.shared_dw)],
                "attn_dx": [_Op(p + "attn_dx", "compute", b.attn_dx, (p + "dispatch",), uses=p + "dispatch")],
                "attn_dw": [_Op(p + "attn_dw", "compute", b.attn_dw)],
            }
        )
        prev = p + "attn_dx"
    return out


_F_ALONE = ("attn", "issue", "prepared", "shared", "mlp", "combine")
_B_ALONE = ("combine", "mlp_dx", "dispatch", "mlp_dw", "shared_dx", "shared_dw", "attn_dx", "attn_dw")
# What each step of the pair order issues for one of our blocks, compute and the transfers it makes ready, in
# issue order (the forward dispatch starts at START_PREPARED: its row counts are exchanged first).
_STEP_OPS = {
    Step("fwd", FIRST): ("F", "attn", "issue"),
    Step("fwd", SIDE): ("F", "shared"),
    Step("fwd", MAIN): ("F", "mlp", "combine"),
    Step("bwd", SIDE): ("B", "shared_dx", "shared_dw"),
    Step("bwd", MAIN): ("B", "mlp_dx", "dispatch", "mlp_dw"),
    Step("bwd", FIRST): ("B", "attn_dx", "attn_dw"),
}


def _end(placed: dict[str, tuple[float, float]]) -> float:
    return max((end for _, end in placed.values()), default=0.0)


def _alone(blocks: list[dict[str, list[_Op]]], steps: Sequence[str]) -> list[_Op]:
    return [op for blk in blocks for k in steps for op in blk[k]]


def _pair_ops(f_blocks: list[dict[str, list[_Op]]], b_blocks: list[dict[str, list[_Op]]]) -> list[_Op]:
    """The runtime's pair order (:data:`dualpipe.pair_order.PAIR_ORDER`) over paired blocks: B.combine at
    once (its input is the previous pair's B.attn dX), then the table's steps; F.dispatch starts at
    ``START_PREPARED``, after the compute issued before it. Unpaired blocks run alone after the pairs (the
    longer module's extra blocks)."""
    ops: list[_Op] = []
    for f, b in zip(f_blocks, b_blocks):
        ops += b["combine"]
        for step in PAIR_ORDER:
            if step == START_PREPARED:
                issued = next(op.name for op in reversed(ops) if op.stream == "compute")  # the last compute issued
                *wait, d = f["prepared"]
                ops += [*wait, _Op(d.name, d.stream, d.seconds, (*d.after, issued))]
                continue
            side, *names = _STEP_OPS[step]
            ops += [op for n in names for op in (f if side == "F" else b)[n]]
    n = min(len(f_blocks), len(b_blocks))
    return ops + _alone(f_blocks[n:], _F_ALONE) + _alone(b_blocks[n:], _B_ALONE)


def in_flight(ops: Sequence[_Op], placed: dict[str, tuple[float, float]]) -> tuple[float, float]:
    """``(in flight, covered)``: the union of the transfers' intervals from their start to their result's use
    (the start of the op that uses it; the end of a wait), and how much of it lies under compute that works
    (not host work, not waits) — :func:`dualpipe.events.hidden_fraction`'s terms, from a predicted timeline."""
    used: dict[str, float] = {}
    for op in ops:
        if op.uses:
            s, e = placed[op.name]
            used[op.uses] = min(used.get(op.uses, math.inf), s if op.work else e)
    flight = interval_union(
        (placed[o.name][0], max(placed[o.name][1], used.get(o.name, -math.inf))) for o in ops if o.stream == "comm"
    )
    work = interval_union(placed[o.name] for o in ops if o.stream == "compute" and o.work and o.seconds > 0)
    return sum(b - a for a, b in flight), interval_overlap(flight, work)


def chunk_times(
    f_blocks: Sequence[BlockTimes],
    b_blocks: Sequence[BlockTimes] | None = None,
    *,
    extra_f: float = 0.0,
    extra_b: float = 0.0,
) -> ChunkTimes:
    """Costs of a chunk of ``f_blocks`` (forward) paired with one of ``b_blocks`` (backward; default the same
    blocks). ``extra_f`` / ``extra_b``: compute outside the blocks (embedding, head and loss), which the
    pair runs unoverlapped at its ends, as the runtime runs unpaired pieces."""
    b_blocks = f_blocks if b_blocks is None else b_blocks
    f_ops, b_ops = _forward_ops(f_blocks, "F"), _backward_ops(b_blocks, "B")
    timelines = [_alone(f_ops, _F_ALONE), _alone(b_ops, _B_ALONE), _pair_ops(f_ops, b_ops)]
    placed = [two_stream_schedule(ops) for ops in timelines]
    lone_f, lone_b = _end(placed[0]) + extra_f, _end(placed[1]) + extra_b
    fb = _end(placed[2]) + extra_f + extra_b
    flights = [in_flight(ops, p) for ops, p in zip(timelines, placed)]
    compute_f = sum(b.compute_f for b in f_blocks) + extra_f
    compute_b = sum(b.compute_b for b in b_blocks) + extra_b
    return ChunkTimes(
        F=lone_f,
        B=lone_b,
        W=sum(b.attn_dw + b.mlp_dw for b in b_blocks),
        FB=fb,
        comm_f=sum(b.comm for b in f_blocks),
        exposed_f=max(0.0, lone_f - compute_f),
        exposed_b=max(0.0, lone_b - compute_b),
        exposed_fb=max(0.0, fb - compute_f - compute_b),
        flight=tuple(f for f, _ in flights),
        covered=tuple(c for _, c in flights),
    )

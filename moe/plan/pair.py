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

from collections.abc import Sequence
from dataclasses import dataclass

from dualpipe.pair_order import FIRST, MAIN, PAIR_ORDER, SIDE, START_PREPARED, Step

__all__ = ["BlockTimes", "ChunkTimes", "chunk_times", "two_stream_schedule"]


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

    @property
    def compute_f(self) -> float:
        return self.attn_f + self.shared_f + self.mlp_f

    @property
    def compute_b(self) -> float:
        return self.attn_dx + self.attn_dw + self.shared_dx + self.shared_dw + self.mlp_dx + self.mlp_dw

    @property
    def comm(self) -> float:
        return self.dispatch + self.combine


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


@dataclass(frozen=True, slots=True)
class _Op:
    name: str
    stream: str  # "compute" or "comm"
    seconds: float
    after: tuple[str, ...] = ()


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


def _forward_ops(blocks: Sequence[BlockTimes], tag: str) -> list[dict[str, _Op]]:
    """Per block, its forward sub-stages by name; a block's attention needs the previous block's combine."""
    out, prev = [], None
    for i, b in enumerate(blocks):
        p = f"{tag}{i}."
        out.append(
            {
                "attn": _Op(p + "attn", "compute", b.attn_f, (prev,) if prev else ()),
                "dispatch": _Op(p + "dispatch", "comm", b.dispatch, (p + "attn",)),
                "shared": _Op(p + "shared", "compute", b.shared_f, (p + "attn",)),
                "mlp": _Op(p + "mlp", "compute", b.mlp_f, (p + "dispatch",)),
                "combine": _Op(p + "combine", "comm", b.combine, (p + "mlp",)),
            }
        )
        prev = p + "combine"
    return out


def _backward_ops(blocks: Sequence[BlockTimes], tag: str) -> list[dict[str, _Op]]:
    """Per block, last block first, its backward sub-stages by name. As the runtime runs a compute piece's
    backward: dX, then the transfer that needs it starts, then dW (under that transfer). A block's combine
    gradient needs the block after it to have finished its attention dX."""
    out, prev = [], None
    for i in reversed(range(len(blocks))):
        b, p = blocks[i], f"{tag}{i}."
        out.append(
            {
                # the combine's gradient travels in the dispatch direction, the dispatch's in the combine's
                "combine": _Op(p + "combine", "comm", b.dispatch, (prev,) if prev else ()),
                "mlp_dx": _Op(p + "mlp_dx", "compute", b.mlp_dx, (p + "combine",)),
                "dispatch": _Op(p + "dispatch", "comm", b.combine, (p + "mlp_dx",)),
                "mlp_dw": _Op(p + "mlp_dw", "compute", b.mlp_dw),
                "shared_dx": _Op(p + "shared_dx", "compute", b.shared_dx, (prev,) if prev else ()),
                "shared_dw": _Op(p + "shared_dw", "compute", b.shared_dw),
                "attn_dx": _Op(p + "attn_dx", "compute", b.attn_dx, (p + "dispatch",)),
                "attn_dw": _Op(p + "attn_dw", "compute", b.attn_dw),
            }
        )
        prev = p + "attn_dx"
    return out


_F_ALONE = ("attn", "dispatch", "shared", "mlp", "combine")
_B_ALONE = ("combine", "mlp_dx", "dispatch", "mlp_dw", "shared_dx", "shared_dw", "attn_dx", "attn_dw")
# What each step of the pair order issues for one of our blocks, compute and the transfers it makes ready, in
# issue order (the forward dispatch is issued at START_PREPARED: its row counts are exchanged first).
_STEP_OPS = {
    Step("fwd", FIRST): ("F", "attn"),
    Step("fwd", SIDE): ("F", "shared"),
    Step("fwd", MAIN): ("F", "mlp", "combine"),
    Step("bwd", SIDE): ("B", "shared_dx", "shared_dw"),
    Step("bwd", MAIN): ("B", "mlp_dx", "dispatch", "mlp_dw"),
    Step("bwd", FIRST): ("B", "attn_dx", "attn_dw"),
}


def _end(placed: dict[str, tuple[float, float]]) -> float:
    return max((end for _, end in placed.values()), default=0.0)


def _pair_ops(f_blocks: list[dict[str, _Op]], b_blocks: list[dict[str, _Op]]) -> list[_Op]:
    """The runtime's pair order (:data:`dualpipe.pair_order.PAIR_ORDER`) over paired blocks: B.combine at
    once (its input is the previous pair's B.attn dX), then the table's steps; F.dispatch is issued at
    ``START_PREPARED``, after the compute issued before it. Unpaired blocks run alone after the pairs (the
    longer module's extra blocks)."""
    ops: list[_Op] = []
    for f, b in zip(f_blocks, b_blocks):
        ops.append(b["combine"])
        issued = f["attn"].name  # the last compute issued
        for step in PAIR_ORDER:
            if step == START_PREPARED:
                d = f["dispatch"]
                ops.append(_Op(d.name, d.stream, d.seconds, (*d.after, issued)))
                continue
            side, *names = _STEP_OPS[step]
            ops += [(f if side == "F" else b)[n] for n in names]
            issued = next(op.name for op in reversed(ops) if op.stream == "compute")
    n = min(len(f_blocks), len(b_blocks))
    for f in f_blocks[n:]:
        ops += [f[k] for k in _F_ALONE]
    for b in b_blocks[n:]:
        ops += [b[k] for k in _B_ALONE]
    return ops


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
    lone_f = _end(two_stream_schedule([blk[k] for blk in _forward_ops(f_blocks, "F") for k in _F_ALONE])) + extra_f
    lone_b = _end(two_stream_schedule([blk[k] for blk in _backward_ops(b_blocks, "B") for k in _B_ALONE])) + extra_b
    pair = two_stream_schedule(_pair_ops(_forward_ops(f_blocks, "F"), _backward_ops(b_blocks, "B")))
    fb = _end(pair) + extra_f + extra_b
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
    )

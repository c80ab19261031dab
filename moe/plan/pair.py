"""Chunk times on two resources: compute and communication, for lone chunks and overlapped pairs.

A chunk is one pipeline module for one micro-batch: a run of blocks, each attention -> dispatch -> MLP ->
combine. Compute sub-stages run on the compute stream, the all-to-alls on the communication stream (SMs
reserved for them), so the two overlap whenever the dependencies allow. :func:`chunk_times` places every
sub-stage of a lone forward, a lone backward and an overlapped forward/backward pair on the two streams,
each stream in issue order, each sub-stage starting when its stream is free and its inputs exist:

- a lone chunk waits for every all-to-all it issues (the next compute needs its result): nothing hidden;
- the overlapped pair follows the runtime's interleave (DeepSeek-V3 Figure 4; :mod:`dualpipe.overlap`):
  forward block i is paired with backward block L-1-i, computes alternate F.attn, B.mlp, F.mlp, B.attn,
  and each all-to-all starts as soon as its input exists, so one micro-batch's transfer runs under the
  other's compute. What the pair's compute cannot cover stays exposed.

The results are the per-action costs :mod:`dualpipe.simulate` takes (``F``, ``B``, ``W``, ``F&B``) plus the
all-to-all time each hides and exposes, which the planner sums into the step's exposed fraction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    """One all-to-all of the dispatch (its backward moves the same bytes the other way: same time)."""
    combine: float

    @property
    def compute_f(self) -> float:
        return self.attn_f + self.mlp_f

    @property
    def compute_b(self) -> float:
        return self.attn_dx + self.attn_dw + self.mlp_dx + self.mlp_dw

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
    exposed_fb: float
    """All-to-all time the pair leaves exposed: its duration minus the longest its compute alone takes."""


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


def _forward_ops(blocks: Sequence[BlockTimes], tag: str, prev: str | None) -> list[list[_Op]]:
    """Per block, its four forward sub-stages; a block's attention needs the previous block's combine."""
    out = []
    for i, b in enumerate(blocks):
        p = f"{tag}{i}."
        first = (prev,) if prev else ()
        out.append(
            [
                _Op(p + "attn", "compute", b.attn_f, first),
                _Op(p + "dispatch", "comm", b.dispatch, (p + "attn",)),
                _Op(p + "mlp", "compute", b.mlp_f, (p + "dispatch",)),
                _Op(p + "combine", "comm", b.combine, (p + "mlp",)),
            ]
        )
        prev = p + "combine"
    return out


def _backward_ops(blocks: Sequence[BlockTimes], tag: str, prev: str | None) -> list[list[_Op]]:
    """Per block, last block first, its backward sub-stages (each compute is dX then dW, as the runtime runs
    a paired backward); a block's combine gradient needs the block after it to have finished attention."""
    out = []
    for i in reversed(range(len(blocks))):
        b, p = blocks[i], f"{tag}{i}."
        first = (prev,) if prev else ()
        out.append(
            [
                _Op(p + "combine", "comm", b.combine, first),
                _Op(p + "mlp", "compute", b.mlp_dx + b.mlp_dw, (p + "combine",)),
                _Op(p + "dispatch", "comm", b.dispatch, (p + "mlp",)),
                _Op(p + "attn", "compute", b.attn_dx + b.attn_dw, (p + "dispatch",)),
            ]
        )
        prev = p + "attn"
    return out


def _end(placed: dict[str, tuple[float, float]]) -> float:
    return max((end for _, end in placed.values()), default=0.0)


def _pair_ops(f_blocks: list[list[_Op]], b_blocks: list[list[_Op]]) -> list[_Op]:
    """The runtime's interleave of paired blocks: per pair, computes F.attn, B.mlp, F.mlp, B.attn and comms
    B.combine, F.dispatch, B.dispatch, F.combine, each stream in that order; unpaired blocks run alone
    after the pairs (the longer module's extra blocks)."""
    ops: list[_Op] = []
    for f, b in zip(f_blocks, b_blocks):
        f_attn, f_dispatch, f_mlp, f_combine = f
        b_combine, b_mlp, b_dispatch, b_attn = b
        ops += [b_combine, f_attn, f_dispatch, b_mlp, b_dispatch, f_mlp, f_combine, b_attn]
    n = min(len(f_blocks), len(b_blocks))
    for rest in (*f_blocks[n:], *b_blocks[n:]):
        ops += rest
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
    lone_f = _end(two_stream_schedule([op for blk in _forward_ops(f_blocks, "F", None) for op in blk])) + extra_f
    lone_b = _end(two_stream_schedule([op for blk in _backward_ops(b_blocks, "B", None) for op in blk])) + extra_b
    pair = two_stream_schedule(_pair_ops(_forward_ops(f_blocks, "F", None), _backward_ops(b_blocks, "B", None)))
    fb = _end(pair) + extra_f + extra_b
    compute = sum(b.compute_f for b in f_blocks) + sum(b.compute_b for b in b_blocks) + extra_f + extra_b
    return ChunkTimes(
        F=lone_f,
        B=lone_b,
        W=sum(b.attn_dw + b.mlp_dw for b in b_blocks),
        FB=fb,
        comm_f=sum(b.comm for b in f_blocks),
        exposed_fb=max(0.0, fb - compute),
    )

"""Every all-to-all of an overlapped pair runs under compute that does work, with and without ``prepare=``.

The worked example's stage (examples/overlap_moe.py: attention, shared expert, routed experts; plain
autograd layers, so every dW piece is empty) on 2 gloo ranks, one expert-parallel group, as declared and
with its shared expert left out (two compute pieces, where nothing but the backward MLP can cover the forward
dispatch): micro-batch A's forward, then the hook (B's forward beside A's backward) with the recorder on. The
recorded timeline is read with ``dualpipe.events.hidden_fraction`` per kind: each forward and backward
dispatch and combine of the pair must have run while a compute piece that did work was running, on every rank
and in every block.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools

import torch
import torch.distributed as dist

from dualpipe.events import EventRecorder, HiddenFraction, hidden_fraction
from dualpipe.pieces import Comm, Pieces
from examples.overlap_moe import Config, Stage, loss_fn
from tests.distributed import run_ranks

CFG = Config(dim=32, heads=2, ffn=64, layers=2)
KINDS = ("dispatch.fwd", "combine.fwd", "dispatch.bwd", "combine.bwd")


def _variant(block: Pieces, prepare: bool, shared: bool) -> Pieces:
    """``block`` without its prepare step (the dispatch exchanges the row counts inside its start) and/or
    without its shared expert."""

    def unprepared(piece):
        if prepare or not isinstance(piece, Comm) or piece.prepare is None:
            return piece
        plan, start = piece.prepare, piece.forward
        return dataclasses.replace(piece, prepare=None, forward=lambda ctx, *x: (plan(ctx, *x), start(ctx, *x))[1])

    pieces = tuple(unprepared(p) for p in block.pieces if shared or p.name != "shared")
    return dataclasses.replace(block, pieces=pieces, output=block.output if shared else ("a", "y"))


def _declared(pieces, prepare: bool, shared: bool) -> list[Pieces]:
    return [_variant(b, prepare, shared) if b.paired else b for b in pieces()]


def _pairs(rank: int, world: int) -> dict[tuple[bool, bool], list[HiddenFraction]]:
    found: dict[tuple[bool, bool], list[HiddenFraction]] = {}
    for prepare, shared in itertools.product((True, False), (True, False)):
        torch.manual_seed(0)
        stage = Stage(CFG, list(range(CFG.layers)), True, True, dist.group.WORLD)
        stage.pieces = functools.partial(_declared, stage.pieces, prepare, shared)
        stage.recorder = recorder = EventRecorder()
        for i in range(3):  # the first pair warms up
            ids = torch.randint(CFG.vocab, (2, 4, 32), generator=torch.Generator().manual_seed(10 * rank + i))
            loss1 = loss_fn(stage(ids[0]), ids[0].roll(1, 1))
            recorder.clear()
            Stage.overlapped_forward_backward(stage, [ids[1]], loss_fn, [ids[1].roll(1, 1)], stage, loss1, None, None)
            if i:
                found.setdefault((prepare, shared), []).append(hidden_fraction(recorder))
    return found


def test_every_all_to_all_of_a_pair_runs_under_working_compute() -> None:
    for rank, variants in enumerate(run_ranks(_pairs, world_size=2, timeout=120)):
        for (prepare, shared), pairs in variants.items():
            for hidden in pairs:
                assert ("counts.fwd" in hidden.kinds) == prepare
                for kind in KINDS:
                    h = hidden.kinds[kind]
                    # one per block, each under compute that did work for part of its flight
                    where = f"rank {rank}, prepare={prepare}, shared expert={shared}: {kind}"
                    assert h.count == CFG.layers and h.covered == h.count and h.hidden_s > 0, (where, h)

"""Gradient helpers for layouts that hold a stage twice."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dualpipe.executor import Pipeline

__all__ = ["sum_mirrored_grads"]


def sum_mirrored_grads(pipe: Pipeline) -> None:
    """Add the gradients of every stage held twice (DualPipe: stage s on rank s as module 0 and on rank N-1-s
    as module 1), so both ranks see the full gradient of each stage, as one model would.

    Call after ``step`` (and before the optimizer). Both ranks compute ``a + b`` with the same operands, so
    the copies stay bitwise identical. A no-op for layouts without mirrored stages.
    """
    layout = pipe.layout
    if not layout.mirrored:
        return
    mirrors = [layout.mirror(pipe.rank, m) for m in range(len(pipe.module))]
    (peer,) = {rank for rank, _ in mirrors}  # one mirror rank holds all of this rank's stages
    mine = [_flat_grads(pipe.module[m]) for m in range(len(pipe.module))]
    theirs = [torch.empty_like(t) for t in mine]  # the peer's copy of the same stage
    group_peer = pipe.p2p.to_group_rank[peer]
    # Both ranks hold the same stages: exchanging them in stage order matches on NCCL (issue order) and on
    # gloo (the tag names the stage).
    ops = []
    for m in sorted(range(len(pipe.module)), key=lambda m: layout.stage_of(pipe.rank, m)):
        tag = 1 + layout.stage_of(pipe.rank, m)
        ops.append(dist.P2POp(dist.isend, mine[m], group=pipe.group, group_peer=group_peer, tag=tag))
        ops.append(dist.P2POp(dist.irecv, theirs[m], group=pipe.group, group_peer=group_peer, tag=tag))
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for m, (own, other) in enumerate(zip(mine, theirs)):
        # IEEE addition is commutative, so both ranks get bitwise-identical sums.
        _unflatten_into(pipe.module[m], own + other)


def _flat_grads(module: torch.nn.Module) -> torch.Tensor:
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        return torch.empty(0, device=next(module.buffers(), torch.empty(0)).device)
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params])


def _unflatten_into(module: torch.nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in module.parameters():
        if not p.requires_grad:
            continue
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n

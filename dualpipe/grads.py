"""Gradient helpers for layouts that hold a stage twice."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dualpipe.executor import Pipeline

__all__ = ["sum_mirrored_grads"]


def sum_mirrored_grads(pipe: Pipeline) -> None:
    """DualPipe holds stage s on rank s (module 0) and on rank N-1-s (module 1): add the two copies'
    gradients so both ranks see the full gradient of each stage, as one model would.

    Call after ``step`` (and before the optimizer). Both ranks compute ``a + b`` with the same operands, so
    the copies stay bitwise identical. A no-op for layouts without mirrored stages.
    """
    if pipe.schedule_name != "dualpipe":
        return
    peer = pipe.num_ranks - 1 - pipe.rank
    mine = [_flat_grads(pipe.module[0]), _flat_grads(pipe.module[1])]
    theirs = [torch.empty_like(mine[1]), torch.empty_like(mine[0])]
    group_peer = pipe.p2p.to_group_rank[peer]
    # My module 0 is the peer's module 1 (the same stage), and vice versa.
    ops = [
        dist.P2POp(dist.isend, mine[0], group=pipe.group, group_peer=group_peer, tag=1),
        dist.P2POp(dist.isend, mine[1], group=pipe.group, group_peer=group_peer, tag=2),
        dist.P2POp(dist.irecv, theirs[0], group=pipe.group, group_peer=group_peer, tag=2),
        dist.P2POp(dist.irecv, theirs[1], group=pipe.group, group_peer=group_peer, tag=1),
    ]
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

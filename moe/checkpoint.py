"""Distributed checkpoints that survive crashes and change of parallel layout.

Everything is saved with ``torch.distributed.checkpoint`` under *global* names, so a checkpoint written at
one (pp, ep) loads at another:

- stage parameters and buffers are already named by global layer (``blocks.7.attn.wq.weight``);
- expert weights, sharded over the expert-parallel group as ``[E_local, ...]``, are saved one expert per
  entry (``blocks.7.mlp.experts.w1.e42``), so any split of the experts reads its rows;
- optimizer state (Adam/AdamW) follows its parameter's names;
- replicated entries (non-expert weights on every ep rank, DualPipe's two copies of a stage) are written
  once, the planner de-duplicates them.

Atomicity: all ranks write into ``.step_NNNNNNNN.partial``; after a barrier rank 0 renames it to
``step_NNNNNNNN`` and then atomically replaces the ``latest`` pointer. A crash at any point leaves the last
good checkpoint and its pointer untouched; a stale partial directory is removed by the next save.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]

_LATEST = "latest"


def _expert_offset(module: nn.Module, name: str) -> int | None:
    """Global index of the first local expert for an expert tensor ``name`` of a stage, else None."""
    parts = name.split(".")
    if "experts" not in parts or parts[0] != "blocks":
        return None
    block = module.blocks[parts[1]]  # type: ignore[index]
    return block.dispatcher.local_experts.start


def _global_tensors(
    modules: Sequence[nn.Module],
) -> Iterator[tuple[str, torch.Tensor, nn.Parameter | None, int | None]]:
    """(global key, tensor to save or load in place, owning parameter or None for buffers, expert row)."""
    for module in modules:
        params = dict(module.named_parameters())
        for name, t in [*params.items(), *module.named_buffers()]:
            param = params.get(name)
            offset = _expert_offset(module, name)
            if offset is None:
                yield name, t, param, None
            else:
                for row in range(t.shape[0]):
                    yield f"{name}.e{offset + row}", t[row], param, row


def _adam_state(optimizer: torch.optim.Optimizer, p: nn.Parameter) -> dict[str, torch.Tensor]:
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"checkpointing supports Adam/AdamW state, not {type(optimizer).__name__}")
    state = optimizer.state[p]
    if not state:  # before the first step: create the state the optimizer would, so it can be loaded into
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _state_dict(modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer | None) -> dict[str, torch.Tensor]:
    flat: dict[str, torch.Tensor] = {}
    for key, t, param, row in _global_tensors(modules):
        flat[f"model.{key}"] = t
        if optimizer is None or param is None or not param.requires_grad:
            continue
        for name, s in _adam_state(optimizer, param).items():
            # "step" is a scalar shared by every row of an expert tensor
            flat[f"optim.{key}.{name}"] = s if row is None or s.dim() == 0 else s[row]
    return flat


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The directory ``latest`` points to, or None when there is no complete checkpoint."""
    pointer = Path(ckpt_dir) / _LATEST
    if not pointer.exists():
        return None
    target = Path(ckpt_dir) / pointer.read_text().strip()
    return target if (target / "meta.json").exists() else None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(
    ckpt_dir: str | Path,
    step: int,
    modules: Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | None,
    meta: dict[str, Any],
    rank_state: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Collectively save a checkpoint of ``step``; every rank of the default group must call it.

    ``meta`` (JSON-able: step, data position, config, layout) is written by rank 0; ``rank_state`` (e.g.
    RNG states) is saved per rank and restored only at the same world size. Keeps the newest ``keep``.
    """
    root = Path(ckpt_dir)
    rank = dist.get_rank()
    final = root / f"step_{step:08d}"
    partial = root / f".step_{step:08d}.partial"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save
        partial.mkdir()
    dist.barrier()
    dcp.save(_state_dict(modules, optimizer), checkpoint_id=partial)
    torch.save(rank_state or {}, partial / f"rank{rank:05d}.pt")
    if rank == 0:
        (partial / "meta.json").write_text(json.dumps({**meta, "step": step, "world_size": dist.get_world_size()}))
    dist.barrier()  # every rank's shards are on disk before the checkpoint becomes visible
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.rename(partial, final)
        tmp = root / f".{_LATEST}.tmp"
        tmp.write_text(final.name)
        with open(tmp) as f:
            os.fsync(f.fileno())
        os.replace(tmp, root / _LATEST)
        _fsync_dir(root)
        for old in sorted(root.glob("step_*"))[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def load_checkpoint(
    path: str | Path,
    modules: Sequence[nn.Module],
    optimizer: torch.optim.Optimizer | None,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Load ``path`` (a ``step_*`` directory) into ``modules`` and ``optimizer`` in place.

    Returns ``(meta, rank_state)``; ``rank_state`` is None when the world size changed.
    """
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    state = _state_dict(modules, optimizer)
    with torch.no_grad():
        dcp.load(state, checkpoint_id=path)
    rank_state = None
    if meta.get("world_size") == dist.get_world_size():
        rank_state = torch.load(path / f"rank{dist.get_rank():05d}.pt", weights_only=False)
    return meta, rank_state

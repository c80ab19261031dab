"""Distributed checkpoints: atomic against crashes, reloadable at another expert-parallel layout."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.distributed import RankFailure, run_ranks

STEPS = (2, 4)


def _stages(world: int, seed: int):
    from moe.config import preset
    from moe.parallel import ParallelConfig, build_stages, init_layout

    layout = init_layout(ParallelConfig(pp=1, ep=world, schedule="dualpipev"))
    cfg = preset("tiny", num_layers=2)
    stages = list(build_stages(cfg, layout, seed=seed))
    opt = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=1e-3)
    return stages, opt


def _train_a_bit(stages, opt, steps: int) -> None:
    for _ in range(steps):
        for s in stages:
            for p in s.parameters():
                p.grad = torch.full_like(p, 0.01)
        opt.step()
    for s in stages:
        for b in s.blocks.values():
            if getattr(b, "is_moe", False):
                b.router.expert_bias.add_(0.5)


def _save_then_crash(rank: int, world: int, ckpt: str) -> None:
    import moe.checkpoint as ck

    stages, opt = _stages(world, seed=1)
    _train_a_bit(stages, opt, 2)
    ck.save_checkpoint(ckpt, 2, stages, opt, {"data_step": 2})
    _train_a_bit(stages, opt, 2)

    def crash(*args, **kwargs):  # every rank dies after its shards are written, before the rename
        os._exit(3)

    ck.torch.save = crash
    ck.save_checkpoint(ckpt, 4, stages, opt, {"data_step": 4})


def _load(rank: int, world: int, ckpt: str) -> dict:
    from moe.checkpoint import latest_checkpoint, load_checkpoint

    path = latest_checkpoint(ckpt)
    stages, opt = _stages(world, seed=99)  # different init: everything must come from the checkpoint
    meta, rank_state = load_checkpoint(path, stages, opt)
    ref, ref_opt = _stages(world, seed=1)
    _train_a_bit(ref, ref_opt, 2)
    same_model = all(
        torch.equal(a, b)
        for s, r in zip(stages, ref)
        for a, b in zip([*s.parameters(), *s.buffers()], [*r.parameters(), *r.buffers()])
    )
    same_opt = all(
        torch.equal(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])
        and float(opt.state[p]["step"]) == float(ref_opt.state[q]["step"])
        for s, r in zip(stages, ref)
        for p, q in zip(s.parameters(), r.parameters())
    )
    return {
        "path": path.name,
        "step": meta["step"],
        "model": same_model,
        "optim": same_opt,
        "rank_state": rank_state is not None,
    }


def test_a_crash_during_a_save_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(RankFailure, match="exit code 3"):
        run_ranks(_save_then_crash, 2, args=(ckpt,), timeout=120)
    assert (tmp_path / "ckpt" / ".step_00000004.partial").is_dir()  # the interrupted write
    assert not (tmp_path / "ckpt" / "step_00000004").exists()
    for world in (2, 1):  # same layout, then all experts on one rank
        for r in run_ranks(_load, world, args=(ckpt,), timeout=120):
            assert r == {"path": "step_00000002", "step": 2, "model": True, "optim": True, "rank_state": world == 2}, r

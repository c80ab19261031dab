"""Optimizer moments in bf16 (optimizer.state_dtype): they track fp32 moments within bf16's rounding, are bf16
tensors between steps, step the same in one bucket or many, and a checkpoint restores them bit for bit (and
into fp32 moments, for a run resumed with the other state_dtype)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import moe.train.optimizer
from moe.models.layers import Linear, RMSNorm
from moe.train.cli import config_from_args
from moe.train.optimizer import DistributedOptimizer, ShardGroup
from tests.distributed import run_ranks

HYPER = {"adamw": dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), "sgd": dict(momentum=0.9, weight_decay=0.1)}
STEPS = 6


def _model(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(Linear(6, 16), RMSNorm(16, 1e-6), Linear(16, 4))
    for p in model.parameters():
        nn.init.normal_(p, std=0.5)
    return model.to(dtype)


def _train(model: nn.Module, opt: DistributedOptimizer, steps: range) -> None:
    dtype = next(model.parameters()).dtype
    for step in steps:
        x = torch.randn(8, 6, generator=torch.Generator().manual_seed(step)).to(dtype)
        opt.zero_grad()
        model(x).float().pow(2).mean().backward()
        opt.step()


def _optimizer(model: nn.Module, name: str, state_dtype: str) -> DistributedOptimizer:
    return DistributedOptimizer(
        [ShardGroup(list(model.parameters()))], name, lr=1e-2, state_dtype=state_dtype, **HYPER[name]
    )


@pytest.mark.parametrize("name", ["adamw", "sgd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-model", "bf16-model"])
def test_bf16_moments_track_fp32_moments(name: str, dtype: torch.dtype) -> None:
    ref, model = _model(dtype), _model(dtype)
    start = [p.detach().float().clone() for p in model.parameters()]
    ref_opt, opt = _optimizer(ref, name, "float32"), _optimizer(model, name, "bfloat16")
    _train(ref, ref_opt, range(STEPS))
    _train(model, opt, range(STEPS))
    for p, q, p0 in zip(model.parameters(), ref.parameters(), start):
        moved = (q.float() - p0).abs().max()
        # the moments' rounding moves the weights by a small fraction of the training's own steps; a bf16 model
        # rounds its weights too (one bf16 spacing at most, 2**-7 of a weight below 2)
        tol = 0.02 * moved + (2**-7 if dtype == torch.bfloat16 else 0)
        assert (p.float() - q.float()).abs().max() <= tol
        state, ref_state = opt.state_for(p), ref_opt.state_for(q)
        for key in opt.spec.moment_keys:
            assert state[key].dtype == torch.bfloat16 and ref_state[key].dtype == torch.float32
            torch.testing.assert_close(
                state[key].float(), ref_state[key], rtol=2**-5, atol=2**-7 * ref_state[key].abs().max()
            )
    assert opt.state_bytes() == ref_opt.state_bytes() - len(opt.spec.moment_keys) * 2 * sum(
        p.numel() for p in model.parameters()
    )


def test_one_bucket_or_many_step_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fp32 upcast runs a bounded bucket of parameters at a time; how many buckets changes nothing."""
    results = []
    for limit in (1 << 30, 64):  # every parameter in one bucket; one parameter per bucket
        monkeypatch.setattr(moe.train.optimizer, "_MAX_UPCAST_BYTES", limit)
        model = _model()
        opt = _optimizer(model, "adamw", "bfloat16")
        assert len(opt._step_buckets(opt._group_slots[0])) == (1 if limit > 64 else 3)
        _train(model, opt, range(3))
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_an_unknown_state_dtype_is_one_line() -> None:
    with pytest.raises(ValueError, match="state_dtype 'float16' is not one of float32, bfloat16"):
        _optimizer(_model(), "adamw", "float16")
    with pytest.raises(SystemExit) as err:
        config_from_args(["--state-dtype", "fp8"], world=1)
    assert str(err.value) == "error: optimizer.state_dtype = 'fp8': choose one of float32, bfloat16"
    config, _ = config_from_args(["--optimizer.state-dtype", "bfloat16"], world=1)
    assert config.optimizer.state_dtype == "bfloat16"


def _resume(rank: int, world: int, ckpt: str) -> list[bool]:
    from moe.train.checkpoint import load_checkpoint, save_checkpoint

    model = _model(torch.bfloat16)
    opt = _optimizer(model, "adamw", "bfloat16")
    _train(model, opt, range(3))
    path = save_checkpoint(ckpt, 3, [model], opt, {})
    fresh = _model(torch.bfloat16)
    fresh_opt = _optimizer(fresh, "adamw", "bfloat16")
    _train(fresh, fresh_opt, range(10, 12))  # other weights and moments: everything must come from the file
    load_checkpoint(path, [fresh], fresh_opt)
    same = []
    for p, q in zip(model.parameters(), fresh.parameters()):
        a, b = opt.state_for(p), fresh_opt.state_for(q)
        same += [b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]) for k in opt.spec.moment_keys]
        same.append(torch.equal(a["step"], b["step"]) and torch.equal(opt.master_for(p), fresh_opt.master_for(q)))
    wide = _model(torch.bfloat16)  # a run may resume with fp32 moments: they load as the bf16 values
    wide_opt = _optimizer(wide, "adamw", "float32")
    load_checkpoint(path, [wide], wide_opt)
    for p, q in zip(model.parameters(), wide.parameters()):
        a, b = opt.state_for(p), wide_opt.state_for(q)
        same += [b[k].dtype == torch.float32 and torch.equal(a[k].float(), b[k]) for k in opt.spec.moment_keys]
    _train(model, opt, range(3, 5))  # and training goes on exactly as without the interruption
    _train(fresh, fresh_opt, range(3, 5))
    same += [torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters())]
    return same


def test_a_checkpoint_restores_bf16_moments_bit_for_bit(tmp_path: Path) -> None:
    (same,) = run_ranks(_resume, 1, args=(str(tmp_path / "ckpt"),), timeout=120)
    assert same and all(same)

"""The moving average of the weights on the host (moe.train.ema), one process; the trainer's use of it, sharded
under ZeRO-1, resumed and exported, is tested in test_trainer.py."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import moe.train.ema
from moe.train.ema import HostEMA, ema_reference
from moe.train.optimizer import DistributedOptimizer, ShardGroup


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _step(model: nn.Module, opt: DistributedOptimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(5, 6, generator=g).to(next(model.parameters()).dtype)
    opt.zero_grad()
    model(x).float().pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_average_is_plain_torch_over_the_trajectory_of_the_masters(dtype: torch.dtype) -> None:
    model = _model(dtype)
    opt = DistributedOptimizer([ShardGroup(list(model.parameters()))], "adamw", lr=0.05)
    ema = HostEMA(opt, decay=0.8)
    trajectory = {id(p): [opt.master_for(p).detach().clone()] for p in model.parameters()}
    for step in range(5):
        ema.before_step()
        _step(model, opt, step)
        ema.update()
        for p in model.parameters():
            trajectory[id(p)].append(opt.master_for(p).detach().clone())
    ema.wait()
    for p in model.parameters():
        got, want = ema.state_for(p), ema_reference(trajectory[id(p)], 0.8)
        assert got.dtype == torch.float32 and got.device.type == "cpu"
        assert torch.equal(got, want)
    ema.close()


def test_update_returns_before_the_average_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's thread queues the average and goes on; a worker thread takes it."""
    gate, seen = threading.Event(), []
    average = moe.train.ema._average_

    def held(*args) -> None:
        seen.append(threading.current_thread().name)
        assert gate.wait(30)
        average(*args)

    monkeypatch.setattr(moe.train.ema, "_average_", held)
    model = _model(torch.float32)
    opt = DistributedOptimizer([ShardGroup(list(model.parameters()))], "sgd", lr=0.1)
    ema = HostEMA(opt, decay=0.5)
    start = {id(p): p.detach().clone() for p in model.parameters()}
    _step(model, opt, 0)
    ema.update()  # returns with the average held at the gate
    assert all(torch.equal(ema.state_for(p), start[id(p)]) for p in model.parameters())
    gate.set()
    ema.wait()
    assert seen and seen[0].startswith("host-ema")
    for p in model.parameters():
        assert torch.equal(ema.state_for(p), ema_reference([start[id(p)], p.detach()], 0.5))
    ema.close()


def test_applied_puts_the_average_in_the_parameters_for_the_block_only() -> None:
    model = _model(torch.float32)
    opt = DistributedOptimizer([ShardGroup(list(model.parameters()))], "sgd", lr=0.1)
    ema = HostEMA(opt, decay=0.5)
    _step(model, opt, 0)
    ema.update()
    weights = {id(p): p.detach().clone() for p in model.parameters()}
    with ema.applied():
        for p in model.parameters():
            assert torch.equal(p.detach(), ema.state_for(p))
    assert all(torch.equal(p.detach(), weights[id(p)]) for p in model.parameters())
    ema.close()

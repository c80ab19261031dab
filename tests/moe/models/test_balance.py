"""Auxiliary-loss-free balancing against the same training run without it (single process, tiny model)."""

from __future__ import annotations

import pytest
import torch

from moe import MoEModel, lm_loss, preset
from moe.data import BYTE_VOCAB_SIZE, open_data
from moe.models.block import Block
from moe.models.router import bias_rate_at, routing_imbalance
from moe.train.grad_sync import balance_routers

STEPS = 40
LR = 3e-3  # the README demo's


def _train(rate: float, steps: int = STEPS) -> list[float]:
    """Worst max / mean expert load per step over the MoE layers, training on text with AdamW."""
    torch.manual_seed(0)
    cfg = preset("tiny", vocab_size=BYTE_VOCAB_SIZE, num_layers=2, bias_update_rate=rate)
    loader = open_data(None).loader("train", seq_len=64, global_batch=16, seed=0)
    model = MoEModel(cfg, seed=1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95))
    routers = [b.router for b in model.blocks.values() if isinstance(b, Block) and b.is_moe]
    history = []
    for step in range(steps):
        ids, labels = loader.batch(step * loader.global_batch)
        opt.zero_grad()
        lm_loss(model(ids), labels).backward()
        opt.step()
        loads = [r.expert_load.clone() for r in routers]
        balance_routers([model], None)  # rate 0 leaves the bias at zero and only resets the counts
        assert all(torch.equal(r.last_load, load) for r, load in zip(routers, loads))
        history.append(routing_imbalance(routers))
    return history


def test_bias_balancing_lowers_the_imbalance() -> None:
    free = _train(0.0)
    balanced = _train(0.01)
    assert free[0] == balanced[0]  # the same run until the first bias step acts
    late_free, late_balanced = sum(free[-10:]) / 10, sum(balanced[-10:]) / 10
    # Without the bias the routers collapse (every token picks one expert: max / mean = E / K = 4).
    assert late_free > 3.5
    assert late_balanced < late_free - 1.0, (late_free, late_balanced)


def test_bias_rate_follows_the_learning_rate() -> None:
    assert bias_rate_at(0.02, 3e-3, 3e-3) == 0.02
    assert bias_rate_at(0.02, 3e-4, 3e-3) == pytest.approx(0.002)
    with pytest.raises(ValueError, match="peak_lr"):
        bias_rate_at(0.02, 1e-3, 0.0)

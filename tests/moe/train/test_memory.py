"""MemoryMeter's CPU figures: exact parameter, gradient and AdamW-state bytes; peak activations by hand count."""

from __future__ import annotations

import typing

import torch
from torch import nn

from moe import MoEModel, lm_loss
from moe.train.memory import MemoryMeter, SavedTensorTracker, optimizer_state_bytes
from tests.moe.helpers import SEED, batch, tiny_config


def _step(model: nn.Module, meter: MemoryMeter, optimizer: torch.optim.Optimizer, ids, labels) -> dict[str, int]:
    meter.start_step()
    lm_loss(model(ids), labels).backward()
    optimizer.step()
    return meter.stop_step()


def test_parameter_gradient_and_adamw_bytes_are_exact() -> None:
    cfg = tiny_config()
    model = MoEModel(cfg, seed=SEED, piecewise=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    want_params = sum(p.numel() * p.element_size() for p in params)
    meter = MemoryMeter([model], opt)
    ids, labels = batch(cfg)
    got = _step(model, meter, opt, ids, labels)
    assert got["param_bytes"] == want_params
    assert got["grad_bytes"] == want_params  # every parameter got an fp32 gradient
    # AdamW: exp_avg and exp_avg_sq like the parameter, plus a 0-d fp32 step count per parameter.
    assert got["optimizer_state_bytes"] == 2 * want_params + 4 * len(params)
    assert got["peak_activation_bytes"] > 0
    # The tracker changes nothing: the same step without it gives the same gradients.
    plain = MoEModel(cfg, seed=SEED, piecewise=True)
    lm_loss(plain(ids), labels).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name
    assert set(got) == {"param_bytes", "grad_bytes", "optimizer_state_bytes", "peak_activation_bytes"}


def test_main_grad_and_state_bytes_are_used_when_present() -> None:
    lin = nn.Linear(4, 3, bias=False).to(torch.bfloat16)
    lin.weight.main_grad = torch.zeros(3, 4, dtype=torch.float32)
    meter = MemoryMeter(lin)
    lin.weight.grad = torch.zeros(3, 4, dtype=torch.bfloat16)
    meter.start_step()
    figures = meter.stop_step()
    assert figures["param_bytes"] == 12 * 2
    assert figures["grad_bytes"] == 12 * 4 + 12 * 2  # the fp32 buffer and the separate bf16 .grad

    class Sharded:
        state: typing.ClassVar[dict] = {}

        def state_bytes(self) -> int:
            return 1234

    assert optimizer_state_bytes(Sharded()) == 1234
    assert optimizer_state_bytes(None) == 0


def test_peak_activation_bytes_match_a_hand_count() -> None:
    """x -> W1 -> tanh -> W2 -> sum keeps x [N, D] (for W1's gradient) and tanh's output [N, H] (for tanh
    and W2's gradient, one storage); weights are parameters and not counted, sum saves nothing."""
    n, d, h = 16, 8, 24
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d, h, bias=False), nn.Tanh(), nn.Linear(h, d, bias=False))
    x = torch.randn(n, d)
    meter = MemoryMeter(model)
    meter.start_step()
    model(x).sum().backward()
    figures = meter.stop_step()
    assert figures["peak_activation_bytes"] == 4 * n * (d + h)
    assert meter.tracker.live_bytes == 0  # everything saved was released by the backward

    # Two micro-batches alive at once double it; the peak is the high-water mark, not the sum of all.
    meter.start_step()
    y1, y2 = model(x), model(x.clone())  # a second input storage (one input saved twice counts once)
    (y1.sum() + y2.sum()).backward()
    del y1, y2
    model(x).sum().backward()
    assert meter.stop_step()["peak_activation_bytes"] == 2 * 4 * n * (d + h)


def test_the_tracker_is_on_where_the_allocator_cannot_say(monkeypatch) -> None:
    """CPU: the tracker measures. Off (as it is by default on CUDA, whose allocator figures stand in): no
    hook runs, so the step pays nothing for it and reports no tracked figure."""
    model = nn.Sequential(nn.Linear(8, 24, bias=False), nn.Tanh())
    assert MemoryMeter(model).track_saved  # CPU default
    meter = MemoryMeter(model, track_saved=False)
    entered = []
    monkeypatch.setattr(type(meter.tracker), "__enter__", lambda self: entered.append(self))
    meter.start_step()
    model(torch.randn(4, 8)).sum().backward()
    figures = meter.stop_step()
    assert entered == [] and figures["peak_activation_bytes"] == 0
    assert figures["param_bytes"] == 4 * 8 * 24


def test_recompute_lowers_the_peak() -> None:
    cfg = tiny_config()
    ids, labels = batch(cfg, size=4, seq=32)
    peaks = {}
    for recompute in (False, True):
        model = MoEModel(cfg, seed=SEED, piecewise=True, recompute=recompute)
        meter = MemoryMeter(model)
        meter.start_step()
        lm_loss(model(ids), labels).backward()
        peaks[recompute] = meter.stop_step()["peak_activation_bytes"]
    assert 0 < peaks[True] < 0.75 * peaks[False], peaks


def test_tracker_counts_a_shared_storage_once() -> None:
    x = torch.randn(10, requires_grad=True)
    with SavedTensorTracker() as tracker:
        y = x.exp()  # saves its output y
        z = y * y  # saves y twice: one storage
        assert tracker.live_bytes == 40  # x is not saved: exp saves its result
        del z
        assert tracker.live_bytes == 40  # exp's graph (held by y) still saves y
    del y
    assert tracker.live_bytes == 0 and tracker.peak_bytes == 40


def test_stage_outputs_are_not_views() -> None:
    """The pipeline frees a sent output's storage only when it is not a view (a view's base may still be
    needed): a stage's output, plain or recomputed, must own its storage."""
    from moe import MoEStage

    cfg = tiny_config()
    ids, _ = batch(cfg)
    for recompute in (False, True):
        stage = MoEStage(cfg, [0, 1], first=True, last=False, recompute=recompute)
        stage.reset_parameters(SEED)
        out = stage(ids)
        assert out.requires_grad and out._base is None
        again = MoEStage(cfg, [2, 3], first=False, last=False, recompute=recompute)
        assert again(out.detach().requires_grad_())._base is None

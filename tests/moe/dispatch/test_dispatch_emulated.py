"""The ``emulated`` dispatcher: ``local``'s results, a link's time.

Its results equal ``local``'s at the same routing, op by op (bf16 and FP8 dispatch) and through a stage's forward
and backward, both the plain graph and an overlapped pair; each transfer charges the rows that leave rank 0 of
the modelled ep-way group at ``alltoall``'s bytes per row, and its ``wait`` returns no earlier than that many
bytes take at the link's bandwidth; bad settings are refused in one line.
"""

from __future__ import annotations

import time

import pytest
import torch

from moe import MoEStage, lm_loss
from moe.dispatch import (
    DISPATCHERS,
    DispatchOptions,
    EmulatedDispatcher,
    Launch,
    LocalDispatcher,
    Traffic,
    make_dispatcher,
)
from moe.dispatch.emulated import DEFAULT_EP, DEFAULT_GBPS
from moe.dispatch.fp8 import wire_row_bytes
from tests.moe.helpers import batch, tiny_config

NUM_EXPERTS, TOP_K, HIDDEN, TOKENS = 8, 3, 256, 6
BF16 = torch.bfloat16


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(TOKENS, HIDDEN, generator=gen) * torch.logspace(-2, 2, HIDDEN)).to(BF16)  # FP8 rounds it
    idx = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(TOKENS)])
    return x, idx, torch.rand(TOKENS, TOP_K, generator=gen), torch.randn(TOKENS, HIDDEN, generator=gen).to(BF16)


def _all_ops(dispatcher, x, idx, w, g) -> list[torch.Tensor]:
    route = dispatcher.plan(idx)
    got = dispatcher.dispatch(route, x, w).wait()
    grad_x, grad_w = dispatcher.dispatch_backward(route, g, w * 2).wait()
    return [
        got.x_RD,
        got.local_idx_RK,
        got.weights_RK,
        dispatcher.combine(route, g).wait(),
        grad_x,
        grad_w,
        dispatcher.combine_backward(route, g).wait(),
    ]


@pytest.mark.parametrize("fp8", [False, True])
def test_every_op_equals_local(fp8: bool):
    x, idx, w, g = _inputs()
    emulated = EmulatedDispatcher(NUM_EXPERTS, fp8=fp8)
    try:
        got = _all_ops(emulated, x, idx, w, g)
    finally:
        emulated.close()
    want = _all_ops(LocalDispatcher(NUM_EXPERTS, fp8=fp8), x, idx, w, g)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want, strict=True))
    assert emulated.communicates and emulated.ep_size == 1 and list(emulated.local_experts) == list(range(8))


def _leaving_rows(idx: torch.Tensor, ep: int) -> int:
    """Rows that leave rank 0 of an ep-way group: per token, the other ranks among its experts' ranks."""
    per_rank = NUM_EXPERTS // ep
    return sum(len({int(e) // per_rank for e in token} - {0}) for token in idx)


def test_charges_the_rows_that_leave_the_rank_at_alltoalls_bytes():
    x, idx, w, g = _inputs(1)
    gbps, ep = 2.0, 4
    d = EmulatedDispatcher(NUM_EXPERTS, gbps=gbps, ep=ep, fp8=True)
    d.traffic = Traffic()
    try:
        _all_ops(d, x, idx, w, g)
    finally:
        d.close()
    rows = _leaving_rows(idx, ep)
    assert 0 < rows < TOKENS * TOP_K  # some tokens stay, some leave for more than one rank
    fp8_row, bf16_row = wire_row_bytes(HIDDEN, BF16, fp8=True), HIDDEN * 2
    want = {
        "dispatch": rows * (fp8_row + 2 * TOP_K * 4),  # FP8 row and scales; ids and weights in fp32
        "combine": rows * bf16_row,
        "dispatch_backward": rows * (bf16_row + TOP_K * 4),  # the gradient row and the fp32 weights' gradients
        "combine_backward": rows * fp8_row,
    }
    for kind, nbytes in want.items():
        charge = d.charged[kind]
        assert (charge.transfers, charge.rows, charge.bytes) == (1, rows, nbytes), kind
        assert charge.seconds == pytest.approx(nbytes / (gbps * 1e9), rel=1e-12), kind
    # Traffic counts what the modelled all-to-all moves, the rank's own share included, as alltoall counts it.
    pairs = sum(len({int(e) // (NUM_EXPERTS // ep) for e in token}) for token in idx)
    assert d.traffic.summary()["combine"] == {
        "calls": 1,
        "rows": pairs,
        "data_bytes": pairs * bf16_row,
        "meta_bytes": 0,
    }
    d.clear_charges()
    assert d.charged["dispatch"].bytes == 0


def test_wait_returns_after_the_link_time_and_start_does_not_block():
    x, idx, w, _ = _inputs(2)
    rows = _leaving_rows(idx, DEFAULT_EP)
    link_s = 0.4
    # The bandwidth at which this dispatch takes link_s: rows of bf16 plus ids and weights in fp32.
    gbps = rows * (HIDDEN * 2 + 2 * TOP_K * 4) / link_s / 1e9
    d = EmulatedDispatcher(NUM_EXPERTS, gbps=gbps)
    try:
        route = d.plan(idx)
        t0 = time.perf_counter()
        pending = d.dispatch(route, x, w)
        issued = time.perf_counter() - t0
        got = pending.wait()
        waited = time.perf_counter() - t0
    finally:
        d.close()
    assert d.charged["dispatch"].seconds == pytest.approx(link_s)
    assert waited >= link_s  # the transfer started inside the call, so the wait ends no earlier than this
    assert issued < link_s  # the start only queues the transfer (a margin of the whole link time)
    assert torch.equal(got.x_RD, x)


def _stage_grads(dispatcher, overlapped: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    cfg = tiny_config()
    stage = MoEStage(cfg, range(cfg.num_layers), first=True, last=True, dispatcher=dispatcher)
    stage.reset_parameters(0)
    (ids_a, lab_a), (ids_b, lab_b) = batch(cfg, 2, 8, seed=0), batch(cfg, 2, 8, seed=1)
    loss_a = lm_loss(stage(ids_a), lab_a)
    if overlapped:  # B's forward paired with A's backward, as the DualPipe executors pair them
        _, loss_b = MoEStage.overlapped_forward_backward(stage, [ids_b], lm_loss, [lab_b], stage, loss_a, None, None)
    else:
        loss_a.backward()
        loss_b = lm_loss(stage(ids_b), lab_b)
    loss_b.backward()
    return [loss_a.item(), loss_b.item()], {n: p.grad for n, p in stage.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("overlapped", [False, True])
def test_a_stage_trains_as_with_local(overlapped: bool):
    cfg = tiny_config()
    emulated = EmulatedDispatcher(cfg.num_experts, gbps=1.0, ep=4)
    try:
        losses, grads = _stage_grads(emulated, overlapped)
    finally:
        emulated.close()
    want_losses, want_grads = _stage_grads(LocalDispatcher(cfg.num_experts), overlapped)
    assert losses == want_losses and grads.keys() == want_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, want_grads[name]), name
    # Every MoE layer's four transfers went over the link, once per micro-batch.
    moe_layers = cfg.num_layers - cfg.num_dense_layers
    assert all(emulated.charged[k].transfers == 2 * moe_layers for k in emulated.charged)


def test_registered_and_refuses_bad_settings_in_one_line():
    spec = DISPATCHERS["emulated"]
    d = make_dispatcher("emulated", NUM_EXPERTS, None, DispatchOptions(fp8=True))
    assert isinstance(d, EmulatedDispatcher) and d.fp8 and (d.gbps, d.modelled_ep) == (DEFAULT_GBPS, DEFAULT_EP)
    for gbps in (0.0, -5.0, float("nan")):
        with pytest.raises(ValueError, match=r"^the emulated link needs a bandwidth > 0 GB/s, got") as err:
            EmulatedDispatcher(NUM_EXPERTS, gbps=gbps)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^the modelled ep=3 must be >= 1 and divide num_experts=8$"):
        EmulatedDispatcher(NUM_EXPERTS, ep=3)
    assert spec.violations(Launch(ep_size=2)) == [
        "an expert group of one rank (it stands in for the all-to-all on one device; got 2 ranks)"
    ]
    assert spec.violations(Launch(ep_size=1, fp8=True)) == []
    with pytest.raises(ValueError, match=r"'emulated' dispatcher has no sync-free mode"):
        make_dispatcher("emulated", NUM_EXPERTS, None, DispatchOptions(sync_free=True))


@pytest.mark.gpu
def test_cuda_transfer_runs_on_its_stream_for_the_link_time():
    x, idx, w, g = (t.cuda() for t in _inputs(3))
    link_s = 0.005
    gbps = _leaving_rows(idx, DEFAULT_EP) * (HIDDEN * 2 + 2 * TOP_K * 4) / link_s / 1e9
    d = EmulatedDispatcher(NUM_EXPERTS, gbps=gbps)
    want = _all_ops(LocalDispatcher(NUM_EXPERTS), x, idx, w, g)
    assert all(torch.equal(a, b) for a, b in zip(_all_ops(d, x, idx, w, g), want, strict=True))
    route = d.plan(idx)
    route.wait_counts()
    begin, landed = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    pending = d.dispatch(route, x, w)
    landed.record(d.comm_stream)
    pending.wait()
    torch.cuda.synchronize()
    assert d.comm_stream is not None and d.comm_stream != torch.cuda.current_stream()
    # The spin is calibrated against these events; 10% leaves room for the clock moving between runs.
    assert begin.elapsed_time(landed) * 1e-3 >= 0.9 * link_s

"""FP8 dispatch (:mod:`moe.dispatch.fp8`) in every dispatcher.

Each dispatcher with ``fp8`` gives exactly what it gives in bf16 for the quantize-dequantize round trip of its
input (dispatch, and the gradient of combine), and exactly its bf16 results for combine and the gradient of
dispatch (not quantized), also through the block's autograd nodes; the dispatch direction moves
``D + 4 * ceil(D / 128)`` bytes per row where bf16 moves ``2 * D``, counted; the DeepEP emulations take and refuse
FP8 input where DeepEP does; the registry refuses what a backend cannot run before building anything.
"""

from __future__ import annotations

import contextlib
import re
import sys

import pytest
import torch
import torch.distributed as dist

from moe.dispatch import (
    DISPATCHERS,
    DispatcherSpec,
    DispatchOptions,
    Launch,
    LocalDispatcher,
    Traffic,
    make_dispatcher,
    register_dispatcher,
    unregister_dispatcher,
)
from moe.dispatch.fp8 import pack_rows, round_trip, unpack_rows, wire_row_bytes
from moe.models.block import _BlockingCombine, _BlockingComm, _BlockingDispatch
from tests.distributed import run_ranks

NUM_EXPERTS, TOP_K, HIDDEN = 8, 3, 256  # DeepEP V2 combines hidden % 256 == 0
BF16 = torch.bfloat16
TOKENS = (5, 3)


def _rows(num_tokens: int, seed: int) -> torch.Tensor:
    """bf16 rows whose tiles span several binades, so that FP8 rounds most of them."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, HIDDEN, generator=gen) * torch.logspace(-2, 2, HIDDEN)).to(BF16)


def _routing(rank: int, num_tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + rank)
    return torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(num_tokens)])


# ---- one process ---------------------------------------------------------------------------------------


def test_wire_rows_carry_their_scales() -> None:
    for hidden in (256, 200):  # a partial last tile too
        x = (torch.randn(4, hidden) * 50).to(BF16)
        packed = pack_rows(x)
        assert packed.dtype == torch.uint8 and packed.shape == (4, wire_row_bytes(hidden, BF16, fp8=True))
        assert wire_row_bytes(hidden, BF16, fp8=True) == hidden + 4 * -(-hidden // 128)
        # rows permuted after packing (as an all-to-all does) unpack to the same rows permuted
        perm = torch.tensor([2, 0, 3, 1])
        assert torch.equal(unpack_rows(packed[perm], hidden, BF16), round_trip(x)[perm])
        assert not torch.equal(round_trip(x), x)
    assert unpack_rows(pack_rows(torch.zeros(0, 200)), 200, BF16).shape == (0, 200)
    with pytest.raises(ValueError, match=r"packed rows \(2, 200\) torch.uint8, expected \[R, 208\] uint8"):
        unpack_rows(torch.zeros(2, 200, dtype=torch.uint8), 200, BF16)


def test_local_applies_the_round_trip_where_the_rows_would_travel() -> None:
    """One process computes what an FP8 expert-parallel run does: dispatch and the gradient of combine
    round-trip; combine and the gradient of dispatch do not."""
    x, g = _rows(5, 0), _rows(5, 1)
    w, idx = torch.rand(5, TOP_K), _routing(0, 5)
    plain, fp8 = LocalDispatcher(NUM_EXPERTS), make_dispatcher("local", NUM_EXPERTS, None, DispatchOptions(fp8=True))
    route = fp8.plan(idx)
    got = fp8.dispatch(route, x, w).wait()
    assert torch.equal(got.x_RD, round_trip(x)) and torch.equal(got.local_idx_RK, idx)
    assert torch.equal(fp8.combine_backward(route, g).wait(), round_trip(g))
    assert fp8.combine(route, g).wait() is g
    assert fp8.dispatch_backward(route, g, w).wait() == (g, w)
    assert plain.dispatch(plain.plan(idx), x, w).wait().x_RD is x


def test_the_registry_refuses_fp8_a_backend_cannot_run() -> None:
    deepep, v2 = DISPATCHERS.lookup("deepep"), DISPATCHERS.lookup("deepep-v2")
    assert all(DISPATCHERS.lookup(name).fp8 for name in ("local", "alltoall", "deepep", "deepep-v2"))
    # DeepEP V1: x_scales [T, hidden // 128] "requiring divisible"; its dispatch kernel's row limit applies to the
    # FP8 rows (bf16 rows of 8192 are too wide, FP8 ones are not).
    assert deepep.violations(Launch(dtype=BF16, hidden_size=8192, fp8=True)) == []
    assert "(hidden 8192 x torch.bfloat16 = 16384)" in deepep.violations(Launch(dtype=BF16, hidden_size=8192))[0]
    assert deepep.violations(Launch(dtype=BF16, hidden_size=7168 + 64, fp8=True)) == [
        "hidden % 128 == 0 for FP8 dispatch (got 7232)"
    ]
    assert deepep.violations(Launch(dtype=BF16, hidden_size=7168 + 64)) == []
    assert v2.violations(Launch(dtype=BF16, hidden_size=7168, fp8=True)) == []

    def factory(num_experts, group, options):
        return LocalDispatcher(num_experts)

    register_dispatcher(DispatcherSpec(name="test-no-fp8", factory=factory))
    try:
        with pytest.raises(ValueError, match="'test-no-fp8' dispatcher cannot run this launch: rows in the model"):
            make_dispatcher("test-no-fp8", NUM_EXPERTS, None, DispatchOptions(fp8=True))
        assert make_dispatcher("test-no-fp8", NUM_EXPERTS).fp8 is False
    finally:
        unregister_dispatcher("test-no-fp8")


# ---- two gloo ranks ------------------------------------------------------------------------------------


def _pair(kind: str, **kw) -> tuple:
    """The backend with and without FP8 dispatch, each counting its traffic."""
    pair = tuple(
        make_dispatcher(
            kind, NUM_EXPERTS, dist.group.WORLD, DispatchOptions(hidden_size=HIDDEN, dtype=BF16, fp8=fp8, **kw)
        )
        for fp8 in (True, False)
    )
    for d in pair:
        d.traffic = Traffic()
    return pair


def _fp8_is_bf16_of_the_round_trip(rank: int, fp8, bf16) -> dict[str, tuple[dict, dict]]:
    n = TOKENS[0] if fp8.sync_free else TOKENS[rank]  # sync-free: every rank routes as many tokens
    x, g = _rows(n, rank), _rows(n, 10 + rank)
    w, idx = torch.rand(n, TOP_K) + 0.1, _routing(rank, n)
    r8, r16 = fp8.plan(idx), bf16.plan(idx)
    got, want = fp8.dispatch(r8, x, w).wait(), bf16.dispatch(r16, round_trip(x), w).wait()
    assert torch.equal(got.x_RD, want.x_RD) and torch.equal(got.local_idx_RK, want.local_idx_RK)
    assert torch.equal(got.weights_RK, want.weights_RK)
    y_RD = _rows(got.x_RD.shape[0], 40 + rank)  # the experts' rows: not FP8 values, so quantizing them shows
    assert torch.equal(fp8.combine(r8, y_RD).wait(), bf16.combine(r16, y_RD).wait())  # bf16 both ways
    back8, back16 = (
        fp8.dispatch_backward(r8, y_RD, got.weights_RK).wait(),
        bf16.dispatch_backward(r16, y_RD, got.weights_RK).wait(),
    )
    assert all(torch.equal(a, b) for a, b in zip(back8, back16, strict=True))  # not quantized
    assert torch.equal(fp8.combine_backward(r8, g).wait(), bf16.combine_backward(r16, round_trip(g)).wait())
    return {"fp8": fp8.traffic.summary(), "bf16": bf16.traffic.summary()}


def _through_autograd(rank: int, fp8, bf16) -> None:
    """The block's blocking autograd nodes: the gradient reaching x went through combine's backward quantized
    (FP8 run with upstream g == bf16 run with upstream round_trip(g)) and dispatch's backward unquantized."""
    n = TOKENS[rank]
    x, g, w, idx = _rows(n, 20 + rank), _rows(n, 30 + rank), torch.rand(n, TOP_K), _routing(rank, n)
    column_scale = torch.linspace(0.5, 1.5, HIDDEN).to(BF16)

    def grad_x(d, upstream: torch.Tensor) -> torch.Tensor:
        comm = _BlockingComm(d, d.plan(idx), None, 0)
        x_TD = x.clone().requires_grad_()
        x_RD, _ = _BlockingDispatch.apply(comm, x_TD, w)
        y_TD = _BlockingCombine.apply(comm, x_RD * column_scale)  # its gradient, rt(g) * scale: not FP8 values
        (y_TD.float() * upstream.float()).sum().backward()
        return x_TD.grad

    assert torch.equal(grad_x(fp8, g), grad_x(bf16, round_trip(g)))
    assert not torch.equal(grad_x(fp8, g), grad_x(bf16, g))


def _emulations_check_fp8_input(rank: int) -> None:
    from tests.moe.dispatch import fake_deep_ep as v1
    from tests.moe.dispatch import fake_deep_ep_v2 as v2

    buf = v1.Buffer(dist.group.WORLD, 1 << 20, explicitly_destroy=True)
    idx = _routing(rank, 4)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, NUM_EXPERTS)
    rows = {"num_tokens_per_rank": per_rank, "is_token_in_rank": in_rank, "num_tokens_per_expert": per_expert}
    w = torch.rand(4, TOP_K)
    q, s = torch.zeros(4, HIDDEN, dtype=torch.float8_e4m3fn), torch.ones(4, HIDDEN // 128)
    refused = {  # csrc/deep_ep.cpp intranode_dispatch's host checks
        "x.element_size": (torch.zeros(4, HIDDEN, dtype=BF16), s),
        "kFloat32 or torch::kInt": (q, s.to(BF16)),
        "x_scales->dim": (q, s[:, 0]),
        "x_scales->size(0)": (q, s[:3]),
    }
    for what, pair in refused.items():
        with pytest.raises(RuntimeError, match=f"Assertion exception .*{re.escape(what)}"):
            buf.dispatch(pair, topk_idx=idx, topk_weights=w, **rows)
    with pytest.raises(RuntimeError, match="device-side assert"):  # 16 one-byte elements: an odd int4 count
        buf.dispatch((q[:, :16].contiguous(), s[:, :1]), topk_idx=idx, topk_weights=w, **rows)
    # Taken as DeepEP takes it: any scale count (hidden // 128 is the caller's contract), int scales (UE8M0).
    for scales in (torch.ones(4, 3), torch.ones(4, 2, dtype=torch.int32)):
        (recv_q, recv_s), *_ = buf.dispatch((q[:, :160].contiguous(), scales), topk_idx=idx, topk_weights=w, **rows)
        assert (
            recv_q.dtype == torch.float8_e4m3fn
            and recv_s.dtype == scales.dtype
            and recv_s.shape[1] == 2 + (scales.dtype == torch.float32)
        )

    ebuf = v2.ElasticBuffer(
        dist.group.WORLD, num_max_tokens_per_rank=8, hidden=HIDDEN, num_topk=TOP_K, explicitly_destroy=True
    )
    call = {"topk_idx": idx, "topk_weights": w, "num_experts": NUM_EXPERTS, "num_sms": 8}
    with pytest.raises(RuntimeError, match="sf->element_size"):  # buffer.hpp: FP32 or packed UE8M0 only
        ebuf.dispatch((q, s.to(BF16)), **call)
    with pytest.raises(RuntimeError, match="num_tokens == num_tokens_"):
        ebuf.dispatch((q, s[:3]), **call)
    with pytest.raises(AssertionError, match="bf16 rows or an fp8 tuple"):
        ebuf.dispatch((q.view(torch.uint8), s), **call)
    (recv_q, recv_s), *_ = ebuf.dispatch((q, s), **call)
    assert recv_q.dtype == torch.float8_e4m3fn and recv_s.shape == (recv_q.shape[0], HIDDEN // 128)
    buf.destroy()
    ebuf.destroy()


def _every_dispatcher(rank: int, world: int) -> dict[str, dict]:
    from tests.moe.dispatch import fake_deep_ep, fake_deep_ep_v2

    traffic = {}
    for kind, fake, kw in (
        ("alltoall", None, {}),
        ("alltoall-sync-free", None, {"sync_free": True}),
        ("deepep", fake_deep_ep, {}),
        ("deepep-v2", fake_deep_ep_v2, {"deterministic": True}),
    ):
        if fake is not None:
            sys.modules["deep_ep"] = fake
        fp8, bf16 = _pair(kind.removesuffix("-sync-free"), **kw)
        # the quantization happens before each launch's event: no race
        with fake_deep_ep.StreamOrder() if kind == "deepep" else contextlib.nullcontext():
            traffic[kind] = _fp8_is_bf16_of_the_round_trip(rank, fp8, bf16)
        for d in (fp8, bf16):
            d.close()
    _through_autograd(rank, *_pair("alltoall"))
    _emulations_check_fp8_input(rank)
    return traffic


def test_every_dispatcher_sends_fp8_rows_and_half_the_bytes() -> None:
    per_rank = run_ranks(_every_dispatcher, world_size=2, timeout=120)
    fp8_row, bf16_row = HIDDEN + 4 * (HIDDEN // 128), 2 * HIDDEN
    for traffic in per_rank:
        for kind, t in traffic.items():
            fp8, bf16 = t["fp8"], t["bf16"]
            assert fp8.keys() == bf16.keys() == {"dispatch", "combine", "dispatch_backward", "combine_backward"}
            for name in ("dispatch", "combine_backward"):  # the dispatch direction: FP8 values and scales
                rows = fp8[name]["rows"]
                assert rows == bf16[name]["rows"] > 0 and fp8[name]["calls"] == 1, kind
                assert (fp8[name]["data_bytes"], bf16[name]["data_bytes"]) == (rows * fp8_row, rows * bf16_row)
                assert fp8[name]["data_bytes"] <= (0.5 + 4 / 128) * bf16[name]["data_bytes"], kind
                assert fp8[name]["meta_bytes"] == bf16[name]["meta_bytes"], kind
            for name in ("combine", "dispatch_backward"):  # the combine direction: unchanged
                assert fp8[name] == bf16[name], kind
    # the sync-free exchange moves every token to every rank: its padding travels and is counted
    assert all(t["alltoall-sync-free"]["fp8"]["dispatch"]["rows"] == TOKENS[0] * 2 for t in per_rank)


def test_one_process_blocks_round_trip_on_both_paths() -> None:
    """A local FP8 dispatcher round-trips the rows in the plain-graph block too (it has no all-to-all to run), so
    the oracle model and the piecewise stages compute the same thing, and that differs from bf16 dispatch."""
    from moe.models.config import MoEConfig
    from moe.models.stage import MoEStage

    cfg = MoEConfig(num_layers=2, hidden_size=128)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    out = {}
    for piecewise in (False, True):
        for fp8 in (False, True):
            dispatcher = make_dispatcher(
                "local", cfg.num_experts, None, DispatchOptions(hidden_size=cfg.hidden_size, fp8=fp8)
            )
            stage = MoEStage(cfg, range(2), first=True, last=True, dispatcher=dispatcher, piecewise=piecewise)
            stage.reset_parameters(0)
            out[piecewise, fp8] = stage(ids)
    assert torch.equal(out[False, True], out[True, True])
    assert torch.equal(out[False, False], out[True, False])
    assert not torch.equal(out[False, True], out[False, False])

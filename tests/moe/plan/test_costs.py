"""Seconds per sub-stage: all-to-all bytes and time, SM reservation, recompute, reductions, P2P."""

from __future__ import annotations

import dataclasses

import pytest

from moe.models.config import PRESETS
from moe.plan import flops as fl
from moe.plan.costs import (
    COMPUTE_FIELDS,
    Parallelism,
    Workload,
    all_to_all_bytes,
    all_to_all_seconds,
    allreduce_busbw,
    allreduce_seconds,
    dp_reduce_seconds,
    op_seconds,
    p2p_seconds,
    substage_costs,
)
from moe.plan.hardware import GPUS, Cluster
from moe.plan.params import rank_params
from tests.moe.helpers import tiny_config

# 8 experts in 2 groups, one group per token, top-2 (5/3 ranks per token at ep 4: see test_routing), hidden 32;
# every layer an MoE layer. The sizes the by-hand numbers below use are stated here, not taken on trust.
CFG = dataclasses.replace(
    tiny_config(), num_dense_layers=0, hidden_size=32, num_experts=8, n_group=2, topk_group=1, top_k=2
)


def test_all_to_all_bytes_by_hand() -> None:
    # ep = 4 over 2 nodes of 2: a token reaches 5/3 ranks on exactly 1 node (its group's).
    # IB: remote node reached with probability 1/2 (d_n (1 - 1/n) = 1 * 1/2), 64 tokens x 32 x 2 bytes.
    # NVLink: reached ranks other than the one the row lands on, d_r (1 - 1/r) = 5/3 * 1/2.
    cluster = Cluster(GPUS["h800"], 4, 2)
    moved = all_to_all_bytes(CFG, cluster, 4, 64, 2)
    assert moved.internode == pytest.approx(64 * 32 * 2 * 0.5)
    assert moved.nvlink == pytest.approx(64 * 32 * 2 * 5 / 6)
    t = all_to_all_seconds(moved, GPUS["h800"])  # DeepEP's published H800 dispatch rates: NVLink 153, RDMA 51 GB/s
    assert t == pytest.approx(max(moved.nvlink / 153e9, moved.internode / 51e9))
    # on one node there is no IB traffic
    one_node = all_to_all_bytes(CFG, Cluster(GPUS["h800"], 8, 8), 4, 64, 2)
    assert one_node.internode == 0 and one_node.nvlink == pytest.approx(64 * 64 * 5 / 3 * 3 / 4)
    assert all_to_all_bytes(CFG, cluster, 1, 64, 2).nvlink == 0


def test_v3_group_limit_lowers_ib_bytes() -> None:
    v3 = PRESETS["v3"]
    cluster = Cluster(GPUS["h800"], 2048, 8)
    limited = all_to_all_bytes(v3, cluster, 64, 4096, 2)
    free = all_to_all_bytes(v3.replace(n_group=1, topk_group=1), cluster, 64, 4096, 2)
    assert limited.nodes_reached <= 4 and limited.internode < free.internode


def test_expert_gemms_lose_the_communication_sms() -> None:
    gpu = GPUS["h100"]
    # experts_gate_up at ep 64 (4 local experts): compute-bound (at ep 1 all 256 experts' weights make it
    # memory-bound)
    op = fl.moe_mlp_ops(PRESETS["v3"], 4096, 4096, 2, ep=64)[1]
    assert op.experts
    full, reserved = op_seconds(op, "fwd", gpu, 0), op_seconds(op, "fwd", gpu, 20)
    assert reserved == pytest.approx(full * 132 / 112)
    assert full == pytest.approx(op.fwd_flops / (989.4e12 * gpu.value("gemm.bf16.grouped")))
    with pytest.raises(ValueError, match="no SM"):
        op_seconds(op, "fwd", gpu, 132)


def test_substage_costs_recompute_and_dense() -> None:
    cluster = Cluster(GPUS["h800"], 16, 8)
    par = Parallelism(pp=2, dp=8, ep=4, schedule="dualpipev")
    work = Workload(seq_len=32, micro_batch=2)
    plain = substage_costs(CFG, cluster, par, work)
    again = substage_costs(CFG, cluster, par, dataclasses.replace(work, recompute=True))
    assert again.attn_dX == pytest.approx(plain.attn_dX + plain.attn_F)
    assert again.mlp_dX == pytest.approx(plain.mlp_dX + plain.mlp_F)
    assert again.shared_dX == pytest.approx(plain.shared_dX + plain.shared_F)
    assert again.W == plain.W
    assert plain.dispatch > 0 and plain.combine > 0
    for name in (*COMPUTE_FIELDS[:9], "head_F", "head_B", "p2p"):
        assert getattr(plain, name) > 0, name
    # the shared experts are a sub-stage of their own (the runtime's side piece), out of mlp_*
    assert plain.shared_F == pytest.approx(
        sum(v for k, v in plain.detail.items() if k.startswith("shared_") and k.endswith(".fwd"))
    )
    parts = ("attn_dX", "attn_dW", "shared_dX", "shared_dW", "mlp_dX", "mlp_dW")
    assert pytest.approx(sum(getattr(plain, n) for n in parts)) == plain.B
    dense = substage_costs(CFG.replace(num_dense_layers=1), cluster, par, work, moe=False)
    assert dense.dispatch == dense.combine == 0
    single = substage_costs(CFG, cluster, Parallelism(pp=2, dp=8, ep=1), work)
    assert single.dispatch == 0


def test_the_busiest_expert_rank_sets_the_pace() -> None:
    """``expert_imbalance``: the routed experts and both all-to-alls of an MoE layer stretch by it (the busiest
    rank's), nothing else does; a dense layer and ep = 1 have no expert-parallel group to wait in."""
    cluster = Cluster(GPUS["h800"], 16, 8)
    par = Parallelism(pp=2, dp=8, ep=4, schedule="dualpipev")
    work = Workload(seq_len=32, micro_batch=2)
    even = substage_costs(CFG, cluster, par, work)
    skewed = substage_costs(CFG, cluster, par, dataclasses.replace(work, expert_imbalance=1.25))
    for name in ("mlp_F", "mlp_dX", "mlp_dW", "dispatch", "combine"):
        assert getattr(skewed, name) == pytest.approx(1.25 * getattr(even, name)), name
    for name in ("attn_F", "attn_dX", "attn_dW", "shared_F", "shared_dX", "shared_dW", "head_F", "p2p", "dp_reduce"):
        assert getattr(skewed, name) == getattr(even, name), name
    dense_cfg = CFG.replace(num_dense_layers=1)
    for args in ((dense_cfg, cluster, par), (CFG, cluster, Parallelism(pp=2, dp=8, ep=1))):
        moe = args[0] is CFG
        assert substage_costs(*args, dataclasses.replace(work, expert_imbalance=1.25), moe=moe) == substage_costs(
            *args, work, moe=moe
        )
    with pytest.raises(ValueError, match="at least 1"):
        Workload(seq_len=32, micro_batch=2, expert_imbalance=0.9)


def test_allreduce_p2p_and_dp_reduce() -> None:
    assert allreduce_seconds(1e9, 4, 50e9) == pytest.approx(2 * 3 / 4 * 1e9 / 50e9)
    assert allreduce_seconds(1e9, 1, 50e9) == 0
    cluster = Cluster(GPUS["h800"], 16, 8)
    work = Workload(seq_len=32, micro_batch=2)
    act = 64 * 32 * 2
    # pipeline of 2 x dp 8 spans both nodes: the boundary crosses IB; pp 2 x dp 4 fits in a node: NVLink.
    assert p2p_seconds(CFG, cluster, Parallelism(pp=2, dp=8, ep=4), work) == pytest.approx(act / 50e9)
    assert p2p_seconds(CFG, cluster, Parallelism(pp=2, dp=4, ep=4), work) == pytest.approx(act / 160e9)
    assert p2p_seconds(CFG, cluster, Parallelism(pp=1, dp=16, ep=4), work) == 0
    # 1F1B, pp 2, dp 8 (one node: NVLink), ep 4 (edp 2): fp32 grads of each rank's dense and expert parameters.
    par = Parallelism(pp=2, dp=8, ep=4, schedule="1f1b")
    want = 0.0
    for r in range(2):
        specs = rank_params(CFG, 2, 4, "1f1b", r)
        dense = 4 * sum(p.numel for p in specs if not p.expert)
        expert = 4 * sum(p.numel for p in specs if p.expert)
        want = max(want, 2 * 7 / 8 * dense / 160e9 + 2 * 1 / 2 * expert / 160e9)  # H800's NVLink all-reduce
    assert dp_reduce_seconds(CFG, cluster, par, work) == pytest.approx(want)
    # dp 16 spans two nodes: a node's 8 ranks send through 8 NICs of 50 GB/s at once, capped at NVLink's 160;
    # the expert group (edp 4, ranks 4 apart) has 2 ranks a node: 2 x 50
    wide = dp_reduce_seconds(CFG, Cluster(GPUS["h800"], 32, 8), Parallelism(pp=2, dp=16, ep=4, schedule="1f1b"), work)
    specs0 = rank_params(CFG, 2, 4, "1f1b", 0)
    assert wide >= 2 * 15 / 16 * 4 * sum(p.numel for p in specs0 if not p.expert) / 160e9
    two = Cluster(GPUS["h800"], 32, 8)
    assert (allreduce_busbw(two, 16, 1), allreduce_busbw(two, 4, 4), allreduce_busbw(two, 4, 8)) == (160e9, 100e9, 50e9)
    assert allreduce_busbw(Cluster(GPUS["h100"], 32, 8), 16, 1) == 400e9  # 8 NICs a node under NVLink's 460
    # DualPipe adds the mirror sum over 2 ranks; pure bf16 halves the bytes
    mirrored = dp_reduce_seconds(CFG, cluster, Parallelism(pp=2, dp=8, ep=4, schedule="dualpipe"), work)
    assert mirrored > want
    bf16 = dp_reduce_seconds(CFG, cluster, par, dataclasses.replace(work, master_weights=False))
    assert bf16 == pytest.approx(want / 2)


def test_layout_validation() -> None:
    with pytest.raises(ValueError, match="must divide"):
        Parallelism(pp=2, dp=6, ep=4)
    with pytest.raises(ValueError, match="even"):
        Parallelism(pp=3, dp=4, ep=4, schedule="dualpipe")
    assert Parallelism(pp=2, dp=8, ep=4).edp == 2 and Parallelism(pp=2, dp=8, ep=4, schedule="dualpipe").mirrored


@pytest.mark.parametrize("name", sorted(GPUS))
def test_v3_costs_are_sane_on_every_profile(name: str) -> None:
    cluster = Cluster(GPUS[name], 2048, 8)
    par = Parallelism(pp=16, dp=128, ep=64, schedule="dualpipe")
    c = substage_costs(PRESETS["v3"], cluster, par, Workload(seq_len=4096, micro_batch=1))
    for f in dataclasses.fields(c):
        value = getattr(c, f.name)
        if f.name in ("host_F", "host_B", "counts"):  # measured only: the host runs ahead of the GPU
            assert value == 0.0, f.name
        elif isinstance(value, float):
            assert 0 < value < 60, f.name  # seconds: positive, and nothing absurd for one micro-batch
    # backward GEMM work is about twice forward
    assert 1.5 < c.B / c.F < 3.0

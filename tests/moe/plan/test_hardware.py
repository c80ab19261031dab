"""GPU profiles: datasheet values pinned, every efficiency cited, overrides reported, validation, cluster shape."""

from __future__ import annotations

import dataclasses

import pytest

from moe.plan.efficiency import KEYS, TABLES, Cited, flop_weighted
from moe.plan.hardware import GPUS, Cluster, gpu, with_overrides


def test_datasheet_values_are_pinned() -> None:
    # dense bf16 (half the datasheet's "with sparsity" 1,979 TFLOPS), HBM, SMs, per-direction links
    for name in ("h100", "h800", "h200"):
        g = gpu(name)
        assert g.bf16_flops == pytest.approx(989.4e12)
        assert g.sms == 132
        assert g.internode_bytes_per_s == 50e9  # one 400 Gb/s NIC per GPU
        assert g.gemm_efficiency is None  # the cited table's, by precision and shape
    assert (GPUS["h100"].hbm_bytes, GPUS["h100"].hbm_bytes_per_s, GPUS["h100"].nvlink_bytes_per_s) == (
        80e9,
        3.35e12,
        450e9,
    )
    assert (GPUS["h800"].hbm_bytes, GPUS["h800"].nvlink_bytes_per_s) == (80e9, 200e9)  # 400 GB/s both ways
    assert (GPUS["h200"].hbm_bytes, GPUS["h200"].hbm_bytes_per_s) == (141e9, 4.8e12)
    assert (GPUS["b200"].bf16_flops, GPUS["b200"].fp8_flops, GPUS["b200"].sms) == (2250e12, 4500e12, 148)


def test_every_efficiency_has_a_source_and_every_device_a_full_table() -> None:
    for name, table in TABLES.items():
        assert set(table) == set(KEYS), name
        for key, cited in table.items():
            assert isinstance(cited, Cited) and cited.source.strip(), (name, key)
        assert GPUS[name].efficiencies is table
    with pytest.raises(ValueError, match="no source"):
        Cited(0.5, " ")


def test_fp8_gemm_efficiency_is_deepgemms_published_rate() -> None:
    # two published rows at equal FLOPs: 1346 and 1214 TFLOPS -> their harmonic mean over the 1,979 dense peak
    rows = ((1, 1, 1, 1346.0), (1, 1, 1, 1214.0))
    assert flop_weighted(rows, 1979) == pytest.approx(2 / (1 / 1346 + 1 / 1214) / 1979)
    h800 = GPUS["h800"]
    assert h800.fp8_gemm_flops / 1e12 == pytest.approx(1223, abs=1)  # DeepGEMM's six dense V3 shapes at M=4096
    assert h800.value("gemm.fp8.grouped") * 1979 == pytest.approx(1299, abs=1)
    assert (h800.value("deepep.intranode.dispatch"), h800.value("deepep.internode.combine")) == (153e9, 50e9)


def test_validation_and_overrides() -> None:
    h = gpu("h100")
    with pytest.raises(ValueError, match="gemm_efficiency"):
        dataclasses.replace(h, gemm_efficiency=1.5)
    with pytest.raises(ValueError, match="hbm_bytes_per_s"):
        dataclasses.replace(h, hbm_bytes_per_s=0)
    with pytest.raises(KeyError, match="known"):
        gpu("a100")
    tuned = with_overrides(h, gemm_efficiency=0.5, nvlink_bytes_per_s=None)
    assert tuned.gemm_efficiency == 0.5 and tuned.nvlink_bytes_per_s == h.nvlink_bytes_per_s
    # an override replaces the cited entries it covers and says so; the rest stay cited
    assert tuned.entry("gemm.fp8.grouped") == (0.5, "override gemm_efficiency=0.5")
    assert tuned.entry("attention.fwd")[1].startswith("cited: FlashAttention-3")
    linked = with_overrides(h, nvlink_bytes_per_s=1e11)
    assert linked.entry("deepep.intranode.combine") == (1e11, "override nvlink_bytes_per_s=1e+11")
    assert linked.entry("deepep.internode.combine")[1].startswith("cited: DeepEP")


def test_cluster() -> None:
    c = Cluster(gpu("h800"), 2048, 8)
    assert c.num_nodes == 256 and c.ranks_per_node(64) == 8 and c.ranks_per_node(4) == 4
    assert Cluster(gpu("h800"), 4, 8).num_nodes == 1
    with pytest.raises(ValueError, match="whole number of nodes"):
        Cluster(gpu("h800"), 12, 8)
    with pytest.raises(ValueError):
        Cluster(gpu("h800"), 0, 8)


def test_explain_names_each_entry_a_plan_uses_and_what_replaced_it() -> None:
    from moe.plan.explain import explain
    from moe.plan.measured import MeasuredCosts
    from tests.moe.helpers import tiny_config

    cfg = tiny_config()
    cluster = Cluster(with_overrides(gpu("h800"), gemm_efficiency=0.5), 8, 8)
    file = MeasuredCosts(config=cfg, seq_len=32, tokens=64, moe={}, ops={"experts_down.fwd": 1e-3}, source="bench")
    text = explain(cfg, cluster, pp=2, dp=4, ep=4, tokens=64, seq_len=32, fp8=False, measured=file)
    assert "gemm.bf16.small_m = 50.0% of peak: override gemm_efficiency=0.5" in text
    assert "deepep.intranode.dispatch = 153 GB/s at 24 SMs: cited: DeepEP" in text
    assert "measured instead for experts_down.fwd (--costs, bench)" in text
    assert "internode" not in text  # ep 4 and pp 2 x dp 4 fit in a node: no NIC entry used

"""GPU profiles: datasheet values pinned, validation, cluster shape."""

from __future__ import annotations

import dataclasses

import pytest

from moe.plan.hardware import DEFAULT_GEMM_EFFICIENCY, GPUS, Cluster, gpu, with_overrides


def test_datasheet_values_are_pinned() -> None:
    # dense bf16 (half the datasheet's "with sparsity" 1,979 TFLOPS), HBM, SMs, per-direction links
    for name in ("h100", "h800", "h200"):
        g = gpu(name)
        assert g.bf16_flops == pytest.approx(989.4e12)
        assert g.sms == 132
        assert g.internode_bytes_per_s == 50e9  # one 400 Gb/s NIC per GPU
        assert g.gemm_efficiency == DEFAULT_GEMM_EFFICIENCY
    assert (GPUS["h100"].hbm_bytes, GPUS["h100"].hbm_bytes_per_s, GPUS["h100"].nvlink_bytes_per_s) == (
        80e9,
        3.35e12,
        450e9,
    )
    assert (GPUS["h800"].hbm_bytes, GPUS["h800"].nvlink_bytes_per_s) == (80e9, 200e9)  # 400 GB/s both ways
    assert (GPUS["h200"].hbm_bytes, GPUS["h200"].hbm_bytes_per_s) == (141e9, 4.8e12)
    assert GPUS["h100"].gemm_flops == pytest.approx(989.4e12 * DEFAULT_GEMM_EFFICIENCY)


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


def test_cluster() -> None:
    c = Cluster(gpu("h800"), 2048, 8)
    assert c.num_nodes == 256 and c.ranks_per_node(64) == 8 and c.ranks_per_node(4) == 4
    assert Cluster(gpu("h800"), 4, 8).num_nodes == 1
    with pytest.raises(ValueError, match="whole number of nodes"):
        Cluster(gpu("h800"), 12, 8)
    with pytest.raises(ValueError):
        Cluster(gpu("h800"), 0, 8)

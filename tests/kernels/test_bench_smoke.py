"""The shared benchmark harness and the kernel benchmark CLI, run tiny on CPU (reference backend)."""

from __future__ import annotations

import datetime
import json

import pytest
import torch

from bench import harness
from bench import kernels as bench_kernels


def test_harness_warms_up_times_and_compares(tmp_path):
    calls = []
    bench = harness.Bench("unit", torch.device("cpu"), warmup=2, repeats=3)
    fast = bench.measure("op", "fast", "s", lambda: calls.append(1), flops=1e6, bytes=2e6)
    assert len(calls) == 5  # warm-up calls are made but not timed
    slow = bench.measure("op", "slow", "s", lambda: sum(range(20000)), flops=1e6, baseline=True)
    assert fast.ms_min <= fast.ms <= fast.ms_max
    assert fast.gbps == pytest.approx(2e6 / (fast.ms * 1e-3) / 1e9)
    assert bench.compare(fast, slow, "speedup") == pytest.approx(slow.ms / fast.ms)
    assert bench.compare(fast, slow, "rate", "tflops") == pytest.approx(fast.tflops / slow.tflops)
    with pytest.raises(ValueError, match="metric"):
        bench.compare(fast, slow, "x", "watts")
    assert "slow*" in bench.table()  # baselines are marked
    path = bench.save(tmp_path)
    assert path.name == f"unit-cpu-{datetime.date.today().isoformat()}.json"
    rows = json.loads(path.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["fast", "slow"] and rows[0]["ratios"].keys() == {"speedup", "rate"}


def test_kernel_benchmark_cli_writes_results(tmp_path, force_torch, capsys):
    path = bench_kernels.main(["--shapes", "small", "--device", "cpu", "--warmup", "1", "--repeats", "2",
                               "--out", str(tmp_path)])  # fmt: skip
    record = json.loads(path.read_text())
    assert path.parent == tmp_path and record["device"] == "cpu" and record["shapes"] == "small"
    by_key = {(r["op"], r["impl"]): r for r in record["rows"]}
    ops_expected = ["grouped_gemm", "grouped_gemm_dgrad", "grouped_gemm_wgrad", "permute", "unpermute",
                    "router_topk", "swiglu"]  # fmt: skip
    for op in ops_expected:
        ours, ref = by_key[(op, "ops[torch]")], by_key[(op, "reference")]
        assert ours["ms"] > 0 and ref["ms"] > 0
        assert ours["ratios"]["speedup_vs_reference"] == pytest.approx(ref["ms"] / ours["ms"])
    if hasattr(torch, "_grouped_mm"):  # the peer baseline runs on CPU too in torch 2.13
        assert "speedup_vs_grouped_mm" in by_key[("grouped_gemm", "ops[torch]")]["ratios"]
    assert by_key[("dense_matmul", "torch.matmul")]["baseline"]
    assert by_key[("d2d_copy", "Tensor.copy_")]["baseline"]
    gemm = by_key[("grouped_gemm", "ops[torch]")]
    shape = bench_kernels.SHAPES["small"][0]
    assert gemm["flops"] == 2.0 * shape.rows * shape.hidden * shape.inter
    assert gemm["tflops"] == pytest.approx(gemm["flops"] / (gemm["ms"] * 1e-3) / 1e12)
    assert "vs_copy_bw" in by_key[("permute", "ops[torch]")]["ratios"]
    assert "saved" in capsys.readouterr().out


def test_targets_are_judged_on_the_ops_rows_only():
    def row(op, impl, **ratios):
        return harness.Row(op=op, impl=impl, shape="s", ms=1.0, ms_min=1.0, ms_max=1.0, ratios=ratios)

    rows = [
        row("grouped_gemm", "ops[triton]", vs_dense_rate=0.65, speedup_vs_grouped_mm=0.9, speedup_vs_reference=5.0),
        row("grouped_gemm", "torch._grouped_mm", vs_dense_rate=0.7),  # a baseline: not judged
        row("grouped_gemm", "ops[triton] comm_sms=20", vs_dense_rate=0.5),  # a variant: not judged
        row("unpermute", "ops[triton]", vs_copy_bw=0.69),
        row("swiglu", "ops[triton]", vs_copy_bw=0.1),  # no target for SwiGLU in the issue
    ]
    verdicts = {(c["check"], c["met"]) for c in bench_kernels.check_targets(rows)}
    assert verdicts == {
        ("grouped_gemm s vs_dense_rate", True),
        ("grouped_gemm s speedup_vs_grouped_mm", False),
        ("unpermute s vs_copy_bw", False),
    }

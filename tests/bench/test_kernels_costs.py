"""``bench.kernels --costs-out``: the planner's costs file from the kernel benchmark, run tiny on CPU."""

from __future__ import annotations

import json

import pytest

from bench import kernels as bench_kernels
from moe.plan.costs import Parallelism, Workload, substage_costs
from moe.plan.hardware import GPUS, Cluster
from moe.plan.measured import load_costs, measured_ops


def test_kernel_bench_writes_a_costs_file_the_planner_uses(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DUALPIPE_KERNELS", "torch")  # the reference path: what runs on a CPU
    out = tmp_path / "costs.json"
    results = bench_kernels.main(["--shapes", "small", "--device", "cpu", "--warmup", "0", "--repeats", "1",
                                  "--out", str(tmp_path), "--costs-out", str(out)])  # fmt: skip
    m = load_costs(out)
    shape = bench_kernels.SHAPES["small"][0]
    assert set(m.ops) == set(bench_kernels.PLANNER_OPS) and all(v > 0 for v in m.ops.values())
    assert m.moe == {} and m.device == "cpu" and "ops[torch]" in m.source and m.comm_sms == 0
    assert (m.config, m.tokens, m.seq_len) == (bench_kernels.planner_config(shape), shape.num_tokens, shape.num_tokens)
    assert (m.ep, m.act_bytes, m.config.num_experts) == (4, 4, 16)  # 16 router experts, 4 per rank; fp32 on CPU
    # each op is its kernel's median times the op's work over the kernel's
    rows = {r["op"]: r for r in json.loads(results.read_text())["rows"] if r["impl"] == "ops[torch]"}
    planner = measured_ops(m)
    assert m.ops["experts_gate_up.fwd"] == pytest.approx(2 * rows["grouped_gemm"]["ms"] * 1e-3)  # D -> 2F
    assert m.ops["experts_down.dw"] == pytest.approx(rows["grouped_gemm_wgrad"]["ms"] * 1e-3)  # same FLOPs
    permute = rows["permute"]
    assert m.ops["permute.fwd"] == pytest.approx(permute["ms"] * 1e-3 * planner["permute"].fwd_bytes / permute["bytes"])
    # the planner at the measured shape takes them as they are; the ops the file lacks stay analytic
    cluster = Cluster(GPUS["h800"], 4, 4)
    par = Parallelism(pp=1, dp=4, ep=4, schedule="1f1b")
    work = Workload(seq_len=shape.num_tokens, micro_batch=1, comm_sms=0, act_bytes=4)
    used = substage_costs(m.config, cluster, par, work, measured=m)
    analytic = substage_costs(m.config, cluster, par, work)
    for key, seconds in m.ops.items():
        assert used.detail[key] == pytest.approx(seconds)
    assert used.detail["permute.dx"] == analytic.detail["permute.dx"] and used.attn_dW == analytic.attn_dW
    mlp = ("permute", "experts_gate_up", "experts_swiglu", "experts_down", "unpermute")  # no shared expert
    assert used.mlp_F == pytest.approx(sum(used.detail[f"{name}.fwd"] for name in mlp))


def test_no_costs_file_from_a_run_that_left_an_op_out(tmp_path, monkeypatch) -> None:
    # Without a timed swiglu row the file would describe what was not measured: no file, and a non-zero exit.
    monkeypatch.setenv("DUALPIPE_KERNELS", "torch")
    out = tmp_path / "costs.json"
    with pytest.raises(SystemExit, match=r"no costs file: .*no timed ops\[\.\.\.\] rows for \['swiglu'\]"):
        bench_kernels.main(["--shapes", "small", "--device", "cpu", "--warmup", "0", "--repeats", "1", "--out",
                            str(tmp_path), "--costs-out", str(out), "--no-fp8"] +
                           [f"--only={op}" for op in set(bench_kernels.PLANNER_OPS.values()) - {"swiglu"}])  # fmt: skip
    assert not out.exists() and list(tmp_path.glob("kernels-*.json"))  # the rows are saved all the same


def test_costs_shape_must_be_in_the_set(tmp_path) -> None:
    with pytest.raises(SystemExit, match="--costs-shape 3"):
        bench_kernels.main(["--shapes", "small", "--device", "cpu", "--costs-out", str(tmp_path / "c.json"),
                            "--costs-shape", "3"])  # fmt: skip

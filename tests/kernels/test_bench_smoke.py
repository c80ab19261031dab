"""The shared benchmark harness and the kernel benchmark CLI, run tiny on CPU: the torch reference path, and the
Triton kernels in the interpreter (TRITON_INTERPRET=1 from the root conftest), each checked before it is timed."""

from __future__ import annotations

import datetime
import json

import pytest
import torch

from bench import harness
from bench import kernels as bench_kernels
from kernels import reference, reference_fp8


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
    failed = bench.untimed("op", "wrong", "s", harness.Check(passed=False, detail="output rel 1 (<= 1e-5)"))
    assert failed.ms is None and failed.tflops is None and bench.compare(failed, slow, "speedup") is None
    table = bench.table()
    assert "slow*" in table  # baselines are marked
    assert "FAIL: op wrong s: output rel 1 (<= 1e-5)" in table
    path = bench.save(tmp_path)
    assert path.name == f"unit-cpu-{datetime.date.today().isoformat()}.json"
    rows = json.loads(path.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["fast", "slow", "wrong"] and rows[0]["ratios"].keys() == {"speedup", "rate"}
    assert rows[2]["ms"] is None and rows[2]["check"] == {"passed": False, "detail": "output rel 1 (<= 1e-5)"}


def test_rotation_cycles_copies_that_outgrow_the_l2():
    seen = []
    x, counts = torch.arange(6.0), torch.tensor([2, 4])
    call = harness.rotation(lambda a, b, k: seen.append((a, b, k)), (x, counts, 3), torch.device("cpu"))
    for _ in range(4):
        call()
    assert [a.data_ptr() for a, _, _ in seen[:2]] == [a.data_ptr() for a, _, _ in seen[2:]]  # two copies, in turn
    assert seen[0][0].data_ptr() == x.data_ptr() and seen[1][0].data_ptr() != x.data_ptr()
    assert all(torch.equal(a, x) and torch.equal(b, counts) and k == 3 for a, b, k in seen)
    transposed = harness.rotation(lambda a: seen.append(a), (x.view(2, 3).t(),), torch.device("cpu"))
    transposed()
    transposed()
    assert seen[-1].stride() == (1, 3)  # a copy keeps the strides a kernel's layout depends on
    l2 = 50 * 2**20
    for touched in (1, 1000, l2 // 3, l2, 10 * l2):
        copies = harness.copies_for(l2, touched)
        assert copies >= 2 and (copies - 1) * touched > l2  # between two uses of a copy, more than the L2 goes by
        assert copies * touched <= 2 * touched + l2  # and no more than that is held


def test_rotation_on_cuda_sizes_its_copies_by_the_l2(monkeypatch):
    # The CUDA branch without a GPU: an L2 of 1000 bytes, a call touching 24 + 24 bytes (its input, its result):
    # 2 + 1000 // 48 = 22 copies, used in turn after one sizing call on the original.
    monkeypatch.setattr(harness, "l2_bytes", lambda device: 1000)
    seen = []
    x = torch.arange(6.0)
    call = harness.rotation(lambda a: seen.append(a.data_ptr()) or a.clone(), (x,), torch.device("cuda"))
    for _ in range(44):
        call()
    assert seen[0] == seen[1] == x.data_ptr() and len(set(seen)) == 22 and seen[1:23] == seen[23:]


def test_check_close_passes_a_correct_bf16_gemm_and_fails_one_wrong_tile():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(1024, 2048, generator=gen), torch.randn(2048, 512, generator=gen) / 2048**0.5
    ref = (a @ b).bfloat16()
    # Another correct kernel: fp32 sums in another order (two halves of K), then one rounding to bf16.
    other = (a[:, :1024] @ b[:1024] + a[:, 1024:] @ b[1024:]).bfloat16()
    ok = harness.check_close(other, ref, bench_kernels.dtype_tolerance)
    assert ok.passed, ok.detail
    wrong = other.clone()
    wrong[128:256, 0:128] = 0  # one 128x128 tile not written: 1/32 of the output
    failed = harness.check_close(wrong, ref, bench_kernels.dtype_tolerance)
    assert not failed.passed and "peak" in failed.detail
    nan = other.clone()
    nan[5, 5] = float("nan")
    assert "non-finite" in harness.check_close(nan, ref, bench_kernels.dtype_tolerance).detail
    ids = torch.arange(10)
    assert harness.check_close((other, ids), (ref, ids), bench_kernels.dtype_tolerance).passed
    moved = ids.clone()
    moved[3] = 7  # one routed row sent to the wrong place
    assert "1 of 10" in harness.check_close((other, moved), (ref, ids), bench_kernels.dtype_tolerance).detail
    assert "reference torch.float32" in harness.check_close(other, ref.float(), bench_kernels.dtype_tolerance).detail


def _round_mantissa(x: torch.Tensor, bits: int) -> torch.Tensor:
    mantissa, exponent = torch.frexp(x)
    return torch.ldexp(torch.round(mantissa * 2**bits) / 2**bits, exponent)


def test_fp8_tolerance_passes_hopper_accumulation_and_fails_one_wrong_scale_tile():
    gen = torch.Generator().manual_seed(1)
    tile = reference_fp8.TILE
    x, x_scale = reference_fp8.quantize_fp8(torch.randn(256, 8 * tile, generator=gen))
    w, w_scale = reference_fp8.quantize_fp8(torch.randn(4 * tile, 8 * tile, generator=gen), (tile, tile))
    ref = reference_fp8.fp8_gemm(x, x_scale, w, w_scale, out_dtype=torch.float32)
    # A correct sm_90 kernel: each 128-wide slice summed keeping 14 bits, then promoted with its scales in float32.
    xd, wd = reference_fp8.dequantize_fp8(x, x_scale), reference_fp8.dequantize_fp8(w, w_scale, (tile, tile))
    slices = [_round_mantissa(xd[:, k : k + tile] @ wd[:, k : k + tile].t(), 14) for k in range(0, 8 * tile, tile)]
    hopper = torch.stack(slices).sum(0)
    assert harness.check_close(hopper, ref, bench_kernels.fp8_tolerance).passed
    wrong_scale = w_scale.clone()
    wrong_scale[1, 2] *= 2  # one 128x128 weight tile read with twice its scale
    wrong = reference_fp8.fp8_gemm(x, x_scale, w, wrong_scale, out_dtype=torch.float32)
    assert not harness.check_close(wrong, ref, bench_kernels.fp8_tolerance).passed


def test_kernel_benchmark_cli_on_the_reference_path(tmp_path, force_torch, capsys):
    path = bench_kernels.main(["--shapes", "small", "--device", "cpu", "--warmup", "1", "--repeats", "2",
                               "--out", str(tmp_path)])  # fmt: skip
    record = json.loads(path.read_text())
    assert path.parent == tmp_path and record["device"] == "cpu" and record["shapes"] == "small"
    assert record["backend"] == "torch" and record["failed"] == []
    by_key = {(r["op"], r["impl"]): r for r in record["rows"]}
    for op in bench_kernels.OPS:
        ours = by_key[(op, "ops[torch]")]
        assert ours["ms"] > 0 and ours["check"] is None  # the reference is not checked against itself
    assert any("nothing was checked" in n for n in record["notes"])
    if hasattr(torch, "_grouped_mm"):  # the peer baseline runs on CPU too in torch 2.13, checked like an op
        peer = by_key[("grouped_gemm_wgrad", "torch._grouped_mm")]
        assert peer["check"]["passed"] and "speedup_vs_grouped_mm" in by_key[("grouped_gemm", "ops[torch]")]["ratios"]
    assert by_key[("dense_matmul", "torch.matmul")]["baseline"]
    assert by_key[("d2d_copy", "Tensor.copy_")]["baseline"]
    shape = bench_kernels.SHAPES["small"][0]
    gemm = by_key[("grouped_gemm", "ops[torch]")]
    assert gemm["flops"] == 2.0 * shape.rows * shape.hidden * shape.inter
    assert gemm["tflops"] == pytest.approx(gemm["flops"] / (gemm["ms"] * 1e-3) / 1e12)
    # bytes: arguments read once and results written once (fp32 here)
    assert by_key[("swiglu", "ops[torch]")]["bytes"] == 3 * shape.rows * shape.inter * 4
    assert "vs_copy_bw" in by_key[("permute", "ops[torch]")]["ratios"]
    assert "speedup_vs_bf16" in by_key[("fp8_grouped_wgrad", "ops[torch]")]["ratios"]
    assert "saved" in capsys.readouterr().out


def test_a_call_that_fails_when_timed_is_a_failed_row(tmp_path, force_torch, monkeypatch):
    # Out of memory for the rotated copies: the op's row fails, the next op still runs, the command exits non-zero.
    right, calls = reference.swiglu, []

    def runs_once(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
        return right(*args, **kwargs)

    monkeypatch.setattr(reference, "swiglu", runs_once)  # the switch looks it up at call time
    with pytest.raises(SystemExit, match=r"1 kernel check\(s\) failed: swiglu ops\[torch\]"):
        bench_kernels.main(["--device", "cpu", "--repeats", "1", "--warmup", "0", "--only", "swiglu", "--only",
                            "router_topk", "--out", str(tmp_path)])  # fmt: skip
    (path,) = tmp_path.glob("kernels-*.json")
    rows = {r["op"]: r for r in json.loads(path.read_text())["rows"] if not r["baseline"]}
    detail = "ops[torch] timed raised RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert rows["swiglu"]["ms"] is None and rows["swiglu"]["check"] == {"passed": False, "detail": detail}
    assert rows["router_topk"]["ms"] > 0


def test_a_spent_budget_starts_no_more_ops_and_saves_what_ran(tmp_path, force_torch):
    path = bench_kernels.main(["--device", "cpu", "--repeats", "1", "--warmup", "0", "--budget-s", "0", "--only",
                               "swiglu", "--only", "router_topk", "--out", str(tmp_path)])  # fmt: skip
    record = json.loads(path.read_text())
    assert record["rows"] == [] and "--budget-s 0 spent: not run swiglu E4 T16" in record["notes"][0]


def test_unknown_only_names_the_valid_ops(tmp_path):
    with pytest.raises(SystemExit) as exc:
        bench_kernels.main(["--only", "swiglu", "--only", "gemm", "--device", "cpu", "--out", str(tmp_path)])
    message = str(exc.value)
    assert message.startswith("--only gemm: not a benchmarked op; one of grouped_gemm,") and "\n" not in message
    assert all(op in message for op in bench_kernels.OPS)


def test_targets_are_judged_on_the_ops_rows_only():
    def row(op, impl, **ratios):
        return harness.Row(op=op, impl=impl, shape="s", ms=1.0, ms_min=1.0, ms_max=1.0, ratios=ratios)

    rows = [
        row("grouped_gemm", "ops[triton]", vs_dense_rate=0.65, speedup_vs_grouped_mm=0.9),
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

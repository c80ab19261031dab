"""``python -m bench.kernels`` on the Triton backend: on CPU in the interpreter (TRITON_INTERPRET=1 from the root
conftest, fp32, the small shape set), compiled on a GPU. Every op is checked against its torch reference before
it is timed, and a wrong kernel fails its row and the command, after the other rows ran."""

from __future__ import annotations

import json
import re

import pytest

from bench import kernels as bench_kernels

pytestmark = pytest.mark.usefixtures("force_triton")


def _argv(tmp_path, device, *extra: str) -> list[str]:
    return ["--shapes", "small", "--device", str(device), "--warmup", "0", "--repeats", "1", "--out", str(tmp_path),
            *extra]  # fmt: skip


def test_every_op_is_checked_against_its_reference_and_passes(tmp_path, device, capsys):
    # --repeats 0 checks every op and times none: the interpreter's time goes to the checks (the timing path on
    # Triton is the next test's).
    path = bench_kernels.main(_argv(tmp_path, device, "--repeats", "0"))
    record = json.loads(path.read_text())
    assert record["backend"] == "triton" and record["failed"] == []
    rows = record["rows"]
    ours = {r["op"] for r in rows if r["impl"] == "ops[triton]"}
    assert ours == set(bench_kernels.OPS)  # every op the benchmark knows ran on Triton
    assert all(r["check"]["passed"] and r["ms"] is None for r in rows), rows  # ours and torch's peers alike
    details = {r["op"]: r["check"]["detail"] for r in rows if r["impl"] == "ops[triton]"}
    assert (
        details["permute"]
        == "output 0 rel 0.00e+00 (<= 0e+00) peak 0.00e+00 (<= 0e+00); output 1 equal; output 2 equal"
    )
    assert details["router_topk"].count("rel") == 2 and "output 1 equal" in details["router_topk"]
    assert "output rel" in details["fp8_grouped_wgrad"]
    # the bench's own failure lines (a note quoting torch's error text, e.g. "ASSERT FAILED", is not one)
    assert not re.search(r"^FAIL: ", capsys.readouterr().out, re.MULTILINE)


def test_a_wrong_kernel_fails_its_row_and_the_command(tmp_path, device, monkeypatch):
    # The switch looks its implementation up on the module at call time: replace the Triton SwiGLU with one that
    # leaves the last routed row unwritten (zeros), one row of 32.
    triton_swiglu = pytest.importorskip("kernels.triton_swiglu")
    right = triton_swiglu.swiglu

    def wrong(x_MF2, scale_M=None):
        y_MF = right(x_MF2, scale_M)
        y_MF[-1] = 0
        return y_MF

    monkeypatch.setattr(triton_swiglu, "swiglu", wrong)
    with pytest.raises(SystemExit, match=r"1 kernel check\(s\) failed: swiglu ops\[triton\] E4 T16") as exc:
        bench_kernels.main(_argv(tmp_path, device, "--only", "swiglu", "--only", "router_topk"))
    assert "\n" not in str(exc.value)
    (path,) = tmp_path.glob("kernels-*.json")  # saved before the exit
    rows = {r["op"]: r for r in json.loads(path.read_text())["rows"] if r["impl"] == "ops[triton]"}
    assert rows["swiglu"]["ms"] is None and not rows["swiglu"]["check"]["passed"]
    detail = rows["swiglu"]["check"]["detail"]  # "output rel <norm> (<= <bound>) peak ...": one row of 32
    assert detail.startswith("output rel ") and 0.1 < float(detail.split()[2]) < 0.3  # about 1/sqrt(32)
    router = rows["router_topk"]  # the next op still ran, was checked and timed (rotated copies, on Triton)
    assert router["check"]["passed"] and router["ms"] > 0 and "vs_copy_bw" in router["ratios"]


def test_a_kernel_that_raises_is_a_failed_row(tmp_path, device, monkeypatch):
    triton_permute = pytest.importorskip("kernels.triton_permute")

    def broken(*args, **kwargs):
        raise RuntimeError("out of resources: shared memory\nsecond line")

    monkeypatch.setattr(triton_permute, "unpermute", broken)
    with pytest.raises(SystemExit, match="unpermute"):
        bench_kernels.main(_argv(tmp_path, device, "--only", "unpermute"))
    (path,) = tmp_path.glob("kernels-*.json")
    (row,) = [r for r in json.loads(path.read_text())["rows"] if r["impl"] == "ops[triton]"]
    assert row["check"] == {
        "passed": False,
        "detail": "ops[triton] raised RuntimeError: out of resources: shared memory",
    }

"""Every Triton kernel compiles for sm_90 (H100/H800) on this CPU-only machine, with sane resources.

Triton bundles ptxas, so the real GPU pipeline runs here; the interpreter tier cannot catch code that
only fails to compile, or compiles into spills. Run in a subprocess: this process has
TRITON_INTERPRET=1, under which kernels are interpreted, not compiled.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = """
import json
from dataclasses import asdict
from kernels import aot
print(json.dumps([asdict(aot.compile_spec(spec, 90)) for spec in aot.kernel_specs()]))
"""


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences 3.9's notice; fusion is its default
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return {r["name"]: r for r in json.loads(result.stdout.strip().splitlines()[-1])}


@pytest.mark.slow
def test_every_kernel_compiles_without_spills(reports):
    assert len(reports) >= 20
    for name, r in reports.items():
        assert r["stack_bytes"] == 0, f"{name} spills: {r}"
        assert r["shared_bytes"] <= 227 * 1024, f"{name} needs more shared memory than an H100 SM has"


@pytest.mark.slow
def test_bf16_grouped_gemms_use_hopper_matrix_units_and_pipelining(reports):
    gemms = [name for name in reports if name.startswith("grouped_gemm") and " bf16 " in name]
    assert len(gemms) >= 3 * 2  # forward, dgrad, wgrad, each with several autotune candidates
    for name in gemms:
        assert reports[name]["wgmma"] > 0, f"{name}: no wgmma, a slower matrix path"
        assert reports[name]["async_copies"] > 0, f"{name}: loads are not software-pipelined"


@pytest.mark.slow
def test_fp8_gemms_use_hopper_matrix_units(reports):
    # Every autotune candidate of the FP8 linear GEMM, the grouped GEMM and the weight gradient multiplies
    # e4m3 operands on the tensor cores (wgmma); the quantization kernels compile too (no spills, above).
    gemms = [name for name in reports if name.startswith(("fp8_gemm ", "fp8_grouped_gemm ", "fp8_gemm_wgrad "))]
    assert {name.split()[0] for name in gemms} == {"fp8_gemm", "fp8_grouped_gemm", "fp8_gemm_wgrad"}
    for name in gemms:
        assert reports[name]["wgmma"] > 0, f"{name}: no wgmma"
    quantization = {"quantize_fp8 1x128", "quantize_fp8 128x128", "quantize_fp8 128x128 transposed",
                    "quantize_fp8_columns", "dequantize_fp8 1x128"}  # fmt: skip
    assert quantization <= set(reports)


def _stages(name: str) -> int:
    """The pipelining depth in a launch's tag ("... w8 s3" -> 3)."""
    return int(name.rsplit(" s", 1)[1])


@pytest.mark.slow
def test_every_fp8_phase_pipelines_as_deeply_as_the_bf16_gemm(reports):
    # sm_90's wgmma takes 8-bit operands K-major only; an operand in another layout is transposed through
    # registers and its loads drop out of the cp.async pipeline (before the K-major layouts: 3 copies of 6 in
    # the grouped forward, none in the weight gradient). With both operands K-major, each FP8 phase issues as
    # many asynchronous copies per stage as the bf16 grouped GEMM's two operands do.
    bf16 = {_stages(n): r["async_copies"] for n, r in reports.items() if n.startswith("grouped_gemm bf16")}
    phases = ("fp8_gemm ", "fp8_gemm dgrad ", "fp8_grouped_gemm ", "fp8_grouped_gemm dgrad ", "fp8_gemm_wgrad ")
    for phase in phases:
        launches = [n for n in reports if n.startswith(phase)]
        assert launches, f"no {phase.strip()} launch in the AOT report"
        for name in launches:
            want = bf16.get(_stages(name), 2 * _stages(name))
            assert reports[name]["async_copies"] >= want, f"{name}: {reports[name]['async_copies']} < {want}"

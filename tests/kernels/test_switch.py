"""The backend switch: DUALPIPE_KERNELS is honoured, read at call time, and Triton is imported lazily; the op
table holds one reference and one Triton launcher per op, with one signature."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

import kernels
from kernels import ops, registry

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_auto_sends_cpu_tensors_to_the_reference(monkeypatch):
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    assert ops.backend_for(torch.zeros(1)) == "torch"
    monkeypatch.setenv(ops.ENV_VAR, "auto")
    assert ops.backend_for(torch.zeros(1)) == "torch"


@pytest.mark.gpu
def test_auto_sends_cuda_tensors_to_triton(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    assert ops.backend_for(torch.zeros(1, device="cuda")) == "triton"
    monkeypatch.setenv(ops.ENV_VAR, "torch")
    assert ops.backend_for(torch.zeros(1, device="cuda")) == "torch"


def test_forced_backends_and_bad_values(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv(ops.ENV_VAR, "torch")
    assert ops.backend_for(torch.zeros(1)) == "torch"
    monkeypatch.setenv(ops.ENV_VAR, " Triton ")  # case and whitespace do not matter
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ops.backend_for(torch.zeros(1)) == "triton"
    monkeypatch.setenv(ops.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="auto, triton, torch"):
        ops.backend_for(torch.zeros(1))


def test_forcing_triton_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv(ops.ENV_VAR, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        ops.swiglu(torch.randn(2, 4))


def test_each_call_dispatches_on_the_current_setting(monkeypatch, device):
    """Spies on both implementations; flipping the variable between calls flips the callee."""
    pytest.importorskip("triton")
    from kernels import triton_swiglu

    calls = []
    real_ref, real_triton = kernels.reference.swiglu, triton_swiglu.swiglu
    monkeypatch.setattr(kernels.reference, "swiglu", lambda x: calls.append("torch") or real_ref(x))
    monkeypatch.setattr(triton_swiglu, "swiglu", lambda x: calls.append("triton") or real_triton(x))
    x = torch.randn(3, 8, device=device)
    for setting in ("torch", "triton", "auto", "triton"):
        monkeypatch.setenv(ops.ENV_VAR, setting)
        torch.testing.assert_close(ops.swiglu(x), real_ref(x))
    auto = "triton" if device.type == "cuda" else "torch"
    assert calls == ["torch", "triton", auto, "triton"]


def test_comm_sms_reaches_triton_only(monkeypatch):
    pytest.importorskip("triton")
    from kernels import triton_grouped_gemm

    seen = {}

    def spy(x, w, counts, *, comm_sms=0):
        seen["comm_sms"] = comm_sms
        return torch.zeros(x.shape[0], w.shape[2])

    monkeypatch.setattr(triton_grouped_gemm, "grouped_gemm", spy)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    args = (torch.randn(4, 16), torch.randn(2, 16, 8), torch.tensor([1, 3]))
    monkeypatch.setenv(ops.ENV_VAR, "triton")
    ops.grouped_gemm(*args, comm_sms=3)
    assert seen == {"comm_sms": 3}
    monkeypatch.setenv(ops.ENV_VAR, "torch")  # the reference ignores comm_sms and must still work
    torch.testing.assert_close(ops.grouped_gemm(*args, comm_sms=3), kernels.reference.grouped_gemm(*args))


def test_every_op_has_a_triton_launcher_with_the_reference_signature():
    pytest.importorskip("triton")
    names = registry.op_names("torch")
    assert names == registry.op_names("triton") == sorted(set(ops.__all__) - {"ENV_VAR", "backend_for"})
    for name in names:
        signature = inspect.signature(registry.implementation(name, "torch"))
        assert inspect.signature(registry.implementation(name, "triton")) == signature, name
        assert inspect.signature(getattr(ops, name)) == signature, name
        assert getattr(ops, name).__doc__ == registry.implementation(name, "torch").__doc__


def test_an_op_registers_once_per_backend():
    def swiglu(x):
        return x

    with pytest.raises(ValueError, match="two torch implementations"):
        registry.register("torch")(swiglu)
    with pytest.raises(ValueError, match="unknown backend"):
        registry.register("cuda")
    with pytest.raises(NotImplementedError, match="no torch implementation"):
        registry.implementation("no_such_op", "torch")


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in (ops.ENV_VAR, "TRITON_INTERPRET")}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=120
    )


def test_import_does_not_import_triton_and_works_without_it():
    code = (
        "import sys\n"
        "import kernels, torch\n"
        "assert 'triton' not in sys.modules, 'import kernels pulled in triton'\n"
        "sys.modules['triton'] = None  # from here on, as if Triton were not installed\n"
        "x = torch.randn(2, 6)\n"
        "assert kernels.backend_for(x) == 'torch'\n"
        "torch.testing.assert_close(kernels.ops.swiglu(x), kernels.reference.swiglu(x))\n"
        "import os; os.environ['DUALPIPE_KERNELS'] = 'triton'\n"
        "try:\n"
        "    kernels.ops.swiglu(x)\n"
        "except RuntimeError as e:\n"
        "    assert 'not installed' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('forcing a missing Triton must fail')\n"
        "print('ok')\n"
    )
    result = _run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_triton_path_accepts_strided_inputs_like_the_reference(device, force_triton):
    """The reference takes any strides; through the switch, Triton must too."""
    x_MF2 = torch.randn(12, 5, device=device).t()  # [5, 12], column-major
    torch.testing.assert_close(ops.swiglu(x_MF2), kernels.reference.swiglu(x_MF2))
    counts_E = torch.tensor([2, 3], device=device)
    x_MK = torch.randn(16, 5, device=device).t()
    w_EKN = torch.randn(2, 16, 16, device=device)
    torch.testing.assert_close(
        ops.grouped_gemm(x_MK, w_EKN, counts_E), kernels.reference.grouped_gemm(x_MK, w_EKN, counts_E)
    )

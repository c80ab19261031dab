"""Triton interpreter tier: without CUDA, Triton kernels run on CPU tensors under TRITON_INTERPRET=1
(set in the root conftest, before any module that imports Triton is collected). With CUDA the same tests
run compiled.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def device() -> torch.device:
    """Where the Triton-vs-reference tests run: the GPU if there is one, else the interpreter on CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def force_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route every kernels.ops call to Triton for the test."""
    pytest.importorskip("triton")
    monkeypatch.setenv("DUALPIPE_KERNELS", "triton")


@pytest.fixture
def force_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route every kernels.ops call to the torch reference for the test."""
    monkeypatch.setenv("DUALPIPE_KERNELS", "torch")

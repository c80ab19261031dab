"""Triton interpreter tier: without CUDA, Triton kernels run on CPU tensors under TRITON_INTERPRET=1.

Triton decides between compiling and interpreting when a kernel is decorated, i.e. when a
``kernels.triton_*`` module is first imported; the variable is set here, at collection, before any test
can import one. It only changes how Triton kernels run: ``DUALPIPE_KERNELS=auto`` still sends CPU tensors
to the torch reference, so the rest of the suite is unaffected. With CUDA the same tests run compiled.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


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

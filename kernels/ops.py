"""The one backend switch: every kernel call of the package goes through the functions here.

The backend is chosen per call from the environment variable ``DUALPIPE_KERNELS``:

* ``auto`` (default): Triton when the tensor is on CUDA and Triton is installed, the torch reference
  otherwise;
* ``triton``: always Triton; off CUDA this needs ``TRITON_INTERPRET=1`` set before the first Triton
  call (the interpreter runs kernels on CPU tensors, slowly);
* ``torch``: always the reference in :mod:`kernels.reference`.

The variable is read on every call, so tests and benchmarks can flip it without reloading anything, and the
tensor that decides is the call's first tensor argument. Triton modules are imported on first use only:
``import kernels`` works without Triton.

There is one function here per op in :mod:`kernels.registry`, named like it and with its reference's (in
:mod:`kernels.reference`, or :mod:`kernels.reference_fp8` for the FP8 ops)
signature and docstring (``help(kernels.ops.swiglu)``); none is written out by hand. They are not
differentiable; :mod:`kernels.functional` wraps them in autograd Functions.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch

# Importing the references registers every op (and its signature); the Triton modules wait for first use.
from kernels import reference, reference_fp8, registry  # noqa: F401

ENV_VAR = "DUALPIPE_KERNELS"
_CHOICES = ("auto", "triton", "torch")


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def backend_for(tensor: torch.Tensor) -> registry.Backend:
    """The backend a call on ``tensor`` takes now, from ``DUALPIPE_KERNELS`` and the tensor's device.

    Raises RuntimeError when Triton is forced but cannot run, ValueError on an unknown setting.
    """
    choice = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if choice not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={choice!r}: expected one of {', '.join(_CHOICES)}")
    if choice == "torch":
        return "torch"
    if choice == "auto":
        return "triton" if tensor.is_cuda and _triton_installed() else "torch"
    if not _triton_installed():
        raise RuntimeError(f"{ENV_VAR}=triton but Triton is not installed: pip install 'dualpipe-moe[triton]'")
    if not tensor.is_cuda and os.environ.get("TRITON_INTERPRET", "").lower() not in ("1", "true", "on", "yes"):
        raise RuntimeError(
            f"{ENV_VAR}=triton with a tensor on {tensor.device}: Triton runs CPU tensors only in its "
            "interpreter; set TRITON_INTERPRET=1 before the first Triton call, or use "
            f"{ENV_VAR}=auto/torch"
        )
    return "triton"


def _contiguous(value: Any) -> Any:
    return value.contiguous() if isinstance(value, torch.Tensor) else value


def _dispatcher(name: str) -> Callable:
    """The switch for op ``name``: the implementation the current setting picks for the first tensor.

    The references accept any strides; most Triton launchers insist on contiguous operands, so the Triton
    path makes their tensor arguments contiguous (free for the contiguous tensors a model passes). A launcher
    registered ``strided=True`` gets its tensors as they are.
    """

    @functools.wraps(registry.implementation(name, "torch"))
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        backend = backend_for(next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)))
        impl = registry.implementation(name, backend)
        if backend == "triton" and not registry.takes_strides(name):
            args = tuple(_contiguous(a) for a in args)
            kwargs = {k: _contiguous(v) for k, v in kwargs.items()}
        return impl(*args, **kwargs)

    dispatch.__module__ = __name__
    return dispatch


_OPS = registry.op_names("torch")
globals().update({name: _dispatcher(name) for name in _OPS})

__all__ = ["ENV_VAR", "backend_for", *_OPS]

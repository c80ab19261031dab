"""The one backend switch: every kernel call of the package goes through the functions here.

Legend for shape suffixes: T tokens, D hidden size, E experts, K top-k (or input features in the GEMMs),
M routed rows, N / F output and intermediate feature sizes.

The backend is chosen per call from the environment variable ``DUALPIPE_KERNELS``:

* ``auto`` (default): Triton when the tensor is on CUDA and Triton is installed, the torch reference
  otherwise;
* ``triton``: always Triton; off CUDA this needs ``TRITON_INTERPRET=1`` set before the first Triton
  call (the interpreter runs kernels on CPU tensors, slowly);
* ``torch``: always the reference in :mod:`kernels.reference`.

The variable is read on every call, so tests and benchmarks can flip it without reloading anything.
Triton modules are imported on first use only: ``import kernels`` works without Triton.

These functions are not differentiable; :mod:`kernels.functional` wraps them in autograd Functions.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import Literal

import torch

from kernels import reference

__all__ = [
    "ENV_VAR",
    "backend_for",
    "grouped_gemm",
    "grouped_gemm_dgrad",
    "grouped_gemm_wgrad",
    "permute",
    "permute_backward",
    "router_topk",
    "swiglu",
    "swiglu_backward",
    "unpermute",
    "unpermute_backward",
]

ENV_VAR = "DUALPIPE_KERNELS"
_CHOICES = ("auto", "triton", "torch")

# Which module holds each op's Triton launcher.
_TRITON_MODULE = {
    "grouped_gemm": "kernels.triton_grouped_gemm",
    "grouped_gemm_dgrad": "kernels.triton_grouped_gemm",
    "grouped_gemm_wgrad": "kernels.triton_grouped_gemm",
    "permute": "kernels.triton_permute",
    "permute_backward": "kernels.triton_permute",
    "unpermute": "kernels.triton_permute",
    "unpermute_backward": "kernels.triton_permute",
    "router_topk": "kernels.triton_router",
    "swiglu": "kernels.triton_swiglu",
    "swiglu_backward": "kernels.triton_swiglu",
}


def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def backend_for(tensor: torch.Tensor) -> Literal["triton", "torch"]:
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


def _impl(name: str, tensor: torch.Tensor, **triton_only: object) -> Callable:
    """The implementation of op ``name`` for ``tensor``; ``triton_only`` keywords go to Triton alone.

    The references accept any strides; the Triton launchers insist on contiguous operands, so the Triton
    path makes its tensor arguments contiguous (free for the contiguous tensors a model passes).
    """
    if backend_for(tensor) == "torch":
        return getattr(reference, name)
    launcher = getattr(importlib.import_module(_TRITON_MODULE[name]), name)

    def call(*args):
        return launcher(*(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args), **triton_only)

    return call


def grouped_gemm(
    x_MK: torch.Tensor, w_EKN: torch.Tensor, tokens_per_expert_E: torch.Tensor, *, comm_sms: int = 0
) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e]: x [M, K], w [E, K, N], counts [E] -> [M, N] in x.dtype.

    comm_sms: SMs left to concurrent communication (the Triton kernel launches num_sms - comm_sms
    persistent programs; the reference ignores it).
    """
    return _impl("grouped_gemm", x_MK, comm_sms=comm_sms)(x_MK, w_EKN, tokens_per_expert_E)


def grouped_gemm_dgrad(
    dy_MN: torch.Tensor, w_EKN: torch.Tensor, tokens_per_expert_E: torch.Tensor, *, comm_sms: int = 0
) -> torch.Tensor:
    """dx[rows of e] = dy[rows of e] @ w[e]^T: dy [M, N], w [E, K, N] -> [M, K] in dy.dtype."""
    return _impl("grouped_gemm_dgrad", dy_MN, comm_sms=comm_sms)(dy_MN, w_EKN, tokens_per_expert_E)


def grouped_gemm_wgrad(
    x_MK: torch.Tensor, dy_MN: torch.Tensor, tokens_per_expert_E: torch.Tensor, *, comm_sms: int = 0
) -> torch.Tensor:
    """dw[e] = x[rows of e]^T @ dy[rows of e]: x [M, K], dy [M, N] -> [E, K, N] in x.dtype (0 if empty)."""
    return _impl("grouped_gemm_wgrad", x_MK, comm_sms=comm_sms)(x_MK, dy_MN, tokens_per_expert_E)


def permute(
    x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows into expert order -> (x_sorted [M, D], row_id [M] int64, tokens_per_expert [E] int64)."""
    return _impl("permute", x_TD)(x_TD, topk_idx_TK, num_experts)


def permute_backward(dx_sorted_MD: torch.Tensor, row_id_M: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """Gradient of :func:`permute` w.r.t. x: [M, D] -> [T, D]."""
    return _impl("permute_backward", dx_sorted_MD)(dx_sorted_MD, row_id_M, num_tokens, top_k)


def unpermute(y_MD: torch.Tensor, row_id_M: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
    """Weighted combine back to token order: [M, D] -> [T, D] in y.dtype."""
    return _impl("unpermute", y_MD)(y_MD, row_id_M, topk_weights_TK)


def unpermute_backward(
    dout_TD: torch.Tensor, y_MD: torch.Tensor, row_id_M: torch.Tensor, topk_weights_TK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of :func:`unpermute` -> (dy [M, D], dweights [T, K])."""
    return _impl("unpermute_backward", dout_TD)(dout_TD, y_MD, row_id_M, topk_weights_TK)


def router_topk(
    logits_TE: torch.Tensor,
    bias_E: torch.Tensor,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    route_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-limited top-k routing -> (weights [T, K] fp32, idx [T, K] int64, scores [T, E] fp32).

    Not differentiable: to train the router, recompute the weights from ``idx`` with torch ops
    (``scores.gather(1, idx)``, normalised) on differentiable sigmoid scores.
    """
    return _impl("router_topk", logits_TE)(logits_TE, bias_E, top_k, n_group, topk_group, route_scale)


def swiglu(x_MF2: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with x = [gate | up]: [M, 2F] -> [M, F]."""
    return _impl("swiglu", x_MF2)(x_MF2)


def swiglu_backward(dy_MF: torch.Tensor, x_MF2: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`swiglu`: [M, F], [M, 2F] -> [M, 2F]."""
    return _impl("swiglu_backward", x_MF2)(dy_MF, x_MF2)

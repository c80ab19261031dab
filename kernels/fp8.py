"""FP8 training GEMMs: the three GEMMs of a linear layer and of the expert MLP, composed from the FP8 ops.

Legend for shape suffixes: T tokens (leading dimensions flattened), K input features, N output features,
M expert-sorted rows, E experts.

:mod:`kernels.reference_fp8` specifies the numerics (DeepSeek-V3's recipe); this module decides what is
quantized how for each GEMM of training, through the backend switch :mod:`kernels.ops`:

=========  ==================================  =====================================
GEMM       operands                            result
=========  ==================================  =====================================
forward    x in 1x128 tiles, W in 128x128      y in the input's dtype
dgrad      dy in 1x128 tiles, W^T in 128x128   dx in dy's dtype
wgrad      dy and x in 128x1 tiles             dW in float32 (weight gradients add
                                               up in float32)
=========  ==================================  =====================================

Every operand reaches its GEMM K-major (its contraction dimension contiguous), the one layout in which sm_90's
FP8 tensor cores take it from shared memory without a transpose through registers (:mod:`kernels.reference_fp8`,
"Layouts"): activations and gradients as rows ``[T, K]``; weights as ``[N, K]`` for the forward and ``[K, N]``
for the input gradient (the contraction then runs over N); the weight gradient's 128x1 operands stored with the
tokens contiguous.

Weights are quantized from the master copy's compute-dtype weight on every call, each phase into the storage it
reads: a transposed view where the master layout is not K-major (an expert weight ``[E, K, N]`` for the forward,
a linear's ``[N, K]`` for the input gradient), which the quantizer writes into transposed storage in the same
pass. A 128x128 block and its transpose share one amax, so both phases see the same FP8 weight bit for bit. Why
not quantize once and keep the second layout for backward: it would save the input gradient's quantization pass
(3 bytes per weight element, small beside a GEMM that reads its expert's weight once per 128-row tile) but hold
an FP8 copy of every expert weight from the forward to the backward, DualPipe keeping several micro-batches in
flight. :class:`Quantized` is an FP8 tensor with its scales: what :class:`FP8Recipe` ``save_fp8`` keeps for
backward in the expert MLP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kernels import ops
from kernels.reference_fp8 import TILE

__all__ = [
    "FP8Recipe",
    "Quantized",
    "grouped_dgrad",
    "grouped_forward",
    "grouped_wgrad",
    "linear_dgrad",
    "linear_forward",
    "linear_wgrad",
    "quantize_rows",
]

_WEIGHT_BLOCK = (TILE, TILE)


@dataclass(frozen=True, slots=True)
class FP8Recipe:
    """How a layer runs its GEMMs in FP8 (a layer without a recipe runs them in its dtype)."""

    save_fp8: bool = False
    """FP8 caching, as DeepSeek-V3 does: the routed experts keep what they save for backward, the
    up-projection's input and the SwiGLU input, in FP8 with 1x128 scales (1 + 4/128 bytes an element instead of
    bf16's 2), and the bf16 copies are freed. Costs one more rounding in the SwiGLU backward and the weight
    gradients. The model's blocks do the rest where one copy can serve every reader (:mod:`moe.models.layers`:
    ``Kept``): the MLP's normed input in FP8 for the router's gate and the shared experts, a SwiGLU MLP's SwiGLU
    input in FP8, SDPA's output in E5M6 for SDPA's backward and the output projection. A lone linear layer
    keeps its input as it is: it is mostly saved in another op's form too."""


class Quantized(NamedTuple):
    """An FP8 tensor ``[T, K]`` in 1x128 tiles along its last dimension and its float32 scales ``[T, ceil(K /
    128)]``, MN-major (:func:`kernels.reference_fp8.mn_major`)."""

    q: torch.Tensor
    scale: torch.Tensor

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return ops.dequantize_fp8(self.q, self.scale, out_dtype=dtype)


def quantize_rows(x_TK: torch.Tensor) -> Quantized:
    """``x`` as 2-D rows in 1x128 tiles (leading dimensions flattened)."""
    return Quantized(*ops.quantize_fp8(x_TK.reshape(-1, x_TK.shape[-1])))


def linear_forward(x: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """``x @ W^T`` with FP8 operands -> ``[..., N]`` in x's dtype."""
    xq = quantize_rows(x)
    y_TN = ops.fp8_gemm(xq.q, xq.scale, *ops.quantize_fp8(w_NK, _WEIGHT_BLOCK), out_dtype=x.dtype)
    return y_TN.view(*x.shape[:-1], w_NK.shape[0])


def linear_dgrad(dy: torch.Tensor, w_NK: torch.Tensor) -> torch.Tensor:
    """Input gradient ``dy @ W`` with FP8 operands -> ``[..., K]`` in dy's dtype."""
    dyq = quantize_rows(dy)
    wq_KN, w_scale = ops.quantize_fp8(w_NK.t(), _WEIGHT_BLOCK)  # K-major for the contraction over N
    dx_TK = ops.fp8_gemm(dyq.q, dyq.scale, wq_KN, w_scale, out_dtype=dy.dtype)
    return dx_TK.view(*dy.shape[:-1], w_NK.shape[1])


def linear_wgrad(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Weight gradient ``dy^T @ x`` over all tokens, operands in 128x1 tiles stored tokens-contiguous -> ``[N, K]``
    float32."""
    a = ops.quantize_fp8_columns(dy.reshape(-1, dy.shape[-1]))
    b = ops.quantize_fp8_columns(x.reshape(-1, x.shape[-1]))
    return ops.fp8_gemm_wgrad(*a, *b)


def grouped_forward(
    x_MK: torch.Tensor,
    w_EKN: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    *,
    comm_sms: int = 0,
    x_fp8: Quantized | None = None,
) -> torch.Tensor:
    """FP8 :func:`kernels.ops.grouped_gemm` -> y ``[M, N]`` in x's dtype. ``x_fp8``: x already quantized
    (:func:`quantize_rows`), by a caller that keeps it."""
    xq = quantize_rows(x_MK) if x_fp8 is None else x_fp8
    wq_ENK, w_scale = ops.quantize_fp8(w_EKN.transpose(1, 2), _WEIGHT_BLOCK)  # K-major: [E, N, K] storage
    return ops.fp8_grouped_gemm(
        xq.q, xq.scale, wq_ENK, w_scale, tokens_per_expert_E, out_dtype=x_MK.dtype, comm_sms=comm_sms
    )


def grouped_dgrad(
    dy_MN: torch.Tensor, w_EKN: torch.Tensor, tokens_per_expert_E: torch.Tensor, *, comm_sms: int = 0
) -> torch.Tensor:
    """FP8 :func:`kernels.ops.grouped_gemm_dgrad`: ``dx[rows of e] = dy[rows of e] @ w[e]^T`` -> ``[M, K]``."""
    dyq = quantize_rows(dy_MN)
    # The contraction runs over N: w as stored, [E, K, N], is the K-major operand ("w_ENK" of the op, N and K
    # swapping roles).
    wq_EKN, w_scale = ops.quantize_fp8(w_EKN, _WEIGHT_BLOCK)
    return ops.fp8_grouped_gemm(
        dyq.q, dyq.scale, wq_EKN, w_scale, tokens_per_expert_E, out_dtype=dy_MN.dtype, comm_sms=comm_sms
    )


def grouped_wgrad(
    x_MK: torch.Tensor, dy_MN: torch.Tensor, tokens_per_expert_E: torch.Tensor, *, comm_sms: int = 0
) -> torch.Tensor:
    """FP8 :func:`kernels.ops.grouped_gemm_wgrad`: ``dw[e] = x[rows of e]^T @ dy[rows of e]`` -> ``[E, K, N]``
    float32, the operands in 128x1 tiles that restart at every expert (stored tokens-contiguous, each expert's
    tiles 128-row aligned: :func:`kernels.ops.quantize_fp8_columns`)."""
    a = ops.quantize_fp8_columns(x_MK, tokens_per_expert_E)
    b = ops.quantize_fp8_columns(dy_MN, tokens_per_expert_E)
    return ops.fp8_gemm_wgrad(*a, *b, tokens_per_expert_E, comm_sms=comm_sms)

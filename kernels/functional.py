"""Differentiable kernel ops: autograd Functions over :mod:`kernels.ops` (the backend switch).

Legend for shape suffixes: T tokens, D hidden size, E experts, K top-k (or input features of the
GEMM), M routed rows, N output features, F intermediate size.

Backward passes call the raw ops too, so forward and backward always take the same backend.
``router_topk`` has no Function: its indices are not differentiable. Callers that train the router
recompute the weights from the indices with torch ops on differentiable scores, e.g.
``w = torch.sigmoid(logits).gather(1, idx); w = w / w.sum(-1, keepdim=True) * route_scale``.
"""

from __future__ import annotations

from typing import Any

import torch

from kernels import ops

__all__ = ["grouped_mm", "permute_tokens", "swiglu", "unpermute_tokens"]


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_MK, w_EKN, tokens_per_expert_E, comm_sms: int):
        ctx.save_for_backward(x_MK, w_EKN, tokens_per_expert_E)
        ctx.comm_sms = comm_sms
        return ops.grouped_gemm(x_MK, w_EKN, tokens_per_expert_E, comm_sms=comm_sms)

    @staticmethod
    def backward(ctx: Any, dy_MN):
        x_MK, w_EKN, tokens_per_expert_E = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dx_MK = dw_EKN = None
        if ctx.needs_input_grad[0]:
            dx_MK = ops.grouped_gemm_dgrad(dy_MN, w_EKN, tokens_per_expert_E, comm_sms=ctx.comm_sms)
        if ctx.needs_input_grad[1]:
            dw_EKN = ops.grouped_gemm_wgrad(x_MK, dy_MN, tokens_per_expert_E, comm_sms=ctx.comm_sms)
        return dx_MK, dw_EKN, None, None


def grouped_mm(
    x_MK: torch.Tensor, w_EKN: torch.Tensor, tokens_per_expert_E: torch.Tensor, comm_sms: int = 0
) -> torch.Tensor:
    """Differentiable grouped GEMM: x [M, K] (rows sorted by expert) @ w [E, K, N] per group -> [M, N].

    Gradients flow to x and w. A zero-bubble schedule that defers the weight-grad calls
    :func:`kernels.ops.grouped_gemm_wgrad` itself instead (with the saved x and dy).
    """
    return _GroupedMM.apply(x_MK.contiguous(), w_EKN, tokens_per_expert_E, comm_sms)


class _PermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_TD, topk_idx_TK, num_experts: int):
        x_sorted_MD, row_id_M, tokens_per_expert_E = ops.permute(x_TD, topk_idx_TK, num_experts)
        ctx.save_for_backward(row_id_M)
        ctx.num_tokens, ctx.top_k = topk_idx_TK.shape
        ctx.mark_non_differentiable(row_id_M, tokens_per_expert_E)
        return x_sorted_MD, row_id_M, tokens_per_expert_E

    @staticmethod
    def backward(ctx: Any, dx_sorted_MD, _drow_id, _dcounts):
        (row_id_M,) = ctx.saved_tensors
        dx_TD = ops.permute_backward(dx_sorted_MD.contiguous(), row_id_M, ctx.num_tokens, ctx.top_k)
        return dx_TD, None, None


def permute_tokens(
    x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Differentiable (w.r.t. x) permute -> (x_sorted [M, D], row_id [M] int64, tokens_per_expert [E])."""
    return _PermuteTokens.apply(x_TD.contiguous(), topk_idx_TK.contiguous(), num_experts)


class _UnpermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y_MD, row_id_M, topk_weights_TK):
        ctx.save_for_backward(y_MD, row_id_M, topk_weights_TK)
        return ops.unpermute(y_MD, row_id_M, topk_weights_TK)

    @staticmethod
    def backward(ctx: Any, dout_TD):
        y_MD, row_id_M, topk_weights_TK = ctx.saved_tensors
        dy_MD, dweights_TK = ops.unpermute_backward(dout_TD.contiguous(), y_MD, row_id_M, topk_weights_TK)
        return dy_MD, None, dweights_TK


def unpermute_tokens(y_MD: torch.Tensor, row_id_M: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
    """Differentiable (w.r.t. y and topk_weights) weighted combine: [M, D] -> [T, D] in y.dtype."""
    return _UnpermuteTokens.apply(y_MD.contiguous(), row_id_M, topk_weights_TK.contiguous())


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_MF2):
        ctx.save_for_backward(x_MF2)
        return ops.swiglu(x_MF2)

    @staticmethod
    def backward(ctx: Any, dy_MF):
        (x_MF2,) = ctx.saved_tensors
        return ops.swiglu_backward(dy_MF.contiguous(), x_MF2)


def swiglu(x_MF2: torch.Tensor) -> torch.Tensor:
    """Differentiable silu(gate) * up with x = [gate | up]: [M, 2F] -> [M, F]."""
    return _SwiGLU.apply(x_MF2.contiguous())

"""Routed experts as grouped matmuls over expert-sorted rows, with the backward split into dX and dW.

Legend for shape suffixes: M routed rows (sorted by local expert), R received token rows, K top-k slots,
D hidden, F expert intermediate width, E local experts.

The autograd function here calls the raw kernel ops: its backward computes the input gradient right away
(``grouped_gemm_dgrad``) and hands the two ``grouped_gemm_wgrad`` calls to the sub-stage's sink, which runs
them after the dispatch-direction all-to-all has been started, or parks them in ``WeightGradStore`` for a
zero-bubble ``W`` slot.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import functional, ops
from moe.layers import WgradSink, accumulate_grad, defer_wgrad

__all__ = ["GroupedExperts"]


class _ExpertsFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        x_MD: torch.Tensor,
        w1_EDF2: torch.Tensor,
        w2_EFD: torch.Tensor,
        tokens_per_expert_E: torch.Tensor,
        sink: WgradSink | None,
        comm_sms: int,
    ) -> torch.Tensor:
        h_MF2 = ops.grouped_gemm(x_MD, w1_EDF2, tokens_per_expert_E, comm_sms=comm_sms)
        a_MF = ops.swiglu(h_MF2)
        y_MD = ops.grouped_gemm(a_MF, w2_EFD, tokens_per_expert_E, comm_sms=comm_sms)
        # Keep h (2F wide) rather than a: the SwiGLU is recomputed in backward, which is cheaper than a
        # second activation of width F per row.
        ctx.save_for_backward(x_MD, h_MF2, w1_EDF2, w2_EFD, tokens_per_expert_E)
        ctx.sink, ctx.comm_sms = sink, comm_sms
        return y_MD

    @staticmethod
    def backward(ctx, dy_MD: torch.Tensor):
        x_MD, h_MF2, w1_EDF2, w2_EFD, tokens_per_expert_E = ctx.saved_tensors
        dy_MD, sms = dy_MD.contiguous(), ctx.comm_sms
        da_MF = ops.grouped_gemm_dgrad(dy_MD, w2_EFD, tokens_per_expert_E, comm_sms=sms)
        dh_MF2 = ops.swiglu_backward(da_MF, h_MF2)
        dx_MD = ops.grouped_gemm_dgrad(dh_MF2, w1_EDF2, tokens_per_expert_E, comm_sms=sms)

        def wgrad() -> None:
            a_MF = ops.swiglu(h_MF2)
            accumulate_grad(w2_EFD, ops.grouped_gemm_wgrad(a_MF, dy_MD, tokens_per_expert_E, comm_sms=sms))
            accumulate_grad(w1_EDF2, ops.grouped_gemm_wgrad(x_MD, dh_MF2, tokens_per_expert_E, comm_sms=sms))

        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            defer_wgrad(ctx.sink, wgrad)
        return dx_MD, None, None, None, None, None


class GroupedExperts(nn.Module):
    """``num_local_experts`` SwiGLU experts; ``w1`` is ``[E, D, 2F]`` (gate | up), ``w2`` is ``[E, F, D]``."""

    def __init__(self, num_local_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_local_experts = num_local_experts
        self.w1 = nn.Parameter(torch.empty(num_local_experts, hidden, 2 * intermediate))
        self.w2 = nn.Parameter(torch.empty(num_local_experts, intermediate, hidden))

    def forward(
        self,
        x_RD: torch.Tensor,
        local_idx_RK: torch.Tensor,
        weights_RK: torch.Tensor,
        sink: WgradSink | None = None,
        comm_sms: int = 0,
    ) -> torch.Tensor:
        """Expert outputs of received rows, weighted and summed over this rank's slots of each row.

        x: ``[R, D]`` rows as received; local_idx: ``[R, K]`` local expert ids, -1 for slots served by other
        ranks; weights: ``[R, K]`` fp32 routing weights. Returns ``[R, D]`` in x's dtype.
        """
        x_MD, row_id_M, tokens_per_expert_E = functional.permute_tokens(x_RD, local_idx_RK, self.num_local_experts)
        y_MD = _ExpertsFn.apply(x_MD, self.w1, self.w2, tokens_per_expert_E, sink, comm_sms)
        return functional.unpermute_tokens(y_MD, row_id_M, weights_RK)

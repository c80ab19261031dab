"""Modules over the differentiable kernel ops: the third layer (kernel -> autograd.Function -> Module).

Legend for shape suffixes: T tokens, D hidden size, E experts, K top-k, M routed rows, F expert
intermediate size.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.functional import grouped_mm, permute_tokens, swiglu, unpermute_tokens

__all__ = ["GroupedExperts"]


class GroupedExperts(nn.Module):
    """E SwiGLU expert MLPs run as two grouped GEMMs over rows sorted by expert.

    For expert e: y = (silu(x @ W_gate[e]) * (x @ W_up[e])) @ W_down[e], with W_gate and W_up fused
    into one [E, D, 2F] weight so the first GEMM reads x once.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        comm_sms: int = 0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        """comm_sms: SMs the grouped GEMMs leave to concurrent all-to-all kernels (0 = use all)."""
        super().__init__()
        if min(num_experts, hidden_size, intermediate_size) < 1 or comm_sms < 0:
            raise ValueError(
                f"GroupedExperts: sizes must be positive and comm_sms >= 0, got E={num_experts}, "
                f"D={hidden_size}, F={intermediate_size}, comm_sms={comm_sms}"
            )
        self.comm_sms = comm_sms
        factory = {"device": device, "dtype": dtype}
        self.w_gate_up_EDF2 = nn.Parameter(torch.empty(num_experts, hidden_size, 2 * intermediate_size, **factory))
        self.w_down_EFD = nn.Parameter(torch.empty(num_experts, intermediate_size, hidden_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # fan-in scaling keeps the activations' variance independent of D and F at initialisation.
        nn.init.normal_(self.w_gate_up_EDF2, std=self.w_gate_up_EDF2.shape[1] ** -0.5)
        nn.init.normal_(self.w_down_EFD, std=self.w_down_EFD.shape[1] ** -0.5)

    def forward(self, x_MD: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """x: [M, D] sorted by expert, tokens_per_expert: [E] summing to M -> [M, D] in x.dtype."""
        h_MF2 = grouped_mm(x_MD, self.w_gate_up_EDF2, tokens_per_expert_E, self.comm_sms)
        return grouped_mm(swiglu(h_MF2), self.w_down_EFD, tokens_per_expert_E, self.comm_sms)

    def forward_tokens(
        self, x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> torch.Tensor:
        """Routed tokens without expert parallelism: permute, experts, weighted combine -> [T, D]."""
        x_sorted_MD, row_id_M, tokens_per_expert_E = permute_tokens(x_TD, topk_idx_TK, self.w_gate_up_EDF2.shape[0])
        return unpermute_tokens(self(x_sorted_MD, tokens_per_expert_E), row_id_M, topk_weights_TK)

    def extra_repr(self) -> str:
        e, d, f2 = self.w_gate_up_EDF2.shape
        return f"num_experts={e}, hidden_size={d}, intermediate_size={f2 // 2}, comm_sms={self.comm_sms}"

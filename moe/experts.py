"""Routed experts: the model's parameters and wiring around :func:`kernels.functional.grouped_experts`.

Legend for shape suffixes: M routed rows (sorted by local expert), R received token rows, K top-k slots,
D hidden, F expert intermediate width, E local experts.

The kernel computes the input gradient in backward and hands the weight gradient, as a closure, to
:func:`moe.layers.defer_wgrad`: the MLP piece's dW runs it after the dispatch-direction all-to-all has
been started, or a zero-bubble ``W`` slot does.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import functional
from moe.layers import defer_wgrad

__all__ = ["GroupedExperts"]


class GroupedExperts(nn.Module):
    """``num_local_experts`` SwiGLU experts; ``w1`` is ``[E, D, 2F]`` (gate | up), ``w2`` is ``[E, F, D]``."""

    def __init__(self, num_local_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        if min(num_local_experts, hidden, intermediate) < 1:
            raise ValueError(
                f"GroupedExperts: sizes must be positive, got E={num_local_experts}, D={hidden}, F={intermediate}"
            )
        self.num_local_experts = num_local_experts
        self.w1 = nn.Parameter(torch.empty(num_local_experts, hidden, 2 * intermediate))
        self.w2 = nn.Parameter(torch.empty(num_local_experts, intermediate, hidden))

    def max_rows(self, received: int, top_k: int) -> int:
        """Most expert-sorted rows ``received`` rows can make: each row's K experts are distinct (the
        router's top-k), so a row feeds at most min(K, E) local experts. Known on the host. (Ids repeated
        within a row could exceed it; permute would then drop the rows past the bound.)"""
        return received * min(top_k, self.num_local_experts)

    def forward(
        self,
        x_RD: torch.Tensor,
        local_idx_RK: torch.Tensor,
        weights_RK: torch.Tensor,
        comm_sms: int = 0,
        *,
        static_rows: bool = False,
    ) -> torch.Tensor:
        """Expert outputs of received rows, weighted and summed over this rank's slots of each row.

        x: ``[R, D]`` rows as received; local_idx: ``[R, K]`` local expert ids, -1 for slots served by other
        ranks; weights: ``[R, K]`` fp32 routing weights. Returns ``[R, D]`` in x's dtype. The weight
        gradients never reach autograd: they go through :func:`moe.layers.defer_wgrad`.

        static_rows: size the expert-sorted rows by the bound :meth:`max_rows` (known on the host) instead
        of the routed count (a device value: one host sync per layer on CUDA). The sync-free mode's choice;
        the results are the same bit for bit; the padded rows cost memory and the elementwise SwiGLU over
        them (the grouped GEMMs and the combine never touch them).
        """
        num_rows = self.max_rows(*local_idx_RK.shape) if static_rows else None
        x_MD, row_id_M, tokens_per_expert_E = functional.permute_tokens(
            x_RD, local_idx_RK, self.num_local_experts, num_rows
        )
        y_MD = functional.grouped_experts(
            x_MD,
            self.w1,
            self.w2,
            tokens_per_expert_E,
            comm_sms=comm_sms,
            defer_weight_grad=defer_wgrad,
        )
        return functional.unpermute_tokens(y_MD, row_id_M, weights_RK)

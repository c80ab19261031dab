"""Routed experts: the model's parameters and wiring around :func:`kernels.functional.grouped_experts`.

Legend for shape suffixes: M routed rows (sorted by local expert), R received token rows, K top-k slots,
D hidden, F expert intermediate width, E local experts.

The kernel computes the input gradient in backward and hands the weight gradient, as a closure, to
:func:`moe.models.layers.defer_wgrad`: the MLP piece's dW runs it after the dispatch-direction all-to-all has
been started, or a zero-bubble ``W`` slot does.

What one layer keeps for backward: the expert-sorted rows, the gate/up output, the row ids and one routing
weight per row. The routing weight multiplies each row's SwiGLU output inside the experts and the combine is
an unweighted sum, so the experts' output is not kept (the weight's gradient comes from the SwiGLU output,
recomputed from the gate/up output); the received rows can be freed once permute has copied them
(``free_input``).
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import functional
from kernels.fp8 import FP8Recipe
from moe.models.layers import defer_wgrad

__all__ = ["GroupedExperts", "free_storage"]


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
        self.fp8: FP8Recipe | None = None
        """None, or the FP8 recipe of the four grouped GEMMs (:func:`moe.models.layers.use_fp8` sets it)."""

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
        free_input: bool = False,
    ) -> torch.Tensor:
        """Expert outputs of received rows, weighted and summed over this rank's slots of each row.

        x: ``[R, D]`` rows as received; local_idx: ``[R, K]`` local expert ids, -1 for slots served by other
        ranks; weights: ``[R, K]`` fp32 routing weights. Returns ``[R, D]`` in x's dtype. The weight
        gradients never reach autograd: they go through :func:`moe.models.layers.defer_wgrad`.

        static_rows: size the expert-sorted rows by the bound :meth:`max_rows` (known on the host) instead
        of the routed count (a device value: one host sync per layer on CUDA). The sync-free mode's choice;
        the results are the same bit for bit; the padded rows cost memory and the elementwise SwiGLU over
        them (the grouped GEMMs and the combine never touch them).

        free_input: free x's storage once permute has copied it into expert order (nothing of the backward
        reads x: permute's gradient needs the row ids only). For rows nobody reads afterwards, such as the rows
        an all-to-all delivered: the caller must not read x again, nor run this forward on it a second time.
        A no-op for x that does not own its whole storage (a view into a larger buffer).
        """
        num_rows = self.max_rows(*local_idx_RK.shape) if static_rows else None
        x_MD, row_id_M, tokens_per_expert_E = functional.permute_tokens(
            x_RD, local_idx_RK, self.num_local_experts, num_rows
        )
        if free_input:
            free_storage(x_RD)
        y_MD = functional.grouped_experts(
            x_MD,
            self.w1,
            self.w2,
            tokens_per_expert_E,
            scale_M=functional.row_weights(weights_RK, row_id_M),
            comm_sms=comm_sms,
            defer_weight_grad=defer_wgrad,
            fp8_recipe=self.fp8,
        )
        return functional.combine_rows(y_MD, row_id_M, *local_idx_RK.shape)


def free_storage(x: torch.Tensor) -> None:
    """Release ``x``'s memory (its storage resized to 0; the tensor keeps its shape) if ``x`` owns all of it."""
    storage = x.untyped_storage()
    if x.storage_offset() != 0 or storage.nbytes() != x.numel() * x.element_size() or storage.nbytes() == 0:
        return
    if x.is_cuda:
        # The rows may come from another stream (the all-to-all's): the allocator must not hand the block
        # out again before the permute kernels on this stream have read it.
        x.record_stream(torch.cuda.current_stream(x.device))
    storage.resize_(0)

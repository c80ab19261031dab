"""moe.experts.GroupedExperts: the adaptor over kernels.functional.grouped_experts."""

from __future__ import annotations

import pytest
import torch

from dualpipe.weight_grad import GradStore
from kernels import functional
from moe.experts import GroupedExperts


def test_weight_grads_wait_in_weight_grad_store_and_equal_autograds():
    torch.manual_seed(0)
    experts = GroupedExperts(4, 8, 6)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x_RD = torch.randn(5, 8)
    local_idx_RK = torch.tensor([[0, -1], [3, 1], [-1, -1], [1, 0], [2, 3]])  # -1: served by another rank
    weights_RK = torch.rand(5, 2)

    store = GradStore()
    x = x_RD.clone().requires_grad_()
    with store.activate(enabled=True):  # what a compute piece's dX does: weight gradients are held back
        experts(x, local_idx_RK, weights_RK).square().sum().backward()
    store.flush()
    assert experts.w1.grad is None and experts.w2.grad is None
    store.pop()

    # Oracle: the same kernels with the weight gradients left to autograd.
    w1, w2 = (p.detach().clone().requires_grad_() for p in (experts.w1, experts.w2))
    x_ref = x_RD.clone().requires_grad_()
    x_MD, row_id_M, counts_E = functional.permute_tokens(x_ref, local_idx_RK, 4)
    y_MD = functional.grouped_experts(x_MD, w1, w2, counts_E)
    functional.unpermute_tokens(y_MD, row_id_M, weights_RK).square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad)
    assert torch.equal(experts.w1.grad, w1.grad) and torch.equal(experts.w2.grad, w2.grad)


def test_sizes_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        GroupedExperts(0, 8, 5)

"""GroupedExperts: the Triton and torch backends give the same outputs and parameter gradients."""

from __future__ import annotations

import pytest
import torch

from kernels import GroupedExperts, ops, reference
from tests.kernels._util import assert_close


def _run(monkeypatch, backend, module, x_TD, idx_TK, w_TK):
    monkeypatch.setenv(ops.ENV_VAR, backend)
    module.zero_grad()
    x = x_TD.clone().requires_grad_()
    out_TD = module.forward_tokens(x, idx_TK, w_TK)
    out_TD.square().sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    return out_TD.detach(), x.grad, grads


def test_grouped_experts_triton_matches_torch(monkeypatch, device):
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(0)
    num_tokens, hidden, inter, num_experts, top_k = 10, 16, 24, 4, 2
    torch.manual_seed(0)
    module = GroupedExperts(num_experts, hidden, inter, device=device)
    x_TD = torch.randn(num_tokens, hidden, generator=gen).to(device)
    idx_TK = torch.stack([torch.randperm(num_experts - 1, generator=gen)[:top_k] for _ in range(num_tokens)])
    idx_TK = idx_TK.to(device)  # expert 3 never chosen: an empty group in both GEMMs
    w_TK = torch.rand(num_tokens, top_k, generator=gen).to(device)

    got = _run(monkeypatch, "triton", module, x_TD, idx_TK, w_TK)
    want = _run(monkeypatch, "torch", module, x_TD, idx_TK, w_TK)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])
    for g, w in zip(got[2], want[2]):
        assert_close(g, w)
    assert torch.count_nonzero(got[2][0][3]) == 0  # the unused expert's weights get no gradient


def test_grouped_experts_forward_is_the_per_expert_mlp(force_torch):
    torch.manual_seed(1)
    module = GroupedExperts(3, 8, 5)
    counts_E = torch.tensor([4, 0, 2])
    x_MD = torch.randn(6, 8)
    y_MD = module(x_MD, counts_E)
    rows = torch.repeat_interleave(torch.arange(3), counts_E)
    for m in range(6):  # one row at a time through its expert's weights: an independent oracle
        e = rows[m]
        h = reference.swiglu((x_MD[m : m + 1] @ module.w_gate_up_EDF2[e]).detach())
        torch.testing.assert_close(y_MD[m : m + 1].detach(), h @ module.w_down_EFD[e].detach())
    with pytest.raises(ValueError, match="positive"):
        GroupedExperts(0, 8, 5)

"""The expert MLP (grouped_experts): both backends agree, it is the per-expert MLP, its three parts are the
gradients of the plain formula, and a deferred weight gradient equals the one autograd gives."""

from __future__ import annotations

import pytest
import torch

from kernels import functional, ops, reference
from tests.kernels._util import assert_close


def _weights(num_experts: int, hidden: int, inter: int, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_gate_up [E, D, 2F], w_down [E, F, D]), fan-in scaled so activations stay O(1)."""
    gen = torch.Generator().manual_seed(seed)
    w_gate_up_EDF2 = torch.randn(num_experts, hidden, 2 * inter, generator=gen) * hidden**-0.5
    w_down_EFD = torch.randn(num_experts, inter, hidden, generator=gen) * inter**-0.5
    return w_gate_up_EDF2.to(device), w_down_EFD.to(device)


def _run(monkeypatch, backend, weights, x_TD, idx_TK, w_TK):
    """Routed tokens without expert parallelism: permute, experts, weighted combine; then backward."""
    monkeypatch.setenv(ops.ENV_VAR, backend)
    params = [w.clone().requires_grad_() for w in weights]
    x = x_TD.clone().requires_grad_()
    x_sorted_MD, row_id_M, tokens_per_expert_E = functional.permute_tokens(x, idx_TK, params[0].shape[0])
    y_MD = functional.grouped_experts(x_sorted_MD, *params, tokens_per_expert_E)
    out_TD = functional.unpermute_tokens(y_MD, row_id_M, w_TK)
    out_TD.square().sum().backward()
    return out_TD.detach(), x.grad, [p.grad for p in params]


def test_grouped_experts_triton_matches_torch(monkeypatch, device):
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(0)
    num_tokens, hidden, inter, num_experts, top_k = 10, 16, 24, 4, 2
    weights = _weights(num_experts, hidden, inter, device, seed=0)
    x_TD = torch.randn(num_tokens, hidden, generator=gen).to(device)
    idx_TK = torch.stack([torch.randperm(num_experts - 1, generator=gen)[:top_k] for _ in range(num_tokens)])
    idx_TK = idx_TK.to(device)  # expert 3 never chosen: an empty group in both GEMMs
    w_TK = torch.rand(num_tokens, top_k, generator=gen).to(device)

    got = _run(monkeypatch, "triton", weights, x_TD, idx_TK, w_TK)
    want = _run(monkeypatch, "torch", weights, x_TD, idx_TK, w_TK)
    assert_close(got[0], want[0])
    assert_close(got[1], want[1])
    for g, w in zip(got[2], want[2]):
        assert_close(g, w)
    assert torch.count_nonzero(got[2][0][3]) == 0  # the unused expert's weights get no gradient


def test_grouped_experts_forward_is_the_per_expert_mlp(force_torch):
    w_gate_up_EDF2, w_down_EFD = _weights(3, 8, 5, "cpu", seed=1)
    counts_E = torch.tensor([4, 0, 2])
    x_MD = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    y_MD = functional.grouped_experts(x_MD, w_gate_up_EDF2, w_down_EFD, counts_E)
    rows = torch.repeat_interleave(torch.arange(3), counts_E)
    for m in range(6):  # one row at a time through its expert's weights: an independent oracle
        e = rows[m]
        h = reference.swiglu(x_MD[m : m + 1] @ w_gate_up_EDF2[e])
        torch.testing.assert_close(y_MD[m : m + 1], h @ w_down_EFD[e])


def test_parts_are_the_gradients_of_the_plain_formula(force_torch):
    """experts_forward / experts_input_grad / experts_weight_grads against torch autograd of the formula."""
    gen = torch.Generator().manual_seed(2)
    counts_E = torch.tensor([3, 0, 4])
    w_gate_up_EDF2, w_down_EFD = _weights(3, 8, 5, "cpu", seed=2)
    x_MD, dy_MD = torch.randn(7, 8, generator=gen), torch.randn(7, 8, generator=gen)

    y_MD, h_MF2 = functional.experts_forward(x_MD, w_gate_up_EDF2, w_down_EFD, counts_E)
    dx_MD, dh_MF2 = functional.experts_input_grad(dy_MD, h_MF2, w_gate_up_EDF2, w_down_EFD, counts_E)
    dw_down_EFD, dw_gate_up_EDF2 = functional.experts_weight_grads(x_MD, h_MF2, dy_MD, dh_MF2, counts_E)

    x, w_gu, w_d = (t.clone().requires_grad_() for t in (x_MD, w_gate_up_EDF2, w_down_EFD))
    rows = torch.repeat_interleave(torch.arange(3), counts_E)
    gate, up = torch.einsum("md,mdf->mf", x, w_gu[rows]).chunk(2, dim=-1)
    y_ref = torch.einsum("mf,mfd->md", torch.nn.functional.silu(gate) * up, w_d[rows])
    y_ref.backward(dy_MD)
    assert_close(y_MD, y_ref.detach())
    assert_close(dx_MD, x.grad)
    assert_close(dw_gate_up_EDF2, w_gu.grad)
    assert_close(dw_down_EFD, w_d.grad)


def test_deferred_weight_grad_equals_autograds(force_torch):
    weights = _weights(3, 8, 5, "cpu", seed=3)
    counts_E = torch.tensor([2, 3, 0])
    x_MD = torch.randn(5, 8, generator=torch.Generator().manual_seed(3))

    def run(defer):
        params = [w.clone().requires_grad_() for w in weights]
        x = x_MD.clone().requires_grad_()
        functional.grouped_experts(x, *params, counts_E, defer_weight_grad=defer).square().sum().backward()
        return x.grad, params

    dx_want, want = run(None)
    pending = []
    dx_got, got = run(pending.append)
    assert torch.equal(dx_got, dx_want)
    assert len(pending) == 1 and all(p.grad is None for p in got), "the hook runs the weight grad, not backward"
    with torch.enable_grad():  # it may run later with grad mode on: no graph may grow
        pending[0]()
    for g, w in zip(got, want):
        assert torch.equal(g.grad, w.grad) and not g.grad.requires_grad
    pending[0]()  # a second run adds, as a second backward would
    for g, w in zip(got, want):
        torch.testing.assert_close(g.grad, 2 * w.grad)

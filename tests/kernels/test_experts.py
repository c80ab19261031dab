"""The expert MLP (grouped_experts): both backends agree, it is the per-expert MLP, its three parts are the
gradients of the plain formula, and a deferred weight gradient equals the one autograd gives. The MoE layer's
path (routing weights applied to the SwiGLU output, an unweighted combine) gives the gradients of the
weighted-combine formula, keeps no expert output, and keeps the padded rows out of every result."""

from __future__ import annotations

import pytest
import torch

from dualpipe.memory import SavedTensorTracker
from kernels import functional, ops, reference
from tests.kernels._util import assert_close


def _weights(num_experts: int, hidden: int, inter: int, device, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_gate_up [E, D, 2F], w_down [E, F, D]), fan-in scaled so activations stay O(1)."""
    gen = torch.Generator().manual_seed(seed)
    w_gate_up_EDF2 = torch.randn(num_experts, hidden, 2 * inter, generator=gen) * hidden**-0.5
    w_down_EFD = torch.randn(num_experts, inter, hidden, generator=gen) * inter**-0.5
    return w_gate_up_EDF2.to(device), w_down_EFD.to(device)


def _routed(x_TD, idx_TK, w_TK, w_gate_up_EDF2, w_down_EFD, num_rows=None):
    """The MoE layer's expert path (moe.models.experts.GroupedExperts): permute, the experts with each row's routing
    weight on its SwiGLU output, an unweighted combine."""
    x_sorted_MD, row_id_M, tokens_per_expert_E = functional.permute_tokens(
        x_TD, idx_TK, w_gate_up_EDF2.shape[0], num_rows
    )
    scale_M = functional.row_weights(w_TK, row_id_M)
    y_MD = functional.grouped_experts(x_sorted_MD, w_gate_up_EDF2, w_down_EFD, tokens_per_expert_E, scale_M=scale_M)
    return functional.combine_rows(y_MD, row_id_M, *idx_TK.shape)


def _plain_moe(x_TD, idx_TK, w_TK, w_gate_up_EDF2, w_down_EFD):
    """An independent oracle in plain torch: out[t] = sum_k w[t, k] * MLP_e(x[t]) over the routed slots (the
    weighted combine after the experts), one top-k position at a time, no kernel op."""
    out_TD = torch.zeros_like(x_TD)
    for k in range(idx_TK.shape[1]):
        e_T = idx_TK[:, k].clamp(min=0)
        gate, up = torch.einsum("td,tdf->tf", x_TD, w_gate_up_EDF2[e_T]).chunk(2, dim=-1)
        y_TD = torch.einsum("tf,tfd->td", torch.nn.functional.silu(gate) * up, w_down_EFD[e_T])
        out_TD = out_TD + torch.where(idx_TK[:, k, None] >= 0, w_TK[:, k, None] * y_TD, 0.0)
    return out_TD


def _routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator, unrouted: int = 0):
    """[T, K] distinct expert ids (the last expert never chosen: an empty group), ``unrouted`` slots -1."""
    idx_TK = torch.stack([torch.randperm(num_experts - 1, generator=gen)[:top_k] for _ in range(num_tokens)])
    idx_TK.view(-1)[torch.randperm(idx_TK.numel(), generator=gen)[:unrouted]] = -1
    return idx_TK


def _run(monkeypatch, backend, weights, x_TD, idx_TK, w_TK, path=_routed, **kwargs):
    """Forward and backward of ``path`` -> (out, dx, dweights, [dw_gate_up, dw_down])."""
    monkeypatch.setenv(ops.ENV_VAR, backend)
    params = [w.clone().requires_grad_() for w in weights]
    x, w = x_TD.clone().requires_grad_(), w_TK.clone().requires_grad_()
    out_TD = path(x, idx_TK, w, *params, **kwargs)
    out_TD.square().sum().backward()
    return out_TD.detach(), x.grad, w.grad, [p.grad for p in params]


def test_grouped_experts_triton_matches_torch(monkeypatch, device):
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(0)
    num_tokens, hidden, inter, num_experts, top_k = 10, 16, 24, 4, 2
    weights = _weights(num_experts, hidden, inter, device, seed=0)
    x_TD = torch.randn(num_tokens, hidden, generator=gen).to(device)
    idx_TK = _routing(num_tokens, num_experts, top_k, gen).to(device)
    w_TK = torch.rand(num_tokens, top_k, generator=gen).to(device)

    got = _run(monkeypatch, "triton", weights, x_TD, idx_TK, w_TK)
    want = _run(monkeypatch, "torch", weights, x_TD, idx_TK, w_TK)
    for g, w in zip(got[:3], want[:3]):
        assert_close(g, w)
    for g, w in zip(got[3], want[3]):
        assert_close(g, w)
    assert torch.count_nonzero(got[3][0][3]) == 0  # the unused expert's weights get no gradient


# Triton leaves padded rows unwritten and SwiGLU runs elementwise over them, whatever memory held: the
# interpreter's numpy may warn of an overflow or an invalid value there, in rows nothing reads.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("padded", [False, True], ids=["routed-rows", "padded-rows"])
def test_weights_inside_the_experts_give_the_weighted_combines_gradients(monkeypatch, device, backend, padded):
    """Output and gradients of x, the routing weights and both expert weights equal plain-torch autograd of
    the weighted combine (fp32, tight); slots served elsewhere (-1) and padded rows contribute nothing."""
    if backend == "triton":
        pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(5)
    num_tokens, hidden, inter, num_experts, top_k = 9, 16, 8, 4, 3
    weights = _weights(num_experts, hidden, inter, device, seed=5)
    x_TD = torch.randn(num_tokens, hidden, generator=gen).to(device)
    idx_TK = _routing(num_tokens, num_experts, top_k, gen, unrouted=5).to(device)
    w_TK = torch.rand(num_tokens, top_k, generator=gen).to(device)
    num_rows = num_tokens * top_k if padded else None  # 5 rows of padding past the 22 routed ones

    got = _run(monkeypatch, backend, weights, x_TD, idx_TK, w_TK, num_rows=num_rows)
    want = _run(monkeypatch, "torch", weights, x_TD, idx_TK, w_TK, path=_plain_moe)
    for g, w in zip(got[:3], want[:3]):
        assert_close(g, w)
    for g, w in zip(got[3], want[3]):
        assert_close(g, w)
    assert torch.count_nonzero(got[2][idx_TK < 0]) == 0  # slots served elsewhere get no weight gradient


def test_the_routed_path_keeps_no_expert_output(force_torch):
    """Saved for backward (moe.train.memory's tracker): the sorted rows, the gate/up output, the counts, the row ids
    and one fp32 weight per row; the weighted combine kept the [M, D] expert output and the [T, K] weights."""
    gen = torch.Generator().manual_seed(6)
    num_tokens, hidden, inter, num_experts, top_k = 8, 16, 12, 4, 2
    params = [w.requires_grad_() for w in _weights(num_experts, hidden, inter, "cpu", seed=6)]
    x_TD = torch.randn(num_tokens, hidden, generator=gen, requires_grad=True)
    idx_TK = _routing(num_tokens, num_experts, top_k, gen, unrouted=3)
    w_TK = torch.rand(num_tokens, top_k, generator=gen, requires_grad=True)
    m, elem = num_tokens * top_k - 3, 4

    def saved(path) -> int:
        with SavedTensorTracker(exclude=params) as tracker:
            out = path(x_TD, idx_TK, w_TK, *params)  # noqa: F841 (its graph holds what is counted)
            return tracker.live_bytes

    def weighted(x, idx, w, w_gate_up, w_down):
        x_MD, row_id_M, counts_E = functional.permute_tokens(x, idx, num_experts)
        return functional.unpermute_tokens(functional.grouped_experts(x_MD, w_gate_up, w_down, counts_E), row_id_M, w)

    # Both keep x_MD, h, the counts and the row ids (the reference's are views of [E + 1] and [T * K] storages).
    kept = m * hidden * elem + m * 2 * inter * elem + (num_experts + 1) * 8 + num_tokens * top_k * 8
    assert saved(_routed) == kept + m * elem  # + the per-row weights
    assert saved(weighted) == kept + m * hidden * elem + num_tokens * top_k * elem  # + y and the [T, K] weights


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


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "routing-weights"])
def test_parts_are_the_gradients_of_the_plain_formula(force_torch, scaled):
    """experts_forward / experts_input_grad / experts_weight_grads against torch autograd of the formula, with
    and without per-row routing weights on the SwiGLU output."""
    gen = torch.Generator().manual_seed(2)
    counts_E = torch.tensor([3, 0, 4])
    w_gate_up_EDF2, w_down_EFD = _weights(3, 8, 5, "cpu", seed=2)
    x_MD, dy_MD = torch.randn(7, 8, generator=gen), torch.randn(7, 8, generator=gen)
    scale_M = torch.rand(7, generator=gen) if scaled else None

    y_MD, h_MF2 = functional.experts_forward(x_MD, w_gate_up_EDF2, w_down_EFD, counts_E, scale_M=scale_M)
    dx_MD, dh_MF2, dscale_M = functional.experts_input_grad(
        dy_MD, h_MF2, w_gate_up_EDF2, w_down_EFD, counts_E, scale_M=scale_M
    )
    dw_down_EFD, dw_gate_up_EDF2 = functional.experts_weight_grads(
        x_MD, h_MF2, dy_MD, dh_MF2, counts_E, scale_M=scale_M
    )

    x, w_gu, w_d = (t.clone().requires_grad_() for t in (x_MD, w_gate_up_EDF2, w_down_EFD))
    s = torch.ones(7) if scale_M is None else scale_M.clone()
    s.requires_grad_()
    rows = torch.repeat_interleave(torch.arange(3), counts_E)
    gate, up = torch.einsum("md,mdf->mf", x, w_gu[rows]).chunk(2, dim=-1)
    y_ref = torch.einsum("mf,mfd->md", torch.nn.functional.silu(gate) * up * s[:, None], w_d[rows])
    y_ref.backward(dy_MD)
    assert_close(y_MD, y_ref.detach())
    assert_close(dx_MD, x.grad)
    assert_close(dw_gate_up_EDF2, w_gu.grad)
    assert_close(dw_down_EFD, w_d.grad)
    if scaled:
        assert_close(dscale_M, s.grad)
    else:
        assert dscale_M is None


def test_deferred_weight_grad_equals_autograds(force_torch):
    weights = _weights(3, 8, 5, "cpu", seed=3)
    counts_E = torch.tensor([2, 3, 0])
    gen = torch.Generator().manual_seed(3)
    x_MD, scale_M = torch.randn(5, 8, generator=gen), torch.rand(5, generator=gen)

    def run(defer):
        params = [w.clone().requires_grad_() for w in weights]
        x, s = x_MD.clone().requires_grad_(), scale_M.clone().requires_grad_()
        y = functional.grouped_experts(x, *params, counts_E, scale_M=s, defer_weight_grad=defer)
        y.square().sum().backward()
        return x.grad, s.grad, params

    dx_want, ds_want, want = run(None)
    pending = []
    dx_got, ds_got, got = run(pending.append)
    assert torch.equal(dx_got, dx_want) and torch.equal(ds_got, ds_want)  # input gradients come at once
    assert len(pending) == 1 and all(p.grad is None for p in got), "the hook runs the weight grad, not backward"
    with torch.enable_grad():  # it may run later with grad mode on: no graph may grow
        pending[0]()
    for g, w in zip(got, want):
        assert torch.equal(g.grad, w.grad) and not g.grad.requires_grad
    pending[0]()  # a second run adds, as a second backward would
    for g, w in zip(got, want):
        torch.testing.assert_close(g.grad, 2 * w.grad)

"""Router top-k through the Triton backend: indices equal to the reference's, weights and scores close."""

from __future__ import annotations

import pytest
import torch

from kernels import ops, reference

pytestmark = pytest.mark.usefixtures("force_triton")


def _check(logits_TE, bias_E, top_k, n_group, topk_group, route_scale=1.0):
    args = (logits_TE, bias_E, top_k, n_group, topk_group, route_scale)
    weights_TK, idx_TK, scores_TE = ops.router_topk(*args)
    ref_weights_TK, ref_idx_TK, ref_scores_TE = reference.router_topk(*args)
    assert idx_TK.dtype == torch.int64 and weights_TK.dtype == scores_TE.dtype == torch.float32
    assert torch.equal(idx_TK, ref_idx_TK)
    torch.testing.assert_close(scores_TE, ref_scores_TE, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(weights_TK, ref_weights_TK, rtol=1e-5, atol=1e-7)
    return idx_TK


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "n_group", "topk_group"),
    # ... (5, 6, 6, 2, 2): all experts chosen; (5, 8, 3, 4, 1): more picks than the kept group holds
    [(19, 16, 4, 1, 1), (21, 32, 8, 4, 2), (9, 12, 3, 3, 2), (6, 8, 2, 8, 3), (5, 6, 6, 2, 2), (5, 8, 3, 4, 1)],
)
def test_matches_reference(device, dtype, tokens, experts, top_k, n_group, topk_group):
    gen = torch.Generator().manual_seed(tokens * experts)
    logits_TE = torch.randn(tokens, experts, generator=gen).to(device, dtype)
    bias_E = (0.1 * torch.randn(experts, generator=gen)).to(device)
    idx_TK = _check(logits_TE, bias_E, top_k, n_group, topk_group, route_scale=2.5)
    if n_group > 1 and top_k <= topk_group * (experts // n_group):  # within at most topk_group groups
        groups_used = torch.nn.functional.one_hot(idx_TK.cpu() // (experts // n_group), n_group).amax(1)
        assert (groups_used.sum(-1) <= topk_group).all()


@pytest.mark.parametrize(("n_group", "topk_group"), [(1, 1), (4, 2)])
def test_ties_break_toward_lower_index(device, n_group, topk_group):
    """Logits from a few values make exact ties among experts and among group scores."""
    gen = torch.Generator().manual_seed(n_group)
    # Non-negative values only: distinct pairs then have clearly distinct sigmoid sums (no s(x)+s(-x)=1).
    values = torch.tensor([0.0, 0.5, 1.0, 2.0])
    logits_TE = values[torch.randint(0, 4, (24, 16), generator=gen)].to(device)
    _check(logits_TE, torch.zeros(16, device=device), 5, n_group, topk_group)


def test_bias_steers_selection_but_not_weights(device):
    logits_TE = torch.zeros(3, 8, device=device)
    bias_E = torch.zeros(8, device=device)
    bias_E[5] = 1.0
    weights_TK, idx_TK, _ = ops.router_topk(logits_TE, bias_E, 2)
    assert (idx_TK[:, 0] == 5).all() and (idx_TK[:, 1] == 0).all()  # then the lowest-index tie
    torch.testing.assert_close(weights_TK, torch.full_like(weights_TK, 0.5))


def test_launcher_rejects_bad_arguments(device):
    from kernels import triton_router

    logits_TE = torch.randn(4, 12, device=device)
    bias_E = torch.zeros(12, device=device)
    with pytest.raises(ValueError, match="n_group"):
        triton_router.router_topk(logits_TE, bias_E, 2, n_group=5)
    with pytest.raises(ValueError, match="topk_group"):
        triton_router.router_topk(logits_TE, bias_E, 2, n_group=4, topk_group=5)
    with pytest.raises(ValueError, match="top_k"):
        triton_router.router_topk(logits_TE, bias_E, 13)
    with pytest.raises(ValueError, match="bias"):
        triton_router.router_topk(logits_TE, bias_E[:5], 2)

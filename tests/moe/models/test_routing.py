"""DeepSeek-V3 routing as published: our Router against transformers' ``DeepseekV3TopkRouter``.

The published rule: sigmoid scores; ``e_score_correction_bias`` added for the choice only; each of ``n_group``
contiguous groups scored by the sum of its top-2 biased scores; the best ``topk_group`` groups kept; top-k
experts among them; the unbiased scores of the chosen experts normalised (when ``norm_topk_prob``) and
multiplied by ``routed_scaling_factor``. transformers returns its top-k unsorted, so experts are compared as
sets per token and weights after ordering both by expert id.

Legend: T tokens, E experts, K top-k, G groups.
"""

from __future__ import annotations

import pytest
import torch

from moe.models.config import MoEConfig
from moe.models.router import Router

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter  # noqa: E402

HIDDEN, EXPERTS, N_GROUP, TOPK_GROUP, TOP_K, SCALE = 32, 16, 4, 2, 4, 2.5


def _hf_router(norm_topk_prob: bool) -> DeepseekV3TopkRouter:
    cfg = transformers.DeepseekV3Config(
        hidden_size=HIDDEN,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        n_group=N_GROUP,
        topk_group=TOPK_GROUP,
        norm_topk_prob=norm_topk_prob,
        routed_scaling_factor=SCALE,
    )
    gen = torch.Generator().manual_seed(0)
    hf = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        # Logits of std ~1.7 spread the sigmoid scores over (0, 1); a bias of std 0.3 is as large as the gaps
        # between neighbouring scores, so dropping it (or applying it to the weights) changes the outcome.
        hf.weight.copy_(0.3 * torch.randn(EXPERTS, HIDDEN, generator=gen))
        hf.e_score_correction_bias.copy_(0.3 * torch.randn(EXPERTS, generator=gen))
    return hf


def _ours_like(hf: DeepseekV3TopkRouter) -> Router:
    cfg = MoEConfig(
        hidden_size=HIDDEN,
        num_experts=EXPERTS,
        top_k=TOP_K,
        n_group=N_GROUP,
        topk_group=TOPK_GROUP,
        route_scale=SCALE,
        norm_topk_prob=hf.norm_topk_prob,
    )
    router = Router(cfg).eval()
    with torch.no_grad():
        router.gate.weight.copy_(hf.weight)
        router.expert_bias.copy_(hf.e_score_correction_bias)
    return router


def _by_expert(idx_TK: torch.Tensor, weights_TK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order_TK = idx_TK.argsort(-1)
    return idx_TK.gather(1, order_TK), weights_TK.gather(1, order_TK)


def _tokens(seed: int = 1) -> torch.Tensor:
    return torch.randn(4, 32, HIDDEN, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_matches_transformers(norm_topk_prob):
    hf = _hf_router(norm_topk_prob)
    x_BSD = _tokens()
    with torch.no_grad():
        _, hf_weights_TK, hf_idx_TK = hf(x_BSD)
        routing = _ours_like(hf)(x_BSD)
    hf_idx_TK, hf_weights_TK = _by_expert(hf_idx_TK, hf_weights_TK)
    idx_TK, weights_TK = _by_expert(routing.topk_idx_TK, routing.topk_weights_TK)
    assert torch.equal(idx_TK, hf_idx_TK)
    torch.testing.assert_close(weights_TK, hf_weights_TK, rtol=1e-6, atol=1e-6)
    sums_T = weights_TK.sum(-1)
    if norm_topk_prob:
        torch.testing.assert_close(sums_T, torch.full_like(sums_T, SCALE))
    else:
        assert (sums_T - SCALE).abs().min() > 1e-3  # the un-normalised case really is different


def _choose(scores_TE: torch.Tensor, bias_E: torch.Tensor, group_rule, use_bias: bool = True) -> torch.Tensor:
    """Top-k experts [T, K] under a group score ``group_rule([T, G, E/G]) -> [T, G]`` (None: no group limit)."""
    choice_TE = scores_TE + bias_E if use_bias else scores_TE.clone()
    if group_rule is not None:
        group_TG = group_rule(choice_TE.view(len(choice_TE), N_GROUP, -1))
        keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, group_TG.topk(TOPK_GROUP, -1).indices, True)
        choice_TE = choice_TE.masked_fill(~keep_TG.repeat_interleave(EXPERTS // N_GROUP, 1), float("-inf"))
    return choice_TE.topk(TOP_K, -1).indices.sort(-1).values


def test_inputs_tell_the_published_rule_from_wrong_ones():
    """The inputs above are discriminating: every plausible mistake picks other experts for some tokens."""
    hf = _hf_router(True)
    x_TD = _tokens().view(-1, HIDDEN)
    with torch.no_grad():
        _, _, hf_idx_TK = hf(x_TD)
        scores_TE = torch.sigmoid(x_TD @ hf.weight.t())
    hf_idx_TK = hf_idx_TK.sort(-1).values
    bias_E = hf.e_score_correction_bias
    top2_sum = lambda g: g.topk(2, -1).values.sum(-1)  # noqa: E731
    assert torch.equal(_choose(scores_TE, bias_E, top2_sum), hf_idx_TK)  # the rule as the test reads it
    wrong = {
        "group max": lambda g: g.amax(-1),
        "group sum": lambda g: g.sum(-1),
        "group top-3 sum": lambda g: g.topk(3, -1).values.sum(-1),
        "no group limit": None,
    }
    for name, rule in wrong.items():
        mismatched = (_choose(scores_TE, bias_E, rule) != hf_idx_TK).any(-1).sum().item()
        assert mismatched >= 3, f"{name}: only {mismatched} tokens differ"
    assert (_choose(scores_TE, bias_E, top2_sum, use_bias=False) != hf_idx_TK).any(-1).sum() >= 3
    # Weights from the biased scores would be off by far more than the tolerance.
    routing = _ours_like(hf)(x_TD[None])
    biased_TK = (scores_TE + bias_E).gather(1, routing.topk_idx_TK)
    biased_TK = biased_TK / biased_TK.sum(-1, keepdim=True) * SCALE
    assert (biased_TK - routing.topk_weights_TK).abs().max() > 1e-2


def test_triton_kernel_selects_as_published():
    """The GPU path's selection (here under TRITON_INTERPRET=1 on CPU) equals transformers' too."""
    pytest.importorskip("triton")
    from kernels import triton_router

    hf = _hf_router(True)
    x_TD = _tokens(2).view(-1, HIDDEN)[:48]  # the interpreter is slow: a few dozen tokens
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.no_grad():
        _, hf_weights_TK, hf_idx_TK = hf(x_TD)
        logits_TE = (x_TD @ hf.weight.t()).to(device)
    weights_TK, idx_TK, _ = triton_router.router_topk(
        logits_TE, hf.e_score_correction_bias.to(device), TOP_K, N_GROUP, TOPK_GROUP, SCALE
    )
    hf_idx_TK, hf_weights_TK = _by_expert(hf_idx_TK, hf_weights_TK)
    idx_TK, weights_TK = _by_expert(idx_TK.cpu(), weights_TK.cpu())
    assert torch.equal(idx_TK, hf_idx_TK)
    torch.testing.assert_close(weights_TK, hf_weights_TK, rtol=1e-5, atol=1e-6)

"""Qwen3-MoE parts against transformers (the oracle), fp32, tiny random config.

Weights are drawn with std 0.5 (not the 0.02 init) so every part moves the output far beyond the tolerance:
the q/k norms, the rotary embedding, the head_dim that differs from hidden / heads.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dualpipe.weight_grad import WeightGradStore
from moe.models.config import MoEConfig
from moe.models.qwen3_moe import Qwen3Attention
from moe.models.router import Router, load_balancing_loss
from tests.moe.helpers import assert_rel_close

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf_qwen  # noqa: E402

BATCH, SEQ, EXPERTS, TOP_K = 2, 24, 8, 2


def _config(norm_topk_prob: bool = True) -> transformers.Qwen3MoeConfig:
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # != 64 / 4
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm_topk_prob,
        router_aux_loss_coef=0.01,
    )
    cfg._attn_implementation = "eager"  # the plain-math oracle (ours runs SDPA)
    return cfg


def _randomize(module: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            noise = 0.5 * torch.randn(p.shape, generator=gen)
            p.copy_(1 + noise if name.endswith("norm.weight") else noise)


def _attention_pair() -> tuple[hf_qwen.Qwen3MoeAttention, Qwen3Attention, transformers.Qwen3MoeConfig]:
    cfg = _config()
    theirs = hf_qwen.Qwen3MoeAttention(cfg, layer_idx=0)
    _randomize(theirs, seed=0)
    ours = Qwen3Attention.from_hf_config(cfg)
    missing, unexpected = ours.load_state_dict(theirs.state_dict(), strict=True)
    assert not missing and not unexpected
    return theirs, ours, cfg


def _hf_attention(theirs: hf_qwen.Qwen3MoeAttention, cfg, x_BSD: torch.Tensor) -> torch.Tensor:
    positions_BS = torch.arange(SEQ)[None].expand(BATCH, -1)
    cos_sin = hf_qwen.Qwen3MoeRotaryEmbedding(cfg)(x_BSD, positions_BS)
    mask = torch.full((SEQ, SEQ), float("-inf")).triu(1)[None, None]
    return theirs(x_BSD, position_embeddings=cos_sin, attention_mask=mask)[0]


def test_attention_forward_and_gradients_match_transformers():
    theirs, ours, cfg = _attention_pair()
    assert {n for n, _ in ours.named_parameters()} == {n for n, _ in theirs.named_parameters()}
    x_BSD = torch.randn(BATCH, SEQ, 64, generator=torch.Generator().manual_seed(1))
    dy_BSD = torch.randn(BATCH, SEQ, 64, generator=torch.Generator().manual_seed(2))
    x_hf, x_ours = x_BSD.clone().requires_grad_(), x_BSD.clone().requires_grad_()

    want = _hf_attention(theirs, cfg, x_hf)
    assert not WeightGradStore.enabled  # our Linear accumulates its weight gradient at once
    got = ours(x_ours)
    assert_rel_close(got, want, 1e-5, "output")
    want.backward(dy_BSD)
    got.backward(dy_BSD)
    assert_rel_close(x_ours.grad, x_hf.grad, 1e-5, "input grad")
    grads = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        assert_rel_close(p.grad, grads[name].grad, 1e-5, f"{name} grad")


def test_leaving_out_qk_norm_or_rope_changes_the_output_far_beyond_tolerance():
    theirs, ours, cfg = _attention_pair()
    x_BSD = torch.randn(BATCH, SEQ, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = _hf_attention(theirs, cfg, x_BSD)
        ours.q_norm, ours.k_norm = torch.nn.Identity(), torch.nn.Identity()
        no_norm = ours(x_BSD)
        _, ours, _ = _attention_pair()
        ours.inv_freq.zero_()  # every position at angle 0
        no_rope = ours(x_BSD)
    scale = want.abs().max()
    assert (no_norm - want).abs().max() > 1e3 * 1e-5 * scale
    assert (no_rope - want).abs().max() > 1e3 * 1e-5 * scale


def test_rmsnorm_equals_qwen3_rmsnorm():
    from moe.models.layers import RMSNorm

    theirs, ours = hf_qwen.Qwen3MoeRMSNorm(32, eps=1e-6), RMSNorm(32, 1e-6)
    _randomize(theirs, seed=3)
    ours.load_state_dict(theirs.state_dict())
    x = 3 * torch.randn(5, 7, 32, generator=torch.Generator().manual_seed(4))
    assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_router_matches_transformers(norm_topk_prob):
    cfg = _config(norm_topk_prob)
    router = hf_qwen.Qwen3MoeTopKRouter(cfg)
    _randomize(router, seed=5)
    x_TD = torch.randn(BATCH * SEQ, 64, generator=torch.Generator().manual_seed(6))
    _, want_w_TK, want_idx_TK = router(x_TD)
    ours = Router(
        MoEConfig(
            hidden_size=64, num_experts=EXPERTS, top_k=TOP_K, router_scoring="softmax", norm_topk_prob=norm_topk_prob
        )
    )
    with torch.no_grad():
        ours.gate.weight.copy_(router.weight)
    routing = ours(x_TD.view(BATCH, SEQ, -1))
    idx_TK, weights_TK = routing.topk_idx_TK, routing.topk_weights_TK
    assert idx_TK.dtype == torch.int64 and weights_TK.dtype == torch.float32
    assert torch.equal(idx_TK, want_idx_TK)
    torch.testing.assert_close(weights_TK, want_w_TK, rtol=1e-6, atol=1e-6)
    sums_T = weights_TK.sum(-1)
    if norm_topk_prob:
        torch.testing.assert_close(sums_T, torch.ones_like(sums_T))
    else:
        assert (sums_T - 1).abs().max() > 0.1  # renormalising would be caught


def _layer_logits(seed: int, layers: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Skewed towards a few experts, unevenly per layer, so the balance terms are far from their minimum.
    return [2 * torch.randn(BATCH * SEQ, EXPERTS, generator=gen) + torch.randn(EXPERTS, generator=gen)
            for _ in range(layers)]  # fmt: skip


@pytest.mark.parametrize("masked", [False, True])
def test_aux_loss_matches_transformers(masked):
    logits = [t.requires_grad_() for t in _layer_logits(7)]
    mask_BS = (torch.arange(SEQ)[None] < torch.tensor([[SEQ], [SEQ - 9]])).long() if masked else None
    want = hf_qwen.load_balancing_loss_func(tuple(logits), EXPERTS, TOP_K, mask_BS)
    got = load_balancing_loss(logits, TOP_K, mask_BS=mask_BS)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    want_grads = torch.autograd.grad(want, logits)
    for g, w in zip(torch.autograd.grad(got, logits), want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-9)
    torch.testing.assert_close(load_balancing_loss(logits, TOP_K, coef=0.01, mask_BS=mask_BS), 0.01 * want)
    # Sensitive: the per-layer average (instead of pooling the layers first) is measurably different.
    per_layer = torch.stack([load_balancing_loss(t, TOP_K, mask_BS=mask_BS) for t in logits]).mean()
    assert (per_layer - want).abs() > 1e3 * 1e-6 * want.abs()


def test_model_adds_coef_times_aux_loss():
    """Qwen3MoeForCausalLM's loss = next-token CE + router_aux_loss_coef * the loss above."""
    cfg = _config()
    torch.manual_seed(8)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    _randomize(model.model.layers, seed=9)
    logits_per_layer = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda m, args, out: logits_per_layer.append(out[0]))
    ids_BS = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        out = model(ids_BS, labels=ids_BS, output_router_logits=True)
    ce = F.cross_entropy(out.logits[:, :-1].reshape(-1, cfg.vocab_size), ids_BS[:, 1:].reshape(-1))
    aux = load_balancing_loss(logits_per_layer, cfg.num_experts_per_tok, coef=cfg.router_aux_loss_coef)
    torch.testing.assert_close(out.loss, ce + aux, rtol=1e-6, atol=0)
    torch.testing.assert_close(out.aux_loss, aux / cfg.router_aux_loss_coef, rtol=1e-6, atol=0)

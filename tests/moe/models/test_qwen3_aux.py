"""Qwen3-MoE's load-balancing loss in training (MoEConfig.router_aux_loss_coef): per MoE layer, averaged over
the layers; with one MoE layer it is transformers' value; its gradient reaches each router's gate through the
block's auxiliary-loss path; config.json's coefficient is read."""

from __future__ import annotations

import pytest
import torch

from moe import MoEModel, lm_loss, preset
from moe.hf import from_hf_config
from moe.models.config import MoEConfig
from moe.models.router import Router, load_balancing_loss
from tests.moe.helpers import assert_rel_close, batch
from tests.moe.models.helpers import large_random_weights

transformers = pytest.importorskip("transformers")

COEF = 0.01


def test_one_moe_layer_gives_transformers_aux_loss() -> None:
    hf_cfg = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        router_aux_loss_coef=COEF,
    )
    theirs = transformers.Qwen3MoeForCausalLM(hf_cfg).eval()
    large_random_weights(theirs, seed=1)
    gate = theirs.model.layers[0].mlp.gate
    seen = []
    gate.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    ids_BS = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = theirs(ids_BS, output_router_logits=True).aux_loss  # before the coefficient
    cfg = from_hf_config({**hf_cfg.to_dict(), "model_type": "qwen3_moe"})
    assert cfg.router_aux_loss_coef == COEF and cfg.moe_layers == [0]
    ours = Router(cfg)
    with torch.no_grad():
        ours.gate.weight.copy_(gate.weight)
    routing = ours(seen[0].view(2, 24, -1))
    assert routing.aux_loss is not None
    torch.testing.assert_close(routing.aux_loss, COEF * want, rtol=1e-6, atol=0)
    assert want - hf_cfg.num_experts_per_tok > 0.05  # skewed: above the balanced value (top_k), its minimum


def test_the_gradient_reaches_every_router_at_its_layer_share() -> None:
    """Trained with the coefficient, each gate's gradient moves by exactly d(COEF / layers x its layer's loss).
    In fp64: the difference of two gradients dominated by the main loss is then far above their rounding."""
    cfg = preset("qwen3-moe-tiny", num_layers=2, vocab_size=64)
    assert cfg.moe_layers == [0, 1]
    ids, labels = batch(cfg, size=2, seq=16)
    grads, inputs = {}, {}
    for coef in (0.0, COEF):
        model = MoEModel(cfg.replace(router_aux_loss_coef=coef), seed=5, piecewise=True).double()
        large_random_weights(model, seed=5)
        for name, block in model.blocks.items():
            block.router.register_forward_pre_hook(
                lambda m, args, name=name: inputs.setdefault(name, args[0].detach().clone())
            )
        lm_loss(model(ids), labels).backward()
        grads[coef] = {n: b.router.gate.weight.grad.clone() for n, b in model.blocks.items()}
        weights = {n: b.router.gate.weight.detach().clone() for n, b in model.blocks.items()}
    for name, z_BSD in inputs.items():
        w = weights[name].requires_grad_()
        logits_TE = z_BSD.reshape(-1, cfg.hidden_size) @ w.t()
        share = load_balancing_loss(logits_TE, cfg.top_k, coef=COEF / len(cfg.moe_layers))
        (want,) = torch.autograd.grad(share, w)
        assert_rel_close(grads[COEF][name] - grads[0.0][name], want, 1e-5, f"layer {name}")


def test_config_reads_and_checks_the_coefficient() -> None:
    qwen = preset("qwen3-30b-a3b")
    assert qwen.router_aux_loss_coef == 0.001 and preset("qwen3-235b-a22b").router_aux_loss_coef == 0.001
    assert preset("deepseek-v3").router_aux_loss_coef == 0.0
    with pytest.raises(ValueError, match="router_scoring='softmax'"):
        MoEConfig(router_aux_loss_coef=0.01)  # the sigmoid router
    with pytest.raises(ValueError, match=r"router_aux_loss_coef=-0\.1 must be >= 0"):
        qwen.replace(router_aux_loss_coef=-0.1)
    off = Router(qwen.replace(num_layers=2, hidden_size=8, router_aux_loss_coef=0.0))
    assert off(torch.randn(1, 3, 8)).aux_loss is None

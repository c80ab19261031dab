"""MLAttention and RopeConfig against transformers' DeepSeek-V3 (the oracle), fp32, tiny random configs.

Weights are drawn large (unit-ish activations everywhere, norm weights away from 1) and every feature the
parity depends on is switched off once to show the comparison notices it (DESIGN.md: small init hides
missing features).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from dualpipe.weight_grad import WeightGradStore
from moe.models.mla import MLAttention
from moe.models.rope import RopeConfig
from tests.moe.models.test_presets import DEEPSEEK_V3

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf  # noqa: E402

TOL = 1e-5  # relative: max |ours - theirs| / max |theirs|
B, S = 2, 40  # S > original_max_position_embeddings: YaRN's interpolated frequencies matter

SHAPES = {
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,  # transformers defaults it to 128, not to num_attention_heads
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 32,  # != qk_head_dim (16 + 8): SDPA with a wider value head
    "max_position_embeddings": 128,
    "rope_theta": 10000.0,
}
# DeepSeek-V3's published rope_scaling, shrunk: mscale == mscale_all_dim makes the cos/sin factor exactly 1.
YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 32,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
# mscale != mscale_all_dim: a cos/sin factor != 1 and a softmax correction at once.
YARN_MIXED = {**YARN, "mscale": 2.0, "mscale_all_dim": 1.0}

CASES = {
    "yarn": {**SHAPES, "rope_scaling": YARN},
    "yarn-no-q-lora": {**SHAPES, "q_lora_rank": None, "rope_scaling": YARN},
    "yarn-v-equal-qk": {**SHAPES, "v_head_dim": 24, "rope_scaling": YARN},
    "yarn-mixed-mscale-half-split": {**SHAPES, "rope_scaling": YARN_MIXED, "rope_interleave": False},
    "yarn-no-mscale": {**SHAPES, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    "default-rope": {**SHAPES, "v_head_dim": 12},
}


def _rel_err(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours - theirs).abs().max() / theirs.abs().max()).item()


def _randomize(module: torch.nn.Module, seed: int) -> None:
    # std 1.5/sqrt(fan_in): every projection keeps activations near unit scale (std 0.19..0.53 here), so the
    # attention logits are O(1..10) and neither softmax nor rotary angles are negligible.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 1:  # norm weights: away from 1, so a missing or swapped norm shows
                p.copy_(1 + 0.5 * noise)
            else:
                p.copy_(noise * 1.5 / math.sqrt(p.shape[1]))


def _pair(hub: dict, seed: int = 0) -> tuple[MLAttention, hf.DeepseekV3Attention, hf.DeepseekV3RotaryEmbedding]:
    """Ours built from the hub-style dict, theirs from a DeepseekV3Config of it, same weights."""
    config = DeepseekV3Config(**hub, attn_implementation="eager")
    theirs = hf.DeepseekV3Attention(config, layer_idx=0)
    _randomize(theirs, seed)
    ours = MLAttention.from_config(hub)
    ours.load_state_dict(theirs.state_dict(), strict=True)  # the checkpoint keys map 1:1
    return ours, theirs, hf.DeepseekV3RotaryEmbedding(config)


def _theirs_forward(theirs: hf.DeepseekV3Attention, rotary: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    # The layer's own inputs, as DeepseekV3Model makes them: cos/sin from the rotary module for positions
    # 0..S-1, an additive causal mask (eager attention applies no mask of its own).
    positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    cos, sin = rotary(x, positions)
    mask = torch.full((x.shape[1], x.shape[1]), torch.finfo(x.dtype).min).triu(1)[None, None]
    out, _ = theirs(x, position_embeddings=(cos, sin), attention_mask=mask)
    return out


def _input(hidden: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(B, S, hidden, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("case", CASES)
def test_forward_equals_transformers(case: str) -> None:
    ours, theirs, rotary = _pair(CASES[case])
    x = _input(ours.o_proj.weight.shape[0])
    with torch.no_grad():
        assert _rel_err(ours(x), _theirs_forward(theirs, rotary, x)) < TOL


@pytest.mark.parametrize("case", ["yarn", "yarn-no-q-lora", "yarn-mixed-mscale-half-split"])
def test_backward_equals_transformers(case: str) -> None:
    assert not WeightGradStore.enabled  # plain autograd: our Linear accumulates its weight grad at once
    ours, theirs, rotary = _pair(CASES[case])
    x = _input(ours.o_proj.weight.shape[0])
    grad_out = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    x_ours, x_theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    (ours(x_ours) * grad_out).sum().backward()
    (_theirs_forward(theirs, rotary, x_theirs) * grad_out).sum().backward()

    assert _rel_err(x_ours.grad, x_theirs.grad) < TOL
    theirs_params = dict(theirs.named_parameters())
    names = [name for name, _ in ours.named_parameters()]
    assert sorted(names) == sorted(theirs_params)
    for name, p in ours.named_parameters():
        assert p.grad is not None, name
        assert _rel_err(p.grad, theirs_params[name].grad) < TOL, name


def _variant(ours: MLAttention, *, rope: RopeConfig | None = None, **changes) -> MLAttention:
    """``ours`` rebuilt with one setting changed, same weights."""
    kwargs = {
        "hidden_size": ours.o_proj.weight.shape[0],
        "num_attention_heads": ours.num_heads,
        "q_lora_rank": ours.q_lora_rank,
        "kv_lora_rank": ours.kv_lora_rank,
        "qk_nope_head_dim": ours.qk_nope_head_dim,
        "qk_rope_head_dim": ours.qk_rope_head_dim,
        "v_head_dim": ours.v_head_dim,
        "rope": rope or ours.rope,
        "rope_interleave": ours.rope_interleave,
        **changes,
    }
    wrong = MLAttention(**kwargs)
    wrong.load_state_dict(ours.state_dict())
    return wrong


def test_parity_is_sensitive_to_each_feature() -> None:
    # Interleave on, cos/sin factor != 1, softmax correction != 1: every knob below moves the output.
    hub = {**CASES["yarn"], "rope_scaling": YARN_MIXED}
    ours, theirs, rotary = _pair(hub)
    x = _input(64)
    with torch.no_grad():
        ref = _theirs_forward(theirs, rotary, x)
        assert _rel_err(ours(x), ref) < TOL
        rope = ours.rope
        wrong = {
            "interleave off": _variant(ours, rope_interleave=False),
            "plain rope instead of yarn": _variant(ours, rope=RopeConfig(theta=rope.theta)),
            "no cos/sin attention factor": _variant(ours, rope=dataclasses.replace(rope, attention_factor=1.0)),
            "no softmax mscale": _variant(ours, rope=dataclasses.replace(rope, mscale_all_dim=None)),
            "latent norm eps 1e-1": _variant(ours, latent_norm_eps=1e-1),
        }
        plain_freqs = _variant(ours)  # YaRN's scales kept, its frequency ramp dropped
        plain_freqs.rope = dataclasses.replace(rope, factor=1.0)
        wrong["no yarn frequency ramp"] = plain_freqs
        softmax_off = _variant(ours)
        softmax_off.softmax_scale = ours.qk_head_dim**-0.5
        wrong["softmax scale without mscale**2"] = softmax_off
        for what, module in wrong.items():
            assert _rel_err(module(x), ref) > 100 * TOL, what


def test_latent_norms_ignore_rms_norm_eps() -> None:
    # transformers (like DeepSeek's own code) builds q_a_layernorm/kv_a_layernorm with eps 1e-6 regardless.
    hub = {**CASES["yarn"], "rms_norm_eps": 1e-1}
    ours, theirs, rotary = _pair(hub)
    assert theirs.kv_a_layernorm.variance_epsilon == ours.kv_a_layernorm.eps == 1e-6
    x = _input(64)
    with torch.no_grad():
        assert _rel_err(ours(x), _theirs_forward(theirs, rotary, x)) < TOL


def test_rms_norm_equals_transformers() -> None:
    from moe.models.layers import RMSNorm

    ours, theirs = RMSNorm(16, 1e-6), hf.DeepseekV3RMSNorm(16, eps=1e-6)
    _randomize(theirs, 3)
    ours.load_state_dict(theirs.state_dict())
    x = 3 * torch.randn(5, 16, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(ours(x), theirs(x))


# DeepSeek-V3's published config.json (tests/moe/models/test_presets.py holds it), its rope part.
HUB_DSV3 = {
    key: DEEPSEEK_V3[key]
    for key in (
        "hidden_size",
        "num_attention_heads",
        "qk_rope_head_dim",
        "max_position_embeddings",
        "rope_theta",
        "rope_scaling",
    )
}


def test_rope_config_reads_both_styles() -> None:
    config = DeepseekV3Config(**HUB_DSV3)
    written = config.to_dict()
    # transformers 5.x writes rope_parameters (theta inside, "type" kept beside "rope_type"), no rope_theta.
    assert "rope_theta" not in written and written.get("rope_scaling") is None
    assert written["rope_parameters"]["rope_type"] == "yarn" and written["rope_parameters"]["rope_theta"] == 10000

    expected = RopeConfig(
        theta=10000,
        rope_type="yarn",
        factor=40,
        original_max_position_embeddings=4096,
        beta_fast=32,
        beta_slow=1,
        mscale=1.0,
        mscale_all_dim=1.0,
    )
    assert RopeConfig.from_hf_config(HUB_DSV3) == expected
    assert RopeConfig.from_hf_config(written) == expected
    assert RopeConfig.from_hf_config(config) == expected
    renamed = {**HUB_DSV3["rope_scaling"], "rope_type": "yarn"}
    del renamed["type"]
    assert RopeConfig.from_hf_config({**HUB_DSV3, "rope_scaling": renamed}) == expected

    plain = RopeConfig(theta=50000.0)
    assert RopeConfig.from_hf_config({"rope_theta": 50000.0}) == plain
    assert RopeConfig.from_hf_config(DeepseekV3Config(rope_theta=50000.0).to_dict()) == plain
    with pytest.raises(ValueError, match="not supported"):
        RopeConfig.from_hf_config({"rope_scaling": {"type": "dynamic", "factor": 2.0}})


@pytest.mark.parametrize("hub", [HUB_DSV3, {**HUB_DSV3, "rope_scaling": YARN_MIXED}, CASES["yarn-no-mscale"]])
def test_rope_numbers_equal_transformers(hub: dict) -> None:
    config = DeepseekV3Config(**hub)
    rope = RopeConfig.from_hf_config(hub)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    torch.testing.assert_close(rope.inv_freq(hub["qk_rope_head_dim"]), inv_freq, rtol=1e-6, atol=0)
    assert rope.cos_sin_scale() == pytest.approx(attention_factor, rel=1e-12)
    assert rope.softmax_mscale() == pytest.approx(hf.yarn_apply_mscale(config.rope_parameters, 1.0), rel=1e-12)

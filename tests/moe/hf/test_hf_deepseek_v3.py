"""A DeepSeek-V3 checkpoint written by transformers (no MTP), loaded into our model: the same logits and loss in
fp32, with MLA, YaRN past the original context, interleaved rotary pairs, shared experts, a dense first layer
and a non-zero selection bias (``e_score_correction_bias``) that decides routes."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from moe.hf import HFCheckpointError, HFConfigError, from_hf_config, load_hf_model, read_safetensors, to_hub, to_ours
from moe.hf.keys import checkpoint_shapes
from moe.models.config import MoEConfig
from moe.models.model import MoEModel, lm_loss
from tests.moe.models.helpers import large_random_weights

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

BATCH, SEQ = 2, 40  # SEQ > original_max_position_embeddings: YaRN's interpolated frequencies matter
LAYERS = 4
YARN = {
    "type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def _hf_model(q_lora_rank: int | None = 32):
    cfg = transformers.DeepseekV3Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,  # transformers defaults it to 128, not to the heads
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        max_position_embeddings=64,  # = factor * original: transformers warns otherwise
        rope_theta=10000.0,
        rope_scaling=YARN,
        rope_interleave=True,
        attn_implementation="eager",
    )
    model = transformers.DeepseekV3ForCausalLM(cfg).eval()
    large_random_weights(model)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):  # as large as the gaps between sigmoid scores
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    return model


@pytest.fixture(scope="module", params=[32, None], ids=["q_lora", "no_q_lora"])
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, MoEModel]:
    model = _hf_model(request.param)
    path = tmp_path_factory.mktemp("deepseek_v3")
    model.save_pretrained(path)
    return path, model, load_hf_model(path).eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def test_logits_and_loss_equal_transformers(checkpoint) -> None:
    _, hf, ours = checkpoint
    cfg = ours.cfg
    assert cfg.attention == "mla" and cfg.moe_layers == [1, 2, 3] and cfg.rope_type == "yarn"
    assert cfg.q_lora_rank == hf.config.q_lora_rank and cfg.route_scale == 2.5 and cfg.num_shared_experts == 1
    bias = hf.model.layers[2].mlp.gate.e_score_correction_bias
    assert bias.abs().min() > 0 and torch.equal(ours.blocks["2"].router.expert_bias, bias)
    ids = _ids()
    with torch.no_grad():
        want = hf(ids, labels=ids)
        got = ours(ids)
    scale = want.logits.abs().max().item()
    torch.testing.assert_close(got, want.logits, rtol=1e-4, atol=1e-4 * scale)
    loss = lm_loss(got[:, :-1], ids[:, 1:])  # transformers shifts the labels inside
    assert loss.item() == pytest.approx(want.loss.item(), rel=1e-5)

    # sensitive: each feature dropped on its own moves the logits far past the tolerance
    state = ours.state_dict()
    no_bias = {k: torch.zeros_like(v) if k.endswith("expert_bias") else v for k, v in state.items()}
    variants = {
        "selection bias zero": (cfg, no_bias),
        "half-split rotary pairs": (dataclasses.replace(cfg, rope_interleave=False), state),
        "plain rope instead of yarn": (dataclasses.replace(cfg, rope_type="default"), state),
        "no softmax mscale": (dataclasses.replace(cfg, rope_mscale_all_dim=None), state),
        "unnormalised top-k": (dataclasses.replace(cfg, norm_topk_prob=False), state),
    }
    for what, (variant_cfg, variant_state) in variants.items():
        other = MoEModel(variant_cfg).eval()
        other.load_state_dict(variant_state)
        with torch.no_grad():
            assert (other(ids) - want.logits).abs().max() > 1e-2 * scale, what


def test_fused_in_memory_experts_and_the_hub_layout_agree(checkpoint) -> None:
    path, hf, ours = checkpoint
    shapes = checkpoint_shapes(ours)
    assert sum(k.endswith("router.expert_bias") for k in shapes) == LAYERS - 1  # a buffer the checkpoint holds
    state = ours.state_dict()
    fused = to_ours(hf.state_dict(), shapes)  # transformers' in-memory layout: gate_up_proj [E, 2F, D]
    assert sorted(fused) == sorted(shapes)
    for key, value in fused.items():
        assert torch.equal(value, state[key]), key
    # and back: our tensors in the hub layout are exactly the files' tensors, key for key
    hub = read_safetensors(path)
    exported = to_hub({k: state[k] for k in shapes})
    assert sorted(exported) == sorted(hub)
    assert all(torch.equal(exported[k], hub[k]) for k in hub)


def test_both_config_styles_read_the_same() -> None:
    written = _hf_model().config.to_dict()  # transformers 5.x: rope_parameters, qk_head_dim, head_dim
    drop = ("rope_parameters", "qk_head_dim", "head_dim", "n_routed_experts")
    hub = {k: v for k, v in written.items() if k not in drop}
    # the published config.json's spelling: rope_theta + rope_scaling, and the fields of DeepSeek's own code
    hub.update(
        rope_theta=10000.0,
        rope_scaling=YARN,
        num_local_experts=8,
        topk_method="noaux_tc",
        scoring_func="sigmoid",
        moe_layer_freq=1,
        num_nextn_predict_layers=1,  # one MTP module (read_hf_config keeps it only when the tensors hold it)
    )
    ours = from_hf_config(written)
    assert from_hf_config(hub) == ours
    assert (ours.rope_type, ours.rope_factor, ours.rope_original_max_position_embeddings) == ("yarn", 4.0, 16)
    assert (ours.rope_mscale, ours.rope_mscale_all_dim, ours.rope_interleave) == (1.0, 1.0, True)
    assert (ours.num_dense_layers, ours.n_group, ours.topk_group, ours.top_k) == (1, 4, 2, 2)
    assert ours.bias_update_rate > 0 and ours.seq_aux_loss_coef == 0  # V3 balances by the selection bias
    assert from_hf_config({**written, "rope_interleave": None}).rope_interleave is False  # as transformers tests it


def test_bad_checkpoints_are_one_line(checkpoint) -> None:
    path, _, ours = checkpoint
    shapes = checkpoint_shapes(ours)
    hub = read_safetensors(path)
    # An MTP module as DeepSeek-V3 ships it (layer num_hidden_layers) for a model built without one.
    names = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight", "mlp.gate.weight")
    mtp = {f"model.layers.{LAYERS}.{name}": torch.zeros(1) for name in names}
    cases = [
        ({**hub, **mtp}, rf"5 tensor\(s\) with no place here: model\.layers\.{LAYERS}\.eh_proj\.weight$"),
        ({**hub, "model.layers.1.mlp.gate.bias": torch.zeros(8)}, r"no place here: model\.layers\.1\.mlp\.gate\.bias$"),
        (
            {k: v for k, v in hub.items() if not k.endswith("3.mlp.gate.e_score_correction_bias")},
            r"lacks model\.layers\.3\.mlp\.gate\.e_score_correction_bias$",
        ),
    ]
    for tensors, message in cases:
        with pytest.raises(HFCheckpointError, match=message) as err:
            to_ours(tensors, shapes)
        assert "\n" not in str(err.value)
    raw = json.loads((path / "config.json").read_text())
    for change, message in [
        ({"tie_word_embeddings": True}, "deepseek_v3: tie_word_embeddings = True is not supported"),
        ({"attention_bias": True}, "deepseek_v3: attention_bias = True is not supported"),
        ({"hidden_act": "gelu"}, "deepseek_v3: hidden_act = 'gelu' is not supported"),
        ({"topk_method": "greedy"}, "deepseek_v3: topk_method = 'greedy' is not supported"),
        ({"num_key_value_heads": 2}, "num_key_value_heads = 2 must equal num_attention_heads = 4"),
        ({"quantization_config": {"quant_method": "awq"}}, "quant_method 'awq' fmt 'e4m3' is not supported"),
        ({"rope_parameters": {"rope_type": "longrope"}}, "rope_type 'longrope' is not supported"),
    ]:
        with pytest.raises(HFConfigError, match=re.escape(message)) as err:
            from_hf_config({**raw, **change})
        assert "\n" not in str(err.value)


def test_mla_fields_are_checked_only_for_mla() -> None:
    assert MoEConfig(qk_rope_head_dim=3, rope_factor=-1.0).attention == "gqa"  # unused fields: not checked
    with pytest.raises(ValueError, match="rope_type='yarn' is built for attention='mla' only"):
        MoEConfig(rope_type="yarn", rope_factor=4.0, rope_original_max_position_embeddings=16)
    with pytest.raises(ValueError, match="qk_rope_head_dim=3 must be even"):
        MoEConfig(attention="mla", num_kv_heads=4, qk_rope_head_dim=3)
    with pytest.raises(ValueError, match="yarn needs factor and original_max_position_embeddings"):
        MoEConfig(attention="mla", num_kv_heads=4, rope_type="yarn")

"""The presets of the published architectures are what their config.json files say, and the CPU shapes of each
family are the published config with only the sizes changed: they build, run a forward and train from the
command line."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from moe.hf import HFConfigError, from_hf_config
from moe.models.config import PRESETS, MoEConfig
from moe.models.model import MoEModel

ROOT = Path(__file__).resolve().parents[3]

# The published config.json files (the hub's spelling), trimmed of the keys the readers never look at (auto_map,
# token ids, dtype, versions). DeepSeek-V3's hub file also holds its fp8 quantization_config, which the reader
# refuses (the weights are dequantized to bf16 first); the architecture is the same without it.
DEEPSEEK_V3 = {  # deepseek-ai/DeepSeek-V3
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "attention_bias": False,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,  # one multi-token-prediction module
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "v_head_dim": 128,
    "vocab_size": 129280,
}

DEEPSEEK_V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "attention_bias": False,
    "aux_loss_alpha": 0.001,
    "ep_size": 1,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "v_head_dim": 128,
    "vocab_size": 102400,
}

QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

QWEN3_235B_A22B = {  # Qwen/Qwen3-235B-A22B: the 30B's keys, these values changed
    **QWEN3_30B_A3B,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_window_layers": 94,
    "moe_intermediate_size": 1536,
    "num_attention_heads": 64,
    "num_hidden_layers": 94,
}

PUBLISHED = {"deepseek-v3": DEEPSEEK_V3, "qwen3-30b-a3b": QWEN3_30B_A3B, "qwen3-235b-a22b": QWEN3_235B_A22B}

# The tiny shapes: the published config.json with the sizes changed and nothing else.
TINY = {
    "deepseek-v3-tiny": {
        **DEEPSEEK_V3,
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 4,
        "first_k_dense_replace": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "q_lora_rank": 24,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 4,
        "topk_group": 2,
        "max_position_embeddings": 64,
        "rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "factor": 4, "original_max_position_embeddings": 16},
    },
    "qwen3-moe-tiny": {
        **QWEN3_30B_A3B,
        "vocab_size": 256,
        "hidden_size": 32,
        "intermediate_size": 64,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 4,
        "max_window_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,  # not hidden / heads, as in the published models (128 vs 64)
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
}

# Fields a config.json does not decide: how a run balances and initialises (not the architecture).
TRAINING_ONLY = ("bias_update_rate", "seq_aux_loss_coef", "init_std")


def _architecture(cfg: MoEConfig) -> MoEConfig:
    defaults = MoEConfig()
    return cfg.replace(**{name: getattr(defaults, name) for name in TRAINING_ONLY})


def _json(raw: dict[str, Any]) -> dict[str, Any]:
    """The dict as a config.json file holds it (lists, not tuples; JSON numbers)."""
    return json.loads(json.dumps(raw))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_published_preset_is_what_its_config_json_reads(name: str) -> None:
    read = from_hf_config(_json(PUBLISHED[name]))
    assert _architecture(read) == _architecture(PRESETS[name])
    # and the training-only fields are the ones a run from the checkpoint would get
    assert read == PRESETS[name]


def test_the_published_numbers() -> None:
    """The headline numbers written out, so a preset and a fixture cannot drift together."""
    v3 = PRESETS["deepseek-v3"]
    assert (v3.vocab_size, v3.hidden_size, v3.num_layers, v3.num_heads) == (129280, 7168, 61, 128)
    assert (v3.q_lora_rank, v3.kv_lora_rank, v3.qk_nope_head_dim, v3.qk_rope_head_dim, v3.v_head_dim) == (
        1536,
        512,
        128,
        64,
        128,
    )
    assert (v3.num_experts, v3.num_shared_experts, v3.top_k, v3.n_group, v3.topk_group) == (256, 1, 8, 8, 4)
    assert (v3.dense_intermediate_size, v3.moe_intermediate_size, v3.num_dense_layers) == (18432, 2048, 3)
    assert (v3.route_scale, v3.rope_type, v3.rope_factor, v3.rope_original_max_position_embeddings) == (
        2.5,
        "yarn",
        40.0,
        4096,
    )
    assert v3.moe_layers == list(range(3, 61))
    for name, hidden, inter, moe_inter, layers, heads in [
        ("qwen3-30b-a3b", 2048, 6144, 768, 48, 32),
        ("qwen3-235b-a22b", 4096, 12288, 1536, 94, 64),
    ]:
        q = PRESETS[name]
        assert (q.hidden_size, q.dense_intermediate_size, q.moe_intermediate_size) == (hidden, inter, moe_inter)
        assert (q.num_layers, q.num_heads, q.num_kv_heads, q.head_dim) == (layers, heads, 4, 128)
        assert (q.vocab_size, q.num_experts, q.top_k, q.num_shared_experts, q.rope_theta) == (151936, 128, 8, 0, 1e6)
        assert q.moe_layers == list(range(layers)) and q.norm_topk_prob and q.router_scoring == "softmax"


def test_deepseek_v2_lite_is_v3s_reading_of_its_config_but_the_router() -> None:
    """No reader maps a deepseek_v2 config.json (the preset trains from scratch; no V2 checkpoint loads). Its
    config is V3's format but for the router: V3's reader, told the router is V3's, reads every other field;
    the preset is that with the softmax router and no selection bias (topk_method greedy)."""
    with pytest.raises(HFConfigError, match="model_type 'deepseek_v2' is not supported"):
        from_hf_config(_json(DEEPSEEK_V2_LITE))
    as_v3 = {**DEEPSEEK_V2_LITE, "model_type": "deepseek_v3", "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    read = from_hf_config(_json(as_v3)).replace(router_scoring="softmax", bias_update_rate=0.0)
    assert read == PRESETS["deepseek-v2-lite"]
    lite = PRESETS["deepseek-v2-lite"]
    assert lite.q_lora_rank is None and lite.num_shared_experts == 2 and lite.top_k == 6 and lite.n_group == 1
    assert not lite.norm_topk_prob and lite.route_scale == 1.0 and lite.moe_layers == list(range(1, 27))
    assert lite.rope_mscale == lite.rope_mscale_all_dim == 0.707


@pytest.mark.parametrize("name", sorted(TINY))
def test_a_tiny_shape_is_its_family_with_only_the_sizes_changed(name: str) -> None:
    tiny = PRESETS[name]
    assert from_hf_config(_json(TINY[name])) == tiny
    assert tiny.vocab_size == 256 and tiny.num_layers == 4 and tiny.num_experts % 2 == 0  # byte data, pp=2, ep=2
    published = PRESETS["deepseek-v3" if name.startswith("deepseek") else "qwen3-30b-a3b"]
    same = ("attention", "router_scoring", "rope_type", "rope_interleave", "norm_topk_prob", "route_scale")
    assert {f: getattr(tiny, f) for f in same} == {f: getattr(published, f) for f in same}
    assert (tiny.q_lora_rank is None) == (published.q_lora_rank is None)
    assert (tiny.num_shared_experts > 0) == (published.num_shared_experts > 0)
    assert (tiny.num_dense_layers > 0) == (published.num_dense_layers > 0)
    assert (tiny.n_group > 1) == (published.n_group > 1)
    if tiny.attention == "gqa-qk-norm":
        assert tiny.attn_head_dim != tiny.hidden_size // tiny.num_heads and tiny.num_kv_heads < tiny.num_heads


@pytest.mark.parametrize("name", sorted(TINY))
def test_a_tiny_shape_runs_a_forward(name: str) -> None:
    cfg = PRESETS[name]
    model = MoEModel(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids, *([ids.roll(-1, 1)] if cfg.mtp_layers else []))  # MTP reads the next tokens
    assert logits.shape == (2, 24, cfg.vocab_size) and torch.isfinite(logits).all()
    if cfg.rope_type == "yarn":  # the sequence reaches past the original context: the stretched frequencies act
        assert ids.shape[1] > cfg.rope_original_max_position_embeddings


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


@pytest.mark.parametrize("name", sorted(TINY))
def test_a_tiny_shape_trains_from_the_command_line(name: str, tmp_path: Path) -> None:
    """``python examples/train.py --model NAME --steps 2 --val-every 0`` as a user types it (byte-level data)."""
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, str(ROOT / "examples/train.py"), "--model", name, "--steps", "2", "--val-every", "0"]
    cmd += ["--metrics-file", str(metrics)]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"MoE {name}:" in done.stdout and "step     2/2" in done.stdout
    losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def test_training_only_fields_are_fields() -> None:
    assert set(TRAINING_ONLY) <= {f.name for f in dataclasses.fields(MoEConfig)}

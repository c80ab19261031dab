"""Hugging Face ``config.json`` to :class:`moe.config.MoEConfig`, one entry per ``model_type``.

Both config styles are read: the hub's (``rope_theta`` + ``rope_scaling``, Qwen's ``num_experts``) and what
transformers 5.x writes (``rope_parameters``, ``num_local_experts``). A config this stack cannot run exactly
as published (an unknown ``model_type``, a feature not built yet) is a :class:`HFConfigError`: one line naming
the field. A field a config.json leaves out takes transformers' default for it, except the sizes, which are
required.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from moe.config import MoEConfig
from moe.models.rope import RopeConfig

__all__ = ["HF_CONFIGS", "HFConfigError", "from_hf_config", "read_hf_config"]


class HFConfigError(ValueError):
    """A config.json this stack does not run as published; the message names the field."""


def _get(raw: Mapping[str, Any], *names: str, default: Any = ...) -> Any:
    """The first of ``names`` present in ``raw`` (the styles spell some fields differently)."""
    for name in names:
        if name in raw and raw[name] is not None:
            return raw[name]
    if default is ...:
        raise HFConfigError(f"config.json lacks {' / '.join(names)}")
    return default


def _rope_theta(raw: Mapping[str, Any]) -> float:
    """The default-rope base from either style; any scaled rope is refused (not built for this family)."""
    params = raw.get("rope_parameters") or {}
    scaling = raw.get("rope_scaling") or {}
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise HFConfigError(f"rope type {kind!r} is not supported for {raw.get('model_type')} (default only)")
    return float(_get(params, "rope_theta", default=None) or _get(raw, "rope_theta", default=10000.0))


def _refuse(raw: Mapping[str, Any], **unsupported: Any) -> None:
    """One line for the first field set to something these blocks do not compute."""
    for name, fine in unsupported.items():
        value = raw.get(name)
        if value not in (None, fine):
            raise HFConfigError(f"{raw.get('model_type')}: {name} = {value!r} is not supported (only {fine!r})")


def _qwen3_moe(raw: Mapping[str, Any]) -> MoEConfig:
    """Qwen3-MoE: GQA with per-head q/k RMSNorm, softmax top-k router, no shared experts, dense layers from
    ``mlp_only_layers`` and ``decoder_sparse_step``, the balance loss's ``router_aux_loss_coef``."""
    _refuse(raw, tie_word_embeddings=False, attention_bias=False, use_sliding_window=False, hidden_act="silu")
    heads = int(_get(raw, "num_attention_heads"))
    hidden = int(_get(raw, "hidden_size"))
    return MoEConfig(
        vocab_size=int(_get(raw, "vocab_size")),
        hidden_size=hidden,
        num_layers=int(_get(raw, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(_get(raw, "num_key_value_heads", default=heads)),
        head_dim=int(_get(raw, "head_dim", default=hidden // heads)),
        rope_theta=_rope_theta(raw),
        attention="gqa-qk-norm",
        dense_intermediate_size=int(_get(raw, "intermediate_size")),
        moe_layer_step=int(_get(raw, "decoder_sparse_step", default=1)),
        dense_layers=tuple(int(i) for i in _get(raw, "mlp_only_layers", default=())),
        num_experts=int(_get(raw, "num_local_experts", "num_experts")),
        num_shared_experts=0,
        moe_intermediate_size=int(_get(raw, "moe_intermediate_size")),
        top_k=int(_get(raw, "num_experts_per_tok")),
        router_scoring="softmax",
        norm_topk_prob=bool(_get(raw, "norm_topk_prob", default=False)),
        route_scale=1.0,
        bias_update_rate=0.0,  # Qwen3-MoE balances with its auxiliary loss, not a selection bias
        # Read whatever output_router_logits says: transformers adds the loss only for calls made with that
        # flag (false in the published configs, written for inference); our training always applies it.
        router_aux_loss_coef=float(_get(raw, "router_aux_loss_coef", default=0.0)),
        norm_eps=float(_get(raw, "rms_norm_eps", default=1e-6)),
        init_std=float(_get(raw, "initializer_range", default=0.02)),
    )


def _deepseek_v3(raw: Mapping[str, Any]) -> MoEConfig:
    """DeepSeek-V3: MLA (plain RoPE or YaRN), the sigmoid group-limited router with its selection bias
    (``e_score_correction_bias``, balanced aux-loss-free as in training), shared experts, the first
    ``first_k_dense_replace`` layers dense, ``num_nextn_predict_layers`` multi-token-prediction modules.

    transformers writes ``num_nextn_predict_layers`` = 1 into every DeepSeek-V3 config.json, whether the
    checkpoint holds MTP weights or not: :func:`read_hf_config` keeps the modules only when the directory's
    tensors include them.
    """
    _refuse(
        raw,
        tie_word_embeddings=False,
        attention_bias=False,
        hidden_act="silu",
        topk_method="noaux_tc",  # the hub config's names for the router transformers implements
        scoring_func="sigmoid",
        moe_layer_freq=1,  # DeepSeek's code: experts on layers >= first_k_dense_replace with i % freq == 0
    )
    if raw.get("quantization_config"):
        method = raw["quantization_config"].get("quant_method", "?")
        raise HFConfigError(f"deepseek_v3: quantization_config ({method}) is not supported: dequantize to bf16 first")
    heads = int(_get(raw, "num_attention_heads"))
    kv_heads = int(_get(raw, "num_key_value_heads", default=heads))
    if kv_heads != heads:  # MLA expands its latent to every head; GQA-style sharing is not this architecture
        raise HFConfigError(f"deepseek_v3: num_key_value_heads = {kv_heads} must equal num_attention_heads = {heads}")
    if "q_lora_rank" not in raw:  # null is meaningful (no query latent), so absence is not read as None
        raise HFConfigError("config.json lacks q_lora_rank")
    q_lora_rank = raw["q_lora_rank"]
    return MoEConfig(
        vocab_size=int(_get(raw, "vocab_size")),
        hidden_size=int(_get(raw, "hidden_size")),
        num_layers=int(_get(raw, "num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=heads,
        attention="mla",
        q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
        kv_lora_rank=int(_get(raw, "kv_lora_rank")),
        qk_nope_head_dim=int(_get(raw, "qk_nope_head_dim")),
        qk_rope_head_dim=int(_get(raw, "qk_rope_head_dim")),
        v_head_dim=int(_get(raw, "v_head_dim")),
        **RopeConfig.from_hf_config(raw).moe_config_fields(),
        # transformers tests the value's truth: absent is its default True, an explicit null is half-split.
        rope_interleave=bool(raw.get("rope_interleave", True)),
        dense_intermediate_size=int(_get(raw, "intermediate_size")),
        num_dense_layers=int(_get(raw, "first_k_dense_replace", default=3)),
        num_experts=int(_get(raw, "n_routed_experts", "num_local_experts")),
        num_shared_experts=int(_get(raw, "n_shared_experts", default=1)),
        moe_intermediate_size=int(_get(raw, "moe_intermediate_size")),
        top_k=int(_get(raw, "num_experts_per_tok")),
        n_group=int(_get(raw, "n_group", default=8)),
        topk_group=int(_get(raw, "topk_group", default=4)),
        router_scoring="sigmoid",
        norm_topk_prob=bool(_get(raw, "norm_topk_prob", default=True)),
        route_scale=float(_get(raw, "routed_scaling_factor", default=2.5)),
        # Training goes on as V3 trained: the selection bias keeps its default step, the sequence-wise loss is
        # off (config.json's aux_loss_alpha/seq_aux describe pre-training, not a default for fine-tuning).
        seq_aux_loss_coef=0.0,
        mtp_layers=int(_get(raw, "num_nextn_predict_layers", "num_mtp_layers", default=0)),
        norm_eps=float(_get(raw, "rms_norm_eps", default=1e-6)),
        init_std=float(_get(raw, "initializer_range", default=0.02)),
    )


HF_CONFIGS: Mapping[str, Callable[[Mapping[str, Any]], MoEConfig]] = MappingProxyType(
    {"qwen3_moe": _qwen3_moe, "deepseek_v3": _deepseek_v3}
)
"""config.json readers by ``model_type``."""


def from_hf_config(raw: Mapping[str, Any]) -> MoEConfig:
    """The :class:`MoEConfig` of a config.json's contents."""
    model_type = raw.get("model_type")
    reader = HF_CONFIGS.get(model_type)  # type: ignore[arg-type]
    if reader is None:
        raise HFConfigError(f"model_type {model_type!r} is not supported; supported: {', '.join(HF_CONFIGS)}")
    try:
        return reader(raw)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, HFConfigError):
            raise
        raise HFConfigError(f"{model_type}: {exc}") from None


def read_hf_config(path: str | Path) -> MoEConfig:
    """``path``: a checkpoint directory or its config.json."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise HFConfigError(f"{file}: no such file (a Hugging Face checkpoint directory holds config.json)") from None
    except json.JSONDecodeError as exc:
        raise HFConfigError(f"{file}: not valid JSON ({exc})") from None
    cfg = from_hf_config(raw)
    if cfg.mtp_layers and not _holds_layer(file.parent, cfg.num_layers):
        cfg = cfg.replace(mtp_layers=0)  # config.json names MTP modules its tensors do not hold (see above)
    return cfg


def _holds_layer(path: Path, layer: int) -> bool:
    """Whether a checkpoint directory's tensors include layer ``layer`` (its weight index, or the names in
    ``model.safetensors``); True when it holds no tensors to look at (a config.json alone)."""
    prefix = f"model.layers.{layer}."
    index = path / "model.safetensors.index.json"
    if index.exists():
        return any(k.startswith(prefix) for k in json.loads(index.read_text()).get("weight_map", {}))
    single = path / "model.safetensors"
    if not single.exists():
        return True
    with single.open("rb") as f:  # the format's header: 8 bytes of length, then JSON keyed by tensor name
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return any(k.startswith(prefix) for k in header)

"""Hugging Face ``config.json`` to :class:`moe.models.config.MoEConfig` and back, one entry per ``model_type``.

Both config styles are read: the hub's (``rope_theta`` + ``rope_scaling``, Qwen's ``num_experts``) and what
transformers 5.x writes (``rope_parameters``, ``num_local_experts``). A config this stack cannot run exactly
as published (an unknown ``model_type``, a feature not built yet) is a :class:`HFConfigError`: one line naming
the field. A field a config.json leaves out takes transformers' default for it, except the sizes, which are
required. FP8 block-quantized weights (``quantization_config``, DeepSeek-V3's published format) are read and
dequantized on load (:mod:`moe.hf.fp8`); other quantizations are refused.

Writing (:func:`to_hf_config`) is the inverse: the architecture is the one whose attention the config uses, and
the config.json is in the hub's style (``rope_theta`` + ``rope_scaling``, Qwen's ``num_experts``), which the
published checkpoints use and transformers reads. A field the architecture cannot express (a shared expert in
Qwen3-MoE, our grouped-query ``gqa`` presets anywhere) is an :class:`HFConfigError` naming it. Fields that shape
our training only, which no config.json holds (the selection-bias step, the sequence-wise loss), are not written.
Given the config.json the model was read from (``source``), the writer keeps it and sets only what differs, so
what it does not model (``max_position_embeddings``, ``bos_token_id``...) survives an export.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from moe.models.config import MoEConfig
from moe.models.rope import RopeConfig

__all__ = [
    "HF_CONFIGS",
    "HFArchitecture",
    "HFConfigError",
    "from_hf_config",
    "quantization_block",
    "read_hf_config",
    "to_hf_config",
]


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


def _express(model_type: str, cfg: MoEConfig, **only: Any) -> None:
    """One line for the first field of ``cfg`` that ``model_type`` cannot express (it only has ``only``'s value)."""
    for name, value in only.items():
        if getattr(cfg, name) != value:
            raise HFConfigError(
                f"{model_type} cannot express MoEConfig.{name} = {getattr(cfg, name)!r} (only {value!r})"
            )


def _qwen3_moe_json(cfg: MoEConfig) -> dict[str, Any]:
    """Qwen3-MoE's config.json (hub style) of ``cfg``: dense layers only as ``mlp_only_layers`` and
    ``decoder_sparse_step``, no shared expert, unscaled softmax routing, plain RoPE."""
    _express("qwen3_moe", cfg, router_scoring="softmax", num_shared_experts=0, route_scale=1.0)
    _express("qwen3_moe", cfg, num_dense_layers=0, mtp_layers=0)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.dense_intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.attn_head_dim,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": 32768,  # the context limit of inference, no field of ours: transformers' default
        "decoder_sparse_step": cfg.moe_layer_step,
        "mlp_only_layers": list(cfg.dense_layers),
        "num_experts": cfg.num_experts,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_experts_per_tok": cfg.top_k,
        "norm_topk_prob": cfg.norm_topk_prob,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "rms_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "hidden_act": "silu",
        "attention_bias": False,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
    }


def _deepseek_v3_json(cfg: MoEConfig) -> dict[str, Any]:
    """DeepSeek-V3's config.json (hub style) of ``cfg``: MLA, the sigmoid group-limited router, shared experts,
    the first ``num_dense_layers`` dense, YaRN as ``rope_scaling``, ``mtp_layers`` MTP modules."""
    _express("deepseek_v3", cfg, router_scoring="sigmoid", moe_layer_step=1, dense_layers=())
    if cfg.num_shared_experts < 1:  # transformers builds the shared MLP unconditionally
        raise HFConfigError("deepseek_v3 cannot express MoEConfig.num_shared_experts = 0 (at least 1)")
    rope = RopeConfig.from_moe_config(cfg)
    scaling, max_positions = None, 4096  # plain RoPE: transformers' default context
    if rope.rope_type == "yarn":
        scaling = {
            "type": "yarn",
            "factor": rope.factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
            "beta_fast": rope.beta_fast,
            "beta_slow": rope.beta_slow,
        }
        extra = {
            "mscale": rope.mscale,
            "mscale_all_dim": rope.mscale_all_dim,
            "attention_factor": rope.attention_factor,
        }
        scaling.update({k: v for k, v in extra.items() if v is not None})
        if not rope.truncate:
            scaling["truncate"] = False
        # the stretched context (V3: 40 x 4096 = 163840); transformers warns when it is anything else
        max_positions = round(rope.factor * rope.original_max_position_embeddings)
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.dense_intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_nextn_predict_layers": cfg.mtp_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads,
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": scaling,
        "rope_interleave": cfg.rope_interleave,
        "max_position_embeddings": max_positions,
        "first_k_dense_replace": cfg.num_dense_layers,
        "moe_layer_freq": 1,
        "n_routed_experts": cfg.num_experts,
        "n_shared_experts": cfg.num_shared_experts,
        "num_experts_per_tok": cfg.top_k,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.route_scale,
        "rms_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
    }


@dataclass(frozen=True, slots=True)
class HFArchitecture:
    """A published architecture: its config.json read into a :class:`MoEConfig` and written back."""

    attention: str
    """The :attr:`MoEConfig.attention` that makes a config this architecture (when writing)."""
    read: Callable[[Mapping[str, Any]], MoEConfig]
    write: Callable[[MoEConfig], dict[str, Any]]


HF_CONFIGS: Mapping[str, HFArchitecture] = MappingProxyType(
    {
        "qwen3_moe": HFArchitecture("gqa-qk-norm", _qwen3_moe, _qwen3_moe_json),
        "deepseek_v3": HFArchitecture("mla", _deepseek_v3, _deepseek_v3_json),
    }
)
"""config.json readers and writers by ``model_type``."""


def quantization_block(raw: Mapping[str, Any]) -> tuple[int, int] | None:
    """The ``weight_block_size`` of a config.json's FP8 block quantization (None: not quantized); any other
    ``quantization_config`` is an :class:`HFConfigError`."""
    q = raw.get("quantization_config")
    if not q:
        return None
    method, fmt = q.get("quant_method"), q.get("fmt", "e4m3")
    if method != "fp8" or fmt != "e4m3":
        raise HFConfigError(
            f"quantization_config: quant_method {method!r} fmt {fmt!r} is not supported (fp8 e4m3 only)"
        )
    block = q.get("weight_block_size", [128, 128])  # transformers' default, DeepSeek-V3's blocks
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise HFConfigError(f"quantization_config.weight_block_size = {block!r}: two positive block sizes")
    return int(block[0]), int(block[1])


def _written(cfg: MoEConfig) -> dict[str, Any]:
    """``cfg``'s config.json in the architecture its attention makes it, written afresh."""
    found = [(name, arch) for name, arch in HF_CONFIGS.items() if arch.attention == cfg.attention]
    if not found:
        known = ", ".join(f"{name} ({arch.attention!r})" for name, arch in HF_CONFIGS.items())
        raise HFConfigError(f"MoEConfig.attention = {cfg.attention!r}: no published architecture has it; {known} do")
    return found[0][1].write(cfg)


def to_hf_config(
    cfg: MoEConfig, *, dtype: str | None = None, source: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The config.json of ``cfg`` in the architecture its attention makes it (:data:`HF_CONFIGS`), with
    ``torch_dtype`` when given; :func:`from_hf_config` reads it back to ``cfg`` (fields that shape training
    only aside).

    ``source``: the config.json the model was read from. The result is then that file with only what differs
    between it and ``cfg`` changed (a ``[model]`` override: ``vocab_size``, ``num_hidden_layers``...), every
    other key kept verbatim, those we do not model too (``max_position_embeddings``, ``bos_token_id``), in the
    source's spelling (``num_local_experts``, ``rope_parameters``, ``dtype``); ``quantization_config`` is
    dropped (the weights are written dequantized). A source of another architecture is ignored."""
    raw = _written(cfg)
    if source is not None and source.get("model_type") == raw["model_type"]:
        return _onto(source, cfg, raw, dtype)
    if dtype is not None:
        raw["torch_dtype"] = dtype
    return raw


_SPELLINGS = {"num_experts": "num_local_experts"}
"""Hub-style keys :func:`to_hf_config` writes -> how transformers 5.x spells them (both are read)."""


def _as_read(raw: Mapping[str, Any], cfg: MoEConfig) -> MoEConfig:
    """``raw`` read as :func:`read_hf_config` read it for ``cfg``'s tensors: MTP modules the config.json names
    but the tensors lack (transformers writes ``num_nextn_predict_layers`` = 1 always) are not there."""
    read = from_hf_config(raw)
    return read.replace(mtp_layers=0) if read.mtp_layers and not cfg.mtp_layers else read


def _onto(source: Mapping[str, Any], cfg: MoEConfig, written: dict[str, Any], dtype: str | None) -> dict[str, Any]:
    """``source`` with the keys where ``cfg`` differs from it set (see :func:`to_hf_config`)."""
    before = _written(_as_read(source, cfg))
    out = json.loads(json.dumps(dict(source)))  # a deep copy: nested dicts (rope_parameters) may change
    out.pop("quantization_config", None)
    for key, value in written.items():
        if value == before.get(key):
            continue
        if key == "rope_theta" and "rope_theta" in (out.get("rope_parameters") or {}):
            out["rope_parameters"]["rope_theta"] = value
        elif key not in out and _SPELLINGS.get(key) in out:
            out[_SPELLINGS[key]] = value
        else:
            out[key] = value
    if dtype is not None:
        for key in [k for k in ("torch_dtype", "dtype") if k in out] or ["torch_dtype"]:
            out[key] = dtype
    if _written(_as_read(out, cfg)) != written:  # a change the source's spelling hides (another rope style)
        differs = sorted(k for k, v in _written(_as_read(out, cfg)).items() if written.get(k) != v)
        raise HFConfigError(f"cannot write {', '.join(differs)} into the source's config.json as it spells them")
    return out


def from_hf_config(raw: Mapping[str, Any]) -> MoEConfig:
    """The :class:`MoEConfig` of a config.json's contents."""
    model_type = raw.get("model_type")
    arch = HF_CONFIGS.get(model_type)  # type: ignore[arg-type]
    if arch is None:
        raise HFConfigError(f"model_type {model_type!r} is not supported; supported: {', '.join(HF_CONFIGS)}")
    quantization_block(raw)  # FP8 weights dequantize on load; any other quantization is refused here
    try:
        return arch.read(raw)
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


def weight_map(path: Path) -> dict[str, str] | None:
    """Tensor name -> file of a checkpoint directory: its ``model.safetensors.index.json``, or the names in the
    header of its one ``model.safetensors`` (read without the safetensors package); None when it has neither."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return dict(json.loads(index.read_text())["weight_map"])
    single = path / "model.safetensors"
    if not single.exists():
        return None
    with single.open("rb") as f:  # the format's header: 8 bytes of length, then JSON keyed by tensor name
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {name: single.name for name in header if name != "__metadata__"}


def _holds_layer(path: Path, layer: int) -> bool:
    """Whether a checkpoint directory's tensors include layer ``layer``; True when it holds no tensors to look at
    (a config.json alone)."""
    where = weight_map(path)
    return where is None or any(k.startswith(f"model.layers.{layer}.") for k in where)

"""What a block is made of: the config (:mod:`.config`), layers (:mod:`.layers`), the router and its balance
losses (:mod:`.router`), the grouped experts (:mod:`.experts`), the block with its four sub-stages
(:mod:`.block`), the pipeline stage (:mod:`.stage`), the single-process model and the LM loss (:mod:`.model`,
:mod:`.loss`), DeepSeek-V3's multi-token prediction (:mod:`.mtp`); the published architectures' parts: rotary
embeddings (:mod:`.rope`), DeepSeek-V3's multi-head latent attention (:mod:`.mla`), Qwen3-MoE's attention
(:mod:`.qwen3_moe`); and the one registry of attention variants a block can hold (:data:`ATTENTIONS`, named by
``MoEConfig.attention``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from torch import nn

from moe.models.layers import Attention
from moe.models.mla import MLAttention
from moe.models.qwen3_moe import Qwen3Attention
from moe.models.rope import RopeConfig

if TYPE_CHECKING:
    from moe.models.config import MoEConfig

__all__ = ["ATTENTIONS", "build_attention"]


def _gqa(cfg: MoEConfig) -> nn.Module:
    return Attention(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.attn_head_dim, cfg.rope_theta)


def _gqa_qk_norm(cfg: MoEConfig) -> nn.Module:
    return Qwen3Attention(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.attn_head_dim,
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
    )


def _mla(cfg: MoEConfig) -> nn.Module:
    return MLAttention(
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope=RopeConfig.from_moe_config(cfg),
        rope_interleave=cfg.rope_interleave,
    )


ATTENTIONS: Mapping[str, Callable[[MoEConfig], nn.Module]] = MappingProxyType(
    {
        "gqa": _gqa,  # grouped-query attention with rotary positions (our blocks)
        "gqa-qk-norm": _gqa_qk_norm,  # Qwen3: per-head RMSNorm on q and k before the rotary embedding
        "mla": _mla,  # DeepSeek-V3: multi-head latent attention, rotary (plain or YaRN) on a decoupled key
    }
)
"""Attention variants by ``MoEConfig.attention``: each builds the module a block's ``attn`` holds."""


def build_attention(cfg: MoEConfig) -> nn.Module:
    """The attention module ``cfg.attention`` names (``[B, S, D] -> [B, S, D]``, causal)."""
    return ATTENTIONS[cfg.attention](cfg)

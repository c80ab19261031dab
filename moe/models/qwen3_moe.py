"""Qwen3-MoE as published: attention with a per-head RMSNorm on q and k (its softmax top-k router is
:class:`moe.models.router.Router` with ``router_scoring="softmax"``, and its Switch-style load-balancing loss
:func:`moe.models.router.load_balancing_loss`).

Legend for shape suffixes: B batch, S sequence, D hidden, H query heads, G key/value heads, C head dim,
P rotary pairs (C/2), T tokens (B*S), E experts, K top-k.

Attribute names are the checkpoint's (``model.layers.N.self_attn.{q,k,v,o}_proj.weight``,
``...self_attn.{q,k}_norm.weight``), so state-dict keys map 1:1. The oracle is transformers'
``Qwen3MoeAttention``, ``Qwen3MoeTopKRouter`` and ``load_balancing_loss_func`` (tests/moe/models/test_qwen3_moe.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moe.models.layers import Linear, RMSNorm, project_attention
from moe.models.rope import RopeConfig, apply_rotary, hf_field, rotary_cos_sin

__all__ = ["Qwen3Attention"]


class Qwen3Attention(nn.Module):
    """Causal grouped-query attention; q and k are RMS-normed per head (over C) before the rotary embedding.

    Arguments are named as in config.json. ``head_dim`` is its own field (Qwen3-MoE-30B-A3B: hidden 2048,
    32 heads, head_dim 128), not ``hidden_size // num_attention_heads``. Plain RoPE in the half-split layout.
    """

    def __init__(
        self,
        *,
        hidden_size: int,
        num_attention_heads: int,
        num_key_value_heads: int,
        head_dim: int,
        rope_theta: float,
        rms_norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        if num_attention_heads % num_key_value_heads:
            raise ValueError(f"{num_attention_heads} query heads do not share {num_key_value_heads} kv heads evenly")
        self.num_heads, self.num_kv_heads, self.head_dim = num_attention_heads, num_key_value_heads, head_dim
        self.q_proj = Linear(hidden_size, num_attention_heads * head_dim)
        self.k_proj = Linear(hidden_size, num_key_value_heads * head_dim)
        self.v_proj = Linear(hidden_size, num_key_value_heads * head_dim)
        self.o_proj = Linear(num_attention_heads * head_dim, hidden_size)
        self.q_norm = RMSNorm(head_dim, rms_norm_eps)
        self.k_norm = RMSNorm(head_dim, rms_norm_eps)
        self.register_buffer("inv_freq", RopeConfig(theta=rope_theta).inv_freq(head_dim), persistent=False)

    @classmethod
    def from_hf_config(cls, config: Any) -> Qwen3Attention:
        """From a Qwen3-MoE config.json dict or config object (hub or transformers 5.x rope style).

        Refuses what this module does not implement: attention biases, sliding windows and scaled RoPE
        (every published Qwen3-MoE checkpoint has none of them).
        """
        if hf_field(config, "attention_bias", False):
            raise ValueError("attention_bias=True is not supported (moe.models.layers.Linear has no bias)")
        if hf_field(config, "use_sliding_window", False):
            raise ValueError("use_sliding_window=True is not supported")
        rope = RopeConfig.from_hf_config(config)
        if rope.rope_type != "default":
            raise ValueError(f"rope_type {rope.rope_type!r} is not supported by Qwen3Attention (plain RoPE only)")
        hidden, heads = hf_field(config, "hidden_size"), hf_field(config, "num_attention_heads")
        return cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=hf_field(config, "num_key_value_heads") or heads,
            head_dim=hf_field(config, "head_dim") or hidden // heads,
            rope_theta=rope.theta,
            rms_norm_eps=hf_field(config, "rms_norm_eps", 1e-6),
        )

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """``[B, S, D] -> [B, S, D]``, positions ``0..S-1``."""
        b, s, _ = x_BSD.shape
        q_BSHC = self.q_norm(self.q_proj(x_BSD).view(b, s, self.num_heads, self.head_dim))
        k_BSGC = self.k_norm(self.k_proj(x_BSD).view(b, s, self.num_kv_heads, self.head_dim))
        v_BSGC = self.v_proj(x_BSD).view(b, s, self.num_kv_heads, self.head_dim)
        cos_SP, sin_SP = rotary_cos_sin(self.inv_freq, torch.arange(s, device=x_BSD.device))
        q_BSHC = apply_rotary(q_BSHC, cos_SP, sin_SP, interleave=False)
        k_BSGC = apply_rotary(k_BSGC, cos_SP, sin_SP, interleave=False)
        return project_attention(self.o_proj, q_BSHC, k_BSGC, v_BSGC)  # scale head_dim ** -0.5, the published one

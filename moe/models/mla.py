"""DeepSeek-V3's multi-head latent attention (MLA; DeepSeek-V2 report §2.1, V3 report §2.1.1).

Legend for shape suffixes: B batch, S sequence, D hidden, H heads, Q query latent (q_lora_rank),
L key/value latent (kv_lora_rank), N per-head dims without position (qk_nope_head_dim), R rotary dims
(qk_rope_head_dim), C = N + R query/key head dim, V value head dim, W = max(C, V) the head dim SDPA runs at.

Keys and values come from one small latent per token, ``c_kv = norm(x W_kv_a)`` (L wide), expanded per head
by ``kv_b_proj``; positions enter through a separate R-wide rotary key computed once per token and shared by
all heads (the "decoupled" RoPE key, MQA-style). Queries optionally go through their own latent (Q wide).

SDPA runs with one head dim W for q, k and v (:func:`sdpa_head_dim`): the narrower side is padded with zero
columns and the output sliced back to V. torch's FlashAttention kernel (CUDA) and the CPU's fused kernel take
q, k and v of one last dim only (``check_head_dim_size_flash`` in ATen's ``sdp_utils``: "Flash attention
requires q,k,v to have the same last dimension"); with DeepSeek-V3's C = 192, V = 128, SDPA would otherwise
fall back to the memory-efficient kernel on CUDA and to the math path on the CPU, which materialises the
``S x S`` scores. The padding is exact: a zero value column gives a zero output column and leaves the other
columns' weighted sums alone, zero query/key columns add nothing to q.k, and the softmax scale is set
explicitly from C. It costs PV (and its backward) at W instead of V: for DeepSeek-V3 a quarter more attention
FLOPs (about 2% of a layer's), against a fused kernel for the whole of it; and SDPA keeps its output W wide,
which ``o_proj`` reads as a strided view (no copy kept), while v, padded, is W wide instead of a view of
``kv_b_proj``'s N + V wide output: for DeepSeek-V3 the two even out (under selective recompute, which drops
v, the output's extra columns remain). cuDNN's kernel, which recent torch
releases prefer on sm_90 and sm_100, takes V != C as well; the padding runs everywhere, so that one module
keeps one set of tensors whatever kernel a machine picks.

Attribute names are the checkpoint's (``model.layers.{i}.self_attn.<name>.weight``), so a hub state dict
loads 1:1. Every matmul is a :class:`moe.models.layers.Linear` (deferrable weight gradient).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moe.models.layers import Linear, RMSNorm, project_attention, recompute, release
from moe.models.rope import RopeConfig, apply_rotary, hf_field, rotary_cos_sin

__all__ = ["LATENT_NORM_EPS", "MLAttention", "sdpa_head_dim"]

# The latent norms (q_a_layernorm, kv_a_layernorm) use 1e-6 whatever config.rms_norm_eps says: DeepSeek's
# reference code, its hub modeling file and transformers all build them with the norm's default eps.
LATENT_NORM_EPS = 1e-6


def sdpa_head_dim(qk_head_dim: int, v_head_dim: int) -> int:
    """The one head dim W that MLA hands SDPA q, k and v at: the wider of C and V (the module docstring)."""
    return max(qk_head_dim, v_head_dim)


class MLAttention(nn.Module):
    """Causal multi-head latent attention ``[B, S, D] -> [B, S, D]``, positions ``0..S-1``.

    Weights (``[out, in]``, no bias): ``q_proj`` ``[H*C, D]`` when ``q_lora_rank`` is None, else ``q_a_proj``
    ``[Q, D]``, ``q_a_layernorm`` ``[Q]``, ``q_b_proj`` ``[H*C, Q]``; ``kv_a_proj_with_mqa`` ``[L+R, D]``,
    ``kv_a_layernorm`` ``[L]``, ``kv_b_proj`` ``[H*(N+V), L]``; ``o_proj`` ``[D, H*V]``.
    """

    selective_recompute: bool = False
    """Recompute :meth:`up_project` in backward (from the latents it keeps) instead of keeping the per-head q,
    k, v and what the latent norms save (:func:`moe.models.layers.selective_recompute`)."""

    def __init__(
        self,
        *,
        hidden_size: int,
        num_attention_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        rope: RopeConfig,
        rope_interleave: bool = True,
        latent_norm_eps: float = LATENT_NORM_EPS,
    ) -> None:
        super().__init__()
        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even (rotary pairs), got {qk_rope_head_dim}")
        self.num_heads = num_attention_heads
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.sdpa_head_dim = sdpa_head_dim(self.qk_head_dim, v_head_dim)
        self.rope, self.rope_interleave = rope, rope_interleave
        h, c = num_attention_heads, self.qk_head_dim

        if q_lora_rank is None:
            self.q_proj = Linear(hidden_size, h * c)
        else:
            self.q_a_proj = Linear(hidden_size, q_lora_rank)
            self.q_a_layernorm = RMSNorm(q_lora_rank, latent_norm_eps)
            self.q_b_proj = Linear(q_lora_rank, h * c)
        # One projection makes the KV latent and the shared rotary key: "with_mqa".
        self.kv_a_proj_with_mqa = Linear(hidden_size, kv_lora_rank + qk_rope_head_dim)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, latent_norm_eps)
        self.kv_b_proj = Linear(kv_lora_rank, h * (qk_nope_head_dim + v_head_dim))
        self.o_proj = Linear(h * v_head_dim, hidden_size)

        self.softmax_scale = self.qk_head_dim**-0.5 * rope.softmax_mscale()
        self.cos_sin_scale = rope.cos_sin_scale()

    @classmethod
    def from_config(cls, config: Any) -> MLAttention:
        """Build from a Hugging Face DeepSeek-V3 config (config.json dict or object; either rope style).
        ``rms_norm_eps`` is not read: it is the block norms' eps, not the latent norms' (``LATENT_NORM_EPS``)."""
        if hf_field(config, "attention_bias", False):
            raise ValueError("attention_bias=True is not supported (DeepSeek-V3 has no attention biases)")
        heads = hf_field(config, "num_attention_heads")
        kv_heads = hf_field(config, "num_key_value_heads") or heads
        if kv_heads != heads:
            raise ValueError(f"MLA expands the latent to every head: num_key_value_heads {kv_heads} != {heads}")
        interleave = hf_field(config, "rope_interleave")
        return cls(
            hidden_size=hf_field(config, "hidden_size"),
            num_attention_heads=heads,
            q_lora_rank=hf_field(config, "q_lora_rank"),
            kv_lora_rank=hf_field(config, "kv_lora_rank"),
            qk_nope_head_dim=hf_field(config, "qk_nope_head_dim"),
            qk_rope_head_dim=hf_field(config, "qk_rope_head_dim"),
            v_head_dim=hf_field(config, "v_head_dim"),
            rope=RopeConfig.from_hf_config(config),
            # transformers' default; the hub config.json of DeepSeek-V3 does not name it.
            rope_interleave=True if interleave is None else bool(interleave),
        )

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """``x_BSD -> out_BSD``; the first token of every sequence is position 0."""
        # The latents (or, without a query latent, the full queries) and the shared rotary key: kept for backward.
        q_in_BSX = self.q_proj(x_BSD) if self.q_lora_rank is None else self.q_a_proj(x_BSD)
        c_kv_BSL, k_rope_BSR = self.kv_a_proj_with_mqa(x_BSD).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        if self.selective_recompute:
            q_BSHW, k_BSHW, v_BSHW = recompute(self.up_project, q_in_BSX, c_kv_BSL, k_rope_BSR)
        else:
            q_BSHW, k_BSHW, v_BSHW = self.up_project(q_in_BSX, c_kv_BSL, k_rope_BSR)
        # One head dim W for q, k and v: a fused kernel (the module docstring); o_proj reads the first V columns
        # of each head as a view of SDPA's output (which SDPA keeps anyway), not a copy; with FP8 caching both
        # read one E5M6 copy instead (moe.models.layers.project_attention).
        out_BSD = project_attention(self.o_proj, q_BSHW, k_BSHW, v_BSHW, self.softmax_scale, self.v_head_dim)
        # Selective recompute: the attention's saved q, k, v are refilled from the latents in its backward.
        release((q_BSHW, k_BSHW, v_BSHW), after=out_BSD)
        return out_BSD

    def up_project(
        self, q_in_BSX: torch.Tensor, c_kv_BSL: torch.Tensor, k_rope_BSR: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-head ``q``, ``k`` and ``v``, each ``[B, S, H, W]`` (zero columns after the C query/key dims or the V
        value dims: the module docstring), from the query latent (``[B, S, Q]``; the queries themselves
        ``[B, S, H*C]`` without one), the key/value latent and the rotary key: the latent norms, ``q_b_proj`` and
        ``kv_b_proj``, the rotary embedding. What selective recompute runs again in backward instead of keeping
        its outputs."""
        b, s, _ = q_in_BSX.shape
        h, n, r, v = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        w = self.sdpa_head_dim
        q_BSX = q_in_BSX if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm.normalize(q_in_BSX))
        q_nope_BSHN, q_rope_BSHR = q_BSX.view(b, s, h, n + r).split([n, r], dim=-1)
        kv_BSHX = self.kv_b_proj(self.kv_a_layernorm.normalize(c_kv_BSL)).view(b, s, h, n + v)
        k_nope_BSHN, v_BSHV = kv_BSHX.split([n, v], dim=-1)

        # The frequencies are recomputed (R/2 numbers), not kept as a buffer: ``module.to(bf16)`` would round a
        # buffer, and bf16 angles are off by whole turns at long positions.
        inv_freq_P = self.rope.inv_freq(r, device=q_in_BSX.device)
        positions_S = torch.arange(s, device=q_in_BSX.device)
        cos_SP, sin_SP = rotary_cos_sin(inv_freq_P, positions_S, self.cos_sin_scale)
        q_rope_BSHR = apply_rotary(q_rope_BSHR, cos_SP, sin_SP, interleave=self.rope_interleave)
        k_rope_BS1R = apply_rotary(k_rope_BSR[:, :, None, :], cos_SP, sin_SP, interleave=self.rope_interleave)

        # q and k are assembled by one concatenation each, their zero columns included (V > C); v is copied into
        # its padded width (V < C), or stays a view of kv_b_proj's output (V == W).
        qk_pad = [q_nope_BSHN.new_zeros(b, s, h, w - n - r)] if w > n + r else []
        q_BSHW = torch.cat([q_nope_BSHN, q_rope_BSHR, *qk_pad], dim=-1)
        k_BSHW = torch.cat([k_nope_BSHN, k_rope_BS1R.expand(b, s, h, r), *qk_pad], dim=-1)
        v_BSHW = F.pad(v_BSHV, (0, w - v)) if w > v else v_BSHV
        return q_BSHW, k_BSHW, v_BSHW

    def extra_repr(self) -> str:
        return (
            f"heads={self.num_heads}, q_lora_rank={self.q_lora_rank}, kv_lora_rank={self.kv_lora_rank}, "
            f"qk_nope={self.qk_nope_head_dim}, qk_rope={self.qk_rope_head_dim}, v={self.v_head_dim}, "
            f"sdpa_head_dim={self.sdpa_head_dim}, rope={self.rope.rope_type}, interleave={self.rope_interleave}, "
            f"softmax_scale={self.softmax_scale:.6g}"
        )

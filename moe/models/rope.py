"""Rotary position embeddings as the published checkpoints expect them: plain RoPE and YaRN.

Legend for shape suffixes: B batch, S sequence, H heads, R rotary dims of a head, P rotary pairs (R/2).

A rotation turns each pair of a head's rotary dims by ``position * inv_freq[pair]``. Two pair layouts exist:
half-split (pair i is dims ``(i, i + R/2)``, Llama/Qwen, transformers' ``rotate_half``) and interleaved
(pair i is dims ``(2i, 2i + 1)``, DeepSeek's ``rope_interleave``). Both come out in half-split order (the
rotated first members, then the rotated second members), as transformers writes them: q and k go through
the same permutation, so ``q·k`` is what the interleaved original gives.

YaRN (https://arxiv.org/abs/2309.00071) changes three numbers: the inverse frequencies (interpolated by
``factor`` for low frequencies, kept for high ones, a linear ramp between), cos/sin scaled by the
``attention_factor``, and, DeepSeek's rule, the softmax scale times ``yarn_mscale(factor, mscale_all_dim)**2``
(:meth:`RopeConfig.softmax_mscale`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["RopeConfig", "apply_rotary", "hf_field", "rotary_cos_sin", "yarn_mscale"]

_ROPE_TYPES = ("default", "yarn")

# RopeConfig field -> (MoEConfig field, its type): flat and ``rope_``-prefixed there; read by both directions.
_MOE_FIELDS: dict[str, tuple[str, type]] = {
    "theta": ("rope_theta", float),
    "rope_type": ("rope_type", str),
    "factor": ("rope_factor", float),
    "original_max_position_embeddings": ("rope_original_max_position_embeddings", int),
    "beta_fast": ("rope_beta_fast", float),
    "beta_slow": ("rope_beta_slow", float),
    "mscale": ("rope_mscale", float),
    "mscale_all_dim": ("rope_mscale_all_dim", float),
    "attention_factor": ("rope_attention_factor", float),
    "truncate": ("rope_truncate", bool),
}


def hf_field(config: Any, name: str, default: Any = None) -> Any:
    """One field of a Hugging Face config: a config.json dict or any object with the fields as attributes."""
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when the context is not stretched)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(kw_only=True, slots=True)
class RopeConfig:
    """The rotary parameters of a checkpoint; names as Hugging Face's ``rope_parameters`` spells them, except
    ``theta`` (``rope_theta``)."""

    theta: float = 10000.0
    """Base wavelength: pair i turns by ``theta ** (-2i / R)`` per position."""
    rope_type: str = "default"
    """``"default"`` (plain RoPE) or ``"yarn"``."""
    factor: float | None = None
    """YaRN: how many times the pre-training context is stretched."""
    original_max_position_embeddings: int | None = None
    """YaRN: the pre-training context length."""
    beta_fast: float = 32.0
    """YaRN: pairs turning more than this many times over the original context keep their frequency."""
    beta_slow: float = 1.0
    """YaRN: pairs turning fewer than this many times are interpolated by ``factor``; a ramp in between."""
    mscale: float | None = None
    """YaRN: numerator ``mscale`` of the cos/sin attention factor (with ``mscale_all_dim``)."""
    mscale_all_dim: float | None = None
    """YaRN: denominator ``mscale`` of the cos/sin factor, and DeepSeek's softmax-scale correction."""
    attention_factor: float | None = None
    """YaRN: cos/sin scale; None infers it from ``factor``, ``mscale`` and ``mscale_all_dim``."""
    truncate: bool = True
    """YaRN: round the ramp's ends to whole dims."""

    def __post_init__(self) -> None:
        if self.rope_type not in _ROPE_TYPES:
            raise ValueError(f"rope_type {self.rope_type!r} is not supported (one of {_ROPE_TYPES})")
        if self.rope_type == "yarn" and (self.factor is None or self.original_max_position_embeddings is None):
            raise ValueError("yarn needs factor and original_max_position_embeddings")

    @classmethod
    def from_hf_config(cls, config: Any) -> RopeConfig:
        """Read either config style: the hub's ``rope_theta`` + ``rope_scaling`` (rope type under ``"type"`` or
        ``"rope_type"``), or transformers 5.x ``rope_parameters`` (theta inside, as ``rope_theta``). ``config``
        is a config.json dict or a config object (5.x objects hold both; ``rope_parameters`` wins)."""
        params = dict(hf_field(config, "rope_parameters") or hf_field(config, "rope_scaling") or {})
        theta = params.get("rope_theta", hf_field(config, "rope_theta"))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "yarn":
            return cls(theta=10000.0 if theta is None else theta, rope_type=rope_type)
        # As transformers: the pre-training length defaults to max_position_embeddings, factor to the ratio.
        max_pos = hf_field(config, "max_position_embeddings")
        original = params.get("original_max_position_embeddings") or max_pos
        factor = params.get("factor")
        if factor is None and original:
            factor = max_pos / original
        return cls(
            theta=10000.0 if theta is None else theta,
            rope_type=rope_type,
            factor=factor,
            original_max_position_embeddings=original,
            # transformers reads these with ``or``: a 0 means the default too.
            beta_fast=params.get("beta_fast") or 32.0,
            beta_slow=params.get("beta_slow") or 1.0,
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=params.get("truncate", True),
        )

    @classmethod
    def from_moe_config(cls, cfg: Any) -> RopeConfig:
        """The rotary parameters of a :class:`moe.models.config.MoEConfig` (``rope_theta``, ``rope_*``)."""
        return cls(**{ours: getattr(cfg, theirs) for ours, (theirs, _) in _MOE_FIELDS.items()})

    def moe_config_fields(self) -> dict[str, Any]:
        """These parameters as :class:`moe.models.config.MoEConfig` keyword arguments of its types (config.json's
        ``40`` becomes ``40.0``), the inverse of :meth:`from_moe_config`."""
        fields = {}
        for ours, (theirs, kind) in _MOE_FIELDS.items():
            value = getattr(self, ours)
            fields[theirs] = value if value is None else kind(value)
        return fields

    def cos_sin_scale(self) -> float:
        """The factor on cos and sin (YaRN's ``attention_factor``; 1 for plain RoPE)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    def softmax_mscale(self) -> float:
        """The factor on the softmax scale ``qk_head_dim ** -0.5``: DeepSeek's ``yarn_mscale(factor,
        mscale_all_dim) ** 2`` under YaRN with a non-zero ``mscale_all_dim``, else 1."""
        if self.rope_type == "default" or not self.mscale_all_dim:
            return 1.0
        m = yarn_mscale(self.factor, self.mscale_all_dim)
        return m * m

    def inv_freq(self, dim: int, device: torch.device | str | None = None) -> torch.Tensor:
        """``[dim/2]`` fp32 inverse frequencies for a rotary width of ``dim``."""
        # theta ** (-2i/dim), in fp32 the way the checkpoints' reference code computes it.
        wavelength_P = self.theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
        kept_P = 1.0 / wavelength_P
        if self.rope_type == "default":
            return kept_P
        interpolated_P = 1.0 / (self.factor * wavelength_P)
        low, high = self._ramp_range(dim)
        if low == high:
            high += 0.001  # a one-point ramp would divide by zero
        ramp_P = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        # Pairs below the ramp (high frequencies) keep their frequency; above it they are interpolated.
        keep_P = 1 - ramp_P
        return interpolated_P * (1 - keep_P) + kept_P * keep_P

    def _ramp_range(self, dim: int) -> tuple[float, float]:
        # The pair index whose wavelength fits ``rotations`` times into the pre-training context.
        def pair_for(rotations: float) -> float:
            turns = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return dim * math.log(turns) / (2 * math.log(self.theta))

        low, high = pair_for(self.beta_fast), pair_for(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, dim - 1)


def rotary_cos_sin(
    inv_freq_P: torch.Tensor, positions_S: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos_SP, sin_SP`` in fp32 for integer positions, times ``scale`` (YaRN's attention factor)."""
    angles_SP = positions_S.to(torch.float32)[:, None] * inv_freq_P.to(torch.float32)[None, :]
    return angles_SP.cos() * scale, angles_SP.sin() * scale


def apply_rotary(x_BSHR: torch.Tensor, cos_SP: torch.Tensor, sin_SP: torch.Tensor, *, interleave: bool) -> torch.Tensor:
    """Rotate the pairs of every head (computed in fp32, returned in ``x``'s dtype); ``interleave`` picks the
    input pair layout, the output is half-split (module docstring)."""
    xf = x_BSHR.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = xf.chunk(2, dim=-1)
    cos, sin = cos_SP[None, :, None, :], sin_SP[None, :, None, :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x_BSHR.dtype)

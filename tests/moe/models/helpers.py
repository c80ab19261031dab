"""Shared by the parity tests against transformers."""

from __future__ import annotations

import torch
from torch import nn


def large_random_weights(model: nn.Module, seed: int = 0) -> None:
    """Weights large enough that a missing feature moves the logits far beyond the tolerance (DESIGN.md: with
    the default small init, switching a feature off moves the loss by only 1e-4..1e-3): matrices N(0, 1/in),
    norm weights 1 + 0.3 N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.3 * noise if name.endswith("norm.weight") else noise / p.shape[-1] ** 0.5)

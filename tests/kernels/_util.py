"""Comparison helpers shared by the kernel tests."""

from __future__ import annotations

import torch

# Relative-norm error bounds ||out - ref|| / ||ref|| per dtype of the kernel's inputs and outputs. fp32
# lands far under 1e-5 (only the summation order differs); fp16 and bf16 outputs are rounded to 11 and 8
# significant bits (relative 2**-11 ~ 5e-4 and 2**-8 ~ 4e-3 per element).
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (0 when both are empty)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    denom = ref64.norm().item()
    diff = (out64 - ref64).norm().item()
    return diff / denom if denom > 0 else diff


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """Same shape and dtype, all finite, relative-norm error within the dtype's bound."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == ref.dtype, (out.dtype, ref.dtype)
    assert torch.isfinite(out).all(), "non-finite values (an unwritten output?)"
    tol = REL_TOL[dtype or out.dtype]
    err = rel_err(out, ref)
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


def random_counts(num_experts: int, total: int, generator: torch.Generator, empty: int = 1) -> torch.Tensor:
    """[E] int64 group sizes summing to ``total`` with at least ``empty`` empty groups (when E > empty)."""
    weights = torch.rand(num_experts, generator=generator)
    weights[torch.randperm(num_experts, generator=generator)[:empty]] = 0.0
    cuts = torch.multinomial(weights, total, replacement=True, generator=generator)
    return torch.bincount(cuts, minlength=num_experts).to(torch.int64)

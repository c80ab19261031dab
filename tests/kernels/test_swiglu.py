"""Fused SwiGLU forward and backward through the Triton backend against the reference."""

from __future__ import annotations

import pytest
import torch

from kernels import functional, ops, reference
from tests.kernels._util import assert_close

pytestmark = pytest.mark.usefixtures("force_triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("rows", "inter"), [(7, 21), (16, 48), (1, 1)])
def test_swiglu_forward_backward(device, dtype, rows, inter):
    gen = torch.Generator().manual_seed(rows * inter)
    x_MF2 = (3 * torch.randn(rows, 2 * inter, generator=gen)).to(device, dtype)
    dy_MF = torch.randn(rows, inter, generator=gen).to(device, dtype)
    assert_close(ops.swiglu(x_MF2), reference.swiglu(x_MF2))
    assert_close(ops.swiglu_backward(dy_MF, x_MF2), reference.swiglu_backward(dy_MF, x_MF2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("rows", "inter"), [(7, 21), (9, 40), (1, 1)])
def test_scaled_swiglu_forward_backward(device, dtype, rows, inter):
    """Per-row routing weights (fp32) on the output; the scaled backward also returns their gradient."""
    gen = torch.Generator().manual_seed(rows + inter)
    x_MF2 = (3 * torch.randn(rows, 2 * inter, generator=gen)).to(device, dtype)
    dy_MF = torch.randn(rows, inter, generator=gen).to(device, dtype)
    scale_M = torch.rand(rows, generator=gen).to(device)
    assert_close(ops.swiglu(x_MF2, scale_M), reference.swiglu(x_MF2, scale_M))
    dx_MF2, dscale_M = ops.swiglu_scaled_backward(dy_MF, x_MF2, scale_M)
    ref_dx_MF2, ref_dscale_M = reference.swiglu_scaled_backward(dy_MF, x_MF2, scale_M)
    assert_close(dx_MF2, ref_dx_MF2)
    assert_close(dscale_M, ref_dscale_M, dtype)  # fp32 sums of products of dtype-rounded inputs


def test_scaled_swiglu_reference_is_autograd_of_the_formula():
    # fp64 autograd of scale * silu(gate) * up: an independent oracle of the reference's two gradients.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 2 * 11, generator=gen, dtype=torch.float64)
    dy = torch.randn(6, 11, generator=gen, dtype=torch.float64)
    s = torch.rand(6, generator=gen, dtype=torch.float64)
    dx, ds = reference.swiglu_scaled_backward(dy.float(), x.float(), s.float())
    x_auto, s_auto = x.clone().requires_grad_(), s.clone().requires_grad_()
    gate, up = x_auto.chunk(2, dim=-1)
    (torch.nn.functional.silu(gate) * up * s_auto[:, None]).backward(dy)
    assert_close(dx, x_auto.grad.float())
    assert_close(ds, s_auto.grad.float())


def test_functional_swiglu_grad_matches_autograd(device):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 2 * 19, generator=gen, dtype=torch.float64).to(device)
    dy = torch.randn(9, 19, generator=gen, dtype=torch.float64).to(device)
    x_triton = x.float().requires_grad_()
    functional.swiglu(x_triton).backward(dy.float())
    x_auto = x.clone().requires_grad_()  # fp64 autograd of the plain formula: an independent oracle
    gate, up = x_auto.chunk(2, dim=-1)
    (torch.nn.functional.silu(gate) * up).backward(dy)
    assert_close(x_triton.grad, x_auto.grad.float())


def test_launcher_rejects_odd_width(device):
    from kernels import triton_swiglu

    with pytest.raises(ValueError, match=r"\[M, 2F\]"):
        triton_swiglu.swiglu(torch.randn(4, 7, device=device))
    with pytest.raises(ValueError, match="dy"):
        triton_swiglu.swiglu_backward(torch.randn(4, 3, device=device), torch.randn(4, 8, device=device))
    with pytest.raises(ValueError, match="scale"):
        triton_swiglu.swiglu(torch.randn(4, 8, device=device), torch.rand(3, device=device))
    with pytest.raises(ValueError, match="scale"):
        triton_swiglu.swiglu_scaled_backward(
            torch.randn(4, 4, device=device), torch.randn(4, 8, device=device), torch.rand(5, device=device)
        )


def test_functional_swiglu_takes_leading_dims(device):
    # A dense MLP passes [B, S, 2F]; the Triton launcher takes [M, 2F], so the rows are flattened.
    x = torch.randn(2, 3, 2 * 5, device=device)
    y = functional.swiglu(x)
    assert y.shape == (2, 3, 5)
    assert_close(y, reference.swiglu(x))

"""Triton SwiGLU: y = silu(gate) * up with x = [gate | up], forward and backward.

Legend for shape suffixes: M rows, F intermediate size (x has 2F columns).

Elementwise and memory-bound: the forward reads 2F and writes F values per row, the backward reads
3F and writes 2F; the fused kernels touch each element exactly once, where the unfused torch graph
materialises sigmoid, silu and the products as separate tensors. Math runs in fp32.

The expert MLP applies each row's routing weight here (``scale``): the forward multiplies it in before
rounding, and the scaled backward returns the weight's gradient too, a dot product per row over the
recomputed SwiGLU output, so neither the expert output nor the SwiGLU output is kept for it. That kernel
walks a row block's F columns in one program (the dot product's sum stays in registers: no atomics).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kernels.registry import Specialization, dtype_name, int_class, register, register_aot

if TYPE_CHECKING:
    from kernels.warmup import KernelShapes

__all__ = ["swiglu", "swiglu_backward", "swiglu_scaled_backward"]


@triton.jit
def _tile(M, F, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    """Row / column indices and mask of this program's [BLOCK_M, BLOCK_F] tile of an [M, F] output."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < M)[:, None] & (cols < F)[None, :]
    return rows, cols, mask


@triton.jit
def _swiglu_fwd_kernel(
    x_ptr, y_ptr, scale_ptr, M, F, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr, SCALED: tl.constexpr
):
    rows, cols, mask = _tile(M, F, BLOCK_M, BLOCK_F)
    gate_ptr = x_ptr + rows[:, None] * (2 * F) + cols[None, :]
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + F, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    if SCALED:
        y *= tl.load(scale_ptr + rows, mask=rows < M, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + rows[:, None] * F + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _grad_tile(dy_ptr, x_ptr, dx_ptr, scale, rows, cols, mask, F):
    """One [rows, cols] tile of the SwiGLU backward with ``da = scale * dy`` (scale: [rows, 1] or 1.0): stores
    dx's gate and up halves, returns the tile's ``dy * silu(gate) * up`` for the scale's gradient."""
    offs = rows[:, None] * (2 * F) + cols[None, :]
    gate = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + offs + F, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows[:, None] * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    da = dy * scale
    # d silu(g) / dg = sig * (1 + g * (1 - sig))
    dgate = da * up * sig * (1.0 + gate * (1.0 - sig))
    tl.store(dx_ptr + offs, dgate.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + offs + F, (da * silu).to(dx_ptr.dtype.element_ty), mask=mask)
    return dy * silu * up


@triton.jit
def _swiglu_bwd_kernel(dy_ptr, x_ptr, dx_ptr, M, F, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr):
    rows, cols, mask = _tile(M, F, BLOCK_M, BLOCK_F)
    _grad_tile(dy_ptr, x_ptr, dx_ptr, 1.0, rows, cols, mask, F)


@triton.jit
def _swiglu_scaled_bwd_kernel(
    dy_ptr, x_ptr, scale_ptr, dx_ptr, dscale_ptr, M, F, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr
):
    """dx = swiglu_backward(scale * dy, x) and dscale = <dy, silu(gate) * up> per row, for BLOCK_M rows."""
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < M
    scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for f0 in range(0, F, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)
        mask = row_mask[:, None] & (cols < F)[None, :]
        dot += tl.sum(_grad_tile(dy_ptr, x_ptr, dx_ptr, scale[:, None], rows, cols, mask, F), axis=1)
    tl.store(dscale_ptr + rows, dot.to(dscale_ptr.dtype.element_ty), mask=row_mask)


def _blocks(device: torch.device, f: int) -> tuple[int, int]:
    """(rows, columns) per program."""
    if device.type != "cuda":
        return 4, 16
    # 8 rows x 512 columns at 4 warps: 32 elements per thread, 16-byte vectors for bf16.
    return 8, min(512, triton.next_power_of_2(f))


def _check_x(name: str, x_MF2: torch.Tensor) -> int:
    if x_MF2.dim() != 2 or not x_MF2.is_contiguous() or x_MF2.shape[1] % 2 != 0:
        raise ValueError(f"{name}: x must be a contiguous [M, 2F], got {tuple(x_MF2.shape)}")
    if not x_MF2.is_floating_point():
        raise ValueError(f"{name}: x must be floating point, got {x_MF2.dtype}")
    return x_MF2.shape[1] // 2


def _check_scale(name: str, scale_M: torch.Tensor, m: int, device: torch.device) -> None:
    if scale_M.shape != (m,) or not scale_M.is_contiguous() or scale_M.device != device:
        raise ValueError(f"{name}: scale {tuple(scale_M.shape)} must be a contiguous [{m}] on {device}")


# --- what the warm-up and kernels.aot need of these ops (kernels.registry.Specialization, register_aot) ---


def _swiglu_key(x_MF2: torch.Tensor, scale_M: torch.Tensor | None = None) -> tuple:
    scaled = "scaled" if scale_M is not None else "plain"  # a constexpr of the kernel: its own compile
    return (x_MF2.shape[1] // 2, dtype_name(x_MF2), int_class(x_MF2.shape[0]), scaled)


def _backward_key(dy_MF: torch.Tensor, x_MF2: torch.Tensor, scale_M: torch.Tensor | None = None) -> tuple:
    return (x_MF2.shape[1] // 2, dtype_name(x_MF2), int_class(x_MF2.shape[0]))


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _swiglu_meta(rows: int, x_MF2: torch.Tensor, scale_M: torch.Tensor | None = None) -> torch.Tensor:
    return _meta(x_MF2.shape[0], x_MF2.shape[1] // 2, dtype=x_MF2.dtype)


_FORWARD = Specialization(key=_swiglu_key, meta=_swiglu_meta)
_BACKWARD = Specialization(key=_backward_key, meta=lambda rows, dy_MF, x_MF2: _meta(*x_MF2.shape, dtype=x_MF2.dtype))
_SCALED_BACKWARD = Specialization(
    key=_backward_key,
    meta=lambda rows, dy_MF, x_MF2, scale_M: (
        _meta(*x_MF2.shape, dtype=x_MF2.dtype),
        _meta(*scale_M.shape, dtype=scale_M.dtype),
    ),
)


@register_aot
def _aot_specs(shapes: KernelShapes) -> list:
    """The SwiGLU kernels over the M = T x top-k routed rows of the expert MLP (F = expert_intermediate)."""
    from kernels.aot import KernelSpec, pointer_type

    m, f, dt = shapes.tokens * shapes.top_k, shapes.expert_intermediate, pointer_type(shapes.dtype)
    block_m, block_f = _blocks(torch.device("cuda"), f)  # only the device's type is read
    blocks, ints = {"BLOCK_M": block_m, "BLOCK_F": block_f}, {"M": m, "F": f}
    return [
        KernelSpec(name="swiglu forward", kernel=_swiglu_fwd_kernel,
                   pointers={"x_ptr": dt, "y_ptr": dt, "scale_ptr": None}, ints=ints,
                   constexprs={**blocks, "SCALED": False}),
        KernelSpec(name="swiglu forward, routing weights", kernel=_swiglu_fwd_kernel,
                   pointers={"x_ptr": dt, "y_ptr": dt, "scale_ptr": "fp32"}, ints=ints,
                   constexprs={**blocks, "SCALED": True}),
        KernelSpec(name="swiglu backward", kernel=_swiglu_bwd_kernel,
                   pointers={"dy_ptr": dt, "x_ptr": dt, "dx_ptr": dt}, ints=ints, constexprs=blocks),
        KernelSpec(name="swiglu backward, routing weights", kernel=_swiglu_scaled_bwd_kernel,
                   pointers={"dy_ptr": dt, "x_ptr": dt, "scale_ptr": "fp32", "dx_ptr": dt, "dscale_ptr": "fp32"},
                   ints=ints, constexprs=blocks),
    ]  # fmt: skip


@register("triton", specialization=_FORWARD)
def swiglu(x_MF2: torch.Tensor, scale_M: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up (times scale[m] per row when given): [M, 2F] contiguous -> [M, F] in x.dtype."""
    f = _check_x("swiglu", x_MF2)
    m = x_MF2.shape[0]
    if scale_M is not None:
        _check_scale("swiglu", scale_M, m, x_MF2.device)
    y_MF = torch.empty(m, f, dtype=x_MF2.dtype, device=x_MF2.device)
    if y_MF.numel() == 0:
        return y_MF
    block_m, block_f = _blocks(x_MF2.device, f)
    grid = (triton.cdiv(m, block_m), triton.cdiv(f, block_f))
    _swiglu_fwd_kernel[grid](x_MF2, y_MF, scale_M, m, f, BLOCK_M=block_m, BLOCK_F=block_f, SCALED=scale_M is not None)
    return y_MF


@register("triton", specialization=_BACKWARD)
def swiglu_backward(dy_MF: torch.Tensor, x_MF2: torch.Tensor) -> torch.Tensor:
    """Input gradient of :func:`swiglu`: dy [M, F], x [M, 2F] (both contiguous) -> dx [M, 2F] in x.dtype."""
    f = _check_x("swiglu_backward", x_MF2)
    m = x_MF2.shape[0]
    if dy_MF.shape != (m, f) or not dy_MF.is_contiguous() or dy_MF.device != x_MF2.device:
        raise ValueError(f"swiglu_backward: dy {tuple(dy_MF.shape)} must be a contiguous [{m}, {f}]")
    dx_MF2 = torch.empty_like(x_MF2)
    if dx_MF2.numel() == 0:
        return dx_MF2
    block_m, block_f = _blocks(x_MF2.device, f)
    grid = (triton.cdiv(m, block_m), triton.cdiv(f, block_f))
    _swiglu_bwd_kernel[grid](dy_MF, x_MF2, dx_MF2, m, f, BLOCK_M=block_m, BLOCK_F=block_f)
    return dx_MF2


@register("triton", specialization=_SCALED_BACKWARD)
def swiglu_scaled_backward(
    dy_MF: torch.Tensor, x_MF2: torch.Tensor, scale_M: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``swiglu(x, scale)``: dy [M, F], x [M, 2F], scale [M] (contiguous) -> (dx [M, 2F] in
    x.dtype, dscale [M] in scale.dtype)."""
    f = _check_x("swiglu_scaled_backward", x_MF2)
    m = x_MF2.shape[0]
    if dy_MF.shape != (m, f) or not dy_MF.is_contiguous() or dy_MF.device != x_MF2.device:
        raise ValueError(f"swiglu_scaled_backward: dy {tuple(dy_MF.shape)} must be a contiguous [{m}, {f}]")
    _check_scale("swiglu_scaled_backward", scale_M, m, x_MF2.device)
    dx_MF2 = torch.empty_like(x_MF2)
    dscale_M = torch.zeros_like(scale_M)  # F = 0 leaves every row's sum at 0
    if m == 0 or f == 0:
        return dx_MF2, dscale_M
    block_m, block_f = _blocks(x_MF2.device, f)
    _swiglu_scaled_bwd_kernel[(triton.cdiv(m, block_m),)](
        dy_MF, x_MF2, scale_M, dx_MF2, dscale_M, m, f, BLOCK_M=block_m, BLOCK_F=block_f
    )
    return dx_MF2, dscale_M

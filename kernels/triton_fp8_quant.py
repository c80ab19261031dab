"""Triton FP8 quantization in DeepSeek-V3's tiles: 1x128 and 128x128 (:func:`quantize_fp8`), 128x1 restarting
per expert (:func:`quantize_fp8_columns`), and the way back (:func:`dequantize_fp8`).

Legend for shape suffixes: M rows, K columns (the contraction of the GEMM that consumes them), E groups
(experts), I and J tile rows and tile columns, T tiles of 128 rows, C their stored rows (128 T).

The numerics are :mod:`kernels.reference_fp8`'s, bit for bit: a tile's scale is ``amax / 448`` divided in
IEEE float32 (``div_rn``: Triton's ``/`` is the approximate ``div.full.f32`` on CUDA), 1 for an all-zero tile;
an element is ``x / scale`` (the same division, not a multiplication by ``1 / scale``), clamped to
``[-448, 448]`` and rounded to the nearest E4M3 value, ties to even. On CUDA the rounding is the hardware's
``cvt.rn.satfinite.e4m3x2.f32``. Triton's interpreter gets that cast wrong (Triton 3.9's ``_convert_float``
drops the carry when the mantissa rounds up, 31.6 -> 16 instead of 32, and rounds ties away from zero), so
there the kernels round in integer arithmetic (:func:`_e4m3`, ``EMULATE``); FP8 loads, stores and upcasts are
right in the interpreter.

Memory-bound, one pass over the input where the tile fits a program's registers: a 1x128 program reads its
rows once, a 128x128 program its tile once, and each writes one byte per element plus its scales.

Layouts (the reference's "Layouts"): q is written contiguous whatever the input's strides, so quantizing a
transposed view writes the transposed storage in the same pass (the weights' K-major copies); the 1x128 scales
are written MN-major (``[J, rows]`` storage); the 128x1 quantization writes q into ``[K, C]`` storage, the
tokens contiguous, each group's tiles from a multiple of 128 columns. The kernels load along the input's
contiguous dimension and store along the output's; Triton moves the tile between the two register layouts
through shared memory.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kernels._launch import validate_counts
from kernels.reference_fp8 import FP8_DTYPE, TILE, column_tile_rows
from kernels.registry import Specialization, launch_key, register, register_aot

if TYPE_CHECKING:
    from kernels.warmup import KernelShapes

__all__ = ["dequantize_fp8", "quantize_fp8", "quantize_fp8_columns"]

# Registers of one program's tile (elements): 16K fp32 values are 64 per thread at 8 warps.
_TILE_ELEMS = 16384
# The column quantization reads 128 rows x this many columns per program (64 values per thread at 4 warps).
_COLUMN_BLOCK = 64
# Row counts change every step (routed rows): never specialised on, so they add no compile classes. The scale
# strides are row counts too where the scales are MN-major (row tiles).
_ROW_COUNTS = ("R", "M", "stride_sb", "stride_si", "stride_sj")


@triton.jit
def _e4m3(v, EMULATE: tl.constexpr):
    """float32 ``v`` (|v| <= 448) as float8e4nv, rounded to nearest even."""
    if EMULATE:
        bits = v.to(tl.int32, bitcast=True)
        mag = bits & 0x7FFFFFFF
        # Normal E4M3 (|v| >= 2**-6): keep 3 of fp32's 23 mantissa bits, rounding at bit 20 to nearest even;
        # the carry of a rounded-up mantissa runs into the exponent, and fp32's exponent bias 127 becomes 7.
        normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - ((127 - 7) << 3)
        # Subnormal E4M3 (steps of 2**-9): adding 2**14, whose float32 ulp is 2**-9, rounds |v| to a multiple
        # of 2**-9 (nearest even, in the float32 add); the low bits are then the count of 2**-9 steps, and 8
        # steps encode as 0x08, the smallest normal, as E4M3 wants.
        sub = (tl.abs(v) + 16384.0).to(tl.int32, bitcast=True) - 0x46800000
        code = tl.where(mag >= 0x3C800000, normal, sub) | ((bits >> 24) & 0x80)
        return code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return v.to(tl.float8e4nv)


@triton.jit
def _scale(amax):
    """A tile's scale from its amax (float32): amax / 448, or 1 for an all-zero tile."""
    return tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)


@triton.jit
def _quantize(x, scale, EMULATE: tl.constexpr):
    return _e4m3(tl.clamp(tl.math.div_rn(x, scale), -448.0, 448.0), EMULATE)


@triton.jit(do_not_specialize=_ROW_COUNTS)
def _quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, R, C, stride_xr, stride_xc,
    TILE_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    """1 x TILE_C tiles of x [R, C]: BLOCK_R rows of one column tile per program, one scale per row, stored
    MN-major (scale [R, J] as [J, R] storage)."""
    j = tl.program_id(1)
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    in_tile = tl.arange(0, BLOCK_C)
    cols = j * TILE_C + in_tile
    row_mask = rows < R
    mask = row_mask[:, None] & ((cols < C) & (in_tile < TILE_C))[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
    scale = _scale(tl.max(tl.abs(x), axis=1))
    q = _quantize(x, scale[:, None], EMULATE)
    tl.store(q_ptr + rows[:, None] * C + cols[None, :], q, mask=mask)
    tl.store(s_ptr + j * R + rows, scale, mask=row_mask)


@triton.jit
def _tile_chunk(
    x_ptr, r0, c0, dr, dc, R, C, stride_xr, stride_xc,
    TILE_R: tl.constexpr, TILE_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """(offsets into a contiguous [R, C], mask, float32 values) of chunk (dr, dc) of the tile at (r0, c0)."""
    in_r = dr + tl.arange(0, BLOCK_R)
    in_c = dc + tl.arange(0, BLOCK_C)
    rows = (r0 + in_r).to(tl.int64)
    cols = c0 + in_c
    mask = ((rows < R) & (in_r < TILE_R))[:, None] & ((cols < C) & (in_c < TILE_C))[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xr + cols[None, :] * stride_xc, mask=mask, other=0.0)
    return rows[:, None] * C + cols[None, :], mask, x.to(tl.float32)


@triton.jit(do_not_specialize=_ROW_COUNTS)
def _quantize_blocks_kernel(
    x_ptr, q_ptr, s_ptr, R, C, stride_xb, stride_xr, stride_xc, stride_sb, stride_si, stride_sj,
    TILE_R: tl.constexpr, TILE_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    """TILE_R x TILE_C tiles, one program and one scale per tile; a tile larger than BLOCK_R x BLOCK_C is read
    twice (its amax first), one that fits is read once."""
    batch = tl.program_id(2).to(tl.int64)
    i, j = tl.program_id(0), tl.program_id(1)
    r0, c0 = i * TILE_R, j * TILE_C
    x_ptr += batch * stride_xb
    q_ptr += batch * R * C
    if TILE_R <= BLOCK_R and TILE_C <= BLOCK_C:
        offs, mask, x = _tile_chunk(x_ptr, r0, c0, 0, 0, R, C, stride_xr, stride_xc, TILE_R, TILE_C, BLOCK_R, BLOCK_C)
        scale = _scale(tl.max(tl.max(tl.abs(x), axis=1), axis=0))
        tl.store(q_ptr + offs, _quantize(x, scale, EMULATE), mask=mask)
    else:
        amax = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
        for dr in range(0, TILE_R, BLOCK_R):
            for dc in range(0, TILE_C, BLOCK_C):
                _, _, x = _tile_chunk(x_ptr, r0, c0, dr, dc, R, C, stride_xr, stride_xc,
                                      TILE_R, TILE_C, BLOCK_R, BLOCK_C)  # fmt: skip
                amax = tl.maximum(amax, tl.abs(x))
        scale = _scale(tl.max(tl.max(amax, axis=1), axis=0))
        for dr in range(0, TILE_R, BLOCK_R):
            for dc in range(0, TILE_C, BLOCK_C):
                offs, mask, x = _tile_chunk(x_ptr, r0, c0, dr, dc, R, C, stride_xr, stride_xc,
                                            TILE_R, TILE_C, BLOCK_R, BLOCK_C)  # fmt: skip
                tl.store(q_ptr + offs, _quantize(x, scale, EMULATE), mask=mask)
    tl.store(s_ptr + batch * stride_sb + i * stride_si + j * stride_sj, scale)


@triton.jit(do_not_specialize=_ROW_COUNTS)
def _quantize_columns_kernel(
    x_ptr, q_ptr, s_ptr, counts_ptr, M, K, E, stride_xm, stride_xk, stride_qk,
    GROUPED: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_C: tl.constexpr, EMULATE: tl.constexpr,
):  # fmt: skip
    """128x1 tiles: program (t, c) quantizes scale row t over BLOCK_C columns into q's storage columns
    128 t .. 128 t + 127 ([K, C] storage, row stride stride_qk = C, a multiple of 128).

    With groups, tile t is found from the device-side counts like the grouped GEMM finds its tiles: group e
    owns scale rows t_e .. t_e + ceil(c_e / 128) - 1. A tile's rows past its group are stored as zeros (the
    GEMM then reads whole tiles, unmasked). A t past the last group's tiles masks every row: its scale row
    becomes 1 (the reference's value there; the spec leaves it unspecified) and no q is written.
    """
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < K
    if GROUPED:
        offs_e = tl.arange(0, BLOCK_E)
        counts_E = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0).to(tl.int32)
        tiles_E = tl.cdiv(counts_E, 128)
        tile_end_E = tl.cumsum(tiles_E, axis=0)
        is_e = offs_e == tl.sum((tile_end_E <= t).to(tl.int32), axis=0)
        row_hi = tl.sum(tl.where(is_e, tl.cumsum(counts_E, axis=0), 0), axis=0)
        row_lo = row_hi - tl.sum(tl.where(is_e, counts_E, 0), axis=0)
        local = t - tl.sum(tl.where(is_e, tile_end_E - tiles_E, 0), axis=0)
    else:
        row_lo, row_hi, local = 0, M, t
    first = row_lo + local * 128
    rows = (first + tl.arange(0, 128)).to(tl.int64)
    mask = (rows < row_hi)[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
    scale = _scale(tl.max(tl.abs(x), axis=0))
    # A tile of a group is stored whole (its rows past the group as the zeros loaded there); one past the groups
    # not at all.
    tile_rows = tl.where(first < row_hi, 128, 0)
    stored = (t.to(tl.int64) * 128 + tl.arange(0, 128))[:, None] + cols.to(tl.int64)[None, :] * stride_qk
    store_mask = (tl.arange(0, 128) < tile_rows)[:, None] & col_mask[None, :]
    tl.store(q_ptr + stored, _quantize(x, scale[None, :], EMULATE), mask=store_mask)
    tl.store(s_ptr + t.to(tl.int64) * K + cols, scale, mask=col_mask)


@triton.jit(do_not_specialize=_ROW_COUNTS)
def _dequantize_kernel(
    q_ptr, s_ptr, y_ptr, R, C, stride_qb, stride_qr, stride_qc, stride_sb, stride_si, stride_sj,
    TILE_R: tl.constexpr, TILE_C: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """y = q * scale of its tile, for one [BLOCK_R, BLOCK_C] block of one matrix of the batch."""
    batch = tl.program_id(2).to(tl.int64)
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (rows < R)[:, None] & (cols < C)[None, :]
    q = tl.load(q_ptr + batch * stride_qb + rows[:, None] * stride_qr + cols[None, :] * stride_qc, mask=mask)
    s_offs = batch * stride_sb + (rows // TILE_R)[:, None] * stride_si + (cols // TILE_C)[None, :] * stride_sj
    scale = tl.load(s_ptr + s_offs, mask=mask, other=1.0)
    y = q.to(tl.float32) * scale
    tl.store(y_ptr + (batch * R + rows[:, None]) * C + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def _emulate(device: torch.device) -> bool:
    """Round in integers where Triton's own fp32 -> fp8 cast is wrong (the interpreter, off CUDA)."""
    return device.type != "cuda"


def _check_block(name: str, block: Sequence[int]) -> tuple[int, int]:
    if len(block) != 2 or any(not isinstance(b, int) or b < 1 for b in block):
        raise ValueError(f"{name}: block must be two positive ints, got {block!r}")
    return int(block[0]), int(block[1])


def _row_tiles(tile_r: int, tile_c: int) -> bool:
    """Whether ``tile_r x tile_c`` tiles take the row kernel: one row per tile, and that row fits a program."""
    return tile_r == 1 and triton.next_power_of_2(tile_c) <= _TILE_ELEMS // 16


# Each _*_launch returns (kernel, grid, arguments by name, constexprs and launch options): one description
# that the launcher runs, the warm-up classifies (_key) and kernels.aot compiles. ``device`` decides the
# tile sizes and the rounding (the warm-up and AOT ask for CUDA's on meta tensors).
_Launch = tuple[object, tuple[int, ...], dict, dict]


def _strides(prefix: str, dims: str, t: torch.Tensor) -> dict[str, int]:
    """t's strides as the kernel's arguments: ``_strides("stride_x", "mk", x)`` -> stride_xm, stride_xk."""
    return {prefix + d: stride for d, stride in zip(dims, t.stride(), strict=True)}


def _quantize_launch(x_MK, q, scale, block: tuple[int, int], device: torch.device) -> _Launch:
    tile_r, tile_c = block
    rows, cols = x_MK.shape[-2:]
    block_c = triton.next_power_of_2(tile_c)
    emulate = _emulate(device)
    if _row_tiles(tile_r, tile_c):
        # Each row is its own tile: the leading dimensions fold into the rows, so a stacked input is one launch
        # and no batch stride (which would change with the row count) reaches the kernel.
        x2 = x_MK.reshape(-1, cols)
        j = triton.cdiv(cols, tile_c)
        block_r = max(1, min(16, _TILE_ELEMS // 4 // block_c))  # 16 rows of a 1x128 tile: 16 values a thread
        args = {"x_ptr": x2, "q_ptr": q, "s_ptr": scale, "R": x2.shape[0], "C": cols,
                **_strides("stride_x", "rc", x2)}  # fmt: skip
        options = {"TILE_C": tile_c, "BLOCK_R": block_r, "BLOCK_C": block_c, "EMULATE": emulate}
        return _quantize_rows_kernel, (triton.cdiv(x2.shape[0], block_r), j), args, options
    x3, s3 = x_MK.reshape(-1, rows, cols), scale.reshape(-1, *scale.shape[-2:])
    i, j = triton.cdiv(rows, tile_r), triton.cdiv(cols, tile_c)
    block_c = min(block_c, 128)
    block_r = min(triton.next_power_of_2(tile_r), _TILE_ELEMS // block_c)
    args = {"x_ptr": x3, "q_ptr": q, "s_ptr": s3, "R": rows, "C": cols, **_strides("stride_x", "brc", x3),
            **_strides("stride_s", "bij", s3)}  # fmt: skip
    if x3.shape[0] == 1:  # one matrix: no batch offset, whatever its size
        args["stride_xb"] = args["stride_sb"] = 0
    options = {"TILE_R": tile_r, "TILE_C": tile_c, "BLOCK_R": block_r, "BLOCK_C": block_c, "EMULATE": emulate,
               "num_warps": 8 if block_r * block_c >= 8192 else 4}  # fmt: skip
    return _quantize_blocks_kernel, (i, j, x3.shape[0]), args, options


def _dequantize_launch(q_MK, scale_IJ, y, block: tuple[int, int], device: torch.device) -> _Launch:
    tile_r, tile_c = block
    rows, cols = q_MK.shape[-2:]
    if tile_r == 1:  # as for quantize: row tiles fold the leading dimensions into the rows
        q3, s3 = q_MK.reshape(1, -1, cols), scale_IJ.reshape(1, -1, scale_IJ.shape[-1])
        rows = q3.shape[1]
    else:
        q3, s3 = q_MK.reshape(-1, rows, cols), scale_IJ.reshape(-1, *scale_IJ.shape[-2:])
    batched = q3.shape[0] > 1
    block_r, block_c = 16, min(128, triton.next_power_of_2(cols))
    args = {"q_ptr": q3, "s_ptr": s3, "y_ptr": y, "R": rows, "C": cols, **_strides("stride_q", "brc", q3),
            **_strides("stride_s", "bij", s3)}  # fmt: skip
    if not batched:  # one matrix: no batch offset, whatever its size
        args["stride_qb"] = args["stride_sb"] = 0
    options = {"TILE_R": tile_r, "TILE_C": tile_c, "BLOCK_R": block_r, "BLOCK_C": block_c}
    return _dequantize_kernel, (triton.cdiv(rows, block_r), triton.cdiv(cols, block_c), q3.shape[0]), args, options


def _columns_launch(x_MK, q, scale, counts_E, device: torch.device) -> _Launch:
    m, k = x_MK.shape
    num_groups = 1 if counts_E is None else counts_E.shape[0]
    block_c = min(_COLUMN_BLOCK, triton.next_power_of_2(k)) if device.type == "cuda" else 16
    args = {"x_ptr": x_MK, "q_ptr": q, "s_ptr": scale, "counts_ptr": counts_E, "M": m, "K": k, "E": num_groups,
            **_strides("stride_x", "mk", x_MK), "stride_qk": q.stride(1)}  # fmt: skip
    options = {"GROUPED": counts_E is not None, "BLOCK_E": triton.next_power_of_2(num_groups), "BLOCK_C": block_c,
               "EMULATE": _emulate(device)}  # fmt: skip
    return _quantize_columns_kernel, (scale.shape[0], triton.cdiv(k, block_c)), args, options


def _run(launch: _Launch) -> None:
    kernel, grid, args, options = launch
    kernel[grid](**args, **options)


def _quantize_outputs(x_MK: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """q contiguous; the scales MN-major for row tiles (``[J, rows]`` storage viewed as ``[..., M, J]``, the
    reference's :func:`~kernels.reference_fp8.mn_major`), row-major otherwise."""
    *lead, rows, cols = x_MK.shape
    i, j = triton.cdiv(rows, block[0]), triton.cdiv(cols, block[1])
    q = torch.empty(x_MK.shape, dtype=FP8_DTYPE, device=x_MK.device)
    if block[0] == 1:
        scale = torch.empty(j, math.prod(lead) * rows, dtype=torch.float32, device=x_MK.device)
        return q, scale.t().view(*lead, rows, j)
    return q, torch.empty(*lead, i, j, dtype=torch.float32, device=x_MK.device)


def _columns_outputs(x_MK: torch.Tensor, counts_E: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``[C, K]`` as a view of ``[K, C]`` storage (C = 128 T, the tokens contiguous), scale ``[T, K]``."""
    m, k = x_MK.shape
    tiles = column_tile_rows(m, None if counts_E is None else counts_E.shape[0])
    q_KC = torch.empty(k, tiles * TILE, dtype=FP8_DTYPE, device=x_MK.device)
    return q_KC.t(), torch.empty(tiles, k, dtype=torch.float32, device=x_MK.device)


# --- what the warm-up and kernels.aot need of these ops (kernels.registry.Specialization, register_aot) ---

_CUDA = torch.device("cuda")  # only its type is read: classes and AOT launches are CUDA's, on meta tensors


def _meta(t: torch.Tensor | None) -> torch.Tensor | None:
    """t on the meta device with its strides (the switch hands these launchers their tensors as they are, and a
    transposed weight view is a class of its own): a key never allocates or copies."""
    return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _key(launch: _Launch) -> tuple:
    kernel, _, args, options = launch
    return launch_key(kernel, args, options, unspecialized=_ROW_COUNTS)


def _quantize_key(x_MK, block=(1, TILE)) -> tuple:
    x = _meta(x_MK)
    return _key(_quantize_launch(x, *_quantize_outputs(x, tuple(block)), tuple(block), _CUDA))


def _dequantize_key(q_MK, scale_IJ, block=(1, TILE), *, out_dtype=torch.float32) -> tuple:
    q = _meta(q_MK)
    y = torch.empty(q.shape, dtype=out_dtype, device="meta")
    return _key(_dequantize_launch(q, _meta(scale_IJ), y, tuple(block), _CUDA))


def _columns_key(x_MK, tokens_per_group_E=None) -> tuple:
    x, counts = _meta(x_MK), _meta(tokens_per_group_E)
    return _key(_columns_launch(x, *_columns_outputs(x, counts), counts, _CUDA))


_QUANTIZE = Specialization(key=_quantize_key, meta=lambda rows, x, block=(1, TILE): _quantize_outputs(x, tuple(block)))
_DEQUANTIZE = Specialization(
    key=_dequantize_key,
    meta=lambda rows, q, scale, block=(1, TILE), *, out_dtype=torch.float32: torch.empty(
        q.shape, dtype=out_dtype, device="meta"
    ),
)
_COLUMNS = Specialization(key=_columns_key, meta=lambda rows, x, counts=None: _columns_outputs(x, counts))


@register_aot
def _aot_specs(shapes: KernelShapes) -> list:
    """At a model's shapes: the activations' 1x128 quantization (T token rows; M = T x top-k routed rows for the
    experts), the weights' 128x128 one as the input gradient reads them (w [E, D, 2F] as stored) and as the
    forward does (its transposed view, written K-major), the routed rows' 128x1 one over the local experts, and
    the dequantization of saved 1x128 activations."""
    from kernels.aot import launch_spec

    def meta(*shape: int, dtype: torch.dtype = shapes.dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device="meta")

    d, f, e = shapes.hidden, shapes.expert_intermediate, shapes.num_local_experts
    m = shapes.tokens * shapes.top_k
    x, w, counts = meta(m, d), meta(e, d, 2 * f), meta(e, dtype=torch.int64)
    q, scale = _quantize_outputs(x, (1, TILE))
    w_t = w.transpose(1, 2)
    launches = {
        "quantize_fp8 1x128": _quantize_launch(x, q, scale, (1, TILE), _CUDA),
        "quantize_fp8 128x128": _quantize_launch(w, *_quantize_outputs(w, (TILE, TILE)), (TILE, TILE), _CUDA),
        "quantize_fp8 128x128 transposed": _quantize_launch(
            w_t, *_quantize_outputs(w_t, (TILE, TILE)), (TILE, TILE), _CUDA
        ),
        "quantize_fp8_columns": _columns_launch(x, *_columns_outputs(x, counts), counts, _CUDA),
        "dequantize_fp8 1x128": _dequantize_launch(q, scale, x, (1, TILE), _CUDA),
    }
    return [launch_spec(name, kernel, args, options) for name, (kernel, _, args, options) in launches.items()]


@register("triton", specialization=_QUANTIZE, strided=True)
def quantize_fp8(x_MK: torch.Tensor, block: tuple[int, int] = (1, TILE)) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last two dimensions in ``block`` tiles -> ``(q [..., M, K] float8_e4m3fn, scale [..., I, J]
    float32)``, bit for bit :func:`kernels.reference_fp8.quantize_fp8`.

    x: ``[..., M, K]`` floating point, any strides (q is written contiguous: a transposed view is quantized into
    transposed storage in this one pass). block: ``(1, c)`` tiles take the row kernel (several rows of one tile
    per program, leading dimensions folded into the rows) and get MN-major scales; other tile shapes (``(128,
    128)`` for weights) take one program per tile and get row-major scales.
    """
    block = _check_block("quantize_fp8", block)
    if x_MK.dim() < 2 or not x_MK.is_floating_point():
        raise ValueError(f"quantize_fp8: x must be floating point with at least 2 dims, got {x_MK.dtype} "
                         f"{tuple(x_MK.shape)}")  # fmt: skip
    q, scale = _quantize_outputs(x_MK, block)
    if q.numel() > 0:
        _run(_quantize_launch(x_MK, q, scale, block, x_MK.device))
    return q, scale


@register("triton", specialization=_DEQUANTIZE, strided=True)
def dequantize_fp8(
    q_MK: torch.Tensor,
    scale_IJ: torch.Tensor,
    block: tuple[int, int] = (1, TILE),
    *,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``q.float() * scale`` over each ``block`` tile of the last two dimensions -> ``[..., M, K]`` in out_dtype.

    q: ``[..., M, K]`` float8_e4m3fn, scale ``[..., ceil(M / block[0]), ceil(K / block[1])]`` float32 (ValueError
    otherwise); any strides.
    """
    tile_r, tile_c = block = _check_block("dequantize_fp8", block)
    if q_MK.dim() < 2 or q_MK.dtype != FP8_DTYPE:
        raise ValueError(f"dequantize_fp8: q must be float8_e4m3fn with at least 2 dims, got {q_MK.dtype} "
                         f"{tuple(q_MK.shape)}")  # fmt: skip
    rows, cols = q_MK.shape[-2:]
    want = (*q_MK.shape[:-2], triton.cdiv(rows, tile_r), triton.cdiv(cols, tile_c))
    if tuple(scale_IJ.shape) != want or scale_IJ.dtype != torch.float32:
        raise ValueError(
            f"dequantize_fp8: scale {scale_IJ.dtype} {tuple(scale_IJ.shape)} for {tuple(q_MK.shape)} in "
            f"{tile_r}x{tile_c} tiles (expected float32 {want})"
        )
    y = torch.empty(q_MK.shape, dtype=out_dtype, device=q_MK.device)
    if y.numel() > 0:
        _run(_dequantize_launch(q_MK, scale_IJ, y, block, q_MK.device))
    return y


@register("triton", specialization=_COLUMNS, strided=True)
def quantize_fp8_columns(
    x_MK: torch.Tensor, tokens_per_group_E: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize in 128x1 tiles -> ``(q [C, K] float8_e4m3fn, a view of [K, C] storage; scale [T, K] float32)``,
    T = :func:`~kernels.reference_fp8.column_tile_rows`, C = 128 T, each group's tiles from a multiple of 128
    rows with zeros past its rows (the reference's layout); bit for bit the reference on the groups' tiles.

    x: ``[M, K]`` floating point, any strides. tokens_per_group: None (one group of M rows), or ``[E]``
    int32/int64 counts on x's device summing to at most M, read on the device only (no host sync: the grid is
    T programs per column block, T bounded on the host). q's tiles past the last group's are left unwritten,
    their scale rows are 1.
    """
    if x_MK.dim() != 2 or not x_MK.is_floating_point():
        raise ValueError(f"quantize_fp8_columns: x must be a floating-point [M, K], got {x_MK.dtype} "
                         f"{tuple(x_MK.shape)}")  # fmt: skip
    if tokens_per_group_E is not None:
        validate_counts("quantize_fp8_columns", tokens_per_group_E)
        if tokens_per_group_E.device != x_MK.device:
            raise ValueError(f"quantize_fp8_columns: tokens_per_group on {tokens_per_group_E.device}, x on "
                             f"{x_MK.device}")  # fmt: skip
    q, scale = _columns_outputs(x_MK, tokens_per_group_E)
    if scale.numel() > 0:
        _run(_columns_launch(x_MK, q, scale, tokens_per_group_E, x_MK.device))
    return q, scale

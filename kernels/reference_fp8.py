"""FP8 numerics as DeepSeek-V3 trains (report section 3.3), in plain torch: the specification of every FP8 op.

Legend for shape suffixes: M rows (tokens), K the contraction, N output features, E groups (experts), I and J
tile rows and tile columns (``ceil(rows / tile rows)``, ``ceil(cols / tile cols)``), T tiles of 128 rows.

Quantization. A matrix is cut into tiles: ``1 x 128`` for activations and their gradients (one scale per row
per 128 elements of the contraction), ``128 x 128`` for weights. A tile's scale is ``amax / 448`` in float32
(448 is E4M3's largest finite value; an all-zero tile gets scale 1), and its elements become
``float8_e4m3fn(x / scale)`` rounded to nearest even; ``|x / scale| <= 448`` by construction, clamped all the
same so that fp32 rounding of the division cannot leave E4M3's range. Tiles at the right and bottom edges may
be partial. Dequantized, an element is ``q.float() * scale``. Scales are float32, not rounded to powers of 2.

GEMMs. Every FP8 GEMM here is ``dequantize(a) @ dequantize(b)`` in float32, rounded once to the output dtype.
A kernel accumulates each 128-wide slice of the contraction in float32 and adds it in multiplied by its two
scales (the report's "promotion to CUDA cores" every 128 elements, for Hopper's limited-precision tensor-core
accumulator): the same sum up to the order of float32 additions.

The three GEMMs of a linear ``y = x @ W^T`` (``W [N, K]``): forward ``x (1x128) @ W (128x128)^T``; input
gradient ``dy (1x128, along N) @ W`` (the weight's 128x128 scales serve transposed); weight gradient
``dy^T @ x``, a contraction over the tokens, whose operands are quantized along the tokens instead: 128x1
tiles, 128 rows of one column per scale (:func:`quantize_fp8_columns`). For experts (rows sorted into groups)
the column tiles start afresh at every group, so that no scale spans two experts.

Each function declares one op of :mod:`kernels.registry`; its Triton twin has the same name and signature.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from kernels.reference import _offsets
from kernels.registry import register

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "TILE",
    "column_tile_rows",
    "dequantize_fp8",
    "fp8_gemm",
    "fp8_gemm_wgrad",
    "fp8_grouped_gemm",
    "quantize_fp8",
    "quantize_fp8_columns",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
"""The largest finite E4M3 value: a tile's amax maps to it."""
TILE = 128
"""Elements of the contraction per scale (the report's 1x128 and 128x128 tiles)."""


def _num_tiles(size: int, tile: int) -> int:
    return -(-size // tile)


def _expand(scale_IJ: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """Each tile's scale over its ``block`` of elements, cut to ``[rows, cols]`` (the edge tiles' partial size)."""
    return scale_IJ.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]


def _scales(amax: torch.Tensor) -> torch.Tensor:
    # An all-zero tile keeps scale 1: its values are 0 either way, and the division stays finite.
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def _to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


@register("torch")
def quantize_fp8(x_MK: torch.Tensor, block: tuple[int, int] = (1, TILE)) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last two dimensions in ``block`` tiles -> ``(q [..., M, K] float8_e4m3fn, scale [..., I, J]
    float32)``; leading dimensions (experts) are kept, one scale grid per matrix.

    block: ``(1, 128)`` for activations and gradients, ``(128, 128)`` for weights (any positive sizes work: a
    checkpoint's ``weight_block_size``).
    """
    rows, cols = x_MK.shape[-2:]
    i, j = _num_tiles(rows, block[0]), _num_tiles(cols, block[1])
    padded = F.pad(x_MK.float(), (0, j * block[1] - cols, 0, i * block[0] - rows))  # zeros leave amax alone
    amax_IJ = padded.unflatten(-1, (j, block[1])).unflatten(-3, (i, block[0])).abs().amax(dim=(-3, -1))
    scale_IJ = _scales(amax_IJ)
    return _to_fp8(x_MK.float(), _expand(scale_IJ, rows, cols, block)), scale_IJ


@register("torch")
def dequantize_fp8(
    q_MK: torch.Tensor,
    scale_IJ: torch.Tensor,
    block: tuple[int, int] = (1, TILE),
    *,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``q.float() * scale`` over each ``block`` tile of the last two dimensions -> ``[..., M, K]`` in out_dtype.

    scale must be ``[..., ceil(M / block[0]), ceil(K / block[1])]`` (ValueError otherwise).
    """
    rows, cols = q_MK.shape[-2:]
    want = (*q_MK.shape[:-2], _num_tiles(rows, block[0]), _num_tiles(cols, block[1]))
    if tuple(scale_IJ.shape) != want:
        raise ValueError(
            f"dequantize_fp8: scale {tuple(scale_IJ.shape)} for {tuple(q_MK.shape)} in {block[0]}x{block[1]} "
            f"tiles (expected {want})"
        )
    return (q_MK.float() * _expand(scale_IJ.float(), rows, cols, block)).to(out_dtype)


def column_tile_rows(num_rows: int, num_groups: int | None) -> int:
    """Rows of :func:`quantize_fp8_columns`' scale: ``ceil(M / 128)`` for one group, else ``M // 128 + E``
    (a bound known on the host: groups of c_e rows use ``sum ceil(c_e / 128)`` tiles)."""
    return _num_tiles(num_rows, TILE) if num_groups is None else num_rows // TILE + num_groups


@register("torch")
def quantize_fp8_columns(
    x_MK: torch.Tensor, tokens_per_group_E: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize in 128x1 tiles (128 rows of one column per scale), the weight gradient's operands ->
    ``(q [M, K] float8_e4m3fn, scale [T, K] float32)`` with T = :func:`column_tile_rows`.

    tokens_per_group: None (all M rows are one group), or [E] counts of consecutive row groups (experts) summing
    to at most M. Group e's tiles start afresh at its first row and take scale rows ``t_e ..``, where
    ``t_e = sum over e' < e of ceil(c_e' / 128)``; scale rows past the last group's tiles are unspecified, as are
    the q rows past the groups (padding: compare through :func:`fp8_gemm_wgrad` or on the routed rows).
    """
    rows, cols = x_MK.shape
    num_groups = None if tokens_per_group_E is None else tokens_per_group_E.shape[0]
    q_MK = torch.zeros(rows, cols, dtype=FP8_DTYPE, device=x_MK.device)
    scale_TK = torch.ones(column_tile_rows(rows, num_groups), cols, dtype=torch.float32, device=x_MK.device)
    offs = [0, rows] if tokens_per_group_E is None else _offsets(tokens_per_group_E)
    tile = 0
    for lo, hi in itertools.pairwise(offs):
        if hi > lo:
            q_KG, scale_KT = quantize_fp8(x_MK[lo:hi].t(), (1, TILE))
            q_MK[lo:hi] = q_KG.t()
            scale_TK[tile : tile + scale_KT.shape[1]] = scale_KT.t()
            tile += scale_KT.shape[1]
    return q_MK, scale_TK


def _check_rows_scale(name: str, x_MK: torch.Tensor, scale: torch.Tensor) -> None:
    want = (x_MK.shape[0], _num_tiles(x_MK.shape[1], TILE))
    if tuple(scale.shape) != want:
        raise ValueError(f"{name}: scale {tuple(scale.shape)} for {tuple(x_MK.shape)} in 1x128 tiles (expected {want})")


@register("torch")
def fp8_gemm(
    a_MK: torch.Tensor,
    a_scale_MJ: torch.Tensor,
    b_NK: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``y = dequantize(a) @ dequantize(b)^T`` -> ``[M, N]`` in out_dtype (float32 accumulation).

    a: ``[M, K]`` float8_e4m3fn in 1x128 tiles, a_scale ``[M, ceil(K/128)]``; b: ``[N, K]`` float8_e4m3fn in
    128x128 blocks, b_scale ``[ceil(N/128), ceil(K/128)]`` (a linear's weight; its transpose for the input
    gradient, with the scales transposed). Any strides.
    """
    _check_rows_scale("fp8_gemm: a", a_MK, a_scale_MJ)
    b = dequantize_fp8(b_NK, b_scale, (TILE, TILE))
    return (dequantize_fp8(a_MK, a_scale_MJ) @ b.t()).to(out_dtype)


@register("torch")
def fp8_grouped_gemm(
    x_MK: torch.Tensor,
    x_scale_MJ: torch.Tensor,
    w_EKN: torch.Tensor,
    w_scale_EIJ: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    comm_sms: int = 0,
) -> torch.Tensor:
    """FP8 :func:`kernels.reference.grouped_gemm`: ``y[rows of e] = dequantize(x)[rows of e] @ dequantize(w[e])``.

    x: ``[M, K]`` float8_e4m3fn in 1x128 tiles, x_scale ``[M, ceil(K/128)]``; w: ``[E, K, N]`` float8_e4m3fn in
    128x128 blocks, w_scale ``[E, ceil(K/128), ceil(N/128)]`` (the input gradient passes ``w.transpose(1, 2)``
    with its scales transposed); tokens_per_expert ``[E]`` summing to at most M -> y ``[M, N]`` in out_dtype,
    zeros in the rows past the groups. comm_sms as for the bf16 grouped GEMM.
    """
    _check_rows_scale("fp8_grouped_gemm: x", x_MK, x_scale_MJ)
    x = dequantize_fp8(x_MK, x_scale_MJ)
    w = dequantize_fp8(w_EKN, w_scale_EIJ, (TILE, TILE))
    y_MN = torch.zeros(x_MK.shape[0], w_EKN.shape[2], dtype=out_dtype, device=x_MK.device)
    offs = _offsets(tokens_per_expert_E)
    for e in range(w_EKN.shape[0]):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            y_MN[lo:hi] = (x[lo:hi] @ w[e]).to(out_dtype)
    return y_MN


def _dequantize_columns(q_MK: torch.Tensor, scale_TK: torch.Tensor, offs: list[int]) -> torch.Tensor:
    """float32 values of :func:`quantize_fp8_columns`' output for the rows of the groups ``offs`` (zeros after)."""
    out = torch.zeros(q_MK.shape, dtype=torch.float32, device=q_MK.device)
    tile = 0
    for lo, hi in itertools.pairwise(offs):
        if hi > lo:
            n = _num_tiles(hi - lo, TILE)
            out[lo:hi] = dequantize_fp8(q_MK[lo:hi].t(), scale_TK[tile : tile + n].t()).t()
            tile += n
    return out


@register("torch")
def fp8_gemm_wgrad(
    a_MN: torch.Tensor,
    a_scale_TN: torch.Tensor,
    b_MK: torch.Tensor,
    b_scale_TK: torch.Tensor,
    tokens_per_group_E: torch.Tensor | None = None,
    *,
    comm_sms: int = 0,
) -> torch.Tensor:
    """The weight gradient's contraction over rows: ``dequantize(a)^T @ dequantize(b)`` per row group, float32.

    a ``[M, N]`` and b ``[M, K]`` as :func:`quantize_fp8_columns` returns them for the same groups (128x1
    tiles). tokens_per_group None: one group -> ``[N, K]`` (a linear's ``dy, x`` give its ``dW``); ``[E]``
    counts -> ``[E, N, K]`` (an expert GEMM's ``x, dy`` give ``dw [E, K_in, N_out]``), zeros for empty groups.
    Float32 because weight gradients accumulate in float32.
    """
    rows = a_MN.shape[0]
    offs = [0, rows] if tokens_per_group_E is None else _offsets(tokens_per_group_E)
    a, b = _dequantize_columns(a_MN, a_scale_TN, offs), _dequantize_columns(b_MK, b_scale_TK, offs)
    if tokens_per_group_E is None:
        return a.t() @ b
    dw_ENK = a.new_zeros(len(offs) - 1, a_MN.shape[1], b_MK.shape[1])
    for e, (lo, hi) in enumerate(itertools.pairwise(offs)):
        if hi > lo:
            dw_ENK[e] = a[lo:hi].t() @ b[lo:hi]
    return dw_ENK

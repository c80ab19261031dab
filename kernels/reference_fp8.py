"""FP8 numerics as DeepSeek-V3 trains (report section 3.3), in plain torch: the specification of every FP8 op.

Legend for shape suffixes: M rows (tokens), K the contraction, N output features, E groups (experts), I and J
tile rows and tile columns (``ceil(rows / tile rows)``, ``ceil(cols / tile cols)``), T tiles of 128 rows, C their
rows (``128 T``).

Quantization. A matrix is cut into tiles: ``1 x 128`` for activations and their gradients (one scale per row
per 128 elements of the contraction), ``128 x 128`` for weights. A tile's scale is ``amax / 448`` in float32
(448 is E4M3's largest finite value; an all-zero tile gets scale 1), and its elements become
``float8_e4m3fn(x / scale)`` rounded to nearest even; ``|x / scale| <= 448`` by construction, clamped all the
same so that fp32 rounding of the division cannot leave E4M3's range. Tiles at the right and bottom edges may
be partial. Dequantized, an element is ``q.float() * scale``. Scales are float32, not rounded to powers of 2.

Layouts, as sm_90's FP8 tensor cores read them (``wgmma`` takes 8-bit operands K-major only: Triton transposes
any other layout through registers and loses the copy pipelining, and DeepGEMM accepts K-major only). Every
GEMM operand here is K-major, its contraction dimension contiguous: rows ``[M, K]`` and weights ``[N, K]`` (a
GEMM computes ``a @ b^T``, DeepGEMM's "NT"); the weight gradient's operands, whose contraction runs over the
tokens, are stored ``[K, C]`` (tokens contiguous) and read as ``[C, K]`` views. Scales are MN-major as DeepGEMM
lays them: the 1x128 scales ``[M, J]`` are a view of ``[J, M]`` storage (M contiguous), the 128x1 scales ``[T,
K]`` are row-major (K contiguous); the small 128x128 grids are ``[I, J]`` row-major. Every op takes any strides
and gives the same numbers; these layouts are what the Triton kernels read fastest (``kernels/NOTES.md``).

GEMMs. Every FP8 GEMM here is ``dequantize(a) @ dequantize(b)^T`` in float32, rounded once to the output dtype.
A kernel accumulates each 128-wide slice of the contraction in float32 and adds it in multiplied by its two
scales (the report's "promotion to CUDA cores" every 128 elements, for Hopper's limited-precision tensor-core
accumulator): the same sum up to the order of float32 additions.

The three GEMMs of a linear ``y = x @ W^T`` (``W [N, K]``): forward ``x (1x128) @ W (128x128)^T``; input
gradient ``dy (1x128, along N) @ W``, whose K-major weight is ``W^T`` quantized into ``[K, N]`` storage (the
128x128 scales of ``W^T`` are exactly the transposed scales of ``W``); weight gradient ``dy^T @ x``, a
contraction over the tokens, whose operands are quantized along the tokens instead: 128x1 tiles, 128 rows of
one column per scale (:func:`quantize_fp8_columns`). For experts (rows sorted into groups) the column tiles
start afresh at every group, so that no scale spans two experts, and each group's tiles start at a multiple of
128 rows of the stored operand (aligned loads, no masks in the GEMM).

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
    "group_tiles",
    "mn_major",
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


def mn_major(scale_MJ: torch.Tensor) -> torch.Tensor:
    """Row tiles' scales ``[..., M, J]`` as a view of ``[J, rows]`` storage, the rows (leading dimensions folded
    in) contiguous: DeepGEMM's MN-major layout, in which a GEMM's tile of rows reads its scales of one slice in
    one contiguous load."""
    *lead, rows, j = scale_MJ.shape
    return scale_MJ.reshape(-1, j).t().contiguous().t().view(*lead, rows, j)


@register("torch")
def quantize_fp8(x_MK: torch.Tensor, block: tuple[int, int] = (1, TILE)) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last two dimensions in ``block`` tiles -> ``(q [..., M, K] float8_e4m3fn, scale [..., I, J]
    float32)``; leading dimensions (experts) are kept, one scale grid per matrix. q is contiguous (quantizing a
    transposed view writes the transposed storage: how a weight becomes K-major).

    block: ``(1, 128)`` for activations and gradients, ``(128, 128)`` for weights (any positive sizes work: a
    checkpoint's ``weight_block_size``). Row tiles (``block[0] == 1``) give MN-major scales (:func:`mn_major`),
    other tiles row-major ones.
    """
    rows, cols = x_MK.shape[-2:]
    i, j = _num_tiles(rows, block[0]), _num_tiles(cols, block[1])
    padded = F.pad(x_MK.float(), (0, j * block[1] - cols, 0, i * block[0] - rows))  # zeros leave amax alone
    amax_IJ = padded.unflatten(-1, (j, block[1])).unflatten(-3, (i, block[0])).abs().amax(dim=(-3, -1))
    scale_IJ = _scales(amax_IJ)
    q = _to_fp8(x_MK.float(), _expand(scale_IJ, rows, cols, block)).contiguous()
    return q, mn_major(scale_IJ) if block[0] == 1 else scale_IJ


@register("torch")
def dequantize_fp8(
    q_MK: torch.Tensor,
    scale_IJ: torch.Tensor,
    block: tuple[int, int] = (1, TILE),
    *,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``q.float() * scale`` over each ``block`` tile of the last two dimensions -> ``[..., M, K]`` in out_dtype.

    scale must be ``[..., ceil(M / block[0]), ceil(K / block[1])]`` (ValueError otherwise); any strides.
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


def group_tiles(tokens_per_group_E: torch.Tensor | None, num_tiles: int) -> list[tuple[int, int]]:
    """Each group's range of 128-row tiles ``[t_e, t_e + ceil(c_e / 128))`` (host values: reads the counts);
    one group over all ``num_tiles`` tiles when the counts are None."""
    if tokens_per_group_E is None:
        return [(0, num_tiles)]
    ends = list(itertools.accumulate(_num_tiles(int(c), TILE) for c in tokens_per_group_E.tolist()))
    return list(zip([0, *ends[:-1]], ends, strict=True))


@register("torch")
def quantize_fp8_columns(
    x_MK: torch.Tensor, tokens_per_group_E: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize in 128x1 tiles (128 rows of one column per scale), the weight gradient's operands, each group's
    tiles aligned to 128 stored rows -> ``(q [C, K] float8_e4m3fn, scale [T, K] float32)``, T =
    :func:`column_tile_rows`, C = 128 T.

    tokens_per_group: None (all M rows are one group), or [E] counts of consecutive row groups (experts) summing
    to at most M. Group e's tiles start afresh at its first row and are tiles ``t_e ..`` with ``t_e = sum over
    e' < e of ceil(c_e' / 128)`` (:func:`group_tiles`): its row ``i`` is q's row ``128 t_e + i``, and the rows
    past ``c_e`` in its last tile are zeros, so that a 128-row slice of q is one scale row's tile: ``q, scale``
    is a plain ``(128, 1)`` block quantization (:func:`dequantize_fp8` reads it). Tiles past the last group's
    are unspecified (q zeros and scale 1 here). q is a view of ``[K, C]`` storage: the GEMM's contraction (the
    rows) contiguous, K-major for :func:`fp8_gemm_wgrad`; the scales are row-major (MN-major for that GEMM).
    """
    rows, cols = x_MK.shape
    num_groups = None if tokens_per_group_E is None else tokens_per_group_E.shape[0]
    tiles = column_tile_rows(rows, num_groups)
    q_KC = torch.zeros(cols, tiles * TILE, dtype=FP8_DTYPE, device=x_MK.device)
    scale_TK = torch.ones(tiles, cols, dtype=torch.float32, device=x_MK.device)
    offs = [0, rows] if tokens_per_group_E is None else _offsets(tokens_per_group_E)
    for (lo, hi), (t_lo, t_hi) in zip(itertools.pairwise(offs), group_tiles(tokens_per_group_E, tiles), strict=True):
        if hi > lo:
            q_KG, scale_KT = quantize_fp8(x_MK[lo:hi].t(), (1, TILE))
            q_KC[:, t_lo * TILE : t_lo * TILE + hi - lo] = q_KG
            scale_TK[t_lo:t_hi] = scale_KT.t()
    return q_KC.t(), scale_TK


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
    128x128 blocks, b_scale ``[ceil(N/128), ceil(K/128)]``: a linear's weight ``W [N, K]`` for the forward, ``W^T``
    quantized into ``[K, N]`` storage for the input gradient. Any strides (K-major, scales MN-major: the fast
    layout, see the module docstring).
    """
    _check_rows_scale("fp8_gemm: a", a_MK, a_scale_MJ)
    b = dequantize_fp8(b_NK, b_scale, (TILE, TILE))
    return (dequantize_fp8(a_MK, a_scale_MJ) @ b.t()).to(out_dtype)


@register("torch")
def fp8_grouped_gemm(
    x_MK: torch.Tensor,
    x_scale_MJ: torch.Tensor,
    w_ENK: torch.Tensor,
    w_scale_EIJ: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    comm_sms: int = 0,
) -> torch.Tensor:
    """FP8 grouped GEMM, :func:`fp8_gemm` per expert: ``y[rows of e] = dequantize(x)[rows of e] @
    dequantize(w[e])^T``.

    x: ``[M, K]`` float8_e4m3fn in 1x128 tiles, x_scale ``[M, ceil(K/128)]``; w: ``[E, N, K]`` float8_e4m3fn in
    128x128 blocks, w_scale ``[E, ceil(N/128), ceil(K/128)]`` (K-major: the expert weight ``w [E, K, N]`` is
    quantized from its transposed view for the forward, as it is stored for the input gradient, whose
    contraction runs over N); tokens_per_expert ``[E]`` summing to at most M -> y ``[M, N]`` in out_dtype. Rows
    past the groups are padding: zeros here, left unwritten by the Triton kernel (compare the routed rows).
    comm_sms as for the bf16 grouped GEMM.
    """
    _check_rows_scale("fp8_grouped_gemm: x", x_MK, x_scale_MJ)
    x = dequantize_fp8(x_MK, x_scale_MJ)
    w = dequantize_fp8(w_ENK, w_scale_EIJ, (TILE, TILE))
    y_MN = torch.zeros(x_MK.shape[0], w_ENK.shape[1], dtype=out_dtype, device=x_MK.device)
    offs = _offsets(tokens_per_expert_E)
    for e in range(w_ENK.shape[0]):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            y_MN[lo:hi] = (x[lo:hi] @ w[e].t()).to(out_dtype)
    return y_MN


@register("torch")
def fp8_gemm_wgrad(
    a_CN: torch.Tensor,
    a_scale_TN: torch.Tensor,
    b_CK: torch.Tensor,
    b_scale_TK: torch.Tensor,
    tokens_per_group_E: torch.Tensor | None = None,
    *,
    comm_sms: int = 0,
) -> torch.Tensor:
    """The weight gradient's contraction over rows: ``dequantize(a)^T @ dequantize(b)`` over each group's tiles,
    float32.

    a ``[C, N]`` and b ``[C, K]`` as :func:`quantize_fp8_columns` returns them for the same groups (128x1 tiles,
    each group's tiles from a multiple of 128 rows, zeros past its rows; any strides, K-major ``[N, C]`` and
    ``[K, C]`` storage the fast layout). tokens_per_group None: one group over all C rows -> ``[N, K]`` (a
    linear's ``dy, x`` give its ``dW``); ``[E]`` counts -> ``[E, N, K]`` over group e's tiles
    (:func:`group_tiles`; an expert GEMM's ``x, dy`` give ``dw [E, K_in, N_out]``), zeros for empty groups.
    Float32 because weight gradients accumulate in float32.
    """
    a = dequantize_fp8(a_CN, a_scale_TN, (TILE, 1))
    b = dequantize_fp8(b_CK, b_scale_TK, (TILE, 1))
    ranges = group_tiles(tokens_per_group_E, a_scale_TN.shape[0])
    dw_ENK = a.new_zeros(len(ranges), a_CN.shape[1], b_CK.shape[1])
    for e, (t_lo, t_hi) in enumerate(ranges):
        rows = slice(t_lo * TILE, t_hi * TILE)
        dw_ENK[e] = a[rows].t() @ b[rows]
    return dw_ENK[0] if tokens_per_group_E is None else dw_ENK

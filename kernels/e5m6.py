"""E5M6, the 12-bit format DeepSeek-V3 keeps the attention output projection's input in (report section 3.3.3):
1 sign, 5 exponent and 6 mantissa bits, plain torch.

Legend for shape suffixes: M rows (tokens), K elements of a row, J tiles of a row (``ceil(K / 128)``), N elements
of the whole tensor.

The report caches activations in FP8 for the backward of the linear layers, except the input of the linear
after the attention: SDPA's backward reads it too and is sensitive to its precision, so it is kept in E5M6,
quantized in 1x128 tiles with power-of-2 ("round") scales, so that the conversion to the 128x1 tiles of the
weight gradient adds no error of its own.

Numerics. A tile's scale is the smallest power of 2 with ``amax / scale <= E5M6_MAX`` (1 for an all-zero tile);
multiplying by it is exact, so a value's only error is rounding ``x / scale`` to 6 mantissa bits, to nearest
even, with E5M6's subnormals (spacing ``2**-20``) below ``2**-14``. E5M6 has fp16's exponent (bias 15), so an E5M6
value is an fp16 whose 4 low mantissa bits are zero: its code is the fp16 bit pattern shifted right by 4.

Storage: no torch dtype holds 12 bits, so a tensor of N codes is two uint8 planes, the high 8 bits of each code
``[M, K]`` and the low 4 bits two to a byte ``[ceil(N / 2)]``, 1.5 bytes an element, plus the float32 scales
``[M, J]``. Plain torch, no Triton kernel: the conversion is elementwise and runs once per layer and micro-batch
each way (a few passes over ``[T, H x V]``), beside an attention that costs ``O(S)`` times more.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from kernels.reference_fp8 import TILE

__all__ = ["E5M6", "E5M6_MAX", "dequantize_e5m6", "e5m6_elem_bytes", "quantize_e5m6"]

E5M6_MAX = 2.0**15 * (1 + 63 / 64)
"""The largest finite E5M6 value (65024): a tile's amax maps at most to it."""
_MIN_NORMAL = 2.0**-14
_SUBNORMAL_STEP = 2.0**-20


class E5M6(NamedTuple):
    """A ``[M, K]`` tensor in E5M6: high 8 bits of each code ``[M, K]`` uint8, low 4 bits two to a byte
    ``[ceil(M K / 2)]`` uint8, float32 scales ``[M, ceil(K / 128)]`` (one per 1x128 tile of a row)."""

    high: torch.Tensor
    low: torch.Tensor
    scale: torch.Tensor


def e5m6_elem_bytes(width: int) -> float:
    """Bytes an element of a ``[rows, width]`` tensor kept in E5M6: 1.5, and one fp32 scale per 1x128 tile along
    ``width`` (an odd element count adds half a byte to the whole tensor, which this leaves out)."""
    return 1.5 + 4 * -(-width // TILE) / width


def _tiles(x_MK: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[M, J, 128]`` (the last tile zero-padded)."""
    m, k = x_MK.shape
    pad = -k % TILE
    return F.pad(x_MK, (0, pad)).view(m, -1, TILE)


def _round_to_e5m6(y: torch.Tensor) -> torch.Tensor:
    """float32 ``y`` with ``|y| <= E5M6_MAX`` rounded to the nearest E5M6 value (ties to even)."""
    bits = y.view(torch.int32)
    # normal range: round the 23-bit mantissa to 6 bits, ties to even (17 bits dropped)
    keep = (bits >> 17) & 1
    normal = ((bits + 0xFFFF + keep) & ~0x1FFFF).view(torch.float32)
    # subnormal range: multiples of 2**-20 (torch.round rounds half to even; the products are exact)
    sub = torch.round(y / _SUBNORMAL_STEP) * _SUBNORMAL_STEP
    return torch.where(y.abs() < _MIN_NORMAL, sub, normal)


def quantize_e5m6(x_MK: torch.Tensor) -> E5M6:
    """``x`` (any float dtype; leading dimensions flattened into rows) in E5M6 with a power-of-2 scale per 1x128
    tile of each row."""
    x_MK = x_MK.reshape(-1, x_MK.shape[-1])
    m, k = x_MK.shape
    tiles_MJC = _tiles(x_MK.float())
    amax_MJ = tiles_MJC.abs().amax(-1)
    scale_MJ = torch.exp2(torch.ceil(torch.log2(amax_MJ / E5M6_MAX)))
    scale_MJ = torch.where(amax_MJ / scale_MJ > E5M6_MAX, scale_MJ * 2, scale_MJ)  # log2's rounding, if any
    scale_MJ = torch.where(amax_MJ > 0, scale_MJ, torch.ones_like(scale_MJ))
    y_MK = (tiles_MJC / scale_MJ[..., None]).reshape(m, -1)[:, :k]
    # exact in fp16 (its mantissa is wider, its subnormals finer): the code is its top 12 bits
    code = (_round_to_e5m6(y_MK.contiguous()).to(torch.float16).view(torch.int16).to(torch.int32) >> 4) & 0xFFF
    low = (code & 0xF).reshape(-1).to(torch.uint8)
    if low.numel() % 2:
        low = F.pad(low, (0, 1))
    return E5M6((code >> 4).to(torch.uint8), low[0::2] | (low[1::2] << 4), scale_MJ.contiguous())


def dequantize_e5m6(q: E5M6, dtype: torch.dtype) -> torch.Tensor:
    """The ``[M, K]`` tensor ``q`` holds, in ``dtype``."""
    m, k = q.high.shape
    low = torch.stack((q.low & 0xF, q.low >> 4), dim=-1).reshape(-1)[: m * k].view(m, k)
    bits = ((q.high.to(torch.int32) << 8) | (low.to(torch.int32) << 4)).to(torch.int16)  # wraps: the sign bit
    y_MJC = _tiles(bits.view(torch.float16).float()) * q.scale[..., None]
    return y_MJC.reshape(m, -1)[:, :k].to(dtype)

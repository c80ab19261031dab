"""FP8 dispatch as DeepSeek-V3 trains (report section 3.3): token rows cross the dispatch-direction all-to-alls
in FP8 with their 1x128 scales, and the combine direction stays in the model dtype.

Legend for shape suffixes: T rows before the exchange, R rows after it, D hidden, J scales per row
(``ceil(D / 128)``), B bytes of one packed row (``D + 4 * J``).

Which all-to-alls: the forward dispatch (activations, before the experts' up-projection) and the gradient of
combine (the activation gradient before the experts' down-projection backward, the report's "similar strategies
are applied to the activation gradient"). The forward combine and the gradient of dispatch stay in the model
dtype. The numerics are :func:`kernels.ops.quantize_fp8` / :func:`kernels.ops.dequantize_fp8` (the
specification is :mod:`kernels.reference_fp8`): a row's scales depend on that row only, so a token reads the
same after the exchange whichever rank it went to, and one process (the ``local`` dispatcher's round trip) gets
the numbers a multi-rank run gets. Autograd treats the round trip as the identity (straight through): the
gradient of dispatch is the combine-direction exchange of the incoming gradient, unquantized.

On the wire (``alltoall`` over gloo or NCCL, neither of which takes float8 tensors): one uint8 row per token, the
D bytes of its FP8 values followed by the 4*J bytes of its float32 scales, so a row's scales travel in the same
message as the row. DeepEP takes the ``(q, scales)`` pair itself.
"""

from __future__ import annotations

import torch

from kernels.fp8 import Quantized, quantize_rows
from kernels.reference_fp8 import FP8_DTYPE, TILE

__all__ = ["num_scales", "pack_rows", "round_trip", "unpack_rows", "wire_row_bytes"]

_SCALE_DTYPE = torch.float32


def num_scales(hidden: int) -> int:
    """Scales per row of ``hidden`` elements: one per 128 (the last tile may be partial)."""
    return -(-hidden // TILE)


def wire_row_bytes(hidden: int, dtype: torch.dtype, fp8: bool) -> int:
    """Bytes one token row occupies in a dispatch-direction exchange: ``hidden`` FP8 values plus their float32
    scales, or ``hidden`` elements of ``dtype``."""
    if fp8:
        return hidden * FP8_DTYPE.itemsize + num_scales(hidden) * _SCALE_DTYPE.itemsize
    return hidden * dtype.itemsize


def round_trip(x_TD: torch.Tensor) -> torch.Tensor:
    """What a rank receives for ``x_TD`` under FP8 dispatch: quantized, dequantized, in ``x_TD``'s dtype."""
    return quantize_rows(x_TD).dequantize(x_TD.dtype)


def pack_rows(x_TD: torch.Tensor) -> torch.Tensor:
    """Quantize ``x_TD`` and pack each row with its scales: ``[T, B]`` uint8, B = D + 4 * J."""
    q_TD, scale_TJ = quantize_rows(x_TD)
    return torch.cat([q_TD.view(torch.uint8), scale_TJ.contiguous().view(torch.uint8)], dim=1)


def unpack_rows(packed_RB: torch.Tensor, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows packed by :func:`pack_rows`, dequantized to ``[R, D]`` in ``dtype``."""
    want = wire_row_bytes(hidden, dtype, fp8=True)
    if packed_RB.dim() != 2 or packed_RB.shape[1] != want or packed_RB.dtype != torch.uint8:
        raise ValueError(
            f"FP8 dispatch: packed rows {tuple(packed_RB.shape)} {packed_RB.dtype}, expected [R, {want}] uint8 "
            f"for hidden {hidden}"
        )
    q_RD = packed_RB[:, :hidden].view(FP8_DTYPE)
    scale_RJ = packed_RB[:, hidden:].contiguous().view(_SCALE_DTYPE)
    return Quantized(q_RD, scale_RJ).dequantize(dtype)

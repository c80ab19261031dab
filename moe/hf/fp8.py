"""Block-scaled FP8 weights as DeepSeek-V3 publishes them: dequantized on load.

A quantized weight ``W [M, N]`` is stored as ``float8_e4m3fn`` beside ``<name>_scale_inv [ceil(M/bm), ceil(N/bn)]``
(float32), one scale per ``bm x bn`` block (config.json: ``quantization_config = {quant_method: fp8, fmt: e4m3,
weight_block_size: [bm, bn], ...}``; V3: 128 x 128). ``W = fp8.float() * scale_inv``, the scale broadcast over
its block; the blocks at the right and bottom edges may be partial. The quantizer here is the inverse (scale =
block amax / 448, e4m3's largest finite value): our tests write FP8 checkpoints with it.

Legend for shape suffixes: M rows, N columns, I row blocks (ceil(M / bm)), J column blocks (ceil(N / bn)).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from kernels import reference_fp8
from kernels.reference_fp8 import FP8_MAX
from moe.hf.keys import HFCheckpointError

__all__ = ["FP8_MAX", "SCALE_SUFFIX", "Dequantized", "dequantize_blockwise", "quantize_blockwise"]

SCALE_SUFFIX = "_scale_inv"
"""A quantized tensor ``X``'s scales are the checkpoint's tensor ``X_scale_inv``."""
_FP8 = (torch.float8_e4m3fn,)


def quantize_blockwise(w_MN: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w_fp8 [M, N] float8_e4m3fn, scale_inv [I, J] float32)`` with ``scale_inv`` = block amax / 448 (leading
    dims, if any, are kept: one scale grid per matrix): :func:`kernels.reference_fp8.quantize_fp8`, the
    quantizer FP8 training uses."""
    return reference_fp8.quantize_fp8(w_MN, block)


def dequantize_blockwise(
    w_fp8_MN: torch.Tensor, scale_inv_IJ: torch.Tensor, block: tuple[int, int] = (128, 128), *, name: str = "weight"
) -> torch.Tensor:
    """``w_fp8.float() * scale_inv`` broadcast over each block: float32 ``[M, N]``. A scale grid of the wrong
    shape is a :class:`HFCheckpointError` naming ``name``."""
    m, n = w_fp8_MN.shape[-2:]
    want = (*w_fp8_MN.shape[:-2], -(-m // block[0]), -(-n // block[1]))
    if tuple(scale_inv_IJ.shape) != want:
        raise HFCheckpointError(
            f"{name}{SCALE_SUFFIX}: shape {tuple(scale_inv_IJ.shape)} for {name} of shape {tuple(w_fp8_MN.shape)} in "
            f"{block[0]}x{block[1]} blocks (expected {want})"
        )
    return reference_fp8.dequantize_fp8(w_fp8_MN, scale_inv_IJ, block)


class Dequantized(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors by name (a lazy mapping) with FP8 weights dequantized to float32 when read.

    ``block``: the checkpoint's ``weight_block_size`` (None: config.json has no ``quantization_config``, so an
    FP8 tensor is an error). The ``*_scale_inv`` tensors of quantized weights are not listed: they are part of
    their weight, read with it.
    """

    def __init__(self, files: Mapping[str, torch.Tensor], block: tuple[int, int] | None) -> None:
        self._files = files
        self._block = block

    def __getitem__(self, key: str) -> torch.Tensor:
        value = self._files[key]
        if value.dtype not in _FP8:
            return value
        if self._block is None:
            raise HFCheckpointError(f"{key} is {value.dtype} but config.json has no quantization_config")
        scale = key + SCALE_SUFFIX
        if scale not in self._files:
            raise HFCheckpointError(f"{key} is {value.dtype} but the checkpoint lacks its scales {scale}")
        return dequantize_blockwise(value, self._files[scale], self._block, name=key)

    def __contains__(self, key: object) -> bool:
        return key in self._files

    def __iter__(self) -> Iterator[str]:
        for key in self._files:
            if not (key.endswith(SCALE_SUFFIX) and key.removesuffix(SCALE_SUFFIX) in self._files):
                yield key

    def __len__(self) -> int:
        return sum(1 for _ in self)

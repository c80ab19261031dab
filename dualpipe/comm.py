"""The reference's process-wide P2P declarations, kept as thin shims.

Pipelines read these only when they were given no declaration of their own
(:meth:`dualpipe.Pipeline.set_p2p_tensor_shapes`); with neither, shapes are inferred per message.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["declared", "set_p2p_tensor_dtype", "set_p2p_tensor_shapes"]

TENSOR_SHAPES: list[tuple[int, ...]] | None = None
TENSOR_DTYPE: list[torch.dtype] | None = None


def set_p2p_tensor_shapes(shapes: Sequence[Sequence[int]] | None) -> None:
    """Declare the shapes of the tensors crossing every stage boundary (``None``: infer them)."""
    global TENSOR_SHAPES
    TENSOR_SHAPES = None if shapes is None else [tuple(int(d) for d in s) for s in shapes]


def set_p2p_tensor_dtype(dtype: torch.dtype | Sequence[torch.dtype]) -> None:
    """Declare the dtype of those tensors: one for all, or one per tensor."""
    global TENSOR_DTYPE
    TENSOR_DTYPE = [dtype] if isinstance(dtype, torch.dtype) else list(dtype)


def declared() -> tuple[list[tuple[int, ...]] | None, list[torch.dtype] | None]:
    return TENSOR_SHAPES, TENSOR_DTYPE

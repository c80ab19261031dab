"""Small autograd and micro-batching helpers (reference-compatible names)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd import Variable

from dualpipe.weight_grad import WeightGradStore

__all__ = ["WeightGradStore", "gather", "run_backward", "scatter"]


def run_backward(tensors: Sequence[torch.Tensor], grad_tensors: Sequence[torch.Tensor]) -> None:
    """Backpropagate ``grad_tensors`` from ``tensors`` into ``.grad`` without keeping the graph.

    Unlike ``torch.autograd.backward`` this tolerates outputs that do not reach every leaf
    (``allow_unreachable``), which a pipeline stage with pass-through tensors needs.
    """
    Variable._execution_engine.run_backward(
        tuple(tensors),
        tuple(grad_tensors),
        keep_graph=False,
        create_graph=False,
        allow_unreachable=True,
        accumulate_grad=True,
    )


def _as_tuple(inputs: torch.Tensor | Sequence[torch.Tensor | None]) -> tuple[torch.Tensor | None, ...]:
    if isinstance(inputs, torch.Tensor):
        return (inputs,)
    if not isinstance(inputs, (tuple, list)):
        raise TypeError(f"expected a tensor or a sequence of tensors, got {type(inputs).__name__}")
    for x in inputs:
        if x is not None and not isinstance(x, torch.Tensor):
            raise TypeError(f"expected tensors or None, got {type(x).__name__}")
    return tuple(inputs)


def scatter(
    inputs: torch.Tensor | Sequence[torch.Tensor | None], chunks: int, dim: int
) -> list[tuple[torch.Tensor | None, ...]]:
    """Split every tensor of ``inputs`` into ``chunks`` micro-batches along ``dim``.

    Returns one tuple per micro-batch. ``None`` entries stay ``None`` in every micro-batch. Raises
    ``ValueError`` when a tensor's ``dim`` size is not divisible by ``chunks`` (uneven micro-batches would
    silently change the loss scale and the P2P shapes).
    """
    tensors = _as_tuple(inputs)
    for i, x in enumerate(tensors):
        if x is None:
            continue
        if x.dim() <= dim:
            raise ValueError(f"input {i} has {x.dim()} dims; cannot split along batch_dim={dim}")
        if x.shape[dim] % chunks != 0:
            raise ValueError(
                f"input {i} has batch size {x.shape[dim]} along dim {dim}, not divisible into "
                f"{chunks} micro-batches; pass a batch that is a multiple of {chunks}"
            )
    split = [[None] * chunks if x is None else list(x.tensor_split(chunks, dim=dim)) for x in tensors]
    if not split:
        return [() for _ in range(chunks)]
    return [tuple(parts) for parts in zip(*split)]


def gather(micro_outputs: Sequence[Sequence[torch.Tensor | None]], dim: int) -> tuple[torch.Tensor | None, ...]:
    """Concatenate per-micro-batch outputs back into whole-batch tensors (inverse of :func:`scatter`)."""
    if not micro_outputs:
        raise ValueError("gather needs at least one micro-batch")
    columns = zip(*[_as_tuple(out) for out in micro_outputs])
    result = []
    for col in columns:
        if col[0] is None:
            if any(x is not None for x in col):
                raise ValueError("an output is None in some micro-batches and a tensor in others")
            result.append(None)
        else:
            result.append(torch.cat(col, dim=dim))
    return tuple(result)

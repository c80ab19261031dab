"""The user hook that overlaps one micro-batch's forward with another's backward."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch
from torch import nn

__all__ = ["OverlappedForwardBackward", "has_overlap_hook"]


@runtime_checkable
class OverlappedForwardBackward(Protocol):
    """A stage module class that can run a forward and an unrelated backward interleaved.

    The pipeline calls ``type(module0).overlapped_forward_backward(...)`` for every ``FB`` action when both
    local modules are of the same class and that class defines it:

    - forward ``module0`` on ``inputs0``; when ``criterion0`` is given (a last stage), also return
      ``loss0 = criterion0(*outputs0, *labels0)``;
    - backward ``module1`` for an earlier micro-batch: from ``loss1`` when given (already scaled by the
      pipeline's loss reduction; then ``loss1.detach_()``), otherwise ``run_backward(outputs1,
      output_grads1)`` (``outputs1`` may have had their storage freed: use their graph only). The gradients
      must land in ``.grad`` of that micro-batch's inputs exactly as the plain backward would; the executor
      raises, naming the hook, when they did not.
    - every rank of an expert-parallel group must issue the hook's collectives in the same order, also
      when it has nothing to send.

    Returns ``(outputs0, loss0)``. ``docs/overlap.md`` details each argument;
    :class:`dualpipe.overlap.OverlapStage` builds the hook from a stage declared as pieces.
    """

    @classmethod
    def overlapped_forward_backward(
        cls,
        module0: nn.Module,
        inputs0: Sequence[torch.Tensor],
        criterion0: Callable[..., torch.Tensor] | None,
        labels0: Sequence[torch.Tensor],
        module1: nn.Module,
        loss1: torch.Tensor | None,
        outputs1: Sequence[torch.Tensor],
        output_grads1: Sequence[torch.Tensor],
    ) -> tuple[Sequence[torch.Tensor], torch.Tensor | None]: ...


def has_overlap_hook(module0: nn.Module, module1: nn.Module) -> bool:
    """The reference's rule: both modules of one class, and the class defines the hook."""
    return type(module0) is type(module1) and callable(getattr(type(module0), "overlapped_forward_backward", None))

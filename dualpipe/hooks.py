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
    - backward ``module1`` for an earlier micro-batch: from ``loss1`` when given (then ``loss1.detach_()``),
      otherwise ``run_backward(outputs1, output_grads1)``. The gradients must land in ``.grad`` of that
      micro-batch's inputs exactly as the plain backward would.

    Returns ``(outputs0, loss0)``.
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

"""Watching the executor: what it runs and when, for benchmarks, traces and debugging.

A :class:`PipelineObserver` attached with :meth:`dualpipe.Pipeline.add_observer` is told when each span of
the executor's work begins and ends. Spans nest (a pair run without the hook is an ``action`` holding its
forward and backward ``action`` s; a ``recv`` sits inside the compute action that consumes the message).
With no observer attached the executor calls nothing and builds nothing.

Span kinds and their subjects:

- ``"action"``: a compute action (:class:`~dualpipe.schedule.Action`: ``F``, ``B``, ``I``, ``W``, ``FB``);
- ``"recv"``: waiting for a pipeline message inside a compute action; subject ``(kind, module, chunk)``
  with kind ``"F"`` (activations) or ``"B"`` (gradients);
- ``"post"``: issuing a batch of sends and receives between compute actions; subject the tuple of
  communication actions;
- ``"reap"``: releasing the activations of sends that completed, between compute actions (subject None);
- ``"drain"``: waiting for this rank's outstanding sends at the end of the step (subject None); the rank
  waits for its peers here, so measurements count it as idle.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

__all__ = ["SPAN_KINDS", "PipelineObserver", "ProfilerObserver", "SpanKind", "span_label"]

SpanKind = Literal["action", "recv", "post", "reap", "drain"]
SPAN_KINDS: tuple[SpanKind, ...] = ("action", "recv", "post", "reap", "drain")


class PipelineObserver:
    """Base class: override :meth:`begin` and :meth:`end` (both do nothing here)."""

    def begin(self, kind: SpanKind, subject: Any) -> None:
        """A span of ``kind`` starts (see the module docstring for the subjects)."""

    def end(self, kind: SpanKind, subject: Any) -> None:
        """The span most recently begun ends (spans nest)."""


def span_label(kind: SpanKind, subject: Any) -> str:
    """A short human-readable name: ``F0.3``, ``recv B1.2``, ``post SEND_F0.1>1 RECV_B0.0<1``, ``reap``."""
    if kind == "action":
        return str(subject)
    if kind == "recv":
        direction, module, chunk = subject
        return f"recv {direction}{module}.{chunk}"
    if kind == "post":
        return " ".join(["post", *map(str, subject)])
    return kind


class ProfilerObserver(PipelineObserver):
    """Marks every span in the torch profiler's trace (``record_function``), e.g. for a training trace."""

    def __init__(self) -> None:
        self._open: list[Any] = []

    def begin(self, kind: SpanKind, subject: Any) -> None:
        ctx = torch.profiler.record_function(f"pipeline {span_label(kind, subject)}")
        ctx.__enter__()
        self._open.append(ctx)

    def end(self, kind: SpanKind, subject: Any) -> None:
        self._open.pop().__exit__(None, None, None)

"""Piece event recording for overlap profiling (the overlap runtime's ``recorder``).

A recorder is optional: a stage with ``recorder=None`` records nothing. Each event is one edge of a span:
a compute sub-stage ("attn", "mlp", "attn.dx", ...) has ``begin``/``end``; a communication
("dispatch", "combine", ...) has ``start`` (issued) and ``wait`` (its result consumed). ``direction`` is
"fwd" or "bwd", so within one overlapped pair it also names the micro-batch (module0's forward or
module1's backward).

Timestamps: ``time.perf_counter`` on CPU; on CUDA a ``torch.cuda.Event`` recorded on the current stream,
resolved to milliseconds by :meth:`EventRecorder.timeline` (which synchronises). A communication's
``wait`` edge goes on the stream the transfer runs on when the caller knows it (``record_edge(...,
stream=)``): on the compute stream it would mark when compute reached the wait, not when the transfer
finished. A stream runs in issue order, so that stamp is the end of the last transfer issued on the stream
before the wait: a later transfer started in between (the other micro-batch's) stretches the span.
The ``start`` edge stays on the current stream: the transfer cannot begin before its input is ready there.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

__all__ = ["Event", "EventRecorder", "Recorder", "hidden_communications", "record_edge", "record_span"]


class Recorder(Protocol):
    """Where piece events go (:class:`EventRecorder` is one): ``edge`` is begin/end or start/wait.
    :func:`record_edge` also passes ``stream=`` when it knows the transfer's stream (CUDA recorders take it)."""

    def record(self, name: str, direction: str, layer: int, edge: str) -> None: ...


@dataclass(frozen=True, slots=True)
class Event:
    """One edge of a recorded span."""

    name: str
    """Sub-stage: attn, mlp, attn.dx, attn.dw, mlp.dx, mlp.dw, dispatch, combine, embed, head, ..."""
    direction: str
    """``fwd`` or ``bwd``."""
    layer: int
    """Global layer index (-1 for embedding and head)."""
    edge: str
    """``begin``/``end`` (compute) or ``start``/``wait`` (communication)."""
    stamp: Any
    """float seconds (CPU) or a recorded ``torch.cuda.Event``."""


class EventRecorder:
    """Appends :class:`Event` s in program order; one recorder per profiled run (never shared state)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.events: list[Event] = []

    def record(self, name: str, direction: str, layer: int, edge: str, stream: Any = None) -> None:
        """Append one edge; on CUDA its event goes on ``stream`` (default: the current stream)."""
        if self.device.type == "cuda":
            stamp: Any = torch.cuda.Event(enable_timing=True)
            stamp.record(stream)
        else:
            stamp = time.perf_counter()
        self.events.append(Event(name, direction, layer, edge, stamp))

    def clear(self) -> None:
        self.events.clear()

    def order(self) -> list[tuple[str, str, int, str]]:
        """The events without timestamps: ``(name, direction, layer, edge)`` in program order."""
        return [(e.name, e.direction, e.layer, e.edge) for e in self.events]

    def timeline(self) -> list[tuple[str, str, int, str, float]]:
        """``(name, direction, layer, edge, milliseconds since the first event)``."""
        if not self.events:
            return []
        first = self.events[0].stamp
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            ms = [first.elapsed_time(e.stamp) for e in self.events]
        else:
            ms = [(e.stamp - first) * 1e3 for e in self.events]
        return [(e.name, e.direction, e.layer, e.edge, t) for e, t in zip(self.events, ms)]


@contextlib.contextmanager
def record_span(recorder: Recorder | None, name: str, direction: str, layer: int) -> Iterator[None]:
    """Record ``begin``/``end`` around a compute sub-stage (no-op without a recorder)."""
    if recorder is None:
        yield
        return
    recorder.record(name, direction, layer, "begin")
    yield
    recorder.record(name, direction, layer, "end")


def record_edge(
    recorder: Recorder | None, name: str, direction: str, layer: int, edge: str, stream: Any = None
) -> None:
    """Record one communication edge (``start`` or ``wait``); no-op without a recorder. ``stream``: the CUDA
    stream the transfer runs on, where the ``wait`` edge belongs (None: the current stream)."""
    if recorder is None:
        return
    if stream is None:
        recorder.record(name, direction, layer, edge)  # recorders without a ``stream`` parameter work too
    else:
        recorder.record(name, direction, layer, edge, stream=stream)  # type: ignore[call-arg]


def hidden_communications(order: Sequence[tuple[str, str, int, str]]) -> int:
    """How many communications (start..wait spans) had a compute of the other direction end inside them:
    the ones an overlapped pair hid. ``order`` is :meth:`EventRecorder.order` (or any such tuples)."""
    hidden, opened = 0, {}
    for i, (name, direction, layer, edge) in enumerate(order):
        if edge == "start":
            opened[(name, direction, layer)] = i
        elif edge == "wait":
            start = opened.pop((name, direction, layer))
            other = "bwd" if direction == "fwd" else "fwd"
            hidden += any(e == "end" and d == other for _, d, _, e in order[start:i])
    return hidden

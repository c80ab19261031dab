"""Piece event recording for overlap profiling (the overlap runtime's ``recorder``).

A recorder is optional: a stage with ``recorder=None`` records nothing. Each event is one edge of a span:
a compute sub-stage ("attn", "mlp", "attn.dx", ...) has ``begin``/``end``; a communication
("dispatch", "combine", ...) has ``start`` (issued: the issuing call returned) and ``wait`` (its result
consumed). ``direction`` is "fwd" or "bwd", so within one overlapped pair it also names the micro-batch
(module0's forward or module1's backward).

Timestamps: ``time.perf_counter`` on CPU; on CUDA a ``torch.cuda.Event`` recorded on the current stream,
resolved to milliseconds by :meth:`EventRecorder.timeline` (which synchronises). A communication's
``wait`` edge goes on the stream the transfer runs on when the caller knows it (``record_edge(...,
stream=)``): on the compute stream it would mark when compute reached the wait, not when the transfer
finished. A stream runs in issue order, so that stamp is the end of the last transfer issued on the stream
before the wait: a later transfer started in between (the other micro-batch's) stretches the span.
The ``start`` edge stays on the current stream, recorded once the call that issues the transfer has
returned: the transfer cannot begin before its input is ready there, and the call's own work (packing the
rows to send) is not flight.

A compute piece that runs but has nothing to compute (the dW of a piece whose layers handed no
weight-gradient closures over: autograd computed those gradients in its dX) still records its span, closed
by an ``empty`` edge instead of ``end``, so a timeline shows it and :func:`hidden_fraction` does not count
it as work.

Hidden communication, the one metric (:func:`hidden_fraction`), per rank::

    |union(communication intervals) ∩ union(intervals of compute that did work)| / |union(communication intervals)|

A communication's interval runs from its ``start`` to its ``wait`` edge; compute is every ``begin``..``end``
span of a sub-stage (direction ``fwd`` or ``bwd``) of either micro-batch. Spans closed by ``empty`` are not
work, and spans of other directions that a caller records in the same recorder (the overlap benchmark's
pipeline actions and steps, which contain the waits) are not compute. On CPU the intervals are host time
(the compute thread's; the transfer runs in the backend's thread); on CUDA they are the events on both
streams, resolved on the GPU's clock.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = [
    "Event",
    "EventRecorder",
    "HiddenFraction",
    "Recorder",
    "hidden_fraction",
    "interval_overlap",
    "interval_union",
    "record_edge",
    "record_span",
    "timeline_text",
]


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
    """``begin``/``end`` (compute; ``empty`` ends a span that did no work) or ``start``/``wait`` (communication)."""
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
def record_span(recorder: Recorder | None, name: str, direction: str, layer: int, work: bool = True) -> Iterator[None]:
    """Record ``begin``/``end`` around a compute sub-stage (no-op without a recorder). ``work=False``: the
    piece has nothing to compute; its span ends with ``empty``, which :func:`hidden_fraction` does not count."""
    if recorder is None:
        yield
        return
    recorder.record(name, direction, layer, "begin")
    yield
    recorder.record(name, direction, layer, "end" if work else "empty")


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


# ------------------------------------------------------------------------------------------ hidden fraction

COMPUTE_DIRECTIONS = ("fwd", "bwd")
"""Directions of the sub-stage spans that count as compute; a recorder may hold other spans (containers)."""


@dataclass(frozen=True, slots=True)
class HiddenFraction:
    """How much communication time ran under compute that did work (:func:`hidden_fraction`). ``a + b`` (or
    ``sum(parts, HiddenFraction())``) pools ranks or steps: seconds and counts add, so the pooled fraction
    weighs each part by its communication time."""

    comm_s: float = 0.0
    """|union of the communication intervals|, seconds."""
    hidden_s: float = 0.0
    """Of which under the union of working compute intervals, seconds."""
    count: int = 0
    """Communications (start..wait spans)."""
    covered: int = 0
    """Of which any part ran under working compute (what the order of the events shows)."""
    kinds: dict[str, HiddenFraction] = field(default_factory=dict)
    """The same per kind, ``"<name>.<direction>"`` (``dispatch.fwd``, ``combine.bwd``, ...), first seen first;
    each kind's union is its own, so the kinds need not add up to the total where kinds overlap in time."""

    @property
    def fraction(self) -> float:
        """``hidden_s / comm_s``; NaN without communication."""
        return self.hidden_s / self.comm_s if self.comm_s > 0 else math.nan

    def __add__(self, other: HiddenFraction) -> HiddenFraction:
        kinds = dict(self.kinds)
        for kind, h in other.kinds.items():
            kinds[kind] = kinds[kind] + h if kind in kinds else h
        return HiddenFraction(
            self.comm_s + other.comm_s,
            self.hidden_s + other.hidden_s,
            self.count + other.count,
            self.covered + other.covered,
            kinds,
        )


def hidden_fraction(source: EventRecorder | Iterable[Event | Sequence[Any]]) -> HiddenFraction:
    """The hidden communication of one rank: ``|union(comm) ∩ union(working compute)| / |union(comm)|``
    overall and per kind (the module docstring gives the rule).

    ``source``: an :class:`EventRecorder` (CPU or CUDA), its ``events``, or rows ``(name, direction, layer,
    edge, time)`` in program order, ``time`` in seconds or a recorded ``torch.cuda.Event`` (resolved against
    the first row's). A ``wait`` without its ``start``, or an ``end`` without its ``begin``, is an error.
    """
    comm: dict[str, list[tuple[float, float]]] = {}
    work: list[tuple[float, float]] = []
    for (name, direction, _), closed_by, t0, t, _ in _spans(_rows(source), "hidden_fraction"):
        if closed_by == "wait":
            comm.setdefault(f"{name}.{direction}", []).append((t0, t))
        elif closed_by == "end" and direction in COMPUTE_DIRECTIONS:
            work.append((t0, t))
    worked = interval_union(work)
    kinds = {kind: _hidden(spans, worked) for kind, spans in comm.items()}
    total = _hidden([s for spans in comm.values() for s in spans], worked)
    return HiddenFraction(total.comm_s, total.hidden_s, total.count, total.covered, kinds)


def _spans(
    rows: Iterable[tuple[str, str, int, str, float]], caller: str
) -> Iterator[tuple[tuple[str, str, int], str, float, float, int]]:
    """``((name, direction, layer), closing edge, opened, closed, index of the opening row)`` of each span, in
    the order they close: a communication's ``start`` .. ``wait`` (first started, first waited), a compute
    span's ``begin`` .. ``end`` or ``empty`` (nested spans of one key close innermost first)."""
    started: dict[tuple[str, str, int], list[tuple[float, int]]] = {}
    begun: dict[tuple[str, str, int], list[tuple[float, int]]] = {}
    for i, (name, direction, layer, edge, t) in enumerate(rows):
        key = (name, direction, layer)
        if edge in ("start", "begin"):
            (started if edge == "start" else begun).setdefault(key, []).append((t, i))
        elif edge == "wait":
            if not started.get(key):
                raise ValueError(f"{caller}: {name}.{direction} (layer {layer}) was waited without a start")
            t0, at = started[key].pop(0)
            yield key, edge, t0, t, at
        elif edge in ("end", "empty"):
            if not begun.get(key):
                raise ValueError(f"{caller}: {name}.{direction} (layer {layer}) ended without a begin")
            t0, at = begun[key].pop()
            yield key, edge, t0, t, at


def timeline_text(
    source: EventRecorder | Iterable[Event | Sequence[Any]],
    *,
    window: tuple[float, float] | None = None,
    width: int = 64,
) -> str:
    """A recorded timeline as text, one line per span in the order they began: ``F.`` or ``B.`` (direction
    ``fwd`` or ``bwd``), the name and layer, then a bar over time: ``#`` a compute piece, ``.`` one that did
    no work (an empty dW), ``=`` a communication in flight (start to wait). ``window``: the seconds since the
    first event to draw (default: everything), ``width`` characters wide; spans outside it are left out.
    ``source`` as for :func:`hidden_fraction`; spans of other directions (pipeline actions) are left out."""
    rows = _rows(source)
    t_first = rows[0][4] if rows else 0.0
    spans = sorted(
        (a - t_first, at, b - t_first, key, closed_by)
        for key, closed_by, a, b, at in _spans(rows, "timeline_text")
        if key[1] in COMPUTE_DIRECTIONS
    )
    lo, hi = window if window is not None else (0.0, max((s[2] for s in spans), default=0.0))
    shown = [(a, b, key, closed_by) for a, _, b, key, closed_by in spans if b > lo and a < hi]
    scale = width / (hi - lo) if hi > lo else 0.0
    labels = [f"{'F' if d == 'fwd' else 'B'}.{n}{'' if layer < 0 else f' {layer}'}" for _, _, (n, d, layer), _ in shown]
    pad = max(map(len, labels), default=0)
    left, right = f"{lo * 1e3:.1f} ms", f"{hi * 1e3:.1f} ms"
    lines = [f"{'':{pad}}  |{left}{' ' * max(1, width - len(left) - len(right))}{right}|"]
    for (a, b, _, closed_by), label in zip(shown, labels):
        first = min(width - 1, int((max(a, lo) - lo) * scale))
        last = max(first + 1, min(width, round((min(b, hi) - lo) * scale)))
        mark = {"wait": "=", "end": "#", "empty": "."}[closed_by]
        lines.append(f"{label:<{pad}}  |{' ' * first}{mark * (last - first)}{' ' * (width - last)}|")
    return "\n".join(lines)


def _rows(source: Any) -> list[tuple[str, str, int, str, float]]:
    """``(name, direction, layer, edge, seconds)`` of ``source`` (see :func:`hidden_fraction`)."""
    if isinstance(source, EventRecorder):
        source = source.events
    rows = [(e.name, e.direction, e.layer, e.edge, e.stamp) if isinstance(e, Event) else tuple(e[:5]) for e in source]
    if rows and not isinstance(rows[0][4], (int, float)):  # CUDA events: milliseconds from the first one
        first = rows[0][4]
        torch.cuda.synchronize()
        return [(*r[:4], first.elapsed_time(r[4]) * 1e-3) for r in rows]
    return rows


def interval_union(spans: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering ``spans`` (empty ones dropped)."""
    merged: list[list[float]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def interval_overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two disjoint, sorted interval lists."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _hidden(spans: list[tuple[float, float]], worked: list[tuple[float, float]]) -> HiddenFraction:
    union = interval_union(spans)
    covered = sum(interval_overlap([s], worked) > 0 for s in spans)
    return HiddenFraction(sum(b - a for a, b in union), interval_overlap(union, worked), len(spans), covered)

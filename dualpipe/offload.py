"""Activation offloading: saved tensors go to host memory after their forward and come back before their backward.

:class:`Offloader` wraps each stage forward in ``torch.autograd.graph.saved_tensors_hooks``. Every tensor autograd
saves there is held through its storage (views of one storage share one entry, so its bytes move once). When the
forward action ends, the entries its ``choose`` callback picks are copied into a :class:`HostPool` buffer and the
device storage is dropped; before the backward that reads them they are copied back. The executor tells it when:
:func:`reload_points` reads this rank's action list, so each backward's tensors are reloaded while the compute
action before it runs (planned from the schedule, not guessed), and a forward whose backward is one of the next
two compute actions is not offloaded at all (its copy out and back would run beside the same action).

On CUDA the copies run on a stream of their own into pinned buffers the pool reuses across steps (keyed by byte
count); the offload records an event the reload waits on (same stream), and the reload an event the backward's
compute stream waits on. On CPU the same code path copies synchronously into the pool's buffers, so tests see
exactly what moved and when (:attr:`Offloader.log`). The copies are byte for byte: gradients do not change.

Naming and choosing are the model's business (``choose(module, entry) -> bool``; :class:`Saved` carries the
labels its ``label`` callback gave each saved view): this module knows nothing of MoE.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dualpipe.memory import SavedTensorTracker, storage_key
from dualpipe.schedule import Action, Op

__all__ = ["HostPool", "OffloadEvent", "Offloader", "Saved", "reload_points"]

Key = tuple[int, int]  # (local module, micro-batch)


class HostPool:
    """Host buffers for offloaded storages, reused across steps: a free list per byte count.

    Pinned on CUDA (``pin=True``) so copies run asynchronously. ``resident_bytes``: bytes of buffers holding an
    offloaded storage now; ``peak_bytes`` its maximum since :meth:`reset_peak`; ``allocated_bytes``: every buffer
    made, free or not (what the host holds for offloading)."""

    def __init__(self, pin: bool = False) -> None:
        self.pin = pin
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self.resident_bytes = 0
        self.peak_bytes = 0
        self.allocated_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        """A uint8 buffer of ``nbytes`` (a free one whose last copy out has finished, else a new one)."""
        free = self._free.get(nbytes, [])
        ready = next((i for i, (_, event) in enumerate(free) if event is None or event.query()), None)
        if ready is not None:
            buf = free.pop(ready)[0]
        else:
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)
            self.allocated_bytes += nbytes
        self.resident_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.resident_bytes)
        return buf

    def give(self, buf: torch.Tensor, event: Any = None) -> None:
        """Return ``buf``; ``event`` (CUDA): the copy reading it, which must finish before it is handed out again."""
        self.resident_bytes -= buf.numel()
        self._free.setdefault(buf.numel(), []).append((buf, event))

    def reset_peak(self) -> None:
        self.peak_bytes = self.resident_bytes


@dataclass(frozen=True, slots=True)
class OffloadEvent:
    """One copy: at action ``action`` of the rank's list, ``name``'s storage of ``(module, chunk)`` moved
    ``kind`` ``"offload"`` (to the host) or ``"reload"`` (back), ``nbytes`` bytes."""

    action: int
    module: int
    chunk: int
    name: str | None
    kind: str
    nbytes: int


class Saved:
    """One storage autograd saved in a stage forward: its bytes, the labels given to the views saved of it,
    and where its bytes are (device, or a host buffer after an offload)."""

    __slots__ = ("__weakref__", "device", "event", "host", "labels", "nbytes", "storage", "tracked")

    def __init__(self, t: torch.Tensor) -> None:
        self.storage: torch.UntypedStorage | None = t.untyped_storage()
        self.nbytes = self.storage.nbytes()
        self.device = t.device
        self.labels: list[Any] = []
        self.host: torch.Tensor | None = None
        self.event: Any = None  # the last copy's CUDA event
        self.tracked: Any = None  # the tracker's handle while the bytes are on the device

    @property
    def name(self) -> str | None:
        """The last name given to a view of it (a label's ``name``, or the label itself), None if none: the
        later reader of a storage knows it best (SDPA's output is the output projection's input)."""
        for label in reversed(self.labels):
            name = getattr(label, "name", label)
            if name is not None:
                return name
        return None


class _View:
    """What the pack hook returns: one saved tensor as a view of a :class:`Saved` storage."""

    __slots__ = ("dtype", "entry", "offset", "plain", "size", "stride")

    def __init__(self, entry: Saved | None, t: torch.Tensor) -> None:
        self.entry = entry
        self.plain = t if entry is None else None  # not held through an entry (meta, empty storage)
        self.dtype, self.offset, self.size, self.stride = t.dtype, t.storage_offset(), t.shape, t.stride()


@dataclass(slots=True)
class _Forward:
    """The storages one forward saved, weakly: an entry the graph has dropped is not worth moving."""

    entries: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)


class Offloader:
    """Moves chosen saved tensors of this rank's stage forwards to the host and back (the module docstring).

    Args:
        choose: ``choose(module, entry) -> bool``: offload this storage of local module ``module``.
        label: ``label(module, tensor) -> Any`` called as each tensor is saved (its name for ``choose`` and the
            log), or None.
        pool: the host buffers (a new :class:`HostPool`, pinned on CUDA, by default).
        tracker: the :class:`~dualpipe.memory.SavedTensorTracker` counting this step's activations, if one runs:
            the offloader's hooks shadow its own inside a forward, so the offloader counts for it (a moved
            storage leaves its count and comes back on reload).
    """

    def __init__(
        self,
        choose: Callable[[int, Saved], bool],
        label: Callable[[int, torch.Tensor], Any] | None = None,
        pool: HostPool | None = None,
        tracker: SavedTensorTracker | None = None,
    ) -> None:
        self.choose, self.label = choose, label
        self.pool = pool
        self.tracker = tracker
        self.log: list[OffloadEvent] = []
        self._forwards: dict[Key, _Forward] = {}
        self._away: dict[Key, list[Saved]] = {}
        self._stream: Any = None
        self._exclude: set[tuple[str, int]] = set()

    def exclude(self, tensors: Sequence[torch.Tensor]) -> None:
        """Never hold these through an entry (parameters, buffers: saved by reference, not activations)."""
        self._exclude = {storage_key(t) for t in tensors}

    def _copy_stream(self, device: torch.device) -> Any:
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    # -- hooks ------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def saving(self, key: Key) -> Iterator[None]:
        """Hold what the forward of ``key`` saves (one :class:`Saved` per storage)."""
        fwd = self._forwards.setdefault(key, _Forward())
        module = key[0]

        def pack(t: torch.Tensor) -> _View:
            storage = t.untyped_storage()
            if t.device.type == "meta" or storage.data_ptr() == 0 or storage_key(t) in self._exclude:
                return _View(None, t.detach())
            sk = storage_key(t)
            entry = fwd.entries.get(sk)
            if entry is None:
                entry = Saved(t)
                if self.tracker is not None:
                    entry.tracked = self.tracker._pack(t)
                fwd.entries[sk] = entry
            entry.labels.append(None if self.label is None else self.label(module, t))
            return _View(entry, t)

        with torch.autograd.graph.saved_tensors_hooks(pack, self._unpack):
            yield

    def _unpack(self, view: _View) -> torch.Tensor:
        entry = view.entry
        if entry is None:
            assert view.plain is not None
            return view.plain
        if entry.storage is None:  # not prefetched (a schedule the plan did not foresee): reload now
            self._reload(entry, None, -1)
        if entry.event is not None:
            torch.cuda.current_stream(entry.device).wait_event(entry.event)
        out = torch.empty(0, dtype=view.dtype, device=entry.device)
        return out.set_(entry.storage, view.offset, view.size, view.stride)

    # -- moves ------------------------------------------------------------------------------------------------
    def offload(self, key: Key, action: int) -> None:
        """The forward of ``key`` has ended: start copying its chosen storages to the host."""
        fwd = self._forwards.pop(key, None)
        if fwd is None:
            return
        moved = []
        for entry in list(fwd.entries.values()):
            storage = entry.storage
            # A storage freed for now (released, refilled before its backward) has nothing to move.
            if storage is None or storage.nbytes() == 0 or not self.choose(key[0], entry):
                continue
            if self.pool is None:
                self.pool = HostPool(pin=entry.device.type == "cuda")
            stream = self._copy_stream(entry.device)
            host = self.pool.take(entry.nbytes)
            device_bytes = torch.empty(0, dtype=torch.uint8, device=entry.device).set_(storage)
            with _on(stream, entry.device):
                host.copy_(device_bytes, non_blocking=stream is not None)
                if stream is not None:
                    # the storage must outlive the copy, which runs on the side stream
                    device_bytes.record_stream(stream)
                    entry.event = torch.cuda.Event()
                    entry.event.record(stream)
            entry.storage, entry.host = None, host
            self._untrack(entry)
            moved.append(entry)
            self.log.append(OffloadEvent(action, key[0], key[1], entry.name, "offload", entry.nbytes))
        if moved:
            self._away[key] = moved

    def reload(self, key: Key, action: int) -> None:
        """The backward of ``key`` comes next: start copying its storages back."""
        for entry in self._away.pop(key, []):
            self._reload(entry, key, action)

    def _reload(self, entry: Saved, key: Key | None, action: int) -> None:
        host = entry.host
        if host is None:
            return
        stream = self._copy_stream(entry.device)
        with _on(stream, entry.device):
            device_bytes = torch.empty(entry.nbytes, dtype=torch.uint8, device=entry.device)
            device_bytes.copy_(host, non_blocking=stream is not None)
            event = None
            if stream is not None:
                # allocated on the side stream, read and freed on the compute stream
                device_bytes.record_stream(torch.cuda.current_stream(entry.device))
                event = torch.cuda.Event()
                event.record(stream)
        assert self.pool is not None
        self.pool.give(host, event)
        entry.storage, entry.host, entry.event = device_bytes.untyped_storage(), None, event
        if self.tracker is not None:
            entry.tracked = self.tracker._pack(device_bytes)
        if key is not None:
            self.log.append(OffloadEvent(action, key[0], key[1], entry.name, "reload", entry.nbytes))
        else:
            self._away = {k: [e for e in v if e is not entry] for k, v in self._away.items()}

    def _untrack(self, entry: Saved) -> None:
        tracked, entry.tracked = entry.tracked, None
        if tracked is not None and tracked.key is not None:
            self.tracker._release(tracked.key)  # type: ignore[union-attr]
            tracked.key, tracked.tensor = None, None

    def end_step(self) -> None:
        """Forget the step's forwards; a storage still away (its backward never ran) stays in the pool's count."""
        self._forwards.clear()
        self._away.clear()

    @property
    def offloaded_bytes(self) -> int:
        """Bytes moved to the host so far (the log's offloads)."""
        return sum(e.nbytes for e in self.log if e.kind == "offload")


@contextlib.contextmanager
def _on(stream: Any, device: torch.device) -> Iterator[None]:
    """Run on the copy stream (CUDA, after what the compute stream has queued), or right here (CPU)."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield


def reload_points(actions: Sequence[Action]) -> tuple[dict[int, list[Key]], frozenset[Key]]:
    """When to reload each backward's saved tensors on a rank running ``actions``.

    Returns ``({action index: [keys to reload before running it]}, kept)``: a backward (``B``, ``I``, or the
    backward half of ``FB``) is reloaded at the compute action before it, so the copy runs under that action's
    compute and the tensors are back just before they are read. ``kept``: forwards whose backward is one of the
    next two compute actions (``W`` s not counted; a last stage's F then B, or F, B of another, B): their copy out
    and their copy back would run beside the same action, or none, and buy nothing.
    """
    points: dict[int, list[Key]] = {}
    kept: set[Key] = set()
    order: list[int] = []  # the compute actions but W, by index
    made: dict[Key, int] = {}  # a forward's position in ``order``
    for i, a in enumerate(actions):
        if not a.op.is_compute or a.op is Op.W:
            continue
        back = (a.module, a.chunk) if a.op in (Op.B, Op.I) else (a.b_module, a.b_chunk) if a.op is Op.FB else None
        if back is not None:
            if back in made and made[back] >= len(order) - 2:
                kept.add(back)
            else:
                points.setdefault(order[-1] if order else i, []).append(back)
        if a.op in (Op.F, Op.FB):
            made[(a.module, a.chunk)] = len(order)
        order.append(i)
    return points, frozenset(kept)

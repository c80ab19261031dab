"""Deferred weight gradients (the "W" of zero-bubble schedules).

A layer that wants its weight gradient deferred checks ``WeightGradStore.enabled`` inside its backward and,
when set, hands a closure to ``WeightGradStore.put`` instead of computing it. The pipeline runs the closures
later, one batch per ``W`` action, in FIFO order.

State lives in :class:`GradStore` instances: every pipeline owns one and makes it the *active* store while it
runs a compute action, so two pipelines in one process never see each other's closures. ``WeightGradStore``
is the reference's class-level name, kept as a thin shim that forwards to whichever store is active.

Which store is active is kept twice: in a context variable (the thread running the step) and on a
process-wide stack. The stack is for autograd's device threads: on CUDA, backward functions run on a worker
thread that does not see the step thread's context variables, while the step thread blocks in backward.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections import deque
from collections.abc import Callable, Iterator

__all__ = ["GradStore", "WeightGradStore", "active_store"]


class GradStore:
    """Per-pipeline queue of deferred weight-gradient closures.

    ``put`` appends to the batch being recorded; ``flush`` closes that batch (one backward = one batch);
    ``pop`` runs the oldest closed batch.
    """

    __slots__ = ("_batches", "_cache", "enabled")

    def __init__(self) -> None:
        self.enabled: bool = False
        self._cache: list[Callable[[], None]] = []
        self._batches: deque[list[Callable[[], None]]] = deque()

    def put(self, func: Callable[[], None]) -> None:
        self._cache.append(func)

    def flush(self) -> None:
        self._batches.append(self._cache)
        self._cache = []

    def pop(self) -> None:
        if not self._batches:
            raise RuntimeError("WeightGradStore.pop: no deferred weight-gradient batch is queued")
        for func in self._batches.popleft():
            func()

    def clear(self) -> None:
        self.enabled = False
        self._cache = []
        self._batches.clear()

    @property
    def pending(self) -> int:
        """Number of closed batches not yet popped."""
        return len(self._batches)

    def is_empty(self) -> bool:
        return not self._batches and not self._cache

    @contextlib.contextmanager
    def activate(self, enabled: bool = False) -> Iterator[GradStore]:
        """Make this the store ``WeightGradStore`` forwards to, with ``enabled`` set, for the block."""
        token = _ACTIVE.set(self)
        _STACK.append(self)
        previous = self.enabled
        self.enabled = enabled
        try:
            yield self
        finally:
            self.enabled = previous
            _STACK.pop()
            _ACTIVE.reset(token)


# Outside any pipeline step the shim forwards to this store (the reference's process-wide behaviour).
_FALLBACK = GradStore()
_ACTIVE: contextvars.ContextVar[GradStore] = contextvars.ContextVar("dualpipe_active_grad_store")
# Innermost active store of any thread, for threads that did not activate one (autograd's device threads).
_STACK: list[GradStore] = []


def active_store() -> GradStore:
    """The store of the pipeline running now, or a process-wide fallback outside any step."""
    store = _ACTIVE.get(None)
    if store is not None:
        return store
    return _STACK[-1] if _STACK else _FALLBACK


class _ForwardingMeta(type):
    # `WeightGradStore.enabled` is read as a class attribute by user layers, so the forwarding has to
    # happen at class level: a metaclass property does that without module-level mutable flags.
    @property
    def enabled(cls) -> bool:
        return active_store().enabled

    @enabled.setter
    def enabled(cls, value: bool) -> None:
        active_store().enabled = value

    @property
    def funcs_queue(cls) -> _QueueView:
        return _QueueView(active_store())


class _QueueView:
    """Read-only stand-in for the reference's ``funcs_queue`` (only ``empty()`` is used by callers)."""

    __slots__ = ("_store",)

    def __init__(self, store: GradStore) -> None:
        self._store = store

    def empty(self) -> bool:
        return self._store.pending == 0

    def qsize(self) -> int:
        return self._store.pending


class WeightGradStore(metaclass=_ForwardingMeta):
    """Reference-compatible facade: ``enabled``, ``put``, ``flush``, ``pop``, ``clear``.

    Every call goes to the store of the pipeline that is running a compute action right now.
    """

    @classmethod
    def put(cls, func: Callable[[], None]) -> None:
        active_store().put(func)

    @classmethod
    def flush(cls) -> None:
        active_store().flush()

    @classmethod
    def pop(cls) -> None:
        active_store().pop()

    @classmethod
    def clear(cls) -> None:
        active_store().clear()

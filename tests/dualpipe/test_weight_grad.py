"""Per-instance weight-gradient stores behind the reference's class-level facade."""

from __future__ import annotations

import pytest

from dualpipe import WeightGradStore
from dualpipe.weight_grad import GradStore, active_store


def test_facade_forwards_to_the_active_store() -> None:
    a, b = GradStore(), GradStore()
    ran: list[str] = []
    with a.activate(enabled=True):
        assert WeightGradStore.enabled
        WeightGradStore.put(lambda: ran.append("a1"))
        with b.activate(enabled=False):
            assert not WeightGradStore.enabled
            WeightGradStore.put(lambda: ran.append("b1"))
            WeightGradStore.flush()
        assert WeightGradStore.enabled  # back to a's setting
        WeightGradStore.flush()
    assert active_store() is not a and active_store() is not b
    assert (a.pending, b.pending) == (1, 1)
    b.pop()
    a.pop()
    assert ran == ["b1", "a1"]
    assert a.is_empty() and b.is_empty()


def test_batches_pop_in_fifo_order_and_empty_pop_raises() -> None:
    s = GradStore()
    ran: list[int] = []
    for i in range(3):
        s.put(lambda i=i: ran.append(i))
        s.put(lambda i=i: ran.append(10 + i))
        s.flush()
    with s.activate():
        assert WeightGradStore.funcs_queue.qsize() == 3
        assert not WeightGradStore.funcs_queue.empty()
    s.pop()
    s.pop()
    assert ran == [0, 10, 1, 11]
    s.clear()
    with pytest.raises(RuntimeError, match="no deferred weight-gradient batch"):
        s.pop()


def test_other_threads_see_the_active_store() -> None:
    # On CUDA, autograd runs backward functions on a device thread that does not inherit context variables.
    import threading

    store = GradStore()
    seen: list[bool] = []
    with store.activate(enabled=True):
        t = threading.Thread(target=lambda: (seen.append(WeightGradStore.enabled), WeightGradStore.put(print)))
        t.start()
        t.join()
        WeightGradStore.flush()
    assert seen == [True]
    assert store.pending == 1

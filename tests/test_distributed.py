"""The multi-rank test harness: results by value, child tracebacks, a deadline instead of a hang."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import RankFailure, RankTimeout, run_ranks


def _tensor_result(rank: int, world: int) -> dict:
    return {"t": torch.full((3,), float(rank)), "world": world}


def _raise_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise KeyError("boom from rank 1")
    dist.barrier()  # rank 0 would wait forever for rank 1


def _deadlock(rank: int, world: int) -> None:
    if rank == 0:
        t = torch.empty(1)
        dist.recv(t, src=1)  # rank 1 never sends


def test_results_come_back_by_value() -> None:
    out = run_ranks(_tensor_result, 2, timeout=60)
    assert [o["world"] for o in out] == [2, 2]
    assert all(torch.equal(o["t"], torch.full((3,), float(r))) for r, o in enumerate(out))


def test_a_child_exception_surfaces_with_its_traceback() -> None:
    with pytest.raises(RankFailure, match=r"rank 1 raised:(.|\n)*KeyError: 'boom from rank 1'"):
        run_ranks(_raise_on_rank_1, 2, timeout=60)


def test_a_deadlock_fails_within_the_deadline() -> None:
    start = time.monotonic()
    with pytest.raises((RankTimeout, RankFailure)):
        run_ranks(_deadlock, 2, timeout=8, pg_timeout=600)
    assert time.monotonic() - start < 30

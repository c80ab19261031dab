"""The parallel layout's pure parts: rank order, mirror pairs, and ParallelConfig's rules (no processes)."""

from __future__ import annotations

import pytest

from moe.parallel import ParallelConfig, mirror_pairs, rank_grid


def test_rank_order_puts_the_inner_dimension_on_consecutive_ranks() -> None:
    pp_major = rank_grid(ParallelConfig(pp=2, ep=3), 6)
    assert pp_major.tolist() == [[0, 1, 2], [3, 4, 5]]  # grid[pp_rank, ep_rank]: an ep group is one node
    ep_major = rank_grid(ParallelConfig(pp=2, ep=3, rank_order=("ep", "pp")), 6)
    assert ep_major.tolist() == [[0, 2, 4], [1, 3, 5]]  # a pipeline is one node
    with pytest.raises(ValueError, match="does not equal the world size 5"):
        rank_grid(ParallelConfig(pp=2, ep=3), 5)
    with pytest.raises(ValueError, match="rank_order"):
        ParallelConfig(rank_order=("pp", "dp"))


def test_stages_and_mirrors_come_from_the_schedule() -> None:
    assert ParallelConfig(pp=4, schedule="dualpipe").num_stages == 4
    assert mirror_pairs(ParallelConfig(pp=4, schedule="dualpipe").stage_layout) == [(0, 3), (1, 2)]
    assert mirror_pairs(ParallelConfig(pp=4, schedule="dualpipev").stage_layout) == []
    v = ParallelConfig(pp=2, schedule="interleaved-1f1b", modules_per_rank=3)
    assert (v.num_stages, v.modules_per_rank) == (6, 3)
    assert [v.stage_layout.stage_of(1, m) for m in range(3)] == [1, 3, 5]
    assert ParallelConfig(pp=2, schedule="interleaved-1f1b").modules_per_rank == 2  # the schedule's default
    with pytest.raises(ValueError, match="takes 2 module"):
        ParallelConfig(pp=2, schedule="dualpipev", modules_per_rank=3)
    with pytest.raises(ValueError, match="unknown schedule"):
        ParallelConfig(schedule="gpipe")

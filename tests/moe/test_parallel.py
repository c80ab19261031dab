"""The parallel layout's pure parts: rank order, mirror pairs, and ParallelConfig's rules (no processes)."""

from __future__ import annotations

import pytest
import torch

from moe.parallel import ParallelConfig, mirror_pairs, rank_grid
from tests.distributed import run_ranks


def test_rank_order_puts_the_inner_dimension_on_consecutive_ranks() -> None:
    pp_major = rank_grid(ParallelConfig(pp=2, ep=3), 6)
    assert pp_major[:, 0].tolist() == [[0, 1, 2], [3, 4, 5]]  # grid[pp, edp, ep]: an ep group is one node
    ep_major = rank_grid(ParallelConfig(pp=2, ep=3, rank_order=("ep", "pp")), 6)
    assert ep_major[:, 0].tolist() == [[0, 2, 4], [1, 3, 5]]  # a pipeline is one node
    with pytest.raises(ValueError, match="does not equal the world size 5"):
        rank_grid(ParallelConfig(pp=2, ep=3), 5)
    with pytest.raises(ValueError, match="rank_order"):
        ParallelConfig(rank_order=("pp", "dp"))


def test_expert_replicas_sit_outside_the_expert_group() -> None:
    # pp=2 x dp=4 with ep=2: two expert replicas per stage; ep innermost, so each ep group is 2 consecutive
    # ranks and a stage's dp group is 4 consecutive ranks.
    config = ParallelConfig(pp=2, dp=4, ep=2)
    assert (config.edp, config.world_size) == (2, 8)
    grid = rank_grid(config, 8)
    assert grid.shape == (2, 2, 2)
    assert grid[1].flatten().tolist() == [4, 5, 6, 7]  # the dp group of stage 1
    assert grid[0, :, 1].tolist() == [1, 3]  # the ranks holding ep rank 1's experts (edp group)
    assert grid[:, 1, 0].tolist() == [2, 6]  # a pipeline
    # ep outermost: an expert group spans the pipelines' ranks
    spread = rank_grid(ParallelConfig(pp=2, dp=4, ep=2, rank_order=("ep", "edp", "pp")), 8)
    assert spread[0, 0].tolist() == [0, 4]
    assert ParallelConfig(pp=2, ep=2).dp == 2  # dp defaults to ep: one replica
    with pytest.raises(ValueError, match="ep=3 must divide dp=4"):
        ParallelConfig(dp=4, ep=3)
    with pytest.raises(ValueError, match="pp x dp = 2 x 4 = 8 does not equal the world size 6"):
        rank_grid(config, 6)


def test_no_sms_are_reserved_without_an_all_to_all() -> None:
    assert ParallelConfig(ep=1, comm_sms=20).reserved_sms == 0
    assert ParallelConfig(ep=2, comm_sms=20).reserved_sms == 20


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


def _reduce_in_buckets(rank: int, world: int) -> tuple[list[torch.Tensor], list[int]]:
    import torch.distributed as dist

    from moe.train import grad_sync

    sizes: list[int] = []
    real = dist.all_reduce

    def counting(t, *args, **kwargs):
        sizes.append(t.numel() * t.element_size())
        return real(t, *args, **kwargs)

    grad_sync.dist.all_reduce = counting
    gen = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(n, generator=gen) for n in (3, 5, 40, 2, 7)] + [torch.ones(4, dtype=torch.float64)]
    grad_sync.all_reduce_buckets(tensors, None, scale=0.5, bucket_bytes=64)
    return tensors, sizes


def test_gradients_are_reduced_in_buckets_not_one_flat_copy() -> None:
    results = run_ranks(_reduce_in_buckets, world_size=2, timeout=60)
    want = [
        (torch.randn(n, generator=g0) + torch.randn(n, generator=g1)) * 0.5
        for g0, g1 in [(torch.Generator().manual_seed(0), torch.Generator().manual_seed(1))]
        for n in (3, 5, 40, 2, 7)
    ]
    for tensors, sizes in results:
        for got, expect in zip(tensors, want):
            torch.testing.assert_close(got, expect)
        assert torch.equal(tensors[-1], torch.ones(4, dtype=torch.float64))  # its own bucket: a new dtype
        # 3+5 floats share a bucket (32 B), the 160-byte tensor is alone, 2+7 share one, the float64 is alone
        assert sizes == [32, 160, 36, 32]

"""The row-count exchange on NCCL: on its own group it does not queue behind a transfer of the expert group.

ProcessGroupNCCL runs a group's collectives in issue order on one stream per device. A large all-to-all is
started on the expert group, then the counts are exchanged and read on the host
(:func:`dualpipe.collectives.exchange_counts_to_host`, as ``alltoall`` does before each dispatch): on
``ParallelLayout.counts_group`` the host has them while the large transfer is still running
(``Work.is_completed()`` False); on the expert group itself it would get them only after the transfer.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dualpipe.collectives import exchange_counts_to_host
from moe.parallel import ParallelConfig, init_layout
from tests.distributed import run_ranks

pytestmark = pytest.mark.multigpu
BIG_ELEMENTS = 1 << 28
"""1 GiB of float32 per rank: milliseconds of transfer even over NVLink, far longer than a count exchange."""


def _counts_while_rows_fly(rank: int, world: int) -> list[bool]:
    layout = init_layout(ParallelConfig(pp=1, ep=world, dispatcher="alltoall"), "cuda")
    assert layout.counts_group is not None and layout.counts_group is not layout.ep_group
    counts = torch.ones(world, dtype=torch.int64, device="cuda")
    for group in (layout.ep_group, layout.counts_group):  # communicators created before anything is timed
        dist.all_to_all_single(torch.empty_like(counts), counts, group=group)
    torch.cuda.synchronize()
    rows = torch.ones(BIG_ELEMENTS, device="cuda")
    got = torch.empty_like(rows)
    still_running = []
    for _ in range(3):
        # As in the overlapped pair: the other micro-batch's transfer is in flight, not yet waited by the compute
        # stream, when this one's counts are exchanged and read.
        work = dist.all_to_all_single(got, rows, group=layout.ep_group, async_op=True)
        sent, received = exchange_counts_to_host(counts, layout.counts_group).wait()
        still_running.append(not work.is_completed())
        assert sent == received == [1] * world
        work.wait()
        torch.cuda.synchronize()
    return still_running


@pytest.mark.multigpu(gpus=2)
def test_counts_arrive_while_the_expert_groups_transfer_runs() -> None:
    for still_running in run_ranks(_counts_while_rows_fly, world_size=2, backend="nccl", timeout=300):
        assert any(still_running), still_running  # at least once in 3 (a fast link may finish first)

"""Every process group of the layout waits as long as the default group (the trainer's ``--timeout``).

``new_group`` and ``DeviceMesh`` give a group its backend's default timeout (gloo 30 minutes, NCCL 10) unless
it is passed: a hung peer in an expert all-to-all then stalled the job for that long. Each group's timeout is
read back from its backend, where c10d keeps it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe.parallel import ParallelConfig, init_layout, with_schedule
from tests.distributed import run_ranks

PG_TIMEOUT = 37.0
"""The default group's timeout (seconds): unlike either backend's default."""


def _timeouts(rank: int, world: int) -> dict[str, float]:
    dualpipe = init_layout(ParallelConfig(pp=2, ep=2, schedule="dualpipe"))  # a mirror group
    one_f_one_b = with_schedule(dualpipe, "1f1b")  # an embedding group, created by with_schedule
    groups = {name: getattr(dualpipe, name) for name in ("pp_group", "dp_group", "edp_group", "ep_group")}
    groups |= {"mirror_group": dualpipe.mirror_group, "embed_group": one_f_one_b.embed_group}
    groups |= {f"mesh[{dim}]": dualpipe.mesh[dim].get_group() for dim in ("pp", "edp", "ep")}
    cpu = torch.device("cpu")
    assert dist.group.WORLD._get_backend(cpu).options._timeout.total_seconds() == PG_TIMEOUT
    return {name: g._get_backend(cpu).options._timeout.total_seconds() for name, g in groups.items()}


def test_every_group_gets_the_default_groups_timeout() -> None:
    for timeouts in run_ranks(_timeouts, world_size=4, timeout=120, pg_timeout=PG_TIMEOUT):
        assert timeouts == dict.fromkeys(timeouts, PG_TIMEOUT)
        assert len(timeouts) == 9

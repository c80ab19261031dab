"""What a costs file's ``host`` entry adds to the planner: host work between pieces, the row counts' wait, a
machine whose ranks share its cores; and the hidden fraction as a recorded run measures it."""

from __future__ import annotations

import dataclasses

import pytest

from dualpipe.schedule import build_schedule
from moe.pipeline_layout import plan_stages
from moe.plan.measured import MeasuredCosts
from moe.plan.pair import BlockTimes, chunk_times
from moe.plan.search import Candidate, predict
from tests.moe.plan.test_pair_search import _Uniform


def _unit(**kw) -> BlockTimes:
    return BlockTimes(1, 1, 1, 1, 1, 1, 1, 1, **{"shared_f": 1, "shared_dx": 1, "shared_dw": 1, **kw})


def test_a_lone_forward_pays_its_host_work_and_waits_for_the_row_counts() -> None:
    t = chunk_times([_unit(shared_f=0, host_f=1.0, counts=0.5)])
    # attn 0-1, host 1-1.5, the counts' wait 1.5-2, dispatch 2-3, mlp 3-4, host 4-4.5, combine 4.5-5.5
    assert t.F == 5.5
    assert t.exposed_f == 2.5  # the counts' wait and both transfers: the host work is the rank's, not exposed
    assert t.flight[0] == 2.5 and t.covered[0] == 0.0  # a lone forward hides nothing
    assert t.comm_f == 2.5


def test_the_pair_hides_all_but_the_row_counts_wait() -> None:
    plain = chunk_times([_unit()])
    assert plain.FB == 9.0 and plain.covered[2] == pytest.approx(plain.flight[2])  # every transfer hidden
    t = chunk_times([_unit(counts=0.5)])
    # the counts fly under B.shared (2 s) from F.attn's end, then the rank waits the last 0.5 s for them
    assert t.FB == 9.5 and t.exposed_fb == 0.5
    assert t.flight[2] - t.covered[2] == pytest.approx(0.5)
    host = chunk_times([_unit(host_f=1.0, host_b=1.0)])
    assert host.FB == 11.0 and host.exposed_fb == 0.0  # the host work is busy time, not all-to-all
    assert host.covered[2] < host.flight[2]  # but a transfer in flight over it is not under compute


class _Shared(_Uniform):
    def __init__(self, cores_per_rank: float, share: float = 1.0, comm_cpu: float = 0.0) -> None:
        super().__init__(compute=1.0, comm=0.0)
        self.shared = (cores_per_rank, share, comm_cpu)

    def shared_cores(self):
        return self.shared


@pytest.mark.parametrize(("cores_per_rank", "share", "comm_cpu"), [(1.0, 1.0, 0.0), (0.5, 1.0, 0.0), (0.5, 0.5, 0.25)])
def test_ranks_sharing_cores_take_at_least_their_cpu_over_the_cores(cores_per_rank, share, comm_cpu) -> None:
    plans = plan_stages("EtL", num_stages=1, num_layers=1, mtp_layers=0)
    c = Candidate("1f1b", 1, 1, 1, 4, 0, "none")
    kw = dict(plans=plans, tokens_per_step=4, num_gpus=1, peak_flops=1.0)
    alone = predict(c, _Uniform(compute=1.0, comm=0.0), **kw)
    shared = predict(c, _Shared(cores_per_rank, share, comm_cpu), **kw)
    busy = 4 * 6.0  # 4 micro-batches, one block of 2 forward and 4 backward units each
    assert alone.pipeline_time == busy and alone.cpu_bound == 0.0
    want = (busy * share + 4 * comm_cpu) / cores_per_rank  # one block a micro-batch: 4 block passes
    assert shared.cpu_bound == pytest.approx(want)
    assert shared.pipeline_time == pytest.approx(max(busy, want))


def _file(**host) -> MeasuredCosts:
    from moe.models.config import PRESETS

    return MeasuredCosts(config=PRESETS["tiny"], seq_len=16, tokens=32, moe={"attn_F": 1e-3}, host=host)


def test_the_host_entry_is_checked_and_kept() -> None:
    f = _file(F=1e-3, B=2e-3, counts=5e-4, cores_per_rank=0.5, cpu_share=0.7, comm_cpu=1e-3, expert_imbalance=1.1)
    again = MeasuredCosts.from_json(f.to_json())
    assert again.host == f.host and again.shared_cores() == (0.5, 0.7, 1e-3)
    assert "host" not in _file().to_json() and _file().shared_cores() is None  # older files read as they did
    for bad, match in (
        ({"cores": 2}, "unknown field 'cores'"),
        ({"cpu_share": 1.5}, "cpu_share must be in"),
        ({"expert_imbalance": 0.9}, "at least 1"),
        ({"F": -1.0}, "host.F must be a number >= 0"),
    ):
        with pytest.raises(ValueError, match=match):
            _file(**bad)
    assert dataclasses.replace(f, host={}).shared_cores() is None
    assert build_schedule("1f1b", 1, 4)  # the schedule the bound test runs exists at pp = 1

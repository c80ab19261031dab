"""The planner's activation offloading: the memory it saves (the executor's reload points walked per action),
the copy time it adds where the host link cannot hide it, and the search trying it where a candidate does not
fit without."""

from __future__ import annotations

import dataclasses

import pytest

from dualpipe.schedule import build_schedule
from dualpipe.simulate import simulate
from moe.models.config import preset
from moe.plan.costs import Parallelism, Workload
from moe.plan.footprint import footprint, offloaded_bytes
from moe.plan.hardware import Cluster, gpu, with_overrides
from moe.plan.offload import with_copies
from moe.plan.params import rank_stages
from moe.plan.report import RunShape, evaluate, plan
from moe.plan.search import OFFLOAD_TRIES, Candidate
from moe.train import config_from_args
from moe.train.preflight import job_footprint

CFG = preset("tiny")
WORK = Workload(seq_len=64, micro_batch=2)


def _acts(schedule: str, pp: int, offload: str, rank: int = 0) -> float:
    par = Parallelism(pp=pp, dp=1, ep=1, schedule=schedule, offload=offload)
    return footprint(CFG, par, WORK, num_chunks=2 * pp, pp_rank=rank).activations


@pytest.mark.parametrize("schedule", ["1f1b", "dualpipev", "dualpipe", "zbv"])
def test_a_policy_that_moves_nothing_on_a_rank_leaves_its_count(schedule: str) -> None:
    assert _acts(schedule, 2, "all@ranks=1", rank=0) == _acts(schedule, 2, "", rank=0)
    # the per-action walk's live micro-batches (on the device and away together) peak where the simulator's do
    par = Parallelism(pp=2, dp=1, ep=1, schedule=schedule, offload="all")
    peaks = simulate(build_schedule(schedule, 2, 4)).peak_activations
    assert [footprint(CFG, par, WORK, num_chunks=4, pp_rank=r).peak_modules for r in (0, 1)] == list(peaks)


def test_the_peak_keeps_only_the_micro_batches_on_the_device_whole() -> None:
    # 1F1B at pp = 4, rank 0: F0 F1 F2 F3 B0 ... Without offloading four micro-batches are live after F3. With it,
    # F1 and F2 are away; F0 came back for B0 under F3, and F3 was just made: two whole, two less the moved bytes.
    par = Parallelism(pp=4, dp=1, ep=1, schedule="1f1b", offload="all")
    stages = [sp for _, sp in rank_stages(CFG, 4, "1f1b", 0)]
    (moved,) = offloaded_bytes(CFG, par, WORK, 0, stages)
    assert moved > 0
    assert _acts("1f1b", 4, "", 0) - _acts("1f1b", 4, "all", 0) == 2 * moved
    # the last rank runs each backward right after its forward: nothing to move there
    assert _acts("1f1b", 4, "all", 3) == _acts("1f1b", 4, "", 3)


def test_copies_lengthen_only_the_actions_they_outlast() -> None:
    schedule = build_schedule("1f1b", 2, 4)
    compute = [[a for a in actions if a.op.is_compute] for actions in schedule.ranks]
    ones = [[1.0] * len(c) for c in compute]
    assert with_copies(schedule, ones, [[0.5], [0.5]]) == ones  # hidden under every action
    slow = with_copies(schedule, ones, [[3.0], [3.0]])
    # rank 0, F0 F1 B0 F2 B1 F3 B2 B3: each copy (3 s) runs beside one action, one copy after another. F0 and F3
    # stay (their backward is two actions on: out and back would run beside the same action); under B0: F1 out;
    # under F2: F1 back; under B1: F2 out; under F3: F2 back
    assert [str(a) for a in compute[0]] == ["F0.0", "F0.1", "B0.0", "F0.2", "B0.1", "F0.3", "B0.2", "B0.3"]
    assert slow[0] == [1.0, 1.0, 3.0, 3.0, 3.0, 3.0, 1.0, 1.0]
    assert slow[1] == ones[1]  # the last rank keeps everything


def test_the_search_offloads_where_a_candidate_does_not_fit_without() -> None:
    small = with_overrides(gpu("h100"), hbm_bytes=1.45e6)  # tiny's dualpipev at pp = 2 needs ~1.26 MB
    cluster = Cluster(small, 8, 4)
    run = RunShape(64, 64, 2)
    result = plan(CFG, cluster, run, schedules=["dualpipev", "dualpipe"], recompute=["none"], top=100)
    offloaded = [p for p in result.ranked if p.candidate.offload]
    assert offloaded and all(p.fits for p in offloaded)
    for p in offloaded:
        c = p.candidate
        bare = evaluate(CFG, cluster, run, dataclasses.replace(c, offload=""))
        assert not bare.fits and p.memory.activations < bare.memory.activations
        tried = OFFLOAD_TRIES[: OFFLOAD_TRIES.index(c.offload)]  # none of the ones moving less fits
        assert not any(evaluate(CFG, cluster, run, dataclasses.replace(c, offload=o)).fits for o in tried)
        assert p.step_time >= bare.step_time  # the copies can only add time
        assert f"offload={c.offload}" in c.describe() and p.to_dict()["offload"] == c.offload
        assert c.label == f"{c.schedule} --offload {c.offload}"  # the trainer's flag, in the table


def test_the_host_link_is_cited_per_device() -> None:
    assert {g: gpu(g).host_bytes_per_s for g in ("h100", "h800", "h200")} == dict.fromkeys(
        ("h100", "h800", "h200"), 64e9
    )
    c = Candidate("dualpipev", 2, 4, 2, 8, 20, "none", offload="all")
    slow = Cluster(with_overrides(gpu("h100"), host_bytes_per_s=1e6), 8, 4)
    fast = Cluster(gpu("h100"), 8, 4)
    run = RunShape(64, 64, 2)
    assert evaluate(CFG, slow, run, c).step_time > evaluate(CFG, fast, run, c).step_time


def test_the_trainers_preflight_counts_its_offload_and_extra_warmup() -> None:
    argv = ["--preset", "tiny", "--pp", "4", "--schedule", "1f1b", "--seq-len", "32", "--num-chunks", "8"]
    plain, _ = config_from_args(argv, world=4)
    moved, _ = config_from_args([*argv, "--offload", "all"], world=4)
    warm, _ = config_from_args([*argv, "--extra-warmup", "1"], world=4)
    assert job_footprint(moved).activations < job_footprint(plain).activations
    assert job_footprint(warm).activations > job_footprint(plain).activations  # one more micro-batch in flight

"""The planner's overlapped 1F1B family: deferred pairs timed like an I, extra warm-up forwards searched and
sized."""

from __future__ import annotations

import pytest

from dualpipe.schedule import Op, build_schedule
from moe.models.config import preset
from moe.plan.costs import Parallelism, Workload
from moe.plan.footprint import footprint
from moe.plan.hardware import Cluster, gpu
from moe.plan.pair import ChunkTimes
from moe.plan.report import RunShape, plan
from moe.plan.search import _durations, candidates

# F 1, B 3 of which W 1, the pair 3.5; each chunk moves 0.5 s of all-to-all, a pair leaves 0.1 s of it exposed.
_T = ChunkTimes(F=1.0, B=3.0, W=1.0, FB=3.5, comm_f=0.5, exposed_f=0.5, exposed_b=0.25, exposed_fb=0.1)


class _Same:
    """Every stage and every pair costs :data:`_T`."""

    def alone(self, stage: int) -> ChunkTimes:
        return _T

    def pair(self, f_stage: int, b_stage: int) -> ChunkTimes:
        return _T

    def half_blocks(self, stage: int) -> float:
        return 0.5


def test_a_deferred_pair_costs_the_pair_less_its_w_and_queues_the_w() -> None:
    schedule = build_schedule("zb1p", 2, 4, extra_warmup=1)
    last = [str(a) for a in schedule.ranks[1] if a.op.is_compute]
    assert last == ["F0.0", "(F0.1&I0.0)", "(F0.2&I0.1)", "W", "(F0.3&I0.2)", "W", "I0.3", "W", "W"]
    tally = _durations(schedule, _Same())
    durations, exposed, total = tally.durations, tally.exposed, tally.total
    # a pair 3.5 - W 1 = 2.5; its W (1) later, as an I's (B - W = 2)
    assert durations[1] == [1.0, 2.5, 2.5, 1.0, 2.5, 1.0, 2.0, 1.0, 1.0]
    assert durations[0] == [1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 2.0, 1.0, 2.0, 1.0, 2.0, 1.0]
    # rank 0: 4 F (0.5 each) and 4 I (all 0.5 exposed); rank 1: F 0.5, 3 pairs 0.1 + the I half's 0.5, I 0.5
    assert exposed == pytest.approx(4 * 0.5 + 4 * 0.5 + 0.5 + 3 * 0.6 + 0.5)
    assert total == pytest.approx(16 * 0.5)
    plain = _durations(schedule, _Same(), overlap=False).durations
    assert plain[1] == [1.0, 3.0, 3.0, 1.0, 3.0, 1.0, 2.0, 1.0, 1.0]  # F + (B - W), then the W


def test_the_search_tries_one_extra_warmup_for_the_1f1b_family_where_ep_is_above_one() -> None:
    found = list(
        candidates(
            num_gpus=8, num_layers=8, num_experts=4, global_batch=32, micro_batch=1,
            schedules=["1f1b", "interleaved-1f1b", "dualpipe"], recompute=["none"],
        )
    )  # fmt: skip
    warm = {(c.schedule, c.pp, c.ep) for c in found if c.extra_warmup}
    assert {c.extra_warmup for c in found} == {0, 1}
    assert ("1f1b", 2, 2) in warm and ("interleaved-1f1b", 2, 2) in warm
    assert all(c.ep > 1 and c.schedule != "dualpipe" for c in found if c.extra_warmup)
    # 1F1B at pp = 8 has 4 micro-batches per rank: rank 0's 7 + 1 warm-up forwards leave no steady step
    assert ("1f1b", 8, 0) in {(c.schedule, c.pp, c.extra_warmup) for c in found}
    assert ("1f1b", 8, 1) not in {(c.schedule, c.pp, c.extra_warmup) for c in found}
    assert next(c for c in found if c.extra_warmup).label.endswith("+w1")


def _tiny_plan(schedules: list[str], option: str) -> dict:
    """The tiny preset's plan on 8 GPUs, every candidate by (schedule, pp, ep, its ``option``)."""
    result = plan(
        preset("tiny"),
        Cluster(gpu("h100"), 8, 4),
        RunShape(64, 64, 2),
        schedules=schedules,
        recompute=["none"],
        top=100,
    )
    return {
        (p.candidate.schedule, p.candidate.pp, p.candidate.ep, getattr(p.candidate, option)): p for p in result.ranked
    }


def test_the_plan_times_the_overlapped_family_with_its_pairs() -> None:
    got = _tiny_plan(["1f1b", "interleaved-1f1b"], "extra_warmup")
    for schedule in ("1f1b", "interleaved-1f1b"):
        for e in (0, 1):
            c = got[schedule, 2, 2, e].candidate
            built = build_schedule(c.schedule, c.pp, c.num_chunks, extra_warmup=e)
            pairs = sum(a.op is Op.FB for actions in built.ranks for a in actions)
            assert pairs > 0 or (schedule, e) == ("1f1b", 0)
    # the pairs one extra forward adds hide all-to-all that the lone chunks expose
    for schedule in ("1f1b", "interleaved-1f1b"):
        assert got[schedule, 2, 2, 1].exposed_a2a_fraction < got[schedule, 2, 2, 0].exposed_a2a_fraction
    assert got["1f1b", 2, 2, 1].to_dict()["extra_warmup"] == 1


@pytest.mark.parametrize(("schedule", "pp"), [("1f1b", 4), ("interleaved-1f1b", 2)])
def test_memory_grows_with_the_extra_warmup(schedule: str, pp: int) -> None:
    cfg, work = preset("tiny"), Workload(seq_len=64, micro_batch=2)
    sized = [
        footprint(cfg, Parallelism(pp=pp, dp=2, ep=2, schedule=schedule, extra_warmup=e), work, num_chunks=8)
        for e in (0, 1)
    ]
    assert sized[1].peak_modules == sized[0].peak_modules + 1  # rank 0 keeps one more micro-batch in flight
    assert sized[1].activations > sized[0].activations and sized[1].params == sized[0].params


def test_the_search_tries_the_v_family_with_and_without_its_pairs() -> None:
    got = _tiny_plan(["v-half", "dualpipev"], "overlap")
    assert ("dualpipev", 2, 2, False) not in got  # DualPipeV's pairs are its order: overlap is all it changes
    on, off = got["v-half", 2, 2, True], got["v-half", 2, 2, False]
    # without overlap v-half runs its plan unpaired: its 2 pairs at this shape do not pay for the sends they hold
    # back (tests/moe/plan/test_compare_schedules.py), and the search sees it
    assert off.step_time < on.step_time and off.exposed_a2a_fraction > on.exposed_a2a_fraction
    assert off.candidate.label == "v-half --no-overlap" and "overlap=off" in off.candidate.describe()
    assert off.to_dict()["overlap"] is False
    # at ep = 1 there is no all-to-all to hide: the V family is tried unpaired only
    assert ("v-half", 2, 1, True) not in got and ("v-half", 2, 1, False) in got

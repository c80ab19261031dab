"""The zero-bubble V family (zbv, v-half, v-min) through the simulator: the published bubble and memory.

Costs are the zero-bubble papers' ``F = I = W`` (``--F 1 --B 2 --W 1``: a full backward is I + W).
``peak_activation_stages`` counts 1F1B stages for one micro-batch, i.e. a rank's layers for one micro-batch
(a V module holds half of them): the bounds below, in full-rank micro-batches, apply to it as is.
"""

from __future__ import annotations

import json

import pytest

from dualpipe.checks import check_schedule
from dualpipe.generators_v import _plan, _v_block, pairs_per_step
from dualpipe.schedule import Op, build_schedule
from dualpipe.simulate import Costs, main, simulate

V_FAMILY = ("zbv", "v-half", "v-min")
SHAPES = [(p, m) for p in (4, 8, 16) for m in (2 * p, 4 * p)]
EQUAL = Costs(F=1, B=2, W=1)


@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_zbv_bubble_is_the_published_figure(p: int, m: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(f"--schedule zbv --ranks {p} --chunks {m} --F 1 --B 2 --W 1 --json".split()) == 0
    out = json.loads(capsys.readouterr().out)
    # simulate's bubble (every rank's idle time over ranks x makespan) and the table's are one figure here:
    # every rank is busy 6m (F, I and W of two modules per micro-batch; a pair costs F + B), so the bubble is
    # 1 - 6m / makespan, and the table's (p-1) / (p-1+6m) is a makespan of 6m + p-1: the last rank's wait for
    # the first forward, and nothing else.
    assert out["busy"] == [6 * m] * p
    assert out["bubble_fraction"] == pytest.approx(sum(out["idle"]) / (p * out["makespan"]), rel=1e-12)
    assert out["bubble_fraction"] == pytest.approx(1 - 6 * m / out["makespan"], rel=1e-12)
    assert out["bubble_fraction"] == pytest.approx((p - 1) / (p - 1 + 6 * m), rel=1e-12)
    assert max(out["peak_activation_stages"]) <= p + 1


@pytest.mark.parametrize(("p", "m"), SHAPES)
def test_activation_memory_per_rank(p: int, m: int) -> None:
    bounds = {"zbv": p + 1, "v-half": p / 2 + 2, "v-min": p / 3 + 2}  # full-rank micro-batches
    peaks, idles = {}, {}
    for name, bound in bounds.items():
        r = simulate(build_schedule(name, p, m), EQUAL)
        assert r.peak_activation_stages == tuple(n / 2 for n in r.peak_activations)  # a module: half a stage
        assert max(r.peak_activation_stages) <= bound, (name, r.peak_activation_stages)
        assert r.parameter_copies == 1
        peaks[name], idles[name] = max(r.peak_activation_stages), max(r.idle)
    # memory bought back costs bubble, in the table's order
    assert peaks["v-min"] < peaks["v-half"] < peaks["zbv"]
    assert idles["zbv"] < idles["v-half"] < idles["v-min"]


@pytest.mark.parametrize("name", V_FAMILY)
def test_the_bubble_is_only_fill_and_drain(name: str) -> None:
    # The steady state runs every rank without a gap: more micro-batches leave every rank's idle time alone.
    for p in (3, 4, 8):
        idle = [simulate(build_schedule(name, p, m), EQUAL).idle for m in (2 * p, 3 * p + 1, 4 * p)]
        assert idle[0] == idle[1] == idle[2], (p, idle)


def test_zbv_bounds_its_deferred_weight_gradients() -> None:
    # W fills the waits, but a rank never queues more than 3N-2 of them (each keeps its layer inputs alive).
    for p in (2, 4, 8):
        for m in (2 * p, 4 * p, 6 * p):
            for actions in build_schedule("zbv", p, m).ranks:
                queued = peak = 0
                for a in actions:
                    queued += (a.op is Op.I) - (a.op is Op.W)
                    peak = max(peak, queued)
                assert peak <= 3 * p - 2


def test_pairs_are_made_where_they_cost_nothing() -> None:
    # zbv pairs a forward with a backward where the three slots of F, I and W run back to back and nobody
    # waits for what the pair sends later; the published bubble holds with them (see the test above).
    s = build_schedule("zbv", 4, 16)
    pairs = [a for actions in s.ranks for a in actions if a.op is Op.FB]
    assert pairs and all(a.chunk != a.b_chunk for a in pairs)
    assert simulate(s, EQUAL).makespan == 6 * 16 + 3
    overlapped = simulate(s, Costs(F=1, B=2, W=1, FB=2.5))  # a pair that hides work ends earlier
    assert overlapped.makespan <= 6 * 16 + 3 and sum(overlapped.busy) < sum(simulate(s, EQUAL).busy)


@pytest.mark.parametrize("memory", ["half", "min"])
def test_building_blocks_repeat_without_collisions(memory: str) -> None:
    # Every rank's four passes of a micro-batch fall on distinct slots of the 6-slot period, at any size.
    for n in range(1, 65):
        for slots in _v_block(n, memory):
            assert len({s % 6 for s in slots}) == 4


@pytest.mark.parametrize("p", [4, 8])
@pytest.mark.parametrize("name", V_FAMILY)
def test_pairs_never_lengthen_the_step(name: str, p: int) -> None:
    # At F&B = F + B a paired step ends when the unpaired one does; with a real overlap it can only end earlier,
    # and the pairs take no activation memory (a pair adds one module and frees one).
    m = 2 * p
    paired, unpaired = build_schedule(name, p, m), build_schedule(name, p, m, overlap=False)
    check_schedule(unpaired, ("async", "grouped"))
    assert not any(a.op is Op.FB for actions in unpaired.ranks for a in actions)  # as run without overlap
    plan = [[a for a in actions if a.op.is_compute] for actions in unpaired.ranks]
    assert plan == [list(order) for order in _plan(name, p, m)]  # the planner's order, the W s where it put them
    base = simulate(unpaired)
    assert simulate(paired).makespan == base.makespan
    for fb in (2.0, 2.5):  # F&B from max(F, B) (a full overlap) to half of F hidden
        assert simulate(paired, Costs(FB=fb)).makespan <= base.makespan
    assert simulate(paired).peak_activations <= base.peak_activations


# Pairs per step at 2p micro-batches (every V schedule's default), pinned: the greedy pairs in the order the
# unpaired plan starts its passes, so the counts are its output, not a closed form. Reasons, per schedule:
# zbv's steady state alternates F and I on every rank with W s to spare: most adjacent F/I fold;
# v-half keeps a micro-batch about 6N slots on a rank, so fewer F/I meet back to back; v-min's block hands every
# pass on at once (no slack), so it pairs least and none at p = 8.
PAIRS = {
    "zbv": {4: 9, 8: 33, 16: 107},
    "v-half": {4: 7, 8: 20, 16: 50},
    "v-min": {4: 5, 8: 0, 16: 24},
}


@pytest.mark.parametrize("name", V_FAMILY)
def test_pairs_per_step(name: str) -> None:
    assert {p: pairs_per_step(name, p) for p in (4, 8, 16)} == PAIRS[name]
    assert pairs_per_step(name, 4) == pairs_per_step(name, 4, 8)  # the default is 2p micro-batches


@pytest.mark.parametrize("name", ["zbv", "v-half", "v-min"])
def test_lazy_pairing_trials_plan_what_running_every_rank_plans(name: str) -> None:
    """A trial pair runs only the ranks it changes (the others are read from the run it departs from): the
    paired plan and its slots are those of trials that run every rank, on shapes where pairs are refused as well
    as taken."""
    from dualpipe.generators_v import _pair

    pairs = 0
    for n, m in ((3, 9), (4, 16), (6, 12), (8, 24)):
        plan = _plan(name, n, m)
        lazy, eager = _pair(n, plan), _pair(n, plan, lazy=False)
        assert lazy == eager, (name, n, m)
        pairs += sum(a.op is Op.FB for order in lazy[0] for a in order)
    assert pairs > 0

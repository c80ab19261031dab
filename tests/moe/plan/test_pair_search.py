"""The planner's timing core: sub-stages on two streams, and schedules timed from them."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dualpipe.schedule import build_schedule
from dualpipe.simulate import Costs, simulate
from moe.pipeline_layout import StagePlan, plan_stages
from moe.plan.pair import BlockTimes, chunk_times
from moe.plan.search import Candidate, candidates, predict, rank_predictions, why_worse


def _block(compute: float = 1.0, comm: float = 0.0) -> BlockTimes:
    c = compute
    return BlockTimes(attn_f=c, attn_dx=c, attn_dw=c, mlp_f=c, mlp_dx=c, mlp_dw=c, dispatch=comm, combine=comm)


def test_a_lone_chunk_waits_for_its_all_to_alls_and_a_pair_hides_them() -> None:
    t = chunk_times([_block(1.0, 1.0)])
    # Forward: 2 computes + 2 transfers. Backward: 4 computes + 2 transfers, one under the MLP's dW.
    assert (t.F, t.B, t.W) == (4.0, 5.0, 2.0)
    assert (t.exposed_f, t.exposed_b) == (2.0, 1.0)
    # The pair: B.combine under F.attn, F.dispatch under B.mlp, B.dispatch and F.combine under F.mlp and
    # B.attn: 6 units of compute, every transfer hidden.
    assert t.FB == 6.0 and t.exposed_fb == 0.0 and t.comm_f == 2.0
    slow = chunk_times([_block(1.0, 3.0)])  # transfers longer than the compute they can hide under
    assert slow.FB > 6.0 and slow.exposed_fb == slow.FB - 6.0
    assert slow.FB < slow.F + slow.B  # still better than running the halves one after the other
    free = chunk_times([_block(1.0, 0.0)] * 3)
    assert free.FB == free.F + free.B == 18.0 and free.exposed_fb == 0.0


def test_uneven_modules_pair_what_they_can() -> None:
    t = chunk_times([_block()] * 3, [_block()] * 1, extra_f=0.5, extra_b=0.25)
    assert t.FB == 3 * 2 + 4 + 0.75  # no communication: the pair is its compute


@dataclass
class _Uniform:
    """A cost model with identical blocks, no embedding or head cost, no P2P and no reduction."""

    compute: float
    comm: float

    def block(self, layer: int) -> BlockTimes:
        return _block(self.compute, self.comm)

    def embed(self) -> tuple[float, float]:
        return (0.0, 0.0)

    def head(self) -> tuple[float, float]:
        return (0.0, 0.0)

    def p2p(self) -> float:
        return 0.0

    def dp_reduce(self) -> float:
        return 0.0

    def memory(self):
        return type("M", (), {"total": 1.0})()

    def fits(self) -> bool:
        return True

    def model_flops(self) -> float:
        return 1.0

    def shared_cores(self) -> None:
        return None


def _one_layer_each(stages: int) -> list[StagePlan]:
    text = "|".join(["Et", *["t"] * (stages - 2), "tL"])
    return plan_stages(text, num_stages=stages, num_layers=stages, mtp_layers=0)


@pytest.mark.parametrize(("schedule", "pp", "chunks"), [("1f1b", 4, 8), ("dualpipe", 4, 8), ("dualpipev", 2, 8)])
def test_without_communication_the_published_bubbles_come_back(schedule: str, pp: int, chunks: int) -> None:
    """One block per stage, every sub-stage 1 unit: F = 2, B = 4, W = 2 per chunk, F&B = F + B (nothing to
    overlap): the simulator's regime for the report's formulas (F = B - W, W <= F, F&B <= F + B)."""
    cand = Candidate(schedule, pp, 1, 1, chunks, 0, False)
    layers = build_schedule(schedule, pp, chunks).layout.num_stages
    plans = _one_layer_each(layers)
    got = predict(cand, _Uniform(1.0, 0.0), plans=plans, tokens_per_step=1, num_gpus=pp, peak_flops=1.0)
    F, B, W = 2.0, 4.0, 2.0
    stages = layers if schedule == "dualpipev" else pp
    formula = {
        "1f1b": (pp - 1) * (F + B),
        "dualpipe": (stages / 2 - 1) * ((F + B) + B - 3 * W),
        "dualpipev": (stages / 2 - 1) * ((F + B) + B - 3 * W),
    }[schedule]
    assert max(got.sim.idle) == pytest.approx(formula)
    reference = simulate(build_schedule(schedule, pp, chunks), Costs(F=F, B=B, W=W))
    assert got.pipeline_time == pytest.approx(reference.makespan)
    assert got.exposed_a2a_fraction == 0.0


def test_overlap_hides_what_a_lone_chunk_exposes() -> None:
    dualpipev = Candidate("dualpipev", 2, 1, 1, 8, 0, False)
    zb1p = Candidate("zb1p", 2, 1, 1, 8, 0, False)
    kw = dict(tokens_per_step=1, num_gpus=2, peak_flops=1.0)
    overlapped = predict(dualpipev, _Uniform(1.0, 1.0), plans=_one_layer_each(4), **kw)
    two_each = plan_stages("Ett|ttL", num_stages=2, num_layers=4, mtp_layers=0)  # the same 4 layers on 2 stages
    plain = predict(zb1p, _Uniform(1.0, 1.0), plans=two_each, **kw)
    assert plain.exposed_a2a_fraction > 0.7  # no pair: only a backward's dW hides anything
    assert 0.0 <= overlapped.exposed_a2a_fraction < 0.5
    best, worse = rank_predictions([plain, overlapped])
    assert best is overlapped
    assert why_worse(worse, best).startswith("step +")


def test_candidates_respect_every_rule() -> None:
    found = list(
        candidates(num_gpus=8, num_layers=4, num_experts=4, global_batch=32, micro_batch=1, schedules=["dualpipev"])
    )
    assert found and all(c.dp * c.pp == 8 and c.dp % c.ep == 0 and 4 % c.ep == 0 for c in found)
    assert all(2 * c.pp <= 4 for c in found)  # DualPipeV: 2 stages per rank, at most one layer each
    assert all(c.comm_sms == 0 for c in found if c.ep == 1)
    assert all(c.num_chunks * c.dp == 32 and c.num_chunks >= 2 * c.pp for c in found)

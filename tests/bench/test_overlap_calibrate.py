"""``bench.overlap --calibrate``'s costs file: sub-stage seconds from recorded spans (unit), and on the
emulated cluster (``cluster`` marker) the planner's prediction from that file against the overlap
benchmark's measurement of DualPipeV with overlap in the same session."""

from __future__ import annotations

import json

import pytest

from bench.overlap.calibrate import Setup, report, run
from bench.overlap.costs import link_rates, rate_bytes_per_s, substage_seconds
from bench.overlap.stats import parse_events
from moe.plan.costs import COMPUTE_FIELDS
from moe.plan.measured import load_costs


def _ev(name, direction, layer, edge, t):
    return [name, direction, layer, edge, t]


def _lone_step(scale: float = 1.0):
    """One layer's lone forward then lone backward, every all-to-all waited at once, with host work
    between the recorded spans; ``scale`` stretches every time."""
    events = [
        ("step", "m", 0, "begin", 0.0),
        ("F0.0", "action", 0, "begin", 0.0),
        ("attn", "fwd", 0, "begin", 0.0), ("attn", "fwd", 0, "end", 1.0),  # then 0.5 s issuing the exchange
        ("counts", "fwd", 0, "start", 1.5), ("counts", "fwd", 0, "wait", 2.0),
        ("dispatch", "fwd", 0, "start", 2.0), ("dispatch", "fwd", 0, "wait", 4.0),
        ("mlp", "fwd", 0, "begin", 4.0), ("mlp", "fwd", 0, "end", 6.0),
        ("combine", "fwd", 0, "start", 6.0), ("combine", "fwd", 0, "wait", 7.0),
        ("residual", "fwd", 0, "begin", 7.0), ("residual", "fwd", 0, "end", 7.5),  # then 0.5 s to the action's end
        ("F0.0", "action", 0, "end", 8.0),
        ("B0.0", "action", 0, "begin", 8.0),
        ("combine", "bwd", 0, "start", 8.0), ("combine", "bwd", 0, "wait", 9.0),
        ("mlp.dx", "bwd", 0, "begin", 9.0), ("mlp.dx", "bwd", 0, "end", 10.0),
        ("dispatch", "bwd", 0, "start", 10.2),  # issued after the input gradient; the weight gradient runs under it
        ("mlp.dw", "bwd", 0, "begin", 10.2), ("mlp.dw", "bwd", 0, "end", 11.2),
        ("dispatch", "bwd", 0, "wait", 12.0),
        ("attn.dx", "bwd", 0, "begin", 12.0), ("attn.dx", "bwd", 0, "end", 13.0),
        ("attn.dw", "bwd", 0, "begin", 13.0), ("attn.dw", "bwd", 0, "end", 13.5),
        ("B0.0", "action", 0, "end", 14.0),
        ("step", "m", 0, "end", 14.0),
    ]  # fmt: skip
    return parse_events([_ev(n, d, layer, e, t * scale) for n, d, layer, e, t in events])


def test_substages_account_for_every_moment_of_a_lone_chunk():
    got = substage_seconds([[_lone_step()], [_lone_step()], [_lone_step(3.0)]])  # the disturbed step is outvoted
    # host work goes to the compute it sits with, pro rata; an all-to-all costs the time the rank waits for it
    want = {
        "attn_F": 1.5 + 1.0,  # attention and the exchange's issue, then the residual and the action's tail
        "mlp_F": 2.0,
        "mlp_dX": 1.1, "mlp_dW": 1.1,  # 2.2 s between the combine's and the dispatch's waits, split 1:1
        "attn_dX": 2.0 * 2 / 3, "attn_dW": 2.0 / 3,
        "dispatch": 0.5 + 2.0,  # the forward's wait (row counts, rows): the backward's hides under its dW
        "combine": 1.0,
    }  # fmt: skip
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v), k
    # every moment of the lone chunks is accounted for once: the forward waits the whole dispatch, the
    # backward only its last 0.8 s (the weight gradient runs under the rest)
    fields = sum(v for k, v in got.items() if k not in ("dispatch", "combine"))
    assert fields + got["dispatch"] + 0.8 + 2 * got["combine"] == pytest.approx(14.0)


def test_within_a_step_the_mean_counts():
    got = substage_seconds([[_lone_step(), _lone_step(2.0)]])  # two ranks in one step
    assert got["mlp_F"] == pytest.approx((2.0 + 4.0) / 2)


def test_rates_in_tc_units():
    assert rate_bytes_per_s("400mbit") == 50e6
    assert rate_bytes_per_s("1gbit") == 125e6 and rate_bytes_per_s("50mbps") == 50e6
    with pytest.raises(ValueError, match="not a tc rate"):
        rate_bytes_per_s("400 megabit")
    assert link_rates("400mbit", ranks_per_node=2, ep=2) == 25e6  # a node's link shared by its ranks
    assert link_rates(None, 1, 2) is None and link_rates("400mbit", 1, 1) is None


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> tuple[dict, object]:
    """One emulated-cluster run: the no-overlap steps calibrate, the overlapped ones are predicted (the
    ranks need the machine's cores to themselves: a process beside them slows what they do unevenly)."""
    out = tmp_path_factory.mktemp("calibration")
    record = run(Setup(steps=3), out)
    print(report(record))
    return record, out


@pytest.mark.cluster
@pytest.mark.slow
def test_costs_file_describes_the_run_and_its_lone_chunks(calibration):
    record, out = calibration
    costs = load_costs(next(out.glob("costs-*.json")))
    assert costs.device == record["device"] and costs.internode_bytes_per_s == 50e6 and costs.gpus_per_node == 1
    assert {"attn_F", "attn_dX", "mlp_dW", "dispatch", "combine", "embed_F", "head_B"} <= costs.moe.keys()
    assert json.loads(next(out.glob("calibration-*.json")).read_text())["error"] == record["error"]
    # a forward plus a backward chunk as the no-overlap mode ran them (the planner takes one dispatch time
    # for both directions, the runtime's forward one also exchanges row counts: the sum is what compares)
    lone, predicted = record["measured_no_overlap"]["costs_ms"], record["predicted"]["costs_ms"]
    assert predicted["F"] + predicted["B"] == pytest.approx(lone["F"] + lone["B"], rel=0.2)


HIDDEN_GAP = (
    "the planner predicts 0.96 hidden here and runs measure 0.74-0.77 (2026-11-26, idle; +0.19 at the test's "
    "0.20 margin): its costs fold the host work between pieces (issuing transfers, routing metadata: about 10% of "
    "a CPU rank's step) into the compute a transfer hides under, which the one metric does not count as work, "
    "and it takes the expert-parallel ranks as equally loaded (here one rank's experts get ~13% more tokens, and "
    "the other waits ~3% of the step for it); neither is modelled yet"
)


@pytest.mark.cluster
@pytest.mark.slow
@pytest.mark.xfail(reason=HIDDEN_GAP, strict=False)
def test_planner_predicts_the_hidden_fraction_within_20_points(calibration):
    record, _ = calibration
    # hidden fractions: absolute points (both are fractions, of different denominators: module docstring)
    assert abs(record["predicted"]["hidden"] - record["measured"]["hidden"]) <= 0.2


@pytest.mark.cluster
@pytest.mark.slow
def test_planner_predicts_the_overlapped_step_within_20_percent(calibration):
    """Measured on a quiet 2-core machine: predicted 2% to 12% under the overlapped step before the pair order,
    11% under since (1,402 against 1,570 ms, 2026-11-26; for a while the runtime waited the row counts after
    B's side dX where the planner times them after its dW, and the gap was 21%); beside another busy process
    the CPU ranks slow unevenly and the gap grows past 30%, which is why the fixture wants the cores to
    itself."""
    record, _ = calibration
    # the benchmark's step is the pipeline alone (no gradient reduction, no optimizer): pipeline_time
    assert record["predicted"]["pipeline_ms"] == pytest.approx(record["measured"]["step_ms"], rel=0.2)


def test_calibrate_on_loopback_writes_compute_only(tmp_path, capsys):
    from bench.overlap import cli

    tiny = ["--hidden", "32", "--moe-intermediate", "32", "--seq-len", "16", "--micro-batch", "2", "--layers", "2"]
    assert cli.main([*tiny, "--pp", "1", "--ep", "2", "--chunks", "4", "--calibrate", "--out", str(tmp_path)]) == 0
    assert "calibration (dualpipev, no overlap)" in capsys.readouterr().out
    costs = load_costs(next(tmp_path.glob("costs-cpu-*-loopback-*.json")))
    # every all-to-all byte stayed on loopback, whose rate nobody measured: compute only
    assert costs.moe.keys() == set(COMPUTE_FIELDS)  # the shared experts' piece timed apart
    assert costs.internode_bytes_per_s is None and costs.act_bytes == 4 and costs.tokens == 32
    assert costs.config.hidden_size == 32 and costs.ep == 2 and costs.gpus_per_node == 2


def test_the_benchmark_and_the_calibration_import_in_one_direction() -> None:
    """The calibration runs the benchmark; the benchmark writes costs through bench.overlap.costs, never through
    the calibration (they used to import each other)."""
    import pathlib

    from tests.imports import imports as imports_of

    root = pathlib.Path(__file__).resolve().parents[2] / "bench" / "overlap"

    def imports(name: str) -> set[str]:
        return imports_of(root / f"{name}.py")

    assert not any(m.startswith("bench.overlap.calibrate") for m in imports("cli"))
    assert "bench.overlap.costs" in imports("cli") and "bench.overlap.cli" in imports("calibrate")
    assert not {"bench.overlap.cli", "bench.overlap.calibrate"} & imports("costs")

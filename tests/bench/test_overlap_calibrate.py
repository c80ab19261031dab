"""``bench.overlap --calibrate``'s costs file and the planner's check against the benchmark: sub-stage seconds
from recorded spans, and the comparison and its report on synthetic inputs (unit); on the emulated cluster
(``cluster`` marker) one calibration run and the files it writes. How close the planner comes to a measured
time depends on the machine's load, so the tool prints that comparison (``python -m bench.overlap.calibrate``)
and no test asserts it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.overlap.calibrate import HIDDEN_MARGIN, MARGIN, Setup, compare, predict_setup, report, run
from bench.overlap.costs import calibration_costs, link_rates, rate_bytes_per_s, substage_seconds
from bench.overlap.run import CALIBRATION_MODE, WorkerOptions, model_config
from bench.overlap.stats import parse_events
from moe.plan.costs import COMPUTE_FIELDS
from moe.plan.measured import MeasuredCosts, load_costs


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
    # each piece its recorded span; the host work between them (issuing the exchanges, the action's tail) apart,
    # per block; an all-to-all costs the time the rank waits for it, the row counts apart from the rows
    want = {
        "attn_F": 1.0 + 0.5,  # attention, and the residual before the next block's
        "mlp_F": 2.0,
        "mlp_dX": 1.0, "mlp_dW": 1.0,
        "attn_dX": 1.0, "attn_dW": 0.5,
        "host_F": 0.5 + 0.5,  # issuing the exchange, and the action's tail after the residual
        "host_B": 0.2 + 0.5,  # issuing the backward dispatch, and the action's tail
        "counts": 0.5,
        "dispatch": 2.0,  # the forward's wait for the rows: the backward's hides under its dW
        "combine": 1.0,
    }  # fmt: skip
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert got[k] == pytest.approx(v), k
    # every moment of the lone chunks is accounted for once: the forward waits the whole dispatch, the
    # backward only its last 0.8 s (the weight gradient runs under the rest)
    fields = sum(v for k, v in got.items() if k not in ("counts", "dispatch", "combine"))
    assert fields + got["counts"] + got["dispatch"] + 0.8 + 2 * got["combine"] == pytest.approx(14.0)


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


def _costs(setup: Setup):
    """A costs file from synthetic lone steps, as the calibration writes it for ``setup`` on the cluster."""
    opts = WorkerOptions(
        pp=setup.pp, ep=setup.ep, chunks=setup.chunks, hidden=setup.hidden, layers=setup.layers,
        moe_intermediate=setup.moe_intermediate, modes=[CALIBRATION_MODE],
    )  # fmt: skip
    return calibration_costs(
        [[_lone_step()], [_lone_step()], [_lone_step()]],
        cfg=model_config(opts),
        seq_len=setup.seq_len,
        micro_batch=setup.micro_batch,
        ep=setup.ep,
        ranks_per_node=1,
        ep_ranks_per_node=1,
        act_bytes=4,
        device="cpu-test",
        rate=setup.rate,
    )


def _row(mode: str, step_ms: float, F: float, B: float, exposed_ms: float, hidden: float) -> dict:
    return {
        "mode": mode, "step_ms": step_ms, "step_ms_min": 0.9 * step_ms, "step_ms_max": 1.1 * step_ms,
        "hidden": hidden, "hidden_in_pairs": hidden, "a2a_ms": 4 * exposed_ms, "a2a_exposed_ms": exposed_ms,
        "bubble": 0.05, "cpu_use": 0.5, "costs_ms": {"F": F, "B": B, "W": 1.0, "FB": F + B},
    }  # fmt: skip


def test_the_comparison_is_predicted_over_measured_with_the_margin_marked():
    setup, memory = Setup(), 8e9
    costs = _costs(setup)
    pred, _ = predict_setup(costs, setup, memory_bytes=memory)
    assert pred.pipeline_time > 0 and 0 <= pred.exposed_a2a_fraction <= 1
    planned = compare(setup, costs, {"rows": [_row("dualpipev-overlap", 1.0, 1.0, 1.0, 1.0, 0.5)]}, memory_bytes=memory)
    step_ms, lone_ms = planned["predicted"]["pipeline_ms"], planned["predicted"]["lone_F_plus_B_ms"]
    assert step_ms == pytest.approx(pred.pipeline_time * 1e3) and lone_ms > 0
    assert "lone_F_plus_B" not in planned["ratio"]  # no no-overlap row: no lone chunk to compare

    # measured: the step 1/0.7 of the prediction (outside), the lone chunk 1/1.05 (within), the hidden fraction
    # 0.3 points under it (outside); the no-overlap mode waited 4x the overlapped one's exposed all-to-all time
    hidden = planned["predicted"]["hidden"] - 0.3
    record = {
        "rows": [
            _row("dualpipev-overlap", step_ms / 0.7, 30.0, 40.0, 100.0, hidden),
            _row(CALIBRATION_MODE, step_ms, 0.4 * lone_ms / 1.05, 0.6 * lone_ms / 1.05, 400.0, 0.1),
        ]
    }
    got = compare(setup, costs, record, memory_bytes=memory)
    assert got["ratio"] == pytest.approx({"step": 0.7, "lone_F_plus_B": 1.05})
    assert got["error"] == {
        "step_relative": pytest.approx(-0.3),
        "hidden_points": pytest.approx(0.3),
        "step_within_margin": False,
        "hidden_within_margin": False,
        "lone_F_plus_B_within_margin": True,
    }
    assert got["measured"]["hidden_vs_lone_wait"] == pytest.approx(0.75)
    assert got["measured"]["costs_ms"]["FB"] == 70.0 and got["measured"]["lone_F_plus_B_ms"] == pytest.approx(
        lone_ms / 1.05
    )
    assert (MARGIN, HIDDEN_MARGIN) == (0.1, 0.05)  # the report's "10%" and "0.05" below

    text = report(
        {
            "device": "cpu-test",
            "date": "2026-01-02",
            "setup": {"pp": 1},
            "cpus": 2,
            "load_average_1min": [0.25, 1.5],
            "substage_ms": {"calibration (dualpipev, no overlap)": {"attn_F": 2.5}},
            **got,
        }
    )
    lines = text.splitlines()
    assert lines[0] == "cpu-test 2026-01-02: dualpipev-overlap, {'pp': 1}"
    assert lines[1].startswith("  step (pipeline, no dp reduction): measured ")
    assert lines[1].endswith(f"predicted {step_ms:.0f} ms, ratio 0.70 (OUTSIDE 10%)")
    assert lines[2].endswith(f"predicted {lone_ms:.1f} ms, ratio 1.05 (within 10%)")
    assert lines[3].endswith("(+0.30 points, OUTSIDE 0.05)")
    assert lines[4].startswith("  action ms measured / predicted: F 30.0 / ")
    assert lines[5] == "  calibration (dualpipev, no overlap): attn_F 2.50"
    assert lines[6].startswith("  load average (1 min) 0.25 before, 1.50 after, on 2 CPUs")


@pytest.fixture(scope="module")
def calibration(tmp_path_factory) -> tuple[dict, object]:
    """One emulated-cluster run: the no-overlap steps calibrate, the overlapped ones are predicted. The test reads
    the files' shape, not the timings: the smallest model and one timed step (the benchmark's own setup is
    ``Setup()``, run by ``python -m bench.overlap.calibrate``)."""
    out = tmp_path_factory.mktemp("calibration")
    tiny = Setup(chunks=4, micro_batch=2, seq_len=16, hidden=32, moe_intermediate=32, layers=2, steps=1)
    record = run(tiny, out)
    print(report(record))  # the planner against the measurement: printed, since it depends on the machine's load
    return record, out


@pytest.mark.cluster
@pytest.mark.slow
def test_costs_file_describes_the_run_and_its_lone_chunks(calibration):
    record, out = calibration
    costs = load_costs(next(out.glob("costs-*.json")))
    assert costs.device == record["device"] and costs.internode_bytes_per_s == 50e6 and costs.gpus_per_node == 1
    assert {"attn_F", "attn_dX", "mlp_dW", "dispatch", "combine", "embed_F", "head_B"} <= costs.moe.keys()
    saved = json.loads(next(out.glob("calibration-*.json")).read_text())
    assert saved["error"] == record["error"] and saved["ratio"] == record["ratio"]
    assert set(record["ratio"]) == {"step", "lone_F_plus_B"} and all(r > 0 for r in record["ratio"].values())
    assert record["measured"]["lone_F_plus_B_ms"] == pytest.approx(
        sum(record["measured_no_overlap"]["costs_ms"][k] for k in "FB")
    )


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


RECORDED = sorted((Path(__file__).resolve().parents[2] / "bench" / "results").glob("calibration-*-idle-*.json"))
"""The idle calibration runs kept in bench/results (``python -m bench.overlap.calibrate``): each has its costs
file, the measured rows of both modes and the setup."""


def test_idle_runs_of_two_configurations_are_recorded():
    setups = {(json.loads(p.read_text())["setup"]["pp"], json.loads(p.read_text())["setup"]["ep"]) for p in RECORDED}
    assert {(1, 2), (2, 2)} <= setups


@pytest.mark.parametrize("path", RECORDED, ids=[p.stem for p in RECORDED])
def test_the_planner_predicts_a_recorded_run_within_the_margins(path):
    """Deterministic: the planner, given the run's own costs file (what the no-overlap steps measured), predicts
    the overlapped steps the run measured, step within 10% and hidden fraction within 0.05; and it still
    predicts what the record says it did (a change to the model shows here first)."""
    record = json.loads(path.read_text())
    costs = MeasuredCosts.from_json(record["costs"])
    got = compare(Setup(**record["setup"]), costs, {"rows": record["rows"]}, memory_bytes=record["memory_bytes"])
    assert abs(got["ratio"]["step"] - 1) <= MARGIN, got["ratio"]
    assert abs(got["error"]["hidden_points"]) <= HIDDEN_MARGIN, got["error"]
    assert got["predicted"]["pipeline_ms"] == pytest.approx(record["predicted"]["pipeline_ms"], rel=1e-6)
    assert got["predicted"]["hidden"] == pytest.approx(record["predicted"]["hidden"], abs=1e-6)


def test_the_machine_and_the_imbalance_from_recorded_steps():
    from bench.overlap.costs import expert_imbalance, machine_costs

    heavy = _lone_step()
    light = parse_events([_ev("step", "m", 0, e, t) for e, t in (("begin", 0.0), ("end", 14.0))]
                         + [_ev("mlp", "fwd", 0, e, t) for e, t in (("begin", 4.0), ("end", 5.0))])  # fmt: skip
    # ep = 2 at pp = 1: the heavy rank's routed experts ran 2 + 1 + 1 s, the light one's 1 s
    assert expert_imbalance([{0: heavy, 1: light}], pp=1) == pytest.approx(4.0 * 2 / 5.0)
    assert expert_imbalance([{0: heavy, 1: heavy}], pp=1) == 1.0
    # each rank busy 8.7 s of its 14 s step (7.0 computing, 1.7 of host work; 5.3 waiting), using half a core
    # meanwhile, and its communication threads 1 s of CPU for its one block
    files = [
        {"cores": 2, "steps": [{"mode": "m", "warmup": False, "cpu_s": 4.35 + 1.0, "thread_s": 4.35},
                               {"mode": "m", "warmup": True, "cpu_s": 99.0, "thread_s": 99.0}]}
        for _ in range(2)
    ]  # fmt: skip
    got = machine_costs(files, [{0: _lone_step(), 1: _lone_step()}], "m")
    assert got == pytest.approx({"cores_per_rank": 1.0, "cpu_share": 0.5, "comm_cpu": 1.0})

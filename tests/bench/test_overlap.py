"""The overlap benchmark: its pure accounting (spans, hidden all-to-all, bubble, trace), a tiny loopback run
in the default suite, and a short emulated-cluster run behind the ``cluster`` marker.

The runs check that the outputs exist and are well formed, and that every mode computes the same losses
(same weights, same data): never the performance targets, which are printed, not asserted.
"""

from __future__ import annotations

import json
import math

import pytest

from bench.overlap import cli
from bench.overlap.report import ModeRow, cpu_floor, table, targets
from bench.overlap.run import TORCH_MODES
from bench.overlap.stats import (
    ActionSpan,
    HostSpan,
    RankSteps,
    action_durations,
    chrome_trace,
    comm_totals,
    measured_bubble,
    measured_costs,
    op_of,
    parse_events,
    predicted_bubble,
    rank_hidden,
    replayed_bubble,
)
from dualpipe import _torch_pipelining as tp
from dualpipe.events import hidden_fraction
from dualpipe.schedule import build_schedule
from dualpipe.simulate import Costs, simulate

TINY = ["--hidden", "32", "--moe-intermediate", "32", "--seq-len", "16", "--micro-batch", "2"]


def _ev(name, direction, layer, edge, t):
    return [name, direction, layer, edge, t]


def test_op_of_reads_schedule_labels():
    assert [op_of(x) for x in ("F0.3", "(F0.4&B1.1)", "I1.0", "W", "B2.5")] == ["F", "FB", "I", "W", "B"]
    with pytest.raises(ValueError):
        op_of("SEND_F0.1>1")


def test_blocking_all_to_all_hides_nothing_and_overlapped_hides_all():
    blocking = parse_events(
        [
            _ev("step", "m", 0, "begin", 0.0),
            _ev("attn", "fwd", 0, "begin", 0.0),
            _ev("attn", "fwd", 0, "end", 1.0),
            _ev("dispatch", "fwd", 0, "start", 1.0),
            _ev("dispatch", "fwd", 0, "wait", 3.0),
            _ev("step", "m", 0, "end", 3.0),
        ]
    )
    assert comm_totals([blocking]) == (2.0, 2.0, 0.0)
    # Started before 2 s of the other micro-batch's compute, which outlasts it: the wait returns at once.
    overlapped = parse_events(
        [
            _ev("step", "m", 0, "begin", 0.0),
            _ev("dispatch", "fwd", 0, "start", 0.0),
            _ev("mlp.dx", "bwd", 1, "begin", 0.0),
            _ev("mlp.dx", "bwd", 1, "end", 2.0),
            _ev("dispatch", "fwd", 0, "wait", 2.0),
            _ev("step", "m", 0, "end", 2.0),
        ]
    )
    assert comm_totals([overlapped]) == (2.0, 0.0, 1.0)
    # Half hidden: 1 s of compute, then 1 s blocked.
    half = parse_events(
        [
            _ev("dispatch", "fwd", 0, "start", 0.0),
            _ev("attn", "fwd", 1, "begin", 0.0),
            _ev("attn", "fwd", 1, "end", 1.0),
            _ev("dispatch", "fwd", 0, "wait", 2.0),
        ]
    )
    (span,) = half.comm
    assert (span.in_flight, span.exposed, span.blocked_from) == (2.0, 1.0, 1.0)
    assert comm_totals([blocking, half]) == (4.0, 3.0, 0.25)
    # Only all-to-alls inside a top-level F&B action count as paired.
    half.actions.append(ActionSpan("(F0.1&B1.0)", 0, 0.0, 2.0))
    assert comm_totals([blocking, half], within="FB") == (2.0, 1.0, 0.5)
    assert math.isnan(comm_totals([RankSteps(0, 1, [], [], [])])[2])


def test_only_compute_that_did_work_hides_an_all_to_all():
    # In flight 0..2 s: B's mlp dX (work), then a dW with nothing to run (closed "empty"); the wait returns at
    # once. Not blocked at all, yet half of it ran under work: the hidden fraction is dualpipe.events' metric.
    events = [
        _ev("dispatch", "fwd", 0, "start", 0.0),
        _ev("mlp.dx", "bwd", 1, "begin", 0.0),
        _ev("mlp.dx", "bwd", 1, "end", 1.0),
        _ev("mlp.dw", "bwd", 1, "begin", 1.0),
        _ev("mlp.dw", "bwd", 1, "empty", 2.0),
        _ev("dispatch", "fwd", 0, "wait", 2.0),
    ]
    r = parse_events(events)
    assert [c.work for c in r.compute] == [True, False]
    assert comm_totals([r]) == (2.0, 0.0, 0.5)
    assert rank_hidden(r) == hidden_fraction(events)
    names = [e["name"] for e in chrome_trace([("m", 0, {0: r})], {0: "rank 0"})["traceEvents"] if e["ph"] == "X"]
    assert "mlp.dw.bwd L1 (empty)" in names


def test_actions_nest_and_costs_count_each_level():
    r0 = parse_events(
        [
            _ev("step", "m", 0, "begin", 0.0),
            _ev("(F0.1&B1.0)", "action", 0, "begin", 0.0),
            _ev("F0.1", "action", 1, "begin", 0.0),
            _ev("F0.1", "action", 1, "end", 1.0),
            _ev("B1.0", "action", 1, "begin", 1.0),
            _ev("B1.0", "action", 1, "end", 3.0),
            _ev("(F0.1&B1.0)", "action", 0, "end", 3.0),
            _ev("step", "m", 0, "end", 4.0),
        ]
    )
    assert [(a.op, a.depth) for a in r0.actions] == [("F", 1), ("B", 1), ("FB", 0)]
    r1 = RankSteps(0.5, 4.0, [], [], [ActionSpan("F0.0", 0, 1.0, 2.0)])
    # window 0..4 on 2 ranks = 8; busy: rank 0 from its begin to its last action's end (3), rank 1 from its
    # begin to its last action's end (1.5: the executor's work before the action counts)
    assert measured_bubble([r0, r1]) == pytest.approx(3.5 / 8)
    costs = measured_costs([r0, r1])
    assert (costs.F, costs.B, costs.W, costs.FB) == (1.0, 2.0, 0.0, 3.0)


def _rank(begin, end, actions, waits=(), posts=()):
    return RankSteps(begin, end, [], [], [ActionSpan(*a) for a in actions], [HostSpan(*w) for w in waits],
                     [HostSpan(*p) for p in posts])  # fmt: skip


def test_message_waits_and_the_end_of_the_step_are_idle_the_executors_work_is_busy():
    r = parse_events(
        [
            _ev("step", "m", 0, "begin", 0.0),
            _ev("post RECV_F0.0<0", "post", 0, "begin", 0.0),
            _ev("post RECV_F0.0<0", "post", 0, "end", 0.5),
            _ev("F0.0", "action", 0, "begin", 1.0),
            _ev("recv F0.0", "p2p", 1, "begin", 1.0),
            _ev("recv F0.0", "p2p", 1, "end", 3.0),
            _ev("F0.0", "action", 0, "end", 4.0),
            _ev("post SEND_F0.0>2", "post", 0, "begin", 4.0),
            _ev("post SEND_F0.0>2", "post", 0, "end", 4.5),
            _ev("step", "m", 0, "end", 6.0),
        ]
    )
    assert [(w.label, w.start, w.end) for w in r.waits] == [("recv F0.0", 1.0, 3.0)]
    assert [p.label for p in r.posts] == ["post RECV_F0.0<0", "post SEND_F0.0>2"]
    assert r.work_end() == 4.5
    # busy 0..4.5 less the 2 s wait; idle: the wait and 4.5..6 (the blocking end-of-step reap)
    assert measured_bubble([r]) == pytest.approx(3.5 / 6)
    assert measured_costs([r]).F == 1.0  # the action less its wait


def test_action_durations_run_from_action_start_to_action_start_less_waits():
    schedule = build_schedule("1f1b", 2, 1)  # rank 0: F0.0, B0.0; rank 1: F0.0, B0.0
    r0 = _rank(0.0, 9.0, [("F0.0", 0, 0.5, 1.5), ("B0.0", 0, 2.0, 6.0)], waits=[("recv B0.0", 2.0, 4.0)],
               posts=[("post", 1.5, 1.8), ("post", 6.0, 6.5)])  # fmt: skip
    r1 = _rank(0.0, 9.0, [("F0.0", 0, 0.0, 3.0), ("B0.0", 0, 3.0, 4.0)], waits=[("recv F0.0", 0.0, 1.0)])
    assert action_durations(schedule, [r0, r1]) == [[2.0, 2.5], [2.0, 1.0]]
    with pytest.raises(ValueError, match="not the schedule's"):
        action_durations(schedule, [r1, _rank(0.0, 1.0, [("F0.0", 0, 0.0, 1.0)])])
    with pytest.raises(ValueError, match="ranks measured"):
        action_durations(schedule, [r0])


def _executed(name: str, ranks: int, chunks: int, costs: Costs, ready: list[float] | None = None) -> list[RankSteps]:
    """What an ideal executor records when every action takes its cost under ``costs`` and rank ``r`` begins
    its step at ``ready[r]``: each action entered as soon as the previous one ended, its wait for a message
    recorded inside it."""
    ready = ready or [0.0] * ranks
    result = simulate(build_schedule(name, ranks, chunks), costs, ready=ready)
    out = []
    for spans, free in zip(result.timelines, ready):
        actions, waits, begin = [], [], free
        for s in spans:
            if s.start > free:
                waits.append(("recv", free, s.start))
            actions.append((s.label, 0, free, s.end))
            free = s.end
        out.append(_rank(begin, result.makespan, actions, waits))
    return out


@pytest.mark.parametrize("name", ["1f1b", "zb1p", "dualpipe", "dualpipev"])
def test_the_replay_of_an_ideal_execution_is_the_measurement(name: str):
    costs = Costs(F=1.0, B=2.0, W=0.5, FB=2.6)
    ranks = _executed(name, 4, 8, costs)
    want = simulate(build_schedule(name, 4, 8), costs).bubble_fraction
    assert measured_bubble(ranks) == pytest.approx(want)
    assert replayed_bubble(name, [ranks], 8) == pytest.approx(want)
    assert replayed_bubble(name, [ranks, ranks], 8) == pytest.approx(want)  # two identical pipelines


def test_slow_messages_are_what_the_replay_does_not_predict():
    costs = Costs(F=1.0, B=2.0, W=0.5, FB=2.6, latency=0.3)
    ranks = _executed("dualpipev", 4, 8, costs)
    measured = measured_bubble(ranks)
    assert measured == pytest.approx(simulate(build_schedule("dualpipev", 4, 8), costs).bubble_fraction)
    assert replayed_bubble("dualpipev", [ranks], 8) < measured - 0.01
    assert replayed_bubble("dualpipev", [ranks], 8, latency=0.3) == pytest.approx(measured)


def test_a_late_start_is_idle_in_the_measurement_and_the_replay():
    costs = Costs(F=1.0, B=2.0, W=1.0)
    late = _executed("1f1b", 2, 4, costs, ready=[0.0, 1.5])  # rank 1 leaves the step barrier late
    assert replayed_bubble("1f1b", [late], 4) == pytest.approx(measured_bubble(late))
    assert measured_bubble(late) > measured_bubble(_executed("1f1b", 2, 4, costs)) + 0.01


def test_costs_without_full_backward_add_input_and_weight_parts():
    r = RankSteps(0, 9, [], [], [ActionSpan("I1.0", 0, 0, 2), ActionSpan("W", 0, 2, 3), ActionSpan("F0.0", 0, 3, 4)])
    costs = measured_costs([r])
    assert (costs.F, costs.B, costs.W, costs.FB) == (1.0, 3.0, 1.0, 4.0)


def test_predicted_bubble_is_the_simulators():
    costs = Costs(F=1.0, B=2.0, W=1.0, FB=2.5)
    want = simulate(build_schedule("dualpipev", 2, 8), costs).bubble_fraction
    assert predicted_bubble("dualpipev", 2, 8, costs) == want > 0


def test_chrome_trace_has_a_track_per_rank_and_stream():
    r = parse_events(
        [
            _ev("step", "m", 0, "begin", 10.0),
            _ev("F0.0", "action", 0, "begin", 10.0),
            _ev("attn", "fwd", 0, "begin", 10.0),
            _ev("attn", "fwd", 0, "end", 10.001),
            _ev("dispatch", "fwd", 0, "start", 10.001),
            _ev("dispatch", "fwd", 0, "wait", 10.002),
            _ev("combine", "bwd", 1, "start", 10.002),
            _ev("combine", "bwd", 1, "wait", 10.003),
            _ev("F0.0", "action", 0, "end", 10.003),
            _ev("step", "m", 0, "end", 10.004),
        ]
    )
    trace = chrome_trace([("m", 3, {0: r, 1: r})], {0: "rank 0", 1: "rank 1"})
    json.dumps(trace)  # serialisable
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    threads = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert threads == {(p, t) for p in (0, 1) for t in ("compute", "comm fwd", "comm bwd")}
    by_name = {(e["pid"], e["name"]): e for e in spans}
    assert by_name[(0, "m step 3")]["ts"] == 0.0 and by_name[(0, "m step 3")]["dur"] == pytest.approx(4000.0)
    assert by_name[(1, "dispatch L0")]["tid"] == 1 and by_name[(1, "combine L1")]["tid"] == 2
    assert by_name[(0, "attn.fwd L0")]["dur"] == pytest.approx(1000.0)


def _row(mode: str, **kw) -> ModeRow:
    base = dict(
        schedule="dualpipev", overlap=True, steps=3, step_ms=80.0, step_ms_min=78.0, step_ms_max=90.0,
        tokens_per_s=1e4, vs_torch=0.8, bubble=0.10, bubble_predicted=0.09,
        bubble_predicted_mean=0.05, a2a_ms=50.0, a2a_exposed_ms=5.0,
        hidden=0.9, hidden_in_pairs=0.95, cpu_use=0.5, rank_use=0.3, costs_ms={}, loss=5.0,
    )  # fmt: skip
    base.update(kw)
    return ModeRow(mode=mode, **base)


def test_targets_are_evaluated_not_asserted():
    met = targets([_row("dualpipev-overlap"), _row("torch-dualpipev", vs_torch=1.0, hidden=0.0)])
    assert [t.met for t in met] == [True, True, True]
    missed = targets([_row("dualpipev-overlap", hidden=0.5, vs_torch=0.95, bubble=0.2)])
    assert [t.met for t in missed] == [False, False, False]
    assert [t.what for t in targets([_row("dualpipev-overlap")], pipeline_ranks=1)] == [
        "all-to-all hidden (dualpipev-overlap)",
        "step time vs torch ScheduleDualPipeV",
    ]
    no_a2a = targets([_row("dualpipev-overlap", hidden=math.nan, vs_torch=None)])
    assert [t.what for t in no_a2a] == ["|bubble measured - simulated| / simulated"]
    assert "| dualpipev-overlap | 80 (78..90) |" in table([_row("dualpipev-overlap")])


def test_cpu_floor_is_our_cpu_time_over_torchs_step():
    # 80 ms at 0.5 of all cores = 40 ms of CPU per core; torch's step is 100 ms
    assert cpu_floor([_row("dualpipev-overlap", vs_torch=0.8, cpu_use=0.5), _row("torch-dualpipev")]) == 0.4
    # one rank's compute thread busy 0.75 of our step: no core can run it faster (one rank per core, its
    # experts given more tokens), so the floor is 0.75 x 80 ms, not the cores' mean
    assert cpu_floor([_row("dualpipev-overlap", vs_torch=0.8, cpu_use=0.5, rank_use=0.75)]) == pytest.approx(0.6)
    assert cpu_floor([_row("dualpipev-overlap", vs_torch=0.8, cpu_use=0.5, rank_use=math.nan)]) == 0.4  # older runs
    assert cpu_floor([_row("dualpipev-overlap", vs_torch=None)]) is None
    assert cpu_floor([_row("dualpipev", vs_torch=0.8)]) is None


def _check_outputs(out_dir, modes: list[str]) -> dict:
    (json_path,) = out_dir.glob("overlap-*-????-??-??.json")
    stem = json_path.name.removesuffix(".json")
    record = json.loads(json_path.read_text())
    assert [r["mode"] for r in record["rows"]] == modes
    for r in record["rows"]:
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and 0 <= r["bubble"] < 1
    trace = json.loads((out_dir / f"{stem}.trace.json").read_text())
    pids = {e["pid"] for e in trace["traceEvents"]}
    assert pids == {0, 1, 2, 3}
    assert (out_dir / f"{stem}.png").read_bytes()[:4] == b"\x89PNG"
    # Same weights, same data: every mode computes torch's losses.
    for mode, diff in record["loss_check"]["max_abs_diff_to_torch"].items():
        assert diff <= 1e-5, mode
    return record


def test_smoke_run_on_loopback(tmp_path, capsys):
    modes = ["dualpipev-overlap", "dualpipev", "dualpipe-overlap", "1f1b", "torch-dualpipev", "torch-dualpipev-overlap"]
    argv = [*TINY, "--steps", "1", "--modes", *modes, "--out", str(tmp_path), "--timeout", "120", "--keep-events"]
    if tp.internals().greets_own_rank:  # a torch whose ScheduleDualPipeV cannot start on gloo: the bridge says so
        with pytest.raises(SystemExit, match="cannot start on CPU ranks over gloo"):
            cli.main(argv)
        return
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "targets (DualPipeV with overlap)" in printed and "loopback" in printed and "CPU floor" in printed
    record = _check_outputs(tmp_path, modes)
    assert record["device"].endswith("-loopback") and record["cluster"] is None
    rows = {r["mode"]: r for r in record["rows"]}
    for mode in modes[:-2]:  # our executor: the replay matches the recorded actions to the schedule
        assert 0 <= rows[mode]["bubble_predicted"] < 1 and 0 <= rows[mode]["bubble_predicted_mean"] < 1
    for mode in TORCH_MODES:  # torch's own action order: no replay
        assert math.isnan(rows[mode]["bubble_predicted"])
    # torch's schedule with the bridge hides all-to-alls in its overlapped pairs; without, nothing
    assert rows["torch-dualpipev-overlap"]["hidden_in_pairs"] > 0 and rows["torch-dualpipev"]["hidden"] == 0
    events = sorted(p.name for p in (tmp_path / "events").glob("rank*.json"))
    assert events == [f"rank{r}.json" for r in range(4)]
    # modes interleaved step by step, in a rotating order (warm-up step 0, then step 1)
    ran = [(s["step"], s["mode"]) for s in json.loads((tmp_path / "events" / "rank0.json").read_text())["steps"]]
    assert ran == [(0, m) for m in modes] + [(1, m) for m in modes[1:] + modes[:1]]
    names = {e["name"].split()[0] for e in json.loads(next(tmp_path.glob("*.trace.json")).read_text())["traceEvents"]}
    assert {"wait", "post"} <= names  # pipeline-message waits and the executor's issuing are on the trace
    assert record["loss_check"]["grad_sq_rel_diff_torch_vs_dualpipev"] <= 1e-6


@pytest.mark.cluster
def test_short_run_on_the_emulated_cluster(tmp_path):
    modes = ["dualpipev-overlap", "dualpipev", "torch-dualpipev"]
    argv = [*TINY, "--cluster", "--nodes", "2", "--steps", "1", "--modes", *modes, "--out", str(tmp_path)]
    assert cli.main([*argv, "--timeout", "240"]) == 0
    record = _check_outputs(tmp_path, modes)
    assert record["cluster"]["nodes"] == 2 and "emulated-2node" in record["device"]

"""The simulator against the published bubble and activation formulas, in the regime each formula assumes."""

from __future__ import annotations

import itertools
import json
import sys

import pytest

from dualpipe.schedule import build_schedule
from dualpipe.simulate import Costs, main, render_png, simulate

# (F, B, W) triples inside each formula's regime (see the dualpipe.simulate docstring).
ZB_COSTS = [(1.0, 2.0, 1.0), (2.0, 2.0, 1.0), (1.0, 3.0, 1.0), (1.0, 1.5, 0.5), (1.0, 1.0, 0.0)]
DUAL_COSTS = [(1.0, 2.0, 1.0), (1.0, 1.5, 0.5), (2.0, 2.5, 0.5), (2.0, 4.0, 2.0), (1.0, 1.0, 0.0)]


def _idle(name: str, ranks: int, chunks: int, costs: Costs) -> list[float]:
    return list(simulate(build_schedule(name, ranks, chunks), costs).idle)


@pytest.mark.parametrize("ranks", range(1, 9))
@pytest.mark.parametrize("costs", [Costs(F=1, B=2, W=1), Costs(F=1.5, B=1, W=0.25), Costs(F=0.5, B=3, W=3)])
def test_1f1b_bubble_is_pp_minus_1_times_f_plus_b(ranks: int, costs: Costs) -> None:
    for chunks in (1, 2, ranks, ranks + 1, 3 * ranks + 1):
        expected = (ranks - 1) * (costs.F + costs.B)
        assert _idle("1f1b", ranks, chunks, costs) == pytest.approx([expected] * ranks)


@pytest.mark.parametrize("ranks", range(1, 9))
@pytest.mark.parametrize(("F", "B", "W"), ZB_COSTS)
def test_zb1p_bubble_is_pp_minus_1_times_f_plus_b_minus_2w(ranks: int, F: float, B: float, W: float) -> None:
    costs = Costs(F=F, B=B, W=W)
    for chunks in (ranks, ranks + 1, 2 * ranks + 1, 4 * ranks):
        expected = (ranks - 1) * (F + B - 2 * W)
        assert _idle("zb1p", ranks, chunks, costs) == pytest.approx([expected] * ranks)


def test_zb1p_formula_needs_w_no_larger_than_f_and_i() -> None:
    # The edge of the regime: a W longer than a forward no longer fits in the cool-down waits.
    idle = _idle("zb1p", 4, 8, Costs(F=1, B=2.5, W=1.5))
    assert max(idle) > 3 * (1 + 2.5 - 3)


def _dual_cases(name: str):
    if name == "dualpipe":
        for ranks in (2, 4, 6, 8):
            for chunks in range(2 * ranks, 4 * ranks + 1, 2):
                yield ranks, chunks, ranks, (ranks // 2 - 1, ranks // 2)  # PP = ranks; turn at the middle
    else:
        for ranks in range(1, 9):
            for chunks in (2 * ranks, 2 * ranks + 1, 3 * ranks, 5 * ranks):
                yield ranks, chunks, 2 * ranks, (ranks - 1,)  # PP = 2 x ranks stages; turn at the last rank


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
@pytest.mark.parametrize(("F", "B", "W"), DUAL_COSTS)
def test_dual_bubble_without_overlap_is_the_formula_on_every_rank(name: str, F: float, B: float, W: float) -> None:
    costs = Costs(F=F, B=B, W=W)  # F&B = F + B
    for ranks, chunks, pp, _ in _dual_cases(name):
        expected = (pp / 2 - 1) * (costs.FB + B - 3 * W)
        assert _idle(name, ranks, chunks, costs) == pytest.approx([expected] * ranks), (ranks, chunks)


@pytest.mark.parametrize("name", ["dualpipe", "dualpipev"])
@pytest.mark.parametrize(("F", "B", "W"), DUAL_COSTS)
@pytest.mark.parametrize("overlap", [0.0, 0.5, 1.0])
def test_dual_bubble_with_overlap_is_the_formula_at_the_turn(
    name: str, F: float, B: float, W: float, overlap: float
) -> None:
    costs = Costs(F=F, B=B, W=W, FB=B + (1 - overlap) * F)  # from B (F fully hidden) to F + B
    for ranks, chunks, pp, turn in _dual_cases(name):
        expected = (pp / 2 - 1) * (costs.FB + B - 3 * W)
        idle = _idle(name, ranks, chunks, costs)
        assert max(idle) == pytest.approx(expected), (ranks, chunks)
        assert [idle[r] for r in turn] == pytest.approx([expected] * len(turn)), (ranks, chunks)


def test_dual_formula_needs_forward_equal_to_input_backward() -> None:
    idle = _idle("dualpipe", 8, 16, Costs(F=1, B=2.1, W=1))
    assert max(idle) != pytest.approx(3 * (3.1 + 2.1 - 3))


@pytest.mark.parametrize("ranks", range(1, 9))
def test_activations_of_1f1b_and_zb1p(ranks: int) -> None:
    for name in ("1f1b", "zb1p"):
        result = simulate(build_schedule(name, ranks, 2 * ranks + 1))
        assert result.peak_activations == tuple(ranks - r for r in range(ranks))
        assert result.peak_activation_stages[0] == ranks
        assert result.parameter_copies == 1


@pytest.mark.parametrize("ranks", [2, 4, 6, 8])
def test_dualpipe_activations_are_pp_plus_1_on_the_middle_ranks(ranks: int) -> None:
    for chunks in (2 * ranks, 3 * ranks):
        result = simulate(build_schedule("dualpipe", ranks, chunks))
        middle = {ranks // 2 - 1, ranks // 2}
        assert result.peak_activations == tuple(ranks + (r in middle) for r in range(ranks))
        assert result.peak_activation_stages == result.peak_activations  # a module is a full stage
        assert result.parameter_copies == 2


@pytest.mark.parametrize("ranks", range(1, 9))
def test_dualpipev_activations_are_stages_plus_1_on_the_last_rank(ranks: int) -> None:
    result = simulate(build_schedule("dualpipev", ranks, 3 * ranks))
    assert result.peak_activations == tuple(2 * ranks + (r == ranks - 1) for r in range(ranks))
    assert result.peak_activation_stages[-1] == ranks + 0.5  # a module is half a stage
    assert result.parameter_copies == 1


@pytest.mark.parametrize(("ranks", "v"), [(2, 2), (4, 2), (4, 3), (8, 4)])
@pytest.mark.parametrize(("F", "B"), [(1.0, 2.0), (1.0, 1.0), (0.5, 3.0)])
def test_interleaved_1f1b_bubble_is_pp_minus_1_times_f_plus_b_over_v(ranks: int, v: int, F: float, B: float) -> None:
    # F and B are one full stage's costs; each of the v modules per rank holds 1/v of a stage.
    for chunks in (ranks, 2 * ranks, 4 * ranks):
        r = simulate(build_schedule("interleaved-1f1b", ranks, chunks, False, v), Costs(F=F / v, B=B / v, W=0.0))
        assert r.idle == pytest.approx([(ranks - 1) * (F + B) / v] * ranks)
        assert r.parameter_copies == 1
        if chunks >= 2 * ranks:
            # Megatron's interleaved activations, PP + (PP-1)/v stages on rank 0, less the module a steady
            # F-then-B holds between its halves: a pair swaps one module for the other (FB adds one, frees one)
            assert r.peak_activation_stages[0] == pytest.approx(ranks + (ranks - 2) / v)


def test_cli_takes_modules_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--schedule", "interleaved-1f1b", "--ranks", "4", "--chunks", "8", "--modules-per-rank", "4", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["peak_activation_stages"][0] == 4 + 2 / 4  # PP + (PP-1)/v, less the pair's swap (see above)


def test_one_rank_has_no_bubble() -> None:
    for name, chunks in (("1f1b", 5), ("zb1p", 5), ("dualpipev", 4)):
        result = simulate(build_schedule(name, 1, chunks), Costs(F=1, B=2, W=1, FB=2.5, latency=7))
        assert result.idle == (0.0,)  # no messages at all: DualPipeV's turn is a local hand-over
        assert result.bubble_fraction == 0.0
        assert result.makespan == result.busy[0]


def test_makespan_adds_latency_per_hop() -> None:
    # 2 ranks, 1 chunk: F on rank 0, F then B on rank 1, B on rank 0; two messages on the critical path.
    result = simulate(build_schedule("1f1b", 2, 1), Costs(F=1, B=2, W=1, latency=0.25))
    assert result.makespan == pytest.approx(2 * 1 + 2 * 2 + 2 * 0.25)
    assert [t for s in result.timelines[1] for t in (s.start, s.end)] == pytest.approx([1.25, 2.25, 2.25, 4.25])


def test_busy_time_and_bubble_fraction_add_up() -> None:
    costs = Costs(F=1, B=2, W=0.5, FB=2.5, latency=0.1)
    result = simulate(build_schedule("dualpipe", 4, 10), costs)
    for spans, busy in zip(result.timelines, result.busy):
        assert all(a.end <= b.start + 1e-12 for a, b in itertools.pairwise(spans))  # one action at a time
        assert busy == pytest.approx(sum(s.end - s.start for s in spans))
    total = result.num_ranks * result.makespan
    assert result.bubble_fraction == pytest.approx(sum(result.idle) / total)


def test_early_receives_do_not_change_timing() -> None:
    costs = Costs(F=1, B=2, W=1, latency=0.3)
    plain = simulate(build_schedule("dualpipev", 4, 10), costs)
    early = simulate(build_schedule("dualpipev", 4, 10, early_receives=True), costs)
    assert early.timelines == plain.timelines


@pytest.mark.parametrize("name", ["1f1b", "zb1p", "dualpipe", "dualpipev"])
def test_per_action_durations_equal_to_the_costs_give_the_same_timelines(name: str) -> None:
    costs = Costs(F=1, B=2, W=0.5, FB=2.5, latency=0.1)
    schedule = build_schedule(name, 4, 8)
    durations = [[costs.of(a) for a in actions if a.op.is_compute] for actions in schedule.ranks]
    assert simulate(schedule, costs, durations=durations).timelines == simulate(schedule, costs).timelines


def test_per_action_durations_move_only_what_depends_on_them() -> None:
    # 1F1B on 2 ranks, 1 chunk: F on rank 0, F then B on rank 1, B on rank 0 (a chain).
    schedule = build_schedule("1f1b", 2, 1)
    result = simulate(schedule, Costs(latency=0.5), durations=[[3.0, 5.0], [1.0, 2.0]])
    assert [[(s.start, s.end) for s in spans] for spans in result.timelines] == [
        [(0.0, 3.0), (7.0, 12.0)],
        [(3.5, 4.5), (4.5, 6.5)],
    ]
    assert result.busy == (8.0, 3.0) and result.makespan == 12.0


def test_ready_times_delay_each_rank_and_count_as_idle() -> None:
    schedule = build_schedule("1f1b", 2, 1)
    result = simulate(schedule, Costs(F=1, B=2, W=1), ready=[0.0, 2.0])
    assert [s.start for s in result.timelines[1]] == [2.0, 3.0]  # waits for itself, not for the message at 1
    assert result.makespan == 2.0 + 1 + 2 + 2 and result.idle == (result.makespan - 3, result.makespan - 3)


@pytest.mark.parametrize(
    "durations",
    [[[1.0, 1.0]], [[1.0], [1.0, 1.0]], [[1.0, -1.0], [1.0, 1.0]], [[1.0, float("nan")], [1.0, 1.0]]],
    ids=["ranks", "actions", "negative", "nan"],
)
def test_durations_are_validated(durations: list[list[float]]) -> None:
    with pytest.raises(ValueError, match="durations"):
        simulate(build_schedule("1f1b", 2, 1), durations=durations)


@pytest.mark.parametrize("ready", [[0.0], [0.0, -1.0], [0.0, float("inf")]], ids=str)
def test_ready_times_are_validated(ready: list[float]) -> None:
    with pytest.raises(ValueError, match="ready"):
        simulate(build_schedule("1f1b", 2, 1), ready=ready)


@pytest.mark.parametrize("kwargs", [{"F": -1.0}, {"W": 3.0}, {"latency": float("nan")}, {"FB": float("inf")}], ids=str)
def test_costs_are_validated(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        Costs(**kwargs)


def test_overlapped_pair_defaults_to_f_plus_b() -> None:
    assert Costs(F=1.5, B=2).FB == 3.5


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = "--schedule dualpipev --ranks 4 --chunks 10 --F 1 --B 2 --W 1 --FB 2.5 --latency 0 --json"
    assert main(argv.split()) == 0
    out = json.loads(capsys.readouterr().out)
    for key in ("makespan", "busy", "idle", "bubble_fraction", "peak_activations", "parameter_copies"):
        assert key in out
    assert out["schedule"] == "dualpipev" and out["costs"]["FB"] == 2.5
    assert len(out["timelines"]) == 4 and len(out["idle"]) == 4
    assert max(out["idle"]) == pytest.approx(3 * (2.5 + 2 - 3))


def test_cli_summary_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--schedule", "1f1b", "--ranks", "2", "--chunks", "3"]) == 0
    assert "makespan" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="DualPipe needs"):
        main(["--schedule", "dualpipe", "--ranks", "3", "--chunks", "6"])


def test_png_is_written(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    render_png(simulate(build_schedule("dualpipe", 4, 8)), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["--schedule", "zb1p", "--ranks", "3", "--chunks", "4", "--png", str(tmp_path / "cli.png")]) == 0
    assert (tmp_path / "cli.png").stat().st_size > 0


def test_png_without_matplotlib_names_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.patches"):
        monkeypatch.setitem(sys.modules, name, None)  # makes the import fail as if not installed
    with pytest.raises(ImportError, match=r"pip install dualpipe-moe\[plot\]"):
        render_png(simulate(build_schedule("1f1b", 2, 2)), str(tmp_path / "x.png"))


def test_a_deferred_pair_leaves_its_weight_gradient_to_a_w() -> None:
    """ZB1P's steady pairs run their backward half as an I: the pair costs F&B - W, and the W it left costs W
    later, so a rank's busy time is the same as with the pairs' halves run apart."""
    from dualpipe.schedule import Op

    costs = Costs(F=1.0, B=2.0, W=0.5, FB=2.5)
    schedule = build_schedule("zb1p", 4, 8, extra_warmup=1)
    last = schedule.ranks[-1]
    pairs = [a for a in last if a.op is Op.FB]
    assert pairs and all(a.deferred for a in pairs)
    assert costs.of(pairs[0]) == 2.0
    busy = sum(costs.of(a) for a in last if a.op.is_compute)
    counts = {op: sum(a.op is op for a in last) for op in (Op.F, Op.I, Op.W, Op.FB)}
    want = counts[Op.F] * 1.0 + counts[Op.I] * 1.5 + counts[Op.W] * 0.5 + counts[Op.FB] * 2.0
    assert busy == want and simulate(schedule, costs).busy[-1] == want

"""The overlap benchmark's byte counts: bytes per all-to-all from the ranks' per-step counts, FP8 dispatch set beside
the model dtype's run, and ``--fp8-dispatch`` adding an FP8 twin of each of our modes (not of torch's)."""

from __future__ import annotations

import pytest

from bench.overlap import cli
from bench.overlap.run import MODES, PLAIN_MODES, WorkerOptions
from bench.overlap.traffic import FP8_SUFFIX, fp8_comparison, fp8_table, traffic, traffic_table


def _step(mode: str, step: int, rows: int, row_bytes: int, warmup: bool = False) -> dict:
    per_kind = {"calls": 2, "rows": 2 * rows, "data_bytes": 2 * rows * row_bytes, "meta_bytes": 2 * rows * 24}
    back = {"calls": 2, "rows": 2 * rows, "data_bytes": 2 * rows * 512, "meta_bytes": 0}
    return {"mode": mode, "step": step, "warmup": warmup, "traffic": {"dispatch": per_kind, "combine": back}}


def _rank(rank: int, rows: int) -> dict:
    steps = []
    for step in range(3):
        steps += [
            _step("dualpipev", step, rows, 512, warmup=step == 0),
            _step("dualpipev+fp8", step, rows, 264, warmup=step == 0),
            {"mode": "torch-dualpipev", "step": step, "warmup": step == 0, "traffic": None},
        ]
    return {"rank": rank, "options": {"modes": ["dualpipev", "torch-dualpipev", "dualpipev+fp8"]}, "steps": steps}


def test_bytes_per_all_to_all_and_the_fp8_comparison() -> None:
    counted = traffic([_rank(0, 10), _rank(1, 30)])
    assert list(counted) == ["dualpipev", "dualpipev+fp8"]  # --modes order; torch's schedule is not counted
    # 2 all-to-alls per rank and step; ranks of 10 and 30 rows: 20 rows per all-to-all on average
    assert counted["dualpipev"]["dispatch"] == {"per_rank_step": 2.0, "data_bytes": 20 * 512, "meta_bytes": 20 * 24}
    assert counted["dualpipev+fp8"]["dispatch"]["data_bytes"] == 20 * 264
    assert counted["dualpipev+fp8"]["combine"] == counted["dualpipev"]["combine"]
    rows = fp8_comparison({"dualpipev": 100.0, "torch-dualpipev": 90.0, "dualpipev+fp8": 80.0}, counted)
    assert len(rows) == 1 and rows[0]["mode"] == "dualpipev"
    assert rows[0]["step_ratio"] == pytest.approx(0.8) and rows[0]["dispatch_ratio"] == pytest.approx(264 / 512)
    assert "combine_backward_ratio" not in rows[0]  # not counted here
    assert "| dualpipev | 100 / 80 (0.80x) | 0.516 | - |" in fp8_table(rows)
    assert "| dualpipev+fp8 | dispatch | 2 | 5.3 | 0.5 |" in traffic_table(counted)


def test_fp8_dispatch_adds_a_twin_of_each_of_our_modes() -> None:
    assert all(not m.endswith(FP8_SUFFIX) for m in PLAIN_MODES) and "torch-dualpipev+fp8" not in MODES
    args = cli._parser().parse_args(["--modes", "dualpipev", "torch-dualpipev", "--fp8-dispatch"])
    opts = cli._options(args, "/nonexistent")
    assert opts.modes == ["dualpipev", "torch-dualpipev", "dualpipev+fp8"]
    # the default: every plain mode that runs at these numbers (1F1B and ZB1P pair only with an extra warm-up)
    default = cli._options(cli._parser().parse_args([]), "/nonexistent").modes
    assert "dualpipev-overlap" in default and "interleaved-1f1b-overlap" in default and "1f1b-overlap" not in default
    assert default == [m for m in PLAIN_MODES if WorkerOptions().refusal(m) is None]
    warm = cli._options(cli._parser().parse_args(["--extra-warmup", "1"]), "/nonexistent").modes
    assert "1f1b-overlap" in warm and "zb1p-overlap" in warm
    with pytest.raises(ValueError, match=r"mode 1f1b-overlap at pp=2, chunks=16: overlap: 1F1B .* --extra-warmup 1"):
        WorkerOptions(modes=["1f1b-overlap"])
    with pytest.raises(ValueError, match="dtype must be float32 or bfloat16"):
        WorkerOptions(dtype="float16")

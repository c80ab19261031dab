"""bench.gpu_model on CPU: the check's model step at tiny widths end to end (both runs, one summary JSON and one
log, the memory beside the estimate), the verdict of the summary on fake step records, and the non-zero exit
when a loss does not fall, a run fails or runs out of time (the trainer's launch stood in)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import bench.gpu_model as gm

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--device", "cpu", "--model", "deepseek-v3-tiny", "--layers", "3", "--experts", "8", "--seq-len", "32"]
FIELDS = {
    "command", "exit_code", "wall_s", "error", "steps", "losses", "loss_first", "loss_last", "loss_fell",
    "tokens_per_s", "mfu", "step_time_s", "peak_memory_gib", "peak_memory_source", "estimate_gib",
    "host_syncs_per_step", "host_syncs_max", "host_sync_sites",
}  # fmt: skip


def _records(losses: list[float], **extra) -> list[dict]:
    """Step records as moe.train writes them (the fields the summary reads), on CUDA."""
    return [
        {
            "step": i + 1,
            "loss": loss,
            "tokens_per_s": 1000.0 * (i + 1),
            "mfu": 0.01 * (i + 1),
            "step_time_s": 1.0 / (i + 1),
            "memory_estimate_bytes": 70 * 2**30,
            "cuda_peak_allocated_bytes": (60 + i) * 2**30,
            **({"host_syncs": 3 + i, "host_sync_sites": {f"a.py:{i}": 3 + i}} if i else {}),
            **extra,
        }
        for i, loss in enumerate(losses)
    ]


def test_the_summary_of_a_run() -> None:
    """Loss at step 1 against the last 3 steps' mean; medians after the 2 warm-up steps; the largest CUDA peak;
    host syncs over the steps that counted them (not the first)."""
    s = gm.summarize(_records([7.0, 6.5, 6.0, 5.5, 5.0, 4.5]))
    assert (s["loss_first"], s["loss_last"], s["loss_fell"]) == (7.0, 5.0, True)
    assert s["tokens_per_s"] == 4500.0 and s["mfu"] == pytest.approx(0.045)  # steps 3..6
    assert s["peak_memory_gib"] == 65 and s["estimate_gib"] == 70
    assert s["peak_memory_source"] == "torch.cuda.max_memory_allocated"
    assert (s["host_syncs_per_step"], s["host_syncs_max"], s["host_sync_sites"]) == (
        6,
        8,
        {"a.py:5": 8},
    )  # steps 2..6: 4..8


@pytest.mark.parametrize(
    "losses",
    [[7.0] * 6, [7.0, 6.95, 7.02, 6.97, 6.93, 6.92], [7.0, 6.0, 6.5, 7.5, 8.0, 9.0]],
    ids=["flat", "noise-below-the-margin", "fell-then-rose"],
)
def test_a_loss_that_did_not_fall_by_the_margin(losses: list[float]) -> None:
    assert not gm.summarize(_records(losses))["loss_fell"]


def test_memory_off_cuda_is_the_meters_sum() -> None:
    records = _records([5.0, 4.0, 3.0])
    for r in records:
        del r["cuda_peak_allocated_bytes"]
        r.update(param_bytes=2**30, grad_bytes=2**30, optimizer_state_bytes=2**31, peak_activation_bytes=r["step"])
    s = gm.summarize(records)
    assert s["peak_memory_gib"] == pytest.approx(4 + 3 / 2**30) and s["peak_memory_source"].startswith(
        "moe.train.memory"
    )
    with pytest.raises(ValueError, match="no step"):
        gm.summarize([])


def _fake_launch(
    monkeypatch: pytest.MonkeyPatch, losses: list[float], returncode: int = 0, stderr: str = "", late: bool = False
):
    """bench.gpu_model's launch replaced: no training, the run's metrics file written with ``losses``; ``late``:
    then the run's time is up (what bench.process_tree.run raises once it has killed the tree)."""
    launched = []

    def launch(argv, *, timeout, **kwargs):
        launched.append(list(argv))
        metrics = Path(argv[argv.index("--metrics-file") + 1])
        metrics.write_text("".join(json.dumps(r) + "\n" for r in _records(losses)))
        if late:
            raise subprocess.TimeoutExpired(argv, timeout, output=b"step 1\n", stderr=b"")
        return subprocess.CompletedProcess(argv, returncode, "step lines\n", stderr)

    monkeypatch.setattr(gm, "run_tree", launch)
    return launched


def _summary(out: Path) -> dict:
    (path,) = out.glob("gpu-model-*.json")
    return json.loads(path.read_text())


def test_exit_status_follows_the_loss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both runs launched (bf16, then FP8 with the FP8 flags), each with --sync-debug; a falling loss exits 0, a
    flat one 1 with the reason in the summary."""
    launched = _fake_launch(monkeypatch, [7.0, 6.0, 5.5, 5.0, 4.5, 4.0])
    assert gm.main([*TINY, "--steps", "6", "--out", str(tmp_path / "ok")]) == 0
    assert [("--fp8" in a, "--fp8-activations" in a, "--sync-debug" in a) for a in launched] == [
        (False, False, True),
        (True, True, True),
    ]
    assert _summary(tmp_path / "ok")["ok"] is True

    _fake_launch(monkeypatch, [7.0, 7.0, 6.99, 7.01, 7.0, 6.98])
    assert gm.main([*TINY, "--steps", "6", "--out", str(tmp_path / "flat")]) == 1
    summary = _summary(tmp_path / "flat")
    assert summary["ok"] is False and len(summary["failures"]) == 2
    assert all("did not fall" in r["error"] for r in summary["runs"].values())


def test_a_failed_or_late_run_fails_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that exits non-zero (its last line is the reason) or outlives its share of the budget (killed, the
    next run still runs) fails the check, even with a falling loss recorded."""
    _fake_launch(monkeypatch, [7.0, 6.0, 5.0, 4.0], returncode=1, stderr="warn\nerror: out of memory\n")
    assert gm.main([*TINY, "--steps", "4", "--out", str(tmp_path / "failed")]) == 1
    errors = [r["error"] for r in _summary(tmp_path / "failed")["runs"].values()]
    assert errors == ["exit 1: error: out of memory"] * 2

    launched = _fake_launch(monkeypatch, [7.0, 6.0, 5.0, 4.0], late=True)
    assert gm.main([*TINY, "--steps", "4", "--out", str(tmp_path / "late")]) == 1
    runs = _summary(tmp_path / "late")["runs"]
    assert all(r["error"].startswith("timed out after") for r in runs.values()) and len(launched) == 2

    launched = _fake_launch(monkeypatch, [7.0, 6.0, 5.0, 4.0])
    assert gm.main([*TINY, "--steps", "4", "--budget-s", "1e-4", "--out", str(tmp_path / "no-time")]) == 1
    runs = _summary(tmp_path / "no-time")["runs"]
    assert all(r["error"].startswith("not run: no time left") for r in runs.values()) and not launched


def test_bad_options_fail_in_one_line(tmp_path: Path) -> None:
    for flags, message in [
        (["--layers", "2", "--dense-layers", "2"], "needs an MoE layer"),
        (["--steps", "2"], "more than the 2 warm-up steps"),
    ]:
        with pytest.raises(SystemExit, match=message):
            gm.main([*TINY, *flags, "--out", str(tmp_path)])
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="no CUDA device"):
            gm.main(["--out", str(tmp_path)])


@pytest.mark.slow
def test_a_tiny_slice_trains_on_cpu(tmp_path: Path) -> None:
    """The module as the check runs it, at tiny widths on the CPU: exit 0, one JSON and one log, both runs'
    losses fell, the measured memory within 2% of the pre-flight estimate, host syncs not counted (no CUDA:
    the trainer says so once per run) and the slice as asked (one dense layer, then MoE layers)."""
    out = tmp_path / "out"
    argv = [*TINY, "--steps", "6", "--lr", "5e-3", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "bench.gpu_model", *argv], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.suffix for p in out.iterdir()) == [".json", ".log"]
    summary = _summary(out)
    assert summary["ok"] and summary["failures"] == []
    assert summary["slice"]["layers"] == 3 and summary["slice"]["dense_layers"] == 1
    assert list(summary["runs"]) == ["bf16", "fp8"]
    for name, run in summary["runs"].items():
        assert set(run) == FIELDS, name
        assert run["exit_code"] == 0 and run["error"] is None and run["steps"] == 6
        assert run["loss_fell"] and run["loss_last"] < run["loss_first"]
        assert run["tokens_per_s"] > 0 and run["mfu"] > 0
        assert run["peak_memory_gib"] == pytest.approx(run["estimate_gib"], rel=0.02)
        assert run["host_syncs_per_step"] is None and run["host_sync_sites"] is None
        assert "--num-dense-layers 1" in run["command"] and "--sync-debug" in run["command"]
    log = next(out.glob("*.log")).read_text()
    assert log.count("--sync-debug: no CUDA device") == 2 and "fp8-gemm" in log


def test_records_stop_at_a_line_cut_short(tmp_path: Path) -> None:
    """A run killed while writing its metrics leaves a partial last line: the steps before it still count."""
    path = tmp_path / "m.jsonl"
    assert gm.read_records(path) == []
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    assert gm.read_records(path) == [{"step": 1}, {"step": 2}]


def test_the_first_run_may_overrun_its_half_but_leaves_the_next_its_floor() -> None:
    later = gm.LATER_RUN_S
    assert gm.time_limit(170.0, 2) == 170.0 - later  # bf16 may take 110 s of 170
    assert gm.time_limit(100.0, 2) == 50.0  # never less than an equal share
    assert gm.time_limit(70.0, 1) == 70.0  # the last run takes what is left

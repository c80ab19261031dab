"""--sync-debug: the host syncs torch.cuda.set_sync_debug_mode("warn") reports inside a training step.

On CPU: the counting, fed the warnings torch gives (its exact message, from the lines that would sync); the
context manager's mode switching and warning hand-back with torch.cuda's two calls stood in; the trainer
accepting the flag and ignoring it with one line. On a GPU: the real warnings of ``item()`` and ``nonzero``."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from moe.train.metrics import SYNC_SITES, SYNC_WARNING, HostSyncs, SyncDebug, count_host_syncs

ROOT = Path(__file__).resolve().parents[3]
HERE = Path(__file__).name


def _warn_syncs(lines: int, repeats: int) -> None:
    """``repeats`` sync warnings from each of ``lines`` code objects (as torch issues them: a UserWarning from the
    line that called the op) and one other warning."""
    for _ in range(repeats):
        for i in range(lines):
            exec(compile(f"warnings.warn({SYNC_WARNING!r})", f"/src/step{i}.py", "exec"), {"warnings": warnings})
    warnings.warn("something else", DeprecationWarning, stacklevel=2)


def test_counting_takes_every_sync_and_names_the_first_sites() -> None:
    sites = [f"step{i}.py:1" for _ in range(3) for i in range(SYNC_SITES + 2)]
    syncs = count_host_syncs(sites)
    assert syncs.count == 3 * (SYNC_SITES + 2)
    # the first sites met, each with all of its syncs (repeats at a named site still count there)
    assert syncs.sites == {f"step{i}.py:1": 3 for i in range(SYNC_SITES)}
    assert count_host_syncs([]) == HostSyncs(0)


def test_sync_debug_counts_at_the_call_site_and_passes_other_warnings_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.cuda's get/set_sync_debug_mode stood in (a CPU build has no CUDA): the mode is "warn" inside and the
    caller's again after; every sync warning is counted at the line that issued it, not shown, even where the
    caller's filters show a warning once; every other warning reaches the caller's filters and display."""
    modes = [2]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: modes[-1])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with warnings.catch_warnings(record=True) as outer:
        warnings.simplefilter("once")
        with SyncDebug(torch.device("cuda")) as syncs:
            assert modes[-1] == "warn"
            _warn_syncs(lines=2, repeats=2)
    assert modes == [2, "warn", 2]
    assert syncs.result == HostSyncs(4, {"/src/step0.py:1 in <module>": 2, "/src/step1.py:1 in <module>": 2})
    assert [(w.category, str(w.message)) for w in outer] == [(DeprecationWarning, "something else")]


@pytest.mark.parametrize(("device", "enabled"), [("cpu", True), ("cuda", False)])
def test_sync_debug_off_does_nothing(device: str, enabled: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU, or not enabled (the run's first step), no mode is set and warnings pass through untouched."""
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: pytest.fail("no mode may be set"))
    with warnings.catch_warnings(record=True) as outer:
        warnings.simplefilter("always")
        with SyncDebug(torch.device(device), enabled=enabled) as syncs:
            _warn_syncs(lines=1, repeats=1)
    assert syncs.result is None
    assert [str(w.message) for w in outer] == [SYNC_WARNING, "something else"]


@pytest.mark.slow
def test_the_trainer_accepts_the_flag_and_ignores_it_without_cuda(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line says so, once; the steps run and record no host syncs; the resolved job keeps the flag."""
    if torch.cuda.is_available():
        pytest.skip("the flag counts on this machine")
    metrics = tmp_path / "m.jsonl"
    argv = ["--preset", "tiny", "--steps", "2", "--seq-len", "16", "--val-every", "0", "--sync-debug"]
    proc = subprocess.run(
        [sys.executable, "-m", "moe.train", *argv, "--metrics-file", str(metrics)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("--sync-debug: no CUDA device") == 1
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert not any("host_syncs" in r for r in records)
    assert all(r["memory_estimate_bytes"] > 0 for r in records)
    from moe.train import main

    main([*argv, "--print-config"])  # printing starts no process group: in this process, not a second one
    assert "sync_debug = true" in capsys.readouterr().out.splitlines()


@pytest.mark.gpu
def test_sync_debug_counts_the_syncs_of_cuda_ops() -> None:
    """``item()`` and ``nonzero`` each make the host wait (counted, at this file's lines); elementwise work queued
    on the stream does not."""
    x = torch.arange(8.0, device="cuda")
    with SyncDebug(x.device) as quiet:
        (x * 2 + 1).exp()
    assert quiet.result == HostSyncs(0)
    with SyncDebug(x.device) as syncs:
        x.sum().item()
        torch.nonzero(x > 3)
    assert syncs.result is not None and syncs.result.count >= 2
    assert all(site.split(":")[0].endswith(HERE) for site in syncs.result.sites), syncs.result.sites

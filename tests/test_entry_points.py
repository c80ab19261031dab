"""Every command-line entry point answers ``--help``: exit status 0, a usage line, quickly, with no side effects.

The entry points are discovered, not listed: under the packages, every module with a ``__main__`` guard
(``python -m package.module``) and every ``__main__.py`` (``python -m package``); under examples/, every
script with a ``__main__`` guard (``python examples/x.py``, since examples are run as scripts). ``KNOWN``
pins the ones the docs and launch scripts rely on, so a test fails if one of them disappears.

Each run is a fresh interpreter that imports torch (about 1.5 s), so the runs go concurrently in a small
thread pool started by the first test that needs one; each test then waits only for its own run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.selected import selected_params

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dualpipe", "moe", "kernels", "bench")
SCRIPT_DIRS = ("examples",)
TIMEOUT_S = 180.0  # a hang guard, not a speed check: three interpreters importing torch at once on 2 busy cores
WORKERS = 3  # CI has 2 cores; the interpreters partly wait on disk while importing torch

# An entry point as the arguments after ``sys.executable``: ("-m", "package.module") or ("examples/x.py",).
EntryPoint = tuple[str, ...]

KNOWN: frozenset[EntryPoint] = frozenset(
    {
        ("-m", "bench.cluster"),
        ("-m", "bench.kernels"),
        ("-m", "bench.overlap"),
        ("-m", "bench.overlap.calibrate"),
        ("-m", "bench.overlap.report"),
        ("-m", "bench.schedules"),
        ("-m", "dualpipe.simulate"),
        ("-m", "moe.data"),
        ("-m", "moe.plan"),
        ("examples/overlap_moe.py",),
        ("examples/toy_dualpipev.py",),
        ("examples/train.py",),
    }
)

_MAIN_GUARD = re.compile(r"""^if __name__ == ["']__main__["']\s*:""", re.MULTILINE)


def _python_files(top: Path) -> Iterator[Path]:
    for path in sorted(top.rglob("*.py")):
        rel = path.relative_to(top)
        if not any(part == "__pycache__" or part.startswith(".") for part in rel.parts):
            yield path


def _has_main_guard(path: Path) -> bool:
    return bool(_MAIN_GUARD.search(path.read_text(encoding="utf-8", errors="replace")))


def discover_entry_points(root: Path = ROOT) -> set[EntryPoint]:
    found: set[EntryPoint] = set()
    for package in PACKAGES:
        for path in _python_files(root / package):
            rel = path.relative_to(root).with_suffix("")
            if rel.name == "__main__":
                found.add(("-m", ".".join(rel.parent.parts)))
            elif _has_main_guard(path):
                found.add(("-m", ".".join(rel.parts)))
    for folder in SCRIPT_DIRS:
        for path in _python_files(root / folder):
            if _has_main_guard(path):
                found.add((path.relative_to(root).as_posix(),))
    return found


def _name(entry: EntryPoint) -> str:
    return " ".join(("python", *entry))


DISCOVERED = discover_entry_points()
ENTRY_POINTS = sorted(DISCOVERED | KNOWN)


def _run_help(entry: EntryPoint) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, *entry, "--help"]
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        return subprocess.CompletedProcess(cmd, -1, out, err + f"\n[timed out after {TIMEOUT_S:.0f} s]")


@pytest.fixture(scope="module")
def help_runs(request: pytest.FixtureRequest) -> Iterator[dict[EntryPoint, Future[subprocess.CompletedProcess[str]]]]:
    """Starts ``--help`` for every entry point selected in this session (honours -k and xdist splits)."""
    selected = selected_params(request, "test_entry_point_answers_help", "entry")
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        yield {entry: pool.submit(_run_help, entry) for entry in selected}


def test_discovery_finds_the_known_entry_points():
    missing = sorted(_name(e) for e in KNOWN - DISCOVERED)
    assert not missing, f"entry points no longer found (no __main__ guard / __main__.py): {missing}"


@pytest.mark.parametrize("entry", ENTRY_POINTS, ids=_name)
def test_entry_point_answers_help(entry: EntryPoint, help_runs):
    result = help_runs[entry].result()
    output = f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-3000:]}"
    assert result.returncode == 0, f"{_name(entry)} --help exited {result.returncode}\n{output}"
    assert "usage" in result.stdout.lower(), f"{_name(entry)} --help printed no usage line\n{output}"

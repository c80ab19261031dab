"""How long the planner takes to answer, and how much memory it needs, for every preset.

    python -m bench.plan_speed                                  # every preset at 64 and 2,048 H100s
    python -m bench.plan_speed --presets qwen3-30b-a3b --gpus 64 --timeout 120 --out bench/results

Each (preset, GPUs) runs ``python -m moe.plan --model PRESET --gpu GPU --gpus N --gpus-per-node 8 --seq-len
4096`` (its defaults otherwise, ``--extra`` appended) in a process of its own, so the peak resident memory is
that run's alone (``getrusage``'s ``ru_maxrss`` of the child); a run still going after ``--timeout`` seconds is
killed and recorded as over it. The wall time includes the interpreter's start and the imports (about a
second), as a user waits for them. ``--out`` saves the rows as ``plan-speed-<host>-<date>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from moe.models.config import PRESETS

__all__ = ["Row", "measure", "plan_argv"]

ROOT = Path(__file__).resolve().parents[1]
"""The repository root: the child runs from it, so ``-m bench.plan_speed`` resolves wherever the caller stands."""

ALIASES = {"v3": "deepseek-v3"}
"""Presets that name the same model as another: measured once, under the other name."""


@dataclass(frozen=True, slots=True)
class Row:
    preset: str
    gpus: int
    seconds: float | None
    """Wall time of the whole command; None when it ran past the timeout."""
    peak_mib: float | None
    """Peak resident memory of the planner's process (None past the timeout)."""
    note: str = ""


def plan_argv(preset: str, gpus: int, gpu: str = "h100", extra: tuple[str, ...] = ()) -> list[str]:
    """The planner's arguments for one row."""
    return ["--model", preset, "--gpu", gpu, "--gpus", str(gpus), "--gpus-per-node", "8", "--seq-len", "4096", *extra]


def _child(argv: list[str]) -> None:
    """Run the planner in this process (its output discarded) and print its time and peak memory as JSON."""
    from moe.plan.cli import main

    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        main(argv)
    seconds = time.perf_counter() - start
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    print(json.dumps({"seconds": seconds, "peak_mib": peak_kib / 1024}))


def measure(preset: str, gpus: int, *, gpu: str = "h100", timeout: float = 120.0, extra: tuple[str, ...] = ()) -> Row:
    """One planner run in a fresh process: its wall time (with the start-up) and peak memory."""
    cmd = [sys.executable, "-m", "bench.plan_speed", "--child", json.dumps(plan_argv(preset, gpus, gpu, extra))]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return Row(preset, gpus, None, None, f"over {timeout:.0f} s")
    wall = time.perf_counter() - start
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["?"])[-1]
        return Row(preset, gpus, wall, None, f"failed: {tail}")
    peak = json.loads(done.stdout.strip().splitlines()[-1])["peak_mib"]
    return Row(preset, gpus, wall, peak)


def table(rows: list[Row]) -> str:
    lines = [f"{'preset':>18}  {'GPUs':>5}  {'seconds':>8}  {'peak MiB':>8}  note"]
    for r in rows:
        s = "-" if r.seconds is None else f"{r.seconds:.1f}"
        m = "-" if r.peak_mib is None else f"{r.peak_mib:.0f}"
        lines.append(f"{r.preset:>18}  {r.gpus:>5}  {s:>8}  {m:>8}  {r.note}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.plan_speed", description=__doc__.split("\n")[0])
    p.add_argument("--presets", nargs="+", choices=sorted(PRESETS), help="default: every preset (aliases once)")
    p.add_argument("--gpus", type=int, nargs="+", default=[64, 2048], help="cluster sizes (default 64 2048)")
    p.add_argument("--gpu", default="h100", help="device profile (default h100)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a run is killed (default 120)")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="more planner flags, after everything")
    p.add_argument("--out", metavar="DIR", help="save the rows as JSON in DIR")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return 0
    presets = args.presets or [name for name in PRESETS if name not in ALIASES]
    rows = []
    for name in presets:
        for gpus in args.gpus:
            rows.append(measure(name, gpus, gpu=args.gpu, timeout=args.timeout, extra=tuple(args.extra)))
            print(table(rows[-1:]).splitlines()[1], flush=True)
    print(table(rows))
    if args.out:
        date = datetime.date.today().isoformat()
        host = f"cpu-{os.cpu_count()}core"
        doc = {
            "date": date,
            "command": "python -m bench.plan_speed " + " ".join(argv if argv is not None else sys.argv[1:]),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
            "planner_args": plan_argv("PRESET", 0, args.gpu, tuple(args.extra)),
            "rows": [asdict(r) for r in rows],
        }
        path = Path(args.out) / f"plan-speed-{host}-{date}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

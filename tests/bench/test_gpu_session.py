"""The GPU scripts without a GPU: ``bench/gpu_session.sh`` (the one-GPU check) and ``bench/cluster_session.sh``
(2+ GPUs) in their dry runs, and the step runner they share (``bench/gpu_common.sh``) for real.

In a dry run, the commands the scripts would run (the Python interpreter, torchrun, nsys, git) are stand-ins
that leave a mark when called; ``NGPUS`` plans the cluster checks for a machine with that many GPUs. The
training runs the cluster plan prints must be jobs the trainer accepts at their world size (``--print-config``
checks the layout and the dispatcher).
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from moe.dispatch.deepep import DEEPEP_V1_COMMIT
from moe.train import config_from_args

ROOT = Path(__file__).resolve().parents[2]
NINE_MINUTES = 9 * 60


def _dry_run(tmp_path: Path, script: str, *args: str, gpus: int | None = None) -> subprocess.CompletedProcess:
    bin_dir, marks = tmp_path / "bin", tmp_path / "ran"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("python3", "torchrun", "nsys", "git", "tar", "timeout"):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {marks}\n')
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python3")}
    env["OUT"] = str(tmp_path / "out")
    env.pop("NGPUS", None)
    if gpus is not None:
        env["NGPUS"] = str(gpus)
    done = subprocess.run(
        ["bash", str(ROOT / script), "--dry-run", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert not marks.exists(), f"a dry run ran: {marks.read_text()}"
    assert not (tmp_path / "out").exists(), "a dry run wrote files"
    return done


def _steps(stdout: str) -> list[tuple[str, int | None, str]]:
    """Each step's line ``=== NAME (budget S s): COMMAND`` as (name, budget, command); a note has no budget."""
    steps = []
    for line in stdout.splitlines():
        if not line.startswith("=== "):
            continue
        m = re.fullmatch(r"=== (.+?) \(budget (\d+) s\): (.*)", line)
        if m:
            steps.append((m[1], int(m[2]), m[3]))
        else:
            name, command = line[4:].split(": ", 1)
            steps.append((name, None, command))
    return steps


def _names(steps: list[tuple[str, int | None, str]]) -> list[str]:
    return [name for name, _, _ in steps]


# ---- the one-GPU check --------------------------------------------------------------------------------------


def test_the_one_gpu_check_is_four_steps_in_nine_minutes(tmp_path: Path) -> None:
    done = _dry_run(tmp_path, "bench/gpu_session.sh")
    assert done.returncode == 0, done.stderr
    steps = _steps(done.stdout)
    assert _names(steps) == [
        "versions",
        "pytest -m gpu",
        "kernels at DeepSeek-V3 shapes",
        "deepseek-v3 slice on one GPU, bf16 and FP8",
        "overlap on one GPU, emulated all-to-all",
    ]
    budgets = [budget for _, budget, _ in steps]
    assert all(b is not None and b > 0 for b in budgets)
    assert sum(budgets) <= NINE_MINUTES
    assert f"{sum(budgets)} s in all" in done.stdout
    commands = [command for _, _, command in steps]
    assert "-m pytest -m gpu " in commands[1]
    assert "-m bench.kernels --shapes v3" in commands[2]
    assert "-m bench.gpu_model" in commands[3]
    assert "-m bench.gpu_overlap_trace --emulated-gbps" in commands[4]
    out = str(tmp_path / "out")
    assert all(f"--out {out}" in c for c in commands[2:])  # every result lands in $OUT


def test_every_python_step_is_a_command_its_module_accepts(tmp_path: Path) -> None:
    """Each ``python -m MODULE ARGS`` step parses with that module's own parser (a renamed flag fails here)."""
    steps = _steps(_dry_run(tmp_path, "bench/gpu_session.sh").stdout)
    modules = []
    for _, _, command in steps:
        argv = shlex.split(command)
        if argv[1:2] != ["-m"] or argv[2] == "pytest":
            continue
        modules.append(argv[2])
        importlib.import_module(argv[2]).build_parser().parse_args(argv[3:])  # SystemExit(2) on a bad flag
    assert modules == ["bench.kernels", "bench.gpu_model", "bench.gpu_overlap_trace"]


@pytest.mark.parametrize("args", [("1",), ("--dry-run", "4"), ("deepep",)])
def test_the_one_gpu_check_takes_no_call_number(tmp_path: Path, args: tuple[str, ...]) -> None:
    done = subprocess.run(["bash", str(ROOT / "bench/gpu_session.sh"), *args], capture_output=True, text=True,
                          timeout=60, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().startswith("usage: bash bench/gpu_session.sh [--dry-run]")
    assert "bench/cluster_session.sh" in done.stderr  # where the multi-GPU checks went


# ---- the step runner, for real ------------------------------------------------------------------------------


def _source_steps(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    """Run ``body`` in bash after sourcing bench/gpu_common.sh as the scripts do (from the repository root)."""
    script = f"""
set -uo pipefail
cd {ROOT}
dry=0 log={tmp_path}/log py=python3 status=0
source bench/gpu_common.sh
{body}
echo "status=$status"
"""
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)


def test_a_step_over_its_budget_is_ended_and_kept_as_the_failure(tmp_path: Path) -> None:
    done = _source_steps(
        tmp_path,
        """
slow() { echo "started $1"; sleep 30; echo "never"; }
step fine 5 true
step slow 1 slow "$PWD"
step failing 5 false
""",
    )
    assert done.returncode == 0, done.stderr
    assert f"started {ROOT}" in done.stdout  # a shell function runs, with its arguments
    assert "never" not in done.stdout
    assert "=== slow: exit 124 after 1 s (over its budget of 1 s)" in done.stdout
    assert "=== fine: exit 0" in done.stdout
    assert "=== failing: exit 1" in done.stdout
    assert done.stdout.strip().endswith("status=124")  # the first failure, not the last
    assert "=== slow: exit 124" in (tmp_path / "log").read_text()


def test_a_step_function_reads_exported_variables_and_other_functions(tmp_path: Path) -> None:
    done = _source_steps(
        tmp_path,
        """
export where=here
inner() { echo "inner sees $where and py=$py"; }
outer() { inner; }
step outer 5 outer
""",
    )
    assert "inner sees here and py=python3" in done.stdout
    assert done.stdout.strip().endswith("status=0")


# ---- the cluster checks -------------------------------------------------------------------------------------


def test_the_cluster_checks_on_8_gpus_plan_deepep_ours_training_then_deepep_v2(tmp_path: Path) -> None:
    done = _dry_run(tmp_path, "bench/cluster_session.sh", gpus=8)
    assert done.returncode == 0, done.stderr
    steps = _steps(done.stdout)
    names = _names(steps)
    want = [
        "versions",
        f"DeepEP V1 build (build/DeepEP at {DEEPEP_V1_COMMIT[:7]})",
        "DeepEP's own tests/test_intranode.py on 8 GPUs",
        "pytest -m multigpu (ep = 8, alltoall and deepep, synced and sync-free)",
        "train pp=2 x ep=4 alltoall CUDA_DEVICE_MAX_CONNECTIONS=1",
        "train pp=2 x ep=4 alltoall CUDA_DEVICE_MAX_CONNECTIONS=32",
        "train pp=2 x ep=4 deepep CUDA_DEVICE_MAX_CONNECTIONS=1",
        "train pp=2 x ep=4 deepep CUDA_DEVICE_MAX_CONNECTIONS=32",
        "DeepEP V2's own tests/elastic/test_ep.py on 8 GPUs",
        "pytest -m multigpu -k deepep-v2",
        "train pp=2 x ep=4 deepep-v2",
        "tokens/s and loss per training run",
        "bundle the runs",
    ]
    at = [next(i for i, n in enumerate(names) if n.startswith(w)) for w in want]
    assert at == sorted(at), names
    assert sum(n.startswith("DeepEP V1 build") for n in names) == 1  # each part that needs it asks, once built
    assert f"deepep_build build/DeepEP {DEEPEP_V1_COMMIT}" in done.stdout
    assert "8xnogpu" in done.stdout  # the machine: GPU count and model (none visible here)
    assert all(budget for name, budget, _ in steps if name != "note")  # every step has a time limit
    # Every training run is a job the trainer accepts at its world size.
    runs = [command.split("train_ep ", 1)[1].split() for _, _, command in steps if "train_ep " in command]
    assert len(runs) == 5
    for _name, _connections, *argv in runs:
        config, _ = config_from_args([*argv, "--print-config"], world=8)
        assert (config.parallel.pp, config.parallel.ep) == (2, 4)


def test_the_cluster_checks_on_one_gpu_say_deepep_needs_two_and_go_on(tmp_path: Path) -> None:
    done = _dry_run(tmp_path, "bench/cluster_session.sh", gpus=1)
    assert done.returncode == 0, done.stderr
    steps = _steps(done.stdout)
    assert any("DeepEP intranode with one rank is not possible" in command for _, _, command in steps)
    assert not any(n.startswith("train") or "test_intranode" in c or "test_ep.py" in c for n, _, c in steps), steps
    assert [n for n in _names(steps) if n != "note"] == [
        "versions",
        "GPUs and their links",
        f"DeepEP V1 build (build/DeepEP at {DEEPEP_V1_COMMIT[:7]})",
        "DeepEP V1 as the deepep backend sees it",
        "pytest -m multigpu (it skips on one GPU, saying why)",
        "DeepEP V2 build (build/DeepEP-v2)",
        "DeepEP V2 as the deepep-v2 backend sees it",
        "pytest -m multigpu -k deepep-v2",
    ]


def test_the_cluster_checks_run_only_the_parts_asked_for_in_their_own_order(tmp_path: Path) -> None:
    steps = _steps(_dry_run(tmp_path, "bench/cluster_session.sh", "v2", "ours", gpus=4).stdout)
    names = _names(steps)
    assert names.index("pytest -m multigpu (ep = 4, alltoall and deepep, synced and sync-free)") < names.index(
        "DeepEP V2 build (build/DeepEP-v2)"
    )
    assert not any("test_intranode" in c or "CUDA_DEVICE_MAX_CONNECTIONS=32" in n for n, _, c in steps)


@pytest.mark.parametrize("args", [("nccl-tests",), ("ours", "1")])
def test_a_wrong_part_prints_the_usage(tmp_path: Path, args: tuple[str, ...]) -> None:
    done = _dry_run(tmp_path, "bench/cluster_session.sh", *args)
    assert done.returncode == 2
    assert "usage: bash bench/cluster_session.sh [--dry-run] [PART...] (parts: deepep ours train v2)" in done.stderr

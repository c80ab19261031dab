"""``bash bench/gpu_session.sh --dry-run N``: the steps of call N, in order, with nothing run and nothing written.

Commands the script would run (the Python interpreter, torchrun, nsys, git) are stand-ins that leave a mark
when called; ``NGPUS`` plans call 4 for a machine with that many GPUs. The training runs the plan prints must
be jobs the trainer accepts at their world size (``--print-config`` checks the layout and the dispatcher).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from moe.dispatch.deepep import DEEPEP_V1_COMMIT
from moe.train import config_from_args

ROOT = Path(__file__).resolve().parents[2]


def _dry_run(tmp_path: Path, *args: str, gpus: int | None = None) -> subprocess.CompletedProcess:
    bin_dir, marks = tmp_path / "bin", tmp_path / "ran"
    bin_dir.mkdir(exist_ok=True)
    for tool in ("python3", "torchrun", "nsys", "git", "tar"):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {marks}\n')
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python3")}
    env["OUT"] = str(tmp_path / "out")
    env.pop("NGPUS", None)
    if gpus is not None:
        env["NGPUS"] = str(gpus)
    done = subprocess.run(
        ["bash", str(ROOT / "bench/gpu_session.sh"), "--dry-run", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert not marks.exists(), f"a dry run ran: {marks.read_text()}"
    assert not (tmp_path / "out").exists(), "a dry run wrote files"
    return done


def _steps(stdout: str) -> list[str]:
    """Each step's line, ``NAME: COMMAND`` (a name has no ": ")."""
    return [line[4:] for line in stdout.splitlines() if line.startswith("=== ")]


def _names(steps: list[str]) -> list[str]:
    return [s.split(": ", 1)[0] for s in steps]


def test_call_4_on_8_gpus_plans_deepep_ours_training_then_deepep_v2(tmp_path: Path) -> None:
    done = _dry_run(tmp_path, "4", gpus=8)
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
    # Every training run is a job the trainer accepts at its world size.
    runs = [s.split(" train_ep ", 1)[1].split() for s in steps if " train_ep " in s]
    assert len(runs) == 5
    for _name, _connections, *argv in runs:
        config, _ = config_from_args([*argv, "--print-config"], world=8)
        assert (config.parallel.pp, config.parallel.ep) == (2, 4)


def test_call_4_on_one_gpu_says_deepep_needs_two_and_goes_on(tmp_path: Path) -> None:
    done = _dry_run(tmp_path, "4", gpus=1)
    assert done.returncode == 0, done.stderr
    steps = _steps(done.stdout)
    assert any("DeepEP intranode with one rank is not possible" in s for s in steps)
    assert not any(s.startswith("train") or "test_intranode" in s or "test_ep.py" in s for s in steps), steps
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


def test_call_4_runs_only_the_parts_asked_for_in_its_own_order(tmp_path: Path) -> None:
    steps = _steps(_dry_run(tmp_path, "4", "v2", "ours", gpus=4).stdout)
    names = _names(steps)
    assert names.index("pytest -m multigpu (ep = 4, alltoall and deepep, synced and sync-free)") < names.index(
        "DeepEP V2 build (build/DeepEP-v2)"
    )
    assert not any("test_intranode" in s or "CUDA_DEVICE_MAX_CONNECTIONS=32" in s for s in steps)


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (
            "1",
            [
                "versions",
                "pytest -m gpu",
                "train (1 GPU, NCCL)",
                "train FP8 (1 GPU, Triton FP8 GEMMs, FP8 activations)",
                "FP8 loss tracks bf16",
            ],
        ),
        ("2", ["versions", "kernels v3", "overlap trace + host vs GPU (small, 2 layers)", "gzip the trace"]),
        ("3", ["versions", "kernels v3", "overlap trace + host vs GPU (small, all layers)", "gzip the trace",
               "pytest -m multigpu (collection; skips on one GPU)"]),
    ],
)  # fmt: skip
def test_calls_1_to_3_dry_run(tmp_path: Path, call: str, expected: list[str]) -> None:
    done = _dry_run(tmp_path, call)
    assert done.returncode == 0, done.stderr
    assert _names(_steps(done.stdout)) == expected


@pytest.mark.parametrize("args", [("5",), ("4", "nccl-tests"), ("1", "deepep"), ()])
def test_a_wrong_call_prints_the_usage(tmp_path: Path, args: tuple[str, ...]) -> None:
    done = _dry_run(tmp_path, *args)
    assert done.returncode == 2 and "usage: bash bench/gpu_session.sh [--dry-run] 1|2|3|4" in done.stderr

"""The deepseek-v3 preset, cut to a slice at full width, trained on one GPU in bf16 and in FP8: does the loss
fall, how fast does it train (tokens/s, MFU), how much memory does it take against the pre-flight estimate,
and how many times does a step make the host wait for the GPU (``--sync-debug``).

    PYTHONPATH=. python -m bench.gpu_model --out DIR        # step 3 of the one-GPU check (bench/gpu_session.sh)

Each run is ``python -m moe.train`` in a process of its own (one rank, NCCL over an in-process store; no
torchrun), under :func:`bench.process_tree.run`, so a run that fails or hangs is killed with its whole process
tree and the next one still runs; each may use what is left of ``--budget-s`` but :data:`LATER_RUN_S` for each
run after it (:func:`time_limit`: bf16 goes first and may overrun its half, the FP8 run still starts). Writes ONE
summary JSON (``gpu-model-<device>-<date>.json``: per run the loss at the first step and over the last
steps and whether it fell, tokens/s and MFU as medians after the warm-up steps, the peak memory beside the
pre-flight estimate, the host syncs per step and their first call sites) and ONE log with both runs' output
(``gpu-model-<device>-<date>.log``) into ``--out``. Exit status 1 when a run failed or its loss did not fall.

The slice (the defaults). DeepSeek-V3's widths (hidden 7168, 128 MLA heads, its latent ranks and head dims,
dense intermediate 18432, expert intermediate 2048, top-8 of 8 groups, one shared expert) with 3 layers: the
preset's first 3 layers are all dense (``num_dense_layers = 3``, config.json's ``first_k_dense_replace``), so
``--layers`` alone would cut a model without experts; ``--dense-layers 1`` keeps one dense layer and makes
layers 1 and 2 MoE layers, with 32 routed experts. No MTP module: the slice is the main model's blocks. The
vocabulary is 256, the byte-level demo corpus the machine trains on (no network, no tokenizer): at the
published 129,280 the head alone would be a third of the slice's FLOPs and 1.85B of its 5.7B parameters
(2.5% of the full model's FLOPs), so the slice's MFU and memory would measure the head, not the blocks;
``--vocab-size 129280`` runs it anyway (about 107 GiB estimated). At sequence 4096, micro-batch 1, DualPipeV
at pp = 1 (its two stages on the one rank, two micro-batches a step, the overlapped pair run as on a
cluster), bf16 with fp32 master weights, gradients and AdamW moments: 3.87B parameters, and a pre-flight
estimate (moe.plan's footprint) of 75.3 GiB in bf16 and 74.3 GiB with FP8 activations, about 54% of the
H200's 139 GiB: wide of the trainer's 90% limit, so an estimate short by a third would still fit. The FP8 run
adds ``--fp8 --fp8-activations`` (the FP8 GEMMs of :mod:`kernels.fp8`, the experts' saved activations in FP8).
MFU is against the GPU's dense bf16 peak in both runs.

Time (estimated from the parts, not measured: the budget of the check's step is 180 s for both runs).
Per run: interpreter and imports about 10 s; the weights initialised on the CPU from the seed
(moe.models.stage.MoEStage.reset_parameters: one normal draw per parameter, 3.87B of them, at 150-300M/s) and
uploaded, 15-30 s; Triton's compile and autotune of every kernel at these shapes before step 1
(kernels.warmup), the part no CPU can size: tens of seconds, more for the FP8 run; then the steps, each 8,192
tokens of 12 GFLOP (98.6 TFLOP a step, 0.2-0.5 s at 20-50% of the H200's 989 TFLOP/s, plus AdamW over 3.87B
fp32 masters, about 0.05 s of HBM traffic). 10 steps (``--steps``) cost under 10 s: enough for the loss to
fall from the initial weights' and for a median of tokens/s over 8 steps after the 2 warm-up steps (the first
step grows the allocator's pool and creates the communicator), and a small share of the budget next to the
fixed start-up, so 2 runs of 40-80 s fit in ``--budget-s`` 170 (the check gives the step 180). The learning
rate is DeepSeek-V3's peak (2.2e-4, reached after 2 warm-up steps): the published rate for this width, where
AdamW's first updates move every weight by about the rate itself. The steps are timed with ``--sync-debug`` on:
each sync it counts costs the host a stack walk (tens of microseconds), part of what it measures.

The loss fell when the mean of its last 3 steps is at least :data:`MIN_FALL` below the first step's, the loss
of the initial weights: a margin that the differences between batches alone do not reach.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from bench.harness import device_slug
from bench.process_tree import run as run_tree
from moe.models.config import PRESETS

__all__ = [
    "LATER_RUN_S",
    "MIN_FALL",
    "RUNS",
    "RunSpec",
    "main",
    "read_records",
    "summarize",
    "time_limit",
    "trainer_argv",
]

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30

MIN_FALL = 0.02
"""The relative fall of the loss (last steps' mean against the first step's) a run must show. At a learning rate
too small to learn, the loss moves only by the batches' differences: within 1% over 8 steps of 64 tokens of the
demo corpus (the CPU test's shape, measured), less at 8,192 tokens a step."""
LAST_STEPS = 3
"""Steps the final loss is averaged over."""
WARMUP_STEPS = 2
"""Steps left out of the tokens/s and MFU medians (the trainer leaves the first out of its host-sync counts)."""
LR_WARMUP = 2
"""Steps of the learning rate's linear warm-up: the first step's update is half the peak's."""


@dataclass(frozen=True, slots=True)
class RunSpec:
    """One training run of the check: its name and the trainer flags it adds to the slice's."""

    name: str
    flags: tuple[str, ...] = ()


RUNS = (RunSpec("bf16"), RunSpec("fp8", ("--fp8", "--fp8-activations")))
"""bf16 first: when the budget runs out, the run every later figure is compared with has finished."""

LATER_RUN_S = 60.0
"""Seconds of the budget kept for each run still to come: a cold start, its Triton tuning and its steps (the
module docstring); less and a later run could not finish even where its own kernels are already compiled."""


def time_limit(left_s: float, runs_left: int) -> float:
    """Seconds the next of ``runs_left`` runs may take with ``left_s`` of the budget left: all of it but
    :data:`LATER_RUN_S` for each later run, and never less than an equal share."""
    return max(left_s - LATER_RUN_S * (runs_left - 1), left_s / runs_left)


def trainer_argv(args: argparse.Namespace, run: RunSpec, metrics: Path) -> list[str]:
    """The ``python -m moe.train`` command of ``run`` (the module docstring's slice)."""
    values = {
        "--model": args.model,
        "--layers": args.layers,
        "--num-dense-layers": args.dense_layers,
        "--num-experts": args.experts,
        "--vocab-size": args.vocab_size,
        "--mtp-layers": 0,
        "--pp": 1,
        "--ep": 1,
        "--schedule": "dualpipev",
        "--dtype": "bfloat16",
        "--seq-len": args.seq_len,
        "--micro-batch-size": args.micro_batch_size,
        "--steps": args.steps,
        "--lr": args.lr,
        "--warmup": LR_WARMUP,
        "--val-every": 0,
        "--log-every": 1,
        "--metrics-file": metrics,
    }
    argv = [sys.executable, "-m", "moe.train", *(str(x) for pair in values.items() for x in pair)]
    return [*argv, "--overlap", "--sync-debug", *run.flags]


def read_records(path: Path) -> list[dict[str, Any]]:
    """The step records of a metrics JSONL, up to a line cut short (a run killed while writing it)."""
    records = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures from its records (``moe.train``'s metrics JSONL, one dict per step, in order).

    ``loss_first``: the first step's; ``loss_last``: the mean of the last :data:`LAST_STEPS`; ``loss_fell``:
    whether that is :data:`MIN_FALL` (relative) or more below. ``tokens_per_s`` and ``mfu``: medians over the
    steps after :data:`WARMUP_STEPS` (the last step when there are no more). ``peak_memory_gib``: on CUDA the
    largest per-step ``torch.cuda.max_memory_allocated``; elsewhere the largest sum of the meter's parameter,
    gradient, optimizer-state and saved-activation bytes (``peak_memory_source`` says which).
    ``host_syncs_per_step``: the median count over the steps that counted them (None where none did: no CUDA),
    with the largest and the call sites of the last such step."""
    if not records:
        raise ValueError("no step was recorded")
    losses = [float(r["loss"]) for r in records]
    first, last = losses[0], statistics.fmean(losses[-LAST_STEPS:])
    timed = records[WARMUP_STEPS:] or records[-1:]
    if any("cuda_peak_allocated_bytes" in r for r in records):
        peak = max(r["cuda_peak_allocated_bytes"] for r in records)
        source = "torch.cuda.max_memory_allocated"
    else:
        keys = ("param_bytes", "grad_bytes", "optimizer_state_bytes", "peak_activation_bytes")
        peak = max(sum(r[k] for k in keys) for r in records)
        source = "moe.train.memory: parameters + gradients + optimizer state + saved activations"
    counted = [r for r in records if "host_syncs" in r]
    return {
        "steps": len(records),
        "losses": losses,
        "loss_first": first,
        "loss_last": last,
        "loss_fell": last <= first * (1 - MIN_FALL),
        "tokens_per_s": _median([r["tokens_per_s"] for r in timed]),
        "mfu": _median([r["mfu"] for r in timed]),
        "step_time_s": _median([r["step_time_s"] for r in timed]),
        "peak_memory_gib": peak / GiB,
        "peak_memory_source": source,
        "estimate_gib": records[0]["memory_estimate_bytes"] / GiB,
        "host_syncs_per_step": _median([r["host_syncs"] for r in counted]),
        "host_syncs_max": max((r["host_syncs"] for r in counted), default=None),
        "host_sync_sites": counted[-1]["host_sync_sites"] if counted else None,
    }


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def run_one(args: argparse.Namespace, run: RunSpec, tmp: Path, limit_s: float, log: TextIO) -> dict[str, Any]:
    """Train ``run`` within ``limit_s`` seconds; its summary (:func:`summarize`) with the command, exit code, wall
    time and ``error`` (None, or one line: why it failed or did not learn)."""
    metrics = tmp / f"{run.name}.jsonl"
    argv = trainer_argv(args, run, metrics)
    command = shlex.join(["python", *argv[1:]])
    out: dict[str, Any] = {"command": command, "exit_code": None, "wall_s": 0.0, "error": None}
    log.write(f"=== {run.name}: {command} (limit {limit_s:.0f} s)\n")
    log.flush()
    if limit_s <= 1:
        out["error"] = "not run: no time left of --budget-s"
        return out
    env = dict(os.environ)
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the trainer takes a CUDA device wherever it sees one
    t0 = time.monotonic()
    try:
        proc = run_tree(argv, timeout=limit_s, env=env, cwd=ROOT)
        out["exit_code"] = proc.returncode
        stdout, stderr = proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        stdout, stderr = exc.stdout or "", exc.stderr or ""
        stdout, stderr = (s.decode() if isinstance(s, bytes) else s for s in (stdout, stderr))
        out["error"] = f"timed out after {limit_s:.0f} s (its part of --budget-s); its process tree was killed"
    out["wall_s"] = time.monotonic() - t0
    log.write(stdout + stderr + f"=== {run.name}: exit {out['exit_code']} after {out['wall_s']:.1f} s\n")
    log.flush()
    if out["error"] is None and out["exit_code"] != 0:
        out["error"] = f"exit {out['exit_code']}: {_last_line(stderr) or _last_line(stdout)}"
    records = read_records(metrics)
    if records:
        out.update(summarize(records))
    elif out["error"] is None:
        out["error"] = "no step was recorded"
    if out["error"] is None and records and len(records) < args.steps:
        out["error"] = f"{len(records)} of {args.steps} steps recorded"
    if out["error"] is None and not out["loss_fell"]:
        out["error"] = (
            f"the loss did not fall by {MIN_FALL:.0%}: {out['loss_first']:.4f} at step 1, "
            f"{out['loss_last']:.4f} over the last {min(LAST_STEPS, len(records))} steps"
        )
    return out


def _versions() -> dict[str, str | None]:
    try:
        import triton

        triton_version: str | None = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_model",
        description="Train a full-width slice of the deepseek-v3 preset on one GPU in bf16 and FP8; one summary "
        "JSON (loss falls, tokens/s, MFU, peak memory vs the pre-flight estimate, host syncs per step) and one log.",
    )
    p.add_argument("--out", required=True, type=Path, help="directory for the summary JSON and the log")
    p.add_argument("--model", default="deepseek-v3", choices=PRESETS, help="the preset (default: deepseek-v3)")
    p.add_argument("--layers", type=int, default=3, help="layers of the slice (default: 3)")
    p.add_argument("--dense-layers", type=int, default=1, help="of which the first are dense (default: 1)")
    p.add_argument("--experts", type=int, default=32, help="routed experts (default: 32)")
    p.add_argument("--vocab-size", type=int, default=256, help="vocabulary (default: 256, the demo corpus's)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence (default: 4096)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="sequences per micro-batch (default: 1)")
    p.add_argument("--steps", type=int, default=10, help="steps per run (default: 10)")
    p.add_argument("--lr", type=float, default=2.2e-4, help="peak learning rate (default: 2.2e-4, DeepSeek-V3's)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="where to train (default: cuda)")
    p.add_argument(
        "--budget-s", type=float, default=170.0, help="seconds for both runs, start-up included (default: 170)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps <= WARMUP_STEPS:
        raise SystemExit(f"error: --steps {args.steps}: needs more than the {WARMUP_STEPS} warm-up steps")
    if args.dense_layers >= args.layers:
        raise SystemExit(
            f"error: --dense-layers {args.dense_layers} of --layers {args.layers}: the slice needs an MoE layer"
        )
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda: no CUDA device here (--device cpu trains on the CPU)")
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    tag = f"{device_slug(device)}-{datetime.date.today().isoformat()}"
    args.out.mkdir(parents=True, exist_ok=True)
    log_path, summary_path = args.out / f"gpu-model-{tag}.log", args.out / f"gpu-model-{tag}.json"
    deadline = time.monotonic() + args.budget_s
    runs: dict[str, dict[str, Any]] = {}
    # the runs' metrics files are read into the summary and not kept
    with open(log_path, "w") as log, tempfile.TemporaryDirectory(prefix="gpu-model-") as tmp:
        for i, spec in enumerate(RUNS):
            limit = time_limit(deadline - time.monotonic(), len(RUNS) - i)
            runs[spec.name] = run_one(args, spec, Path(tmp), limit, log)
    failures = [f"{name}: {r['error']}" for name, r in runs.items() if r["error"]]
    summary = {
        "what": f"{args.model} slice trained on one {args.device} device, bf16 and FP8",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **_versions(),
        "command": shlex.join(["python", "-m", "bench.gpu_model", *(sys.argv[1:] if argv is None else argv)]),
        "slice": {k: v for k, v in vars(args).items() if k not in ("out", "device", "budget_s")},
        "runs": runs,
        "ok": not failures,
        "failures": failures,
    }
    summary_path.write_text(json.dumps(summary, indent=1) + "\n")
    for name, r in runs.items():
        if "loss_first" in r:
            print(
                f"{name}: loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}, {r['tokens_per_s']:.0f} tok/s, "
                f"MFU {r['mfu']:.1%}, peak {r['peak_memory_gib']:.1f} GiB (estimate {r['estimate_gib']:.1f}), "
                f"host syncs/step {r['host_syncs_per_step']}, {r['wall_s']:.0f} s"
            )
    for failure in failures:
        print(f"FAILED {failure}")
    print(f"summary: {summary_path}; log: {log_path}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())

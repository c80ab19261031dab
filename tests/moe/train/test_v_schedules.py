"""The zero-bubble V family (zbv, v-half, v-min) through training: the single-process losses, step by step.

One spawn of 4 gloo ranks trains every (schedule, layout, overlap) in turn, at pp=4 (ep=1) and at pp=2 x ep=2
(dp=2, experts sharded: the overlapped pairs hide all-to-alls; every sub-stage recomputed in backward),
overlap on and off, each over the same global batch (24 sequences a step) as one process running it as 12
micro-batches. The seed, the data and the model do not depend on the layout, so every run must give that
process's losses. The deferred weight gradients (I and W) run in every one; the overlap hook runs once per
pair the schedule made, per pipeline and step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpipe.schedule import Op, build_schedule
from tests.distributed import run_ranks
from tests.moe.train.test_trainer import COMMON

V_FAMILY = ("zbv", "v-half", "v-min")
STEPS = 2
LAYOUTS = {"pp4": ("4", "1", 12, "none"), "pp2-ep2": ("2", "2", 6, "full")}  # pp, ep, micro-batches, recompute
BASE = [*COMMON, "--layers", "8", "--seq-len", "16", "--steps", str(STEPS)]  # a repeated flag: the last wins


def _train_all(rank: int, world: int, runs: list[tuple[str, list[str]]]) -> dict[str, tuple[list[float], int]]:
    """Train each run in turn; per run, rank 0's losses and this rank's overlapped pairs."""
    import dualpipe.overlap
    from moe.train import main

    calls = [0]
    hook = dualpipe.overlap.overlapped_forward_backward

    def counted(*args):
        calls[0] += 1
        return hook(*args)

    dualpipe.overlap.overlapped_forward_backward = counted
    out = {}
    for name, argv in runs:
        calls[0] = 0
        main(argv)
        metrics = Path(argv[argv.index("--metrics-file") + 1])
        losses = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()] if rank == 0 else []
        out[name] = (losses, calls[0])
    return out


def _pairs(schedule: str, pp: int, chunks: int) -> int:
    return sum(a.op is Op.FB for actions in build_schedule(schedule, pp, chunks).ranks for a in actions)


def test_v_family_trains_like_one_process(tmp_path: Path) -> None:
    runs = []
    for schedule in V_FAMILY:
        for layout, (pp, ep, chunks, recompute) in LAYOUTS.items():
            # without a pair (v-half at these shapes, v-min at pp=2) overlap on runs the very same actions as off
            for overlap in ("--overlap", "--no-overlap") if _pairs(schedule, int(pp), chunks) else ("--overlap",):
                name = f"{schedule} {layout} {overlap}"
                flags = ["--schedule", schedule, "--pp", pp, "--ep", ep, "--num-chunks", str(chunks), overlap]
                flags += ["--recompute", recompute]
                runs.append((name, [*BASE, *flags, "--metrics-file", str(tmp_path / f"{len(runs)}.jsonl")]))
    one_run = [*BASE, "--schedule", "1f1b", "--pp", "1", "--ep", "1", "--num-chunks", "12"]
    one_run += ["--metrics-file", str(tmp_path / "one.jsonl")]
    (one,) = run_ranks(_train_all, 1, args=([("one", one_run)],), timeout=120)
    per_rank = run_ranks(_train_all, 4, args=(runs,), timeout=300)

    reference = one["one"][0]
    assert len(reference) == STEPS and reference[-1] < reference[0]
    zbv_pairs = 0
    for name, _ in runs:
        schedule, layout, overlap = name.split()
        losses = per_rank[0][name][0]
        assert losses == pytest.approx(reference, rel=2e-5), name
        pp, _, chunks, _ = LAYOUTS[layout]
        pipelines = 4 // int(pp)  # dp replicas, each its own pipeline
        expected = _pairs(schedule, int(pp), chunks) * pipelines * STEPS if overlap == "--overlap" else 0
        assert sum(r[name][1] for r in per_rank) == expected, name
        zbv_pairs += expected if schedule == "zbv" else 0
    assert zbv_pairs > 0  # the overlapped path ran (zbv pairs at both layouts)

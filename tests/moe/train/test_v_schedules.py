"""The zero-bubble V family (zbv, v-half, v-min) through training: the single-process losses, step by step.

One spawn of 4 gloo ranks trains every (schedule, layout, overlap) in turn, at pp=4 (ep=1) and at pp=2 x ep=2
(dp=2, experts sharded: the overlapped pairs hide all-to-alls; every sub-stage recomputed in backward),
overlap on and off, each over the same global batch (24 sequences a step) as one process running it as 12
micro-batches. The seed, the data and the model do not depend on the layout, so every run must give that
process's losses. The deferred weight gradients (I and W) run in every one; the overlap hook runs once per
pair the schedule made, per pipeline and step.

The same spawns also train every other registered schedule for test_schedules_do_not_change_the_math (the
``schedule_runs`` fixture runs them once), the 1F1B family with its steady pairs overlapped.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dualpipe.schedule import SCHEDULES, Op, build_schedule
from tests.distributed import run_ranks
from tests.moe.train.test_trainer import COMMON

pytestmark = pytest.mark.slow

V_FAMILY = ("zbv", "v-half", "v-min")
STEPS = 2
LAYOUTS = {"pp4": ("4", "1", 12, "none"), "pp2-ep2": ("2", "2", 6, "full")}  # pp, ep, micro-batches, recompute
BASE = [*COMMON, "--layers", "8", "--seq-len", "16", "--steps", str(STEPS)]  # a repeated flag: the last wins
# test_schedules_do_not_change_the_math: every other registered schedule at pp=2 x ep=2 on COMMON's model (4
# micro-batches x 2 ep ranks: the global batch of one process running 8), against dualpipev with overlap
OTHERS = sorted(set(SCHEDULES) - {"dualpipev", *V_FAMILY})
OTHERS_LAYOUT = [*COMMON, "--pp", "2", "--ep", "2", "--steps", str(STEPS), "--num-chunks", "4"]
OTHERS_EXTRA_WARMUP = {"1f1b": 1, "zb1p": 1}  # their last rank pairs given one extra warm-up forward
OFFLOAD = "attn.*,mlp.*@ranks=0;fraction=0.5@ranks=1"  # the trainer's --offload: the same losses, bit for bit


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


def _pairs(schedule: str, pp: int, chunks: int, extra_warmup: int = 0) -> int:
    built = build_schedule(schedule, pp, chunks, extra_warmup=extra_warmup)
    return sum(a.op is Op.FB for actions in built.ranks for a in actions)


def _others_flags(name: str) -> list[str]:
    """The other schedules train with --overlap where they pair (the 1F1B family's with its extra warm-up)."""
    extra = OTHERS_EXTRA_WARMUP.get(name, 0)
    return ["--overlap", "--extra-warmup", str(extra)] if _pairs(name, 2, 4, extra) else []


def v_runs() -> list[tuple[str, list[str]]]:
    """(name, flags) of every V-family run: "schedule layout overlap"."""
    runs = []
    for schedule in V_FAMILY:
        for layout, (pp, ep, chunks, recompute) in LAYOUTS.items():
            # without a pair (v-min at pp=2: its order leaves no slack) --overlap is an error: the run is --no-overlap
            for overlap in ("--overlap", "--no-overlap") if _pairs(schedule, int(pp), chunks) else ("--no-overlap",):
                flags = ["--schedule", schedule, "--pp", pp, "--ep", ep, "--num-chunks", str(chunks), overlap]
                runs.append((f"{schedule} {layout} {overlap}", [*BASE, *flags, "--recompute", recompute]))
    return runs


def train_every_schedule(tmp: Path) -> dict[str, tuple[list[float], list[int]]]:
    """Every run above in one spawn of 4 ranks, and both single-process references ("one", at the V family's
    shapes; "one-others", at the other schedules') in one spawn of 1: per run, rank 0's losses and each rank's
    overlapped pairs."""
    runs = [*v_runs(), ("dualpipev", [*OTHERS_LAYOUT, "--schedule", "dualpipev", "--overlap"])]
    runs += [("dualpipev offload", [*OTHERS_LAYOUT, "--schedule", "dualpipev", "--overlap", "--offload", OFFLOAD])]
    runs += [(name, [*OTHERS_LAYOUT, "--schedule", name, *_others_flags(name)]) for name in OTHERS]
    one = [("one", [*BASE, "--schedule", "1f1b", "--pp", "1", "--ep", "1", "--num-chunks", "12"])]
    one += [("one-others", [*OTHERS_LAYOUT, "--schedule", "1f1b", "--pp", "1", "--ep", "1", "--num-chunks", "8"])]
    with_metrics = [
        [(name, [*argv, "--metrics-file", str(tmp / f"{i}-{j}.jsonl")]) for j, (name, argv) in enumerate(group)]
        for i, group in enumerate((one, runs))
    ]
    (single,) = run_ranks(_train_all, 1, args=(with_metrics[0],), timeout=180)
    per_rank = run_ranks(_train_all, 4, args=(with_metrics[1],), timeout=420)
    out = {name: (losses, [calls]) for name, (losses, calls) in single.items()}
    for name, _ in runs:
        out[name] = (per_rank[0][name][0], [r[name][1] for r in per_rank])
    return out


@pytest.fixture(scope="module")
def schedule_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[float], list[int]]]:
    """Every registered schedule trained once, read by both tests here."""
    return train_every_schedule(tmp_path_factory.mktemp("schedules"))


def test_v_family_trains_like_one_process(schedule_runs: dict[str, tuple[list[float], list[int]]]) -> None:
    reference = schedule_runs["one"][0]
    assert len(reference) == STEPS and reference[-1] < reference[0]
    zbv_pairs = 0
    for name, _ in v_runs():
        schedule, layout, overlap = name.split()
        losses, calls = schedule_runs[name]
        assert losses == pytest.approx(reference, rel=2e-5), name
        pp, _, chunks, _ = LAYOUTS[layout]
        pipelines = 4 // int(pp)  # dp replicas, each its own pipeline
        expected = _pairs(schedule, int(pp), chunks) * pipelines * STEPS if overlap == "--overlap" else 0
        assert sum(calls) == expected, name
        zbv_pairs += expected if schedule == "zbv" else 0
    assert zbv_pairs > 0  # the overlapped path ran (zbv pairs at both layouts)


def test_schedules_do_not_change_the_math(schedule_runs: dict[str, tuple[list[float], list[int]]]) -> None:
    """Every registered schedule, through train.py at pp=2 x ep=2 (the V family: the test above), gives
    dualpipev's losses with overlap, and those of one process running the same global batch (4 micro-batches x 2
    ep ranks = 8 micro-batches); step 2 is the first to read the optimizer state. The runs share the V family's
    spawns (``schedule_runs``)."""
    v = schedule_runs["dualpipev"][0]
    assert len(v) == STEPS == 2 and len(OTHERS) >= 3
    for name in OTHERS:
        losses, calls = schedule_runs[name]
        assert losses == pytest.approx(v, rel=2e-5), name
        # the hook ran once per pair, on both data-parallel pipelines, every step
        assert sum(calls) == _pairs(name, 2, 4, OTHERS_EXTRA_WARMUP.get(name, 0)) * 2 * STEPS, name
    assert all(_others_flags(name) for name in ("1f1b", "zb1p", "interleaved-1f1b"))
    assert schedule_runs["one-others"][0] == pytest.approx(v, rel=2e-5)
    assert schedule_runs["dualpipev offload"][0] == v  # activations offloaded through the trainer: bit for bit
    assert v[-1] < v[0]

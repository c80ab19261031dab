"""``bench.overlap --calibrate``: one MoE layer's measured sub-stage seconds in the planner's costs format,
and the check of the planner against the overlap benchmark (``python -m bench.overlap.calibrate``).

Sub-stages, statistics and link rates: :mod:`bench.overlap.costs`.

The check (:func:`run`): one emulated-cluster run with the ``dualpipev`` (the calibration) and
``dualpipev-overlap`` modes interleaved step by step, so the machine's load hits both alike; the costs file
from the first; the planner (:func:`predict_setup`: the device profile from the file alone) predicts the
second. The benchmark's step has no gradient reduction and no optimizer, so it is compared with the
planner's ``pipeline_time``, and its hidden all-to-all fraction with one minus the planner's exposed fraction,
in absolute points: both are fractions of different denominators (the benchmark divides by the time its
all-to-alls were in flight, which stretches when they overlap compute; the planner by their lone time), so a
ratio would mostly compare denominators. Also compared: a lone forward plus backward chunk (the no-overlap
mode's measured F + B against the planner's; the sum, because the planner takes one dispatch time for both
directions and the runtime's forward one also exchanges row counts).

The report prints each comparison as measured, predicted and their ratio (predicted / measured), marked
within or outside :data:`MARGIN` (the step, 10%) and :data:`HIDDEN_MARGIN` (the hidden fraction, 0.05), with
the machine's load average before and after the run: the measured times are the machine's, and a busy
neighbour slows the CPU ranks unevenly. The hidden fraction is predicted as the run measures it
(:attr:`moe.plan.search.Prediction.hidden_in_flight`: of the transfers' time from issue to use, the share under
compute). What the costs file carries beyond the sub-stages, and the planner uses (the ``host`` entry of
:mod:`moe.plan.measured`): the host work between pieces, the forward dispatch's row counts as the rank waits
for them, the expert-parallel imbalance, and the machine's cores as the ranks share them
(:func:`bench.overlap.costs.machine_costs`), which bound the step where the ranks outnumber the cores. Idle runs
of 2026-11-29 (6 steps, bench/results/calibration-*-idle-*): pp=1 x ep=2 step ratio 0.96 and 0.92, hidden
+0.00 and +0.01; pp=2 x ep=2 0.95 and 0.95, hidden -0.02 and -0.02. With 3 steps a run's median moved by 10%.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.overlap import cli
from bench.overlap.costs import substage_seconds
from bench.overlap.report import collect, load_rank_files
from bench.overlap.run import CALIBRATION_MODE
from moe.plan.measured import MeasuredCosts, load_costs, save_costs
from moe.plan.model import LayerCostModel
from moe.plan.params import stage_plans
from moe.plan.search import StageTimes

__all__ = [
    "HIDDEN_MARGIN",
    "MARGIN",
    "Setup",
    "compare",
    "main",
    "predict_setup",
    "report",
    "run",
]


MARGIN = 0.10
"""The agreement the planner aims for: a predicted step within 10% of the measured one (a ratio in 0.9..1.1)."""

HIDDEN_MARGIN = 0.05
"""The agreement the planner aims for on the hidden fraction: within 0.05 of the measured one."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Setup:
    """The emulated-cluster run both benchmarks make and the planner predicts."""

    pp: int = 1
    ep: int = 2
    chunks: int = 24
    micro_batch: int = 4
    seq_len: int = 64
    hidden: int = 128
    moe_intermediate: int = 128
    layers: int = 4
    rate: str = "400mbit"
    steps: int = 6
    """Timed steps of each mode (the two modes interleaved step by step), after one warm-up step each: with 3,
    the median of a 2-core machine's steps moved by 10% from run to run."""

    @property
    def nodes(self) -> int:
        """One rank per node: no two ranks share a link, and the planner's layout (one GPU per node) is the
        benchmark's."""
        return self.pp * self.ep

    @property
    def tokens_per_step(self) -> int:
        return self.chunks * self.micro_batch * self.ep * self.seq_len

    def argv(self) -> list[str]:
        return [
            "--cluster", "--nodes", str(self.nodes), "--rate", self.rate, "--pp", str(self.pp), "--ep", str(self.ep),
            "--chunks", str(self.chunks), "--micro-batch", str(self.micro_batch), "--seq-len", str(self.seq_len),
            "--hidden", str(self.hidden), "--moe-intermediate", str(self.moe_intermediate),
            "--layers", str(self.layers),
        ]  # fmt: skip


def predict_setup(costs: MeasuredCosts, setup: Setup, *, memory_bytes: float):
    """The planner's prediction of DualPipeV with overlap at ``setup`` from ``costs`` alone: the device from
    the file (:func:`moe.plan.measured.device_of`), one rank per node, dp = ep, no SMs reserved, no
    recompute. Returns the :class:`moe.plan.search.Prediction` and the cost model."""
    from moe.plan.hardware import Cluster
    from moe.plan.measured import device_of
    from moe.plan.search import Candidate, predict

    gpu = device_of(costs, memory_bytes=memory_bytes)
    world = setup.pp * setup.ep
    cluster = Cluster(gpu, num_gpus=world, gpus_per_node=1)
    candidate = Candidate("dualpipev", setup.pp, setup.ep, setup.ep, setup.chunks, 0, False)
    model = LayerCostModel(
        costs.config,
        cluster,
        candidate,
        setup.seq_len,
        setup.micro_batch,
        setup.tokens_per_step,
        measured=costs,
        expert_imbalance=costs.host.get("expert_imbalance", 1.0),
    )
    pred = predict(
        candidate,
        model,
        plans=stage_plans(costs.config, setup.pp, "dualpipev"),
        tokens_per_step=setup.tokens_per_step,
        num_gpus=world,
        peak_flops=gpu.bf16_flops,
    )
    return pred, model


def _action_costs(model: LayerCostModel, pp: int) -> dict[str, float]:
    """The planner's lone F and B and overlapped F&B of one chunk, seconds, averaged over the DualPipeV
    stages (as the trainer places the layers: ``auto``) and the pairs the schedule runs (stage s with stage
    2pp-1-s), as :mod:`moe.plan.search` times them."""
    times = StageTimes(model, stage_plans(model.cfg, pp, "dualpipev"))
    stages = range(2 * pp)
    return {
        "F": statistics.fmean(times.alone(s).F for s in stages),
        "B": statistics.fmean(times.alone(s).B for s in stages),
        "FB": statistics.fmean(times.pair(s, 2 * pp - 1 - s).FB for s in stages),
    }


def compare(setup: Setup, costs: MeasuredCosts, overlap_record: dict, *, memory_bytes: float) -> dict:
    """Measured (the overlap benchmark's DualPipeV-with-overlap row, and its no-overlap row's lone chunks)
    against predicted (the planner from the costs file). The benchmark's step is the pipeline alone (no
    gradient reduction, no optimizer), so it is compared with the planner's ``pipeline_time``; ``step_time``
    adds the data-parallel reduction. ``ratio``: predicted / measured."""
    rows = {r["mode"]: r for r in overlap_record["rows"]}
    row, lone = rows["dualpipev-overlap"], rows.get(CALIBRATION_MODE)
    pred, model = predict_setup(costs, setup, memory_bytes=memory_bytes)
    predicted_hidden = pred.hidden_in_flight
    measured = {
        k: row[k]
        for k in ("step_ms", "step_ms_min", "step_ms_max", "hidden", "hidden_in_pairs", "a2a_ms", "a2a_exposed_ms",
                  "bubble", "cpu_use", "costs_ms")
    }  # fmt: skip
    action_ms = {k: v * 1e3 for k, v in _action_costs(model, setup.pp).items()}
    predicted = {
        "pipeline_ms": pred.pipeline_time * 1e3,
        "cpu_bound_ms": pred.cpu_bound * 1e3,
        "step_ms_with_dp_reduce": pred.step_time * 1e3,
        "hidden": predicted_hidden,
        "hidden_vs_lone": 1.0 - pred.exposed_a2a_fraction,
        "bubble": pred.bubble_fraction,
        "costs_ms": action_ms,
        "lone_F_plus_B_ms": action_ms["F"] + action_ms["B"],
    }
    ratio = {"step": predicted["pipeline_ms"] / row["step_ms"]}
    hidden_error = predicted_hidden - row["hidden"]
    error = {
        "step_relative": ratio["step"] - 1,
        "hidden_points": hidden_error,
        "step_within_margin": abs(ratio["step"] - 1) <= MARGIN,
        "hidden_within_margin": abs(hidden_error) <= HIDDEN_MARGIN,
    }
    if lone is not None:
        measured["lone_F_plus_B_ms"] = lone["costs_ms"]["F"] + lone["costs_ms"]["B"]
        ratio["lone_F_plus_B"] = predicted["lone_F_plus_B_ms"] / measured["lone_F_plus_B_ms"]
        error["lone_F_plus_B_within_margin"] = abs(ratio["lone_F_plus_B"] - 1) <= MARGIN
        if lone["a2a_exposed_ms"] > 0:
            # the planner's denominator: the time the all-to-alls cost alone (waited for in the no-overlap mode)
            measured["hidden_vs_lone_wait"] = 1.0 - row["a2a_exposed_ms"] / lone["a2a_exposed_ms"]
    return {"measured": measured, "predicted": predicted, "ratio": ratio, "error": error}


def run(
    setup: Setup, out: Path, *, memory_bytes: float | None = None, keep_events: bool = False, command: str = ""
) -> dict:
    """One emulated-cluster run of DualPipeV without overlap (the calibration) and with it, their steps
    interleaved so that the machine's load hits both alike; the costs file from the first, the planner's
    prediction from the costs file against the second. Writes ``costs-<device>-<date>.json`` and
    ``calibration-<device>-<date>.json`` under ``out`` and returns the latter's record."""
    out.mkdir(parents=True, exist_ok=True)
    memory_bytes = memory_bytes or _ram_bytes() / (setup.pp * setup.ep)
    with tempfile.TemporaryDirectory(prefix="dualpipe-calibration-") as tmp:
        load = [os.getloadavg()[0]]
        t0 = time.perf_counter()
        costs_path = Path(tmp) / "costs.json"
        modes = ["dualpipev-overlap", CALIBRATION_MODE]
        argv = [*setup.argv(), "--modes", *modes, "--steps", str(setup.steps), "--out", tmp, "--keep-events"]
        cli.main([*argv, "--costs-out", str(costs_path)])
        seconds = time.perf_counter() - t0
        load.append(os.getloadavg()[0])
        costs = load_costs(costs_path)
        (record_path,) = (q for q in Path(tmp).glob("overlap-*.json") if not q.name.endswith(".trace.json"))
        overlap_record = json.loads(record_path.read_text())
        overlapped = substage_seconds(
            ranks.values() for _, ranks in collect(load_rank_files(Path(tmp) / "events")).get(modes[0], [])
        )
        if keep_events:
            shutil.copytree(Path(tmp) / "events", out / "events", dirs_exist_ok=True)
    device, today = costs.device, datetime.date.today().isoformat()
    lone = next(r for r in overlap_record["rows"] if r["mode"] == CALIBRATION_MODE)
    record = {
        "name": "calibration",
        "command": command,
        "device": device,
        "date": today,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_average_1min": load,
        "seconds": seconds,
        "setup": dataclasses.asdict(setup),
        "overlap_run": {k: overlap_record[k] for k in ("command", "options", "cluster", "tokens_per_step")},
        "costs": costs.to_json(),
        "substage_ms": {
            "calibration (dualpipev, no overlap)": {k: v * 1e3 for k, v in sorted(costs.moe.items())},
            "the same accounting in dualpipev-overlap (all-to-alls: the time waited)": {
                k: v * 1e3 for k, v in sorted(overlapped.items())
            },
        },
        "measured_no_overlap": {k: lone[k] for k in ("step_ms", "hidden", "a2a_ms", "a2a_exposed_ms", "costs_ms")},
        "memory_bytes": memory_bytes,
        "rows": [r for r in overlap_record["rows"] if r["mode"] in modes],
        **compare(setup, costs, overlap_record, memory_bytes=memory_bytes),
    }
    save_costs(out / f"costs-{device}-{today}.json", costs)
    (out / f"calibration-{device}-{today}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def _ram_bytes() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _agreement(within: bool, margin: str) -> str:
    return f"{'within' if within else 'OUTSIDE'} {margin}"


def report(record: dict) -> str:
    """The record as a few lines of text: each comparison as measured, predicted, predicted / measured."""
    m, p, r, e = record["measured"], record["predicted"], record["ratio"], record["error"]
    pct, points = f"{MARGIN:.0%}", f"{HIDDEN_MARGIN:.2f}"
    lines = [
        f"{record['device']} {record['date']}: dualpipev-overlap, {record['setup']}",
        f"  step (pipeline, no dp reduction): measured {m['step_ms']:.0f} ms "
        f"({m['step_ms_min']:.0f}..{m['step_ms_max']:.0f}), predicted {p['pipeline_ms']:.0f} ms, "
        f"ratio {r['step']:.2f} ({_agreement(e['step_within_margin'], pct)})"
        + (f"; the cores allow no less than {p['cpu_bound_ms']:.0f} ms" if p.get("cpu_bound_ms") else ""),
    ]
    if "lone_F_plus_B" in r:
        lines.append(
            f"  lone chunk F + B (no overlap): measured {m['lone_F_plus_B_ms']:.1f} ms, predicted "
            f"{p['lone_F_plus_B_ms']:.1f} ms, ratio {r['lone_F_plus_B']:.2f} "
            f"({_agreement(e['lone_F_plus_B_within_margin'], pct)})"
        )
    lines += [
        f"  all-to-all hidden: measured {m['hidden']:.2f}, predicted {p['hidden']:.2f} "
        f"({e['hidden_points']:+.2f} points, {_agreement(e['hidden_within_margin'], points)})",
        "  action ms measured / predicted: "
        + ", ".join(f"{k} {m['costs_ms'][k]:.1f} / {p['costs_ms'][k]:.1f}" for k in ("F", "B", "FB")),
    ]
    for kind, fields in record["substage_ms"].items():
        lines.append(f"  {kind}: " + ", ".join(f"{k} {v:.2f}" for k, v in fields.items()))
    before, after = record["load_average_1min"]
    lines.append(
        f"  load average (1 min) {before:.2f} before, {after:.2f} after, on {record['cpus']} CPUs: measured times "
        "are this machine's under that load (compare on an idle one)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overlap.calibrate", description=__doc__.split("\n\n")[0])
    defaults = Setup()
    for f in dataclasses.fields(Setup):
        p.add_argument(
            f"--{f.name.replace('_', '-')}", type=type(getattr(defaults, f.name)), default=getattr(defaults, f.name)
        )
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--keep-events", action="store_true", help="also keep the overlap run's rank files (<out>/events)")
    args = p.parse_args(argv)
    setup = Setup(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Setup)})
    command = " ".join(["python -m bench.overlap.calibrate", *(sys.argv[1:] if argv is None else argv)])
    print(report(run(setup, args.out, keep_events=args.keep_events, command=command)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

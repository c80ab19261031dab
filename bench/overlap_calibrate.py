"""``bench.overlap --calibrate``: one MoE layer's measured sub-stage seconds in the planner's costs format,
and the check of the planner against the overlap benchmark (``python -m bench.overlap_calibrate``).

Sub-stages. The calibration runs DualPipeV without overlap, so every all-to-all is waited for (the one
exception below) and each chunk's host time splits into compute and waiting. Within each lone chunk (or
each half of a pair run one after the other) the window is cut where the rank is blocked on an
all-to-all; each remaining piece is compute, and its time goes to the recorded compute spans inside it in
proportion to their lengths: host work between spans (issuing an all-to-all, autograd glue, the loss) is
compute the step pays, so it belongs to the sub-stage it sits with. The spans map onto the planner's fields
as :data:`SPAN_FIELDS` says; the residual add after a combine is counted into ``attn_F`` (it runs on the
way to the next attention, before the next dispatch, where the planner puts attention). All-to-alls cost the
time the rank waits for them: the forward dispatch (the row-count exchange, then the rows), the backward
dispatch (issued after the MLP's input gradient; the weight gradient computes under it, counted once as
compute, as the planner's backward puts it before the dispatch), forward and backward combine. ``dispatch``
and ``combine`` are the means over both directions (the planner takes one time for both).

Statistics: per timed step, each field's mean over its instances (layers x micro-batches x ranks): a step
is a sum of many sub-stages and the mean is what the sum costs per term (a median would drop the instances
the operating system descheduled, which the step pays); then the median over steps, which one disturbed
step does not move.

Link rates (:func:`link_rates`): inter-node is the ``tbf`` rate of a node's link shared by the ranks on it
(the planner counts bandwidth per GPU). The intra-node path is loopback, unshaped and not measured, so no
intra-node rate is written, and dispatch and combine are written only where no all-to-all byte stays inside
a node: one ep rank per node, as the emulated cluster's layouts place them (``gpus_per_node`` = 1 in the
file: ranks of one expert-parallel group per node, what the planner's all-to-all needs). On loopback (no
``--cluster``) every byte is intra-node: only compute is written.

The check (:func:`run`): one emulated-cluster run with the ``dualpipev`` (the calibration) and
``dualpipev-overlap`` modes interleaved step by step, so the machine's load hits both alike; the costs file
from the first; the planner (:func:`predict_setup`: the device profile from the file alone) predicts the
second. The benchmark's step has no gradient reduction and no optimizer, so it is compared with the
planner's ``pipeline_time`` (relative error) and its hidden all-to-all fraction with one minus the
planner's exposed fraction, in absolute points: both are fractions of different denominators (the
benchmark divides by the time its all-to-alls were in flight, which stretches when they overlap compute;
the planner by their lone time), so a relative error would mostly compare denominators.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.overlap_report import collect, load_rank_files
from bench.overlap_run import CALIBRATION_MODE
from bench.overlap_stats import RankSteps
from moe.config import MoEConfig
from moe.plan.measured import MeasuredCosts, load_costs, save_costs
from moe.plan.model import LayerCostModel
from moe.plan.params import stage_plans
from moe.plan.search import StageTimes

__all__ = [
    "SPAN_FIELDS",
    "Setup",
    "calibration_costs",
    "compare",
    "link_rates",
    "main",
    "predict_setup",
    "rate_bytes_per_s",
    "report",
    "run",
    "substage_seconds",
]

SPAN_FIELDS = {
    ("attn", "fwd"): "attn_F",
    ("attn.dx", "bwd"): "attn_dX",
    ("attn.dw", "bwd"): "attn_dW",
    ("mlp", "fwd"): "mlp_F",
    ("mlp.dx", "bwd"): "mlp_dX",
    ("mlp.dw", "bwd"): "mlp_dW",
    ("embed", "fwd"): "embed_F",
    ("embed", "bwd"): "embed_B",
    ("head", "fwd"): "head_F",
    ("head", "bwd"): "head_B",
}
"""Recorded compute span (name, direction) -> the planner's field (:data:`moe.plan.costs.COMPUTE_FIELDS`)."""

_UNITS = {  # tc(8): SI multiples; "bit" units are bits per second, "bps" units bytes per second
    "bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
    "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12,
}  # fmt: skip


def rate_bytes_per_s(rate: str) -> float:
    """A tc rate (``"400mbit"``, ``"50mbps"``, ``"1gbit"``) in bytes per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", rate)
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a tc rate: {rate!r} (e.g. 400mbit, 50mbps; units {sorted(_UNITS)})")
    return float(m.group(1)) * _UNITS[m.group(2).lower()]


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _chunk_windows(r: RankSteps) -> list[tuple[float, float]]:
    """The innermost compute actions: a lone chunk, either half of a pair that runs them one after the
    other (recorded nested in the pair), or an overlapped pair (nothing nested): the windows whose host
    time the sub-stages account for."""
    halves = [a for a in r.actions if a.op in ("F", "B", "I")]
    pairs = [a for a in r.actions if a.op == "FB" and not any(a.start <= h.start and h.end <= a.end for h in halves)]
    return [(a.start, a.end) for a in halves + pairs]


def _segment_time(r: RankSteps, window: tuple[float, float]) -> list[tuple[list, float]]:
    """The window cut where the rank is blocked on an all-to-all: each remaining piece (less
    pipeline-message waits) with the compute spans inside it. Host work between recorded spans (issuing
    an all-to-all, autograd glue, the loss) is compute on the way to the next all-to-all; compute that
    runs while an all-to-all is in flight (a backward issues its dispatch after the MLP's input gradient
    and computes the weight gradient under it) is compute too."""
    t0, t1 = window
    cuts = sorted((c.blocked_from, c.wait) for c in r.comm if t0 <= c.start and c.wait <= t1)
    pieces, at = [], t0
    for a, b in [*cuts, (t1, t1)]:
        if a > at:
            pieces.append((at, a))
        at = max(at, b)
    out = []
    for a, b in pieces:
        spans = [c for c in r.compute if a <= c.start and c.end <= b]
        out.append((spans, b - a - r.waited(a, b)))
    return out


def _step_fields(ranks: Iterable[RankSteps]) -> tuple[dict[str, float], dict[str, int], dict[str, tuple[float, int]]]:
    """One step's totals: seconds per field, how many instances (micro-batch x layer) of each, and per
    all-to-all kind (``name.direction``) its seconds blocked on and count."""
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    comm: dict[str, tuple[float, int]] = {}
    for r in ranks:
        for window in _chunk_windows(r):
            for spans, seconds in _segment_time(r, window):
                recorded = sum(c.end - c.start for c in spans)
                for c in spans:
                    key = (
                        "attn_F"
                        if (c.name, c.direction) == ("residual", "fwd")
                        else SPAN_FIELDS.get((c.name, c.direction))
                    )
                    if key is None or recorded <= 0:
                        continue
                    total[key] = total.get(key, 0.0) + seconds * (c.end - c.start) / recorded
                    if (c.name, c.direction) != ("residual", "fwd"):
                        count[key] = count.get(key, 0) + 1
        for c in r.comm:
            kind = f"{c.name}.{c.direction}"
            t, n = comm.get(kind, (0.0, 0))
            comm[kind] = (t + c.exposed, n + 1)
    return total, count, comm


def substage_seconds(steps: Iterable[Iterable[RankSteps]]) -> dict[str, float]:
    """One layer's sub-stage seconds for one micro-batch (see the module docstring), from the spans of
    blocking (non-overlapped) steps, each step's ranks together; a kind nobody recorded is left out.

    Per step, each field is its mean over the step's instances: the step is a sum of many sub-stages, and
    the mean is what a sum costs per term (a median would drop the descheduled instances a shared machine
    has, and those are paid); then the median over steps, which a disturbed step does not move."""
    per_step: dict[str, list[float]] = {}
    for ranks in steps:
        total, count, comm = _step_fields(ranks)
        for key, seconds in total.items():
            if count.get(key):
                per_step.setdefault(key, []).append(seconds / count[key])
        # A transfer's duration is what a lone forward waits for it (the row-count exchange included): the
        # forward computes nothing while it flies. A lone backward runs the MLP's dW under its dispatch, so
        # its wait is less than the transfer; the planner's two-stream model puts that dW there itself.
        d_t = sum(comm.get(k, (0.0, 0))[0] for k in ("counts.fwd", "dispatch.fwd"))
        d_n = comm.get("dispatch.fwd", (0.0, 0))[1]
        c_t, c_n = comm.get("combine.fwd", (0.0, 0))
        if d_n:
            per_step.setdefault("dispatch", []).append(d_t / d_n)
        if c_n:
            per_step.setdefault("combine", []).append(c_t / c_n)
    return {k: _median(v) for k, v in per_step.items() if v}


def link_rates(rate: str | None, ranks_per_node: int, ep: int) -> float | None:
    """Inter-node bytes per second per rank (the node link's ``tbf`` rate over its ranks), or None where the
    measured all-to-alls cannot be described: no shaped link (loopback), or ep ranks sharing a node (their
    bytes would cross the unshaped, unmeasured loopback)."""
    if rate is None or ep < 2:
        return None
    return rate_bytes_per_s(rate) / ranks_per_node


def calibration_costs(
    steps: Iterable[Iterable[RankSteps]],
    *,
    cfg: MoEConfig,
    seq_len: int,
    micro_batch: int,
    ep: int,
    ranks_per_node: int,
    ep_ranks_per_node: int,
    act_bytes: int,
    device: str,
    rate: str | None,
    source: str = "bench.overlap --calibrate",
) -> MeasuredCosts:
    """The planner's costs file for one calibration run. ``ranks_per_node``: ranks sharing one node's link;
    ``ep_ranks_per_node``: ranks of one expert-parallel group on one node (1 on the emulated cluster's
    layouts); ``rate``: the tbf rate, None on loopback."""
    measured = substage_seconds(steps)
    internode = link_rates(rate, ranks_per_node, ep) if ep_ranks_per_node == 1 else None
    if internode is None:
        measured = {k: v for k, v in measured.items() if k not in ("dispatch", "combine")}
    return MeasuredCosts(
        config=cfg,
        seq_len=seq_len,
        tokens=seq_len * micro_batch,
        moe=measured,
        device=device,
        source=source,
        date=datetime.date.today().isoformat(),
        act_bytes=act_bytes,
        ep=ep,
        gpus_per_node=ep_ranks_per_node,
        comm_sms=0,
        recompute=False,
        internode_bytes_per_s=internode,
    )


# ------------------------------------------------------------------------- the planner against the benchmark


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
    steps: int = 3
    """Timed steps of each mode (the two modes interleaved step by step), after one warm-up step each."""

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
        costs.config, cluster, candidate, setup.seq_len, setup.micro_batch, setup.tokens_per_step, measured=costs
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
    """Measured (the overlap benchmark's DualPipeV-with-overlap row) against predicted (the planner from the
    costs file). The benchmark's step is the pipeline alone (no gradient reduction, no optimizer), so it is
    compared with the planner's ``pipeline_time``; ``step_time`` adds the data-parallel reduction."""
    row = next(r for r in overlap_record["rows"] if r["mode"] == "dualpipev-overlap")
    pred, model = predict_setup(costs, setup, memory_bytes=memory_bytes)
    predicted_hidden = 1.0 - pred.exposed_a2a_fraction
    measured = {
        k: row[k]
        for k in ("step_ms", "step_ms_min", "step_ms_max", "hidden", "hidden_in_pairs", "a2a_ms", "a2a_exposed_ms",
                  "bubble", "cpu_use", "costs_ms")
    }  # fmt: skip
    predicted = {
        "pipeline_ms": pred.pipeline_time * 1e3,
        "step_ms_with_dp_reduce": pred.step_time * 1e3,
        "hidden": predicted_hidden,
        "bubble": pred.bubble_fraction,
        "costs_ms": {k: v * 1e3 for k, v in _action_costs(model, setup.pp).items()},
    }
    lone = next((r for r in overlap_record["rows"] if r["mode"] == CALIBRATION_MODE), None)
    if lone is not None and lone["a2a_exposed_ms"] > 0:
        # the planner's denominator: the time the all-to-alls cost alone (waited for in the no-overlap mode)
        measured["hidden_vs_lone_wait"] = 1.0 - row["a2a_exposed_ms"] / lone["a2a_exposed_ms"]
    step_error = predicted["pipeline_ms"] / row["step_ms"] - 1
    hidden_error = predicted_hidden - row["hidden"]
    return {
        "measured": measured,
        "predicted": predicted,
        "error": {
            "step_relative": step_error,
            "hidden_points": hidden_error,
            "step_within_20pct": abs(step_error) <= 0.20,
            "hidden_within_20_points": abs(hidden_error) <= 0.20,
        },
    }


def run(setup: Setup, out: Path, *, memory_bytes: float | None = None, keep_events: bool = False) -> dict:
    """One emulated-cluster run of DualPipeV without overlap (the calibration) and with it, their steps
    interleaved so that the machine's load hits both alike; the costs file from the first, the planner's
    prediction from the costs file against the second. Writes ``costs-<device>-<date>.json`` and
    ``calibration-<device>-<date>.json`` under ``out`` and returns the latter's record."""
    from bench import overlap

    out.mkdir(parents=True, exist_ok=True)
    memory_bytes = memory_bytes or _ram_bytes() / (setup.pp * setup.ep)
    with tempfile.TemporaryDirectory(prefix="dualpipe-calibration-") as tmp:
        load = [os.getloadavg()[0]]
        t0 = time.perf_counter()
        costs_path = Path(tmp) / "costs.json"
        modes = ["dualpipev-overlap", CALIBRATION_MODE]
        argv = [*setup.argv(), "--modes", *modes, "--steps", str(setup.steps), "--out", tmp, "--keep-events"]
        overlap.main([*argv, "--costs-out", str(costs_path)])
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
        **compare(setup, costs, overlap_record, memory_bytes=memory_bytes),
    }
    save_costs(out / f"costs-{device}-{today}.json", costs)
    (out / f"calibration-{device}-{today}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def _ram_bytes() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def report(record: dict) -> str:
    """The record as a few lines of text."""
    m, p, e = record["measured"], record["predicted"], record["error"]
    lines = [
        f"{record['device']} {record['date']}: dualpipev-overlap, {record['setup']}",
        f"  step (pipeline, no dp reduction): measured {m['step_ms']:.0f} ms "
        f"({m['step_ms_min']:.0f}..{m['step_ms_max']:.0f}), predicted {p['pipeline_ms']:.0f} ms "
        f"({e['step_relative']:+.1%})",
        f"  all-to-all hidden: measured {m['hidden']:.2f}, predicted {p['hidden']:.2f} "
        f"({e['hidden_points']:+.2f} points)",
        "  action ms measured / predicted: "
        + ", ".join(f"{k} {m['costs_ms'][k]:.1f} / {p['costs_ms'][k]:.1f}" for k in ("F", "B", "FB")),
    ]
    for kind, fields in record["substage_ms"].items():
        lines.append(f"  {kind}: " + ", ".join(f"{k} {v:.2f}" for k, v in fields.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.overlap_calibrate", description=__doc__.split("\n\n")[0])
    defaults = Setup()
    for f in dataclasses.fields(Setup):
        p.add_argument(
            f"--{f.name.replace('_', '-')}", type=type(getattr(defaults, f.name)), default=getattr(defaults, f.name)
        )
    p.add_argument("--out", type=Path, default=Path("bench/results"))
    p.add_argument("--keep-events", action="store_true", help="also keep the overlap run's rank files (<out>/events)")
    args = p.parse_args(argv)
    setup = Setup(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Setup)})
    print(report(run(setup, args.out, keep_events=args.keep_events)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

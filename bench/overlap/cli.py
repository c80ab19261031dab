"""Overlap profiling: DualPipeV/DualPipe with and without overlap, 1F1B and torch's ScheduleDualPipeV.

    python -m bench.overlap                                         # all ranks on loopback
    python -m bench.overlap --cluster --nodes 2 --rate 500mbit      # emulated 2-node cluster (root)
    python -m bench.overlap --cluster --calibrate                   # compute vs all-to-all, the planner's costs
    python -m bench.overlap --cluster --fp8-dispatch                # every mode also with FP8 dispatch

Every mode runs the same MoE model (same stage split where the schedule allows, same weights, same data,
same micro-batch count) for ``--warmup`` untimed and ``--steps`` timed steps, on pp x ep ranks. The modes
are interleaved: each step index runs once in every mode, in a rotating order, so drift in the machine's
load hits all modes alike. A step is one pipeline step (forward and backward of all micro-batches; no
gradient reduction, no optimizer), timed from a barrier to the last rank's end. Each rank records every
sub-stage's start and end on compute and on communication (:mod:`bench.overlap.run`); this process merges
the ranks and writes, under ``--out``:

- ``overlap-<device>-<date>.json``: per-mode medians, spreads, measured action costs, the loss check, the
  targets;
- ``overlap-<device>-<date>.trace.json``: a Chrome/Perfetto trace, a process per rank, a thread per
  stream (compute, all-to-all forward, all-to-all backward), the last ``--trace-steps`` timed steps of
  every mode;
- ``overlap-<device>-<date>.png``: the last timed step of each mode.

Where the ranks run. Default: one machine, loopback. All-to-all then moves at memory speed and the ranks
share the cores, so the runs are compute-bound and overlap has little to hide. ``--cluster``: the
emulated cluster of :mod:`bench.cluster` (network namespaces, ``tbf``-shaped links, needs root), with
``--nodes`` = ep nodes of pp ranks each (the layout puts every expert-parallel group across the nodes, so
every all-to-all crosses the shaped links, and keeps each pipeline inside a node: loopback P2P) or
``--nodes`` = pp x ep, one rank per node (no two ranks share a link; pipeline P2P crosses links too). Size the
model so compute and all-to-all take about the same time: ``--calibrate`` prints both (the defaults, hidden
256 at 500 Mbit/s with 2 ranks per node, measured ratios of 0.86 to 0.92 on a 2-core machine) and writes
the planner's costs file, one MoE layer's sub-stage seconds (:mod:`bench.overlap.calibrate`); ``--costs-out``
writes it from any run that includes the ``dualpipev`` mode.

The targets (printed as met or missed, never tuned into the output): at least 80% of all-to-all time
hidden, DualPipeV with overlap at most 0.8x torch ScheduleDualPipeV's step time, measured bubble within
15% of the simulator's prediction from the measured action costs (:mod:`bench.overlap.stats` says how
both are taken). A CPU floor is printed as well: the step-time ratio no schedule doing the same CPU work
can beat on this machine (our CPU time spread over the cores, or the busiest rank's compute thread if
more). What keeps a step above it is printed per mode, "where the step went": a rank's compute, host work
between pieces and the time it blocked on all-to-alls and pipeline messages (they add up to the step), the
CPU its communication threads used (gloo's transfers compete with compute for the cores), and the cores'
idle time.

Bytes: every rank counts what its all-to-alls send, per kind (dispatch, combine and their gradients), and the
report gives the bytes per all-to-all. ``--fp8-dispatch`` also runs each of our modes with FP8 dispatch
(``<mode>+fp8``), interleaved with the others, and sets its step time and dispatch bytes beside the model dtype's
(:mod:`bench.overlap.traffic`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from bench import process_tree
from bench.overlap.costs import calibration_costs, expert_imbalance, machine_costs
from bench.overlap.report import breakdown, collect, cpu_floor, loss_check, rows_json, summarise, table, targets
from bench.overlap.run import CALIBRATION_MODE, MODES, WorkerOptions
from bench.overlap.traffic import FP8_SUFFIX, fp8_comparison, fp8_table, traffic, traffic_table
from moe.plan.measured import MeasuredCosts

__all__ = ["main", "measured_costs_of"]

REPO_ROOT = Path(__file__).resolve().parents[2]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.overlap", description=__doc__.split("\n\n")[0])
    p.add_argument("--cluster", action="store_true", help="run on the emulated multi-node cluster (root)")
    p.add_argument("--no-cluster", dest="cluster", action="store_false", help="all ranks on loopback (default)")
    p.add_argument("--nodes", type=int, default=2, help="cluster nodes: --ep (pp ranks per node) or pp x ep")
    p.add_argument("--rate", default="500mbit", help="tbf rate of each node link, each direction")
    p.add_argument("--steps", type=int, default=5, help="timed steps per mode")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per mode before them")
    p.add_argument(
        "--modes",
        nargs="+",
        default=[],
        choices=list(MODES),
        help="default: every mode without FP8 dispatch that runs at --pp, --chunks and --extra-warmup",
    )
    p.add_argument(
        "--fp8-dispatch",
        action="store_true",
        help="also run each of our --modes with FP8 dispatch (<mode>+fp8), in the same interleaved run",
    )
    p.add_argument("--out", default="bench/results", help="directory for the JSON, trace and PNG")
    p.add_argument("--pp", type=int, default=2)
    p.add_argument("--ep", type=int, default=2)
    p.add_argument("--chunks", type=int, default=16, help="micro-batches per step")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch per ep rank")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--moe-intermediate", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="parameters and activations")
    p.add_argument(
        "--extra-warmup",
        type=int,
        default=0,
        metavar="N",
        help="warm-up forwards added on every rank for 1F1B, ZB1P and interleaved 1F1B (1F1B and ZB1P pair only "
        "with at least 1)",
    )
    p.add_argument(
        "--calibrate",
        action="store_true",
        help="time compute vs all-to-all (dualpipev, no overlap) and write the planner's costs file",
    )
    p.add_argument(
        "--costs-out",
        metavar="FILE",
        help="write the planner's costs file (bench.overlap.calibrate) from the dualpipev (no overlap) mode's "
        "sub-stages here: --calibrate writes one by default to <out>/costs-<device>-<date>.json, other runs "
        "when given (dualpipev among --modes: interleaved with the other modes, the same load hits both)",
    )
    p.add_argument("--trace-steps", type=int, default=2, help="timed steps per mode in the trace (the last ones)")
    p.add_argument("--profile", action="store_true", help="also save a torch profiler trace per rank and mode")
    p.add_argument("--keep-events", action="store_true", help="also save every rank's raw events (rank<R>.json)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    p.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    return p


def _options(args: argparse.Namespace, run_dir: str) -> WorkerOptions:
    steps = 2 if args.calibrate else args.steps
    opts = WorkerOptions(
        pp=args.pp,
        ep=args.ep,
        chunks=args.chunks,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        hidden=args.hidden,
        layers=args.layers,
        experts=args.experts,
        moe_intermediate=args.moe_intermediate,
        dtype=args.dtype,
        extra_warmup=args.extra_warmup,
        steps=steps,
        warmup=args.warmup,
        modes=[CALIBRATION_MODE] if args.calibrate else list(args.modes),
        run_dir=run_dir,
        profile=args.profile,
    )  # fmt: skip (empty --modes: WorkerOptions picks every plain mode that runs)
    modes = opts.modes
    if args.fp8_dispatch and not args.calibrate:
        twins = [f"{m}{FP8_SUFFIX}" for m in modes]  # torch's schedule has none
        modes = modes + [t for t in twins if t in MODES and t not in modes]
    if args.costs_out and CALIBRATION_MODE not in modes:
        raise ValueError(f"--costs-out needs the {CALIBRATION_MODE} mode (no overlap) among --modes")
    return dataclasses.replace(opts, modes=modes)


def device_name(args: argparse.Namespace) -> str:
    """File-name-safe description of where the ranks ran."""
    if torch.cuda.is_available():
        from bench.harness import device_slug

        base = device_slug(torch.device("cuda"))
    else:
        base = f"cpu-{os.cpu_count()}core"
    return f"{base}-emulated-{args.nodes}node-{args.rate}" if args.cluster else f"{base}-loopback"


def _launch_local(opts: WorkerOptions, timeout: float) -> None:
    world = opts.pp * opts.ep
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += ["-m", "bench.overlap", "--worker", json.dumps(asdict(opts))]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = process_tree.run(cmd, cwd=REPO_ROOT, env=env, timeout=timeout)  # no worker outlives a timeout
    if proc.returncode != 0:
        raise SystemExit(
            f"error: the benchmark ranks failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-6000:]}"
        )


def _launch_cluster(opts: WorkerOptions, args: argparse.Namespace) -> dict:
    from bench.cluster import ClusterConfig, ClusterError, EmulatedCluster

    world = opts.pp * opts.ep
    if args.nodes not in (opts.ep, world):
        raise SystemExit(
            f"error: --nodes must be --ep ({opts.ep}: a node per ep rank, its pipeline inside the node) or "
            f"pp x ep ({world}: a node per rank), got {args.nodes}"
        )
    per_node = world // args.nodes
    config = ClusterConfig(nodes=args.nodes, rate=args.rate)
    argv = ["-m", "bench.overlap", "--worker", json.dumps(asdict(opts))]
    try:
        with EmulatedCluster(config) as cluster:
            job = cluster.run_torchrun(
                argv, nproc_per_node=per_node, env={"OMP_NUM_THREADS": "1"}, timeout=args.timeout
            )
            dropped = sum(cluster.qdisc_stats(i)["dropped"] for i in range(args.nodes))
        job.raise_for_status()
    except ClusterError as e:
        raise SystemExit(f"error: {e}") from e
    return {
        "nodes": args.nodes,
        "rate": args.rate,
        "ranks_per_node": per_node,
        "tbf": asdict(config),
        "dropped": dropped,
    }


def _calibration(rank_files: list[dict]) -> dict | None:
    """Compute sub-stage time vs blocking all-to-all time per rank and step, in the no-overlap DualPipeV."""
    steps = collect(rank_files).get(CALIBRATION_MODE)
    if not steps:
        return None
    compute = [sum(c.end - c.start for c in r.compute) for _, ranks in steps for r in ranks.values()]
    comm = [sum(c.in_flight for c in r.comm) for _, ranks in steps for r in ranks.values()]
    c, a = sum(compute) / len(compute) * 1e3, sum(comm) / len(comm) * 1e3
    return {"compute_ms_per_rank_step": c, "a2a_ms_per_rank_step": a, "a2a_over_compute": a / c if c else None}


def measured_costs_of(opts: WorkerOptions, rank_files: list[dict], cluster: dict | None, device: str) -> MeasuredCosts:
    """The calibration's sub-stage medians in the planner's costs format (:mod:`bench.overlap.costs`), with
    the host's share where CPU ranks ran (:func:`bench.overlap.costs.machine_costs`)."""
    from bench.overlap.run import model_config

    by_step = [per_rank for _, per_rank in collect(rank_files).get(CALIBRATION_MODE, [])]
    world = opts.pp * opts.ep
    machine = {"expert_imbalance": expert_imbalance(by_step, opts.pp)} if opts.ep > 1 else {}
    if rank_files[0]["device"] == "cpu":  # CPU ranks share the machine's cores (GPUs have their own)
        machine.update(machine_costs(rank_files, by_step, CALIBRATION_MODE))
    return calibration_costs(
        [list(per_rank.values()) for per_rank in by_step],
        cfg=model_config(opts),
        seq_len=opts.seq_len,
        micro_batch=opts.micro_batch,
        ep=opts.ep,
        # the emulated cluster's layouts put each ep rank on its own node (bench.overlap.run: ep-major ranks)
        ranks_per_node=cluster["ranks_per_node"] if cluster else world,
        ep_ranks_per_node=1 if cluster else opts.ep,
        act_bytes=rank_files[0]["act_bytes"],
        device=device,
        rate=cluster["rate"] if cluster else None,
        machine=machine,
    )


def _write_costs(
    args: argparse.Namespace, opts: WorkerOptions, rank_files: list[dict], cluster: dict | None, device: str
) -> Path:
    """:func:`measured_costs_of`, written where ``--costs-out`` (or ``--out``) says."""
    from moe.plan.measured import save_costs

    costs = measured_costs_of(opts, rank_files, cluster, device)
    today = datetime.date.today().isoformat()
    path = Path(args.costs_out) if args.costs_out else Path(args.out) / f"costs-{device}-{today}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    save_costs(path, costs)
    fields = ", ".join(f"{k} {v * 1e3:.2f}" for k, v in sorted(costs.moe.items()))
    host = ", ".join(f"{k} {costs.host[k] * 1e3:.2f}" for k in ("F", "B", "counts") if k in costs.host)
    machine = ", ".join(f"{k} {v:.3g}" for k, v in costs.host.items() if k not in ("F", "B", "counts"))
    print(
        f"costs (ms, one MoE layer, one micro-batch of {costs.tokens} tokens): {fields}\n"
        f"host between pieces (ms): {host or '-'}; machine: {machine or '-'}\nwrote {path}"
    )
    return path


def _write_outputs(out: Path, stem: str, record: dict, rank_files: list[dict], trace_steps: int) -> list[Path]:
    from bench.overlap.plot import render_timelines
    from bench.overlap.stats import chrome_trace

    out.mkdir(parents=True, exist_ok=True)
    json_path, trace_path, png_path = (out / f"{stem}{ext}" for ext in (".json", ".trace.json", ".png"))
    json_path.write_text(json.dumps(record, indent=1) + "\n")
    steps = collect(rank_files)
    names = {
        r["rank"]: f"rank {r['rank']} (pp {r['pp_rank']}, ep {r['ep_rank']}, node {r['node']})" for r in rank_files
    }
    keep = max(trace_steps, 1)
    flat = [(mode, step, ranks) for mode, per in steps.items() for step, ranks in per[-keep:]]
    trace_path.write_text(json.dumps(chrome_trace(flat, names)))
    panels = [(f"{mode} (step {per[-1][0]})", per[-1][1]) for mode, per in steps.items()]
    render_timelines(panels, str(png_path), title=f"{stem}: last timed step of each mode")
    return [json_path, trace_path, png_path]


def _report(args: argparse.Namespace, opts: WorkerOptions, rank_files: list[dict], cluster: dict | None) -> int:
    device = device_name(args)
    calib = _calibration(rank_files)
    if calib is not None:
        print(f"calibration (dualpipev, no overlap): compute {calib['compute_ms_per_rank_step']:.0f} ms, "
              f"all-to-all {calib['a2a_ms_per_rank_step']:.0f} ms per rank and step "
              f"(ratio {calib['a2a_over_compute']:.2f}; aim for about 1 on the cluster)")  # fmt: skip
    if args.calibrate:
        _write_costs(args, opts, rank_files, cluster, device)
        return 0
    rows = summarise(rank_files)
    goals = targets(rows, opts.pp)
    check = loss_check(rank_files)
    print(f"\n{device}: pp={opts.pp} ep={opts.ep} chunks={opts.chunks} tokens/step={opts.tokens_per_step} "
          f"steps={opts.steps} (+{opts.warmup} warm-up), medians over steps\n")  # fmt: skip
    print(table(rows))
    print(breakdown(rows))
    counted = traffic(rank_files)
    fp8_rows = fp8_comparison({r.mode: r.step_ms for r in rows}, counted)
    if counted:
        print("\nbytes per all-to-all (one rank's share, its own rows included; means over ranks and timed steps):")
        print(traffic_table(counted))
    if fp8_rows:
        print("\nFP8 dispatch (the same run, interleaved; bytes of the token rows, scales included):")
        print(fp8_table(fp8_rows))
    if not args.cluster:
        print("\nnote: loopback run: all-to-all moves at memory speed and all ranks share the cores, so this is "
              "compute-bound and overlap has little to hide (use --cluster for a network-bound run)")  # fmt: skip
    diffs = check.get("max_abs_diff_to_torch", {})
    if diffs:
        print("\nloss check (same weights and data): max |mean loss - torch's| per mode: "
              + ", ".join(f"{m} {d:.2e}" for m, d in diffs.items()))  # fmt: skip
    if "grad_sq_rel_diff_torch_vs_dualpipev" in check:
        print(
            "gradient check: |grad|^2 torch vs dualpipev-overlap, max rel diff "
            f"{check['grad_sq_rel_diff_torch_vs_dualpipev']:.2e}"
        )
    print("\ntargets (DualPipeV with overlap):")
    for t in goals:
        print(f"  {'met   ' if t.met else 'MISSED'} {t.what}: {t.value:.3f} (goal {t.goal})")
    floor = cpu_floor(rows)
    if floor is not None:
        cores = rank_files[0].get("cores", 1)
        print(f"  CPU floor: dualpipev-overlap's CPU time per step (over all {cores} cores, or its busiest rank's "
              f"compute thread if more) is {floor:.2f}x torch's step time; overlap hides waiting, not work, so no "
              "schedule gets below it here"
              + (" (the 0.80x goal is out of reach on this machine)" if floor > 0.8 else ""))  # fmt: skip
    today = datetime.date.today().isoformat()
    record = {
        "name": "overlap",
        "device": device,
        "date": today,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "command": "python -m bench.overlap " + " ".join(sys.argv[1:]),
        "options": {k: v for k, v in asdict(opts).items() if k != "run_dir"},
        "tokens_per_step": opts.tokens_per_step,
        "cluster": cluster,
        "rows": rows_json(rows),
        "targets": [asdict(t) for t in goals],
        "cpu_floor_vs_torch": floor,
        "loss_check": check,
        "calibration": calib,
        "traffic": counted,
        "fp8_dispatch": fp8_rows,
    }
    paths = _write_outputs(Path(args.out), f"overlap-{device}-{today}", record, rank_files, args.trace_steps)
    print("\nwrote " + ", ".join(map(str, paths)))
    if args.costs_out:
        _write_costs(args, opts, rank_files, cluster, device)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker is not None:
        from bench.overlap.run import worker_main

        worker_main(args.worker)
        return 0
    run_dir = tempfile.mkdtemp(prefix="dualpipe-overlap-")
    try:
        try:
            opts = _options(args, run_dir)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from e
        cluster = _launch_cluster(opts, args) if args.cluster else None
        if cluster is None:
            _launch_local(opts, args.timeout)
        rank_files = [json.loads(p.read_text()) for p in sorted(Path(run_dir).glob("rank*.json"))]
        if len(rank_files) != opts.pp * opts.ep:
            raise SystemExit(f"error: expected {opts.pp * opts.ep} rank results, found {len(rank_files)} in {run_dir}")
        for wanted, pattern, sub in (
            (args.profile, "profile-*.json", "profiles"),
            (args.keep_events, "rank*.json", "events"),
        ):
            if wanted:
                dest = Path(args.out) / sub
                dest.mkdir(parents=True, exist_ok=True)
                for p in Path(run_dir).glob(pattern):
                    shutil.copy(p, dest / p.name)
        return _report(args, opts, rank_files, cluster)
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)

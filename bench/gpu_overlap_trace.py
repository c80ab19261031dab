"""One overlapped forward-and-backward pair on one GPU: a Chrome trace, and host time against GPU time.

    PYTHONPATH=. python -m bench.gpu_overlap_trace --out $OUT                 # the checklist's call-2 items
    PYTHONPATH=. python -m bench.gpu_overlap_trace --device cpu --preset tiny --reps 1   # a CPU smoke run

The stage holds the whole model (first and last), its dispatcher is ``alltoall`` over a one-rank process
group (NCCL on CUDA: ProcessGroupNCCL runs the all-to-all on its own internal stream, which stands in for
the communication stream; gloo on CPU). One pair is micro-batch B's forward interleaved with micro-batch
A's backward through :meth:`moe.MoEStage.overlapped_forward_backward`, as the DualPipeV executor calls it.

Two answers, printed last:

1. *Does communication-stream work run under compute-stream kernels?* The pair runs under the torch
   profiler; the Chrome trace is saved, and its kernel events (``"cat": "kernel"``, each with its stream)
   are split into NCCL kernels (names starting ``nccl``) and the rest. The answer is the union of NCCL
   kernel intervals that lies inside the union of compute kernel intervals, over that union: the rule of
   :func:`dualpipe.events.hidden_fraction` at kernel level. That metric itself, from the recorder's CUDA
   events on both streams (each all-to-all from its start to its wait edge, under the compute sub-stages
   that did work), is printed per kind for the overlapped pair alone, pooled over the ``--reps`` pairs
   (with one rank the dispatcher moves nothing between ranks and no transfer is recorded: no answer).
2. *Host overhead per sub-stage*: every recorded edge gets both a host clock reading and (on CUDA) an
   event on the stream. For each compute sub-stage (attn, mlp, attn.dx, ...) the host milliseconds spent
   between its begin and end (issuing kernels, and any host sync inside) are set against the GPU
   milliseconds between the same edges. Host >= GPU means the sub-stage is host-bound: the GPU waits for
   Python. Medians over ``--reps`` pairs, after the Triton warm-up and one untimed pair.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dualpipe.events import HiddenFraction, hidden_fraction, interval_overlap, interval_union
from kernels.warmup import KernelShapes, warm_up
from moe import MoEStage, lm_loss, next_token_batch
from moe.config import PRESETS, preset
from moe.dispatch import DEFAULT_COMM_SMS, make_dispatcher

__all__ = ["HostDeviceRecorder", "comm_under_compute", "main"]


class HostDeviceRecorder:
    """A stage recorder that stamps every edge with the host clock and, on CUDA, an event on the stream."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.events: list[tuple[str, str, int, str, float, Any]] = []

    def record(self, name: str, direction: str, layer: int, edge: str, stream: Any = None) -> None:
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
        self.events.append((name, direction, layer, edge, time.perf_counter(), event))

    def hidden(self, window: slice = slice(None)) -> HiddenFraction:
        """:func:`dualpipe.events.hidden_fraction` of the events in ``window``: from the CUDA events on both
        streams on CUDA, from the host clock elsewhere."""
        gpu = self.device.type == "cuda"
        return hidden_fraction([(n, d, lay, e, ev if gpu else host) for n, d, lay, e, host, ev in self.events[window]])

    def spans(self) -> list[tuple[str, float, float]]:
        """(sub-stage, host ms, GPU ms) of every compute span (begin/end); GPU ms is NaN off CUDA."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        opened: dict[tuple, tuple[float, Any]] = {}
        out = []
        for name, direction, layer, edge, host, event in self.events:
            key = (name, direction, layer)
            if edge == "begin":
                opened[key] = (host, event)
            elif edge == "end" and key in opened:
                host0, event0 = opened.pop(key)
                gpu = event0.elapsed_time(event) if event is not None else float("nan")
                out.append((name, (host - host0) * 1e3, gpu))
        return out


def comm_under_compute(trace: dict) -> dict:
    """From a Chrome trace of torch's profiler: NCCL kernel time, and how much of it lies under compute kernels.

    Returns {"comm_us", "hidden_us", "compute_us", "comm_streams", "compute_streams", "comm_kernels"}.
    """
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") == "kernel" and "dur" in e]
    comm = [e for e in kernels if e.get("name", "").lower().startswith("nccl")]
    compute = [e for e in kernels if not e.get("name", "").lower().startswith("nccl")]
    busy = interval_union([(e["ts"], e["ts"] + e["dur"]) for e in compute])
    comm_union = interval_union([(e["ts"], e["ts"] + e["dur"]) for e in comm])
    hidden = interval_overlap(comm_union, busy)
    return {
        "comm_us": sum(b - a for a, b in comm_union),
        "hidden_us": hidden,
        "compute_us": sum(b - a for a, b in busy),
        "comm_streams": sorted({e.get("args", {}).get("stream") for e in comm}, key=str),
        "compute_streams": sorted({e.get("args", {}).get("stream") for e in compute}, key=str),
        "comm_kernels": len(comm),
    }


def _hidden_json(h: HiddenFraction, device: torch.device) -> dict:
    def one(x: HiddenFraction) -> dict:
        return {"fraction": x.fraction, "comm_ms": x.comm_s * 1e3, "hidden_ms": x.hidden_s * 1e3,
                "count": x.count, "covered": x.covered}  # fmt: skip

    clock = "cuda events" if device.type == "cuda" else "host"
    return {**one(h), "clock": clock, "kinds": {k: one(x) for k, x in h.kinds.items()}}


def _one_rank_group(device: torch.device) -> None:
    if dist.is_initialized():
        return
    with socket.socket() as s:  # a free port for the one-rank rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=2, help="override the preset's layer count (0: keep it)")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--comm-sms", type=int, default=DEFAULT_COMM_SMS, help="SMs the grouped GEMMs leave free")
    p.add_argument("--reps", type=int, default=5, help="timed pairs for the host-overhead table")
    p.add_argument("--out", default="bench/results", help="directory for the trace and the JSON summary")
    return p


def _stage(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    cfg = preset(args.preset)
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers, num_dense_layers=min(cfg.num_dense_layers, args.layers - 1))
    group = dist.group.WORLD
    dispatcher = make_dispatcher("alltoall", cfg.num_experts, group, hidden_size=cfg.hidden_size, dtype=dtype)
    sms = args.comm_sms if device.type == "cuda" else 0
    stage = MoEStage(cfg, range(cfg.num_layers), first=True, last=True, dispatcher=dispatcher, comm_sms=sms)
    stage.reset_parameters(0)
    return cfg, stage.to(device=device, dtype=dtype)


def _pair(stage: MoEStage, cfg, args, device: torch.device, seed: int) -> slice:
    """Forward of micro-batch A, then one overlapped pair: B's forward with A's backward; then B's backward.
    Returns the slice of the stage recorder's events that the pair recorded (every transfer of the pair is
    started and waited inside it)."""
    (ids_a, lab_a), (ids_b, lab_b) = (
        (t.to(device) for t in next_token_batch(cfg, args.micro_batch, args.seq_len, seed=seed + i)) for i in (0, 1)
    )
    recorded = stage.recorder.events if stage.recorder is not None else []
    loss_a = lm_loss(stage(ids_a), lab_a)
    first = len(recorded)
    _, loss_b = MoEStage.overlapped_forward_backward(stage, [ids_b], lm_loss, [lab_b], stage, loss_a, None, None)
    window = slice(first, len(recorded))
    loss_b.backward()
    return window


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _one_rank_group(device)
    cfg, stage = _stage(args, device, dtype)
    tokens = args.micro_batch * args.seq_len
    t0 = time.perf_counter()
    warmed = warm_up(KernelShapes.from_config(cfg, tokens=tokens, ep=1, dtype=dtype), device, comm_sms=args.comm_sms)
    print(f"kernel warm-up: {len(warmed)} shape classes in {time.perf_counter() - t0:.1f} s")
    _pair(stage, cfg, args, device, seed=0)  # untimed: allocator, cuBLAS handles, the first NCCL call

    name = torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else "cpu"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace_path = out / f"overlap-trace-{name}-{stamp}.json"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        _pair(stage, cfg, args, device, seed=10)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    prof.export_chrome_trace(str(trace_path))
    overlap = comm_under_compute(json.loads(trace_path.read_text()))

    per_stage: dict[str, list[tuple[float, float]]] = defaultdict(list)
    hidden = HiddenFraction()
    for rep in range(args.reps):
        recorder = HostDeviceRecorder(device)
        stage.recorder = recorder
        window = _pair(stage, cfg, args, device, seed=100 + rep)
        stage.recorder = None
        for sub, host_ms, gpu_ms in recorder.spans():
            per_stage[sub].append((host_ms, gpu_ms))
        hidden += recorder.hidden(window)
    table = {
        sub: {
            "host_ms": statistics.median(h for h, _ in v),
            "gpu_ms": statistics.median(g for _, g in v),
            "spans": len(v),
        }
        for sub, v in sorted(per_stage.items())
    }
    summary = {
        "device": name,
        "torch": torch.__version__,
        "preset": args.preset,
        "layers": cfg.num_layers,
        "tokens_per_micro_batch": tokens,
        "dtype": args.dtype,
        "trace": trace_path.name,
        "overlap": overlap,
        "hidden": _hidden_json(hidden, device),
        "host_vs_gpu": table,
    }
    (out / f"overlap-summary-{name}-{stamp}.json").write_text(json.dumps(summary, indent=1))

    print(f"\nhost vs GPU per sub-stage ({args.preset}, {cfg.num_layers} layers, {tokens} tokens, {args.dtype}):")
    print(f"{'sub-stage':<14}{'host ms':>10}{'GPU ms':>10}{'host/GPU':>10}")
    for sub, row in table.items():
        ratio = row["host_ms"] / row["gpu_ms"] if row["gpu_ms"] == row["gpu_ms"] and row["gpu_ms"] > 0 else float("nan")
        print(f"{sub:<14}{row['host_ms']:>10.3f}{row['gpu_ms']:>10.3f}{ratio:>10.2f}")
    if overlap["comm_kernels"] == 0:
        print("\ncomm under compute: no NCCL kernels in the trace (CPU run, or NCCL issued none): no answer")
    else:
        share = overlap["hidden_us"] / overlap["comm_us"] if overlap["comm_us"] else 0.0
        verdict = "yes" if overlap["hidden_us"] > 0 else "no"
        print(
            f"\ncomm under compute: {verdict}: {overlap['hidden_us']:.0f} of {overlap['comm_us']:.0f} us of NCCL "
            f"kernel time ({share:.0%}) ran while a compute kernel ran; NCCL streams {overlap['comm_streams']}, "
            f"compute streams {overlap['compute_streams']}"
        )
    clock = "CUDA events on both streams" if device.type == "cuda" else "host clock"
    if hidden.count == 0:  # one rank: the dispatcher moves nothing between ranks, its pieces record no transfer
        print(f"hidden fraction (dualpipe.events.hidden_fraction, {clock}): no all-to-all recorded: no answer")
    else:
        kinds = ", ".join(f"{k} {h.fraction:.2f}" for k, h in hidden.kinds.items())
        print(
            f"hidden fraction of the overlapped pair (dualpipe.events.hidden_fraction, {clock}, {args.reps} "
            f"pairs): {hidden.fraction:.2f} ({hidden.hidden_s * 1e3:.3f} of {hidden.comm_s * 1e3:.3f} ms); "
            f"by kind: {kinds}"
        )
    print(f"trace: {trace_path}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

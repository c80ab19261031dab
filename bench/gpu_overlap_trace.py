"""One overlapped forward-and-backward pair on one GPU: a Chrome trace, and host time against GPU time.

    PYTHONPATH=. python -m bench.gpu_overlap_trace --emulated-gbps 50 --out $OUT   # the one-GPU check's step
    PYTHONPATH=. python -m bench.gpu_overlap_trace --out $OUT                      # alltoall over one rank
    PYTHONPATH=. python -m bench.gpu_overlap_trace --device cpu --preset tiny --reps 1 [--emulated-gbps 1]

The stage holds the whole model (first and last). With ``--emulated-gbps G`` its dispatcher is ``emulated``
(:mod:`moe.dispatch.emulated`): every transfer copies its rows on the dispatcher's communication stream and
takes the time rank 0 of an ``--emulated-ep``-way all-to-all would wait for its rows to leave over a link of
G GB/s (a background thread on CPU), so one device has communication to hide. Without it the dispatcher is
``alltoall`` over a one-rank process group (NCCL on CUDA, gloo on CPU), which moves nothing between ranks.
The grouped GEMMs leave ``--comm-sms`` SMs free on CUDA either way. One pair is micro-batch B's forward
interleaved with micro-batch A's backward through :meth:`moe.MoEStage.overlapped_forward_backward`, as the
DualPipeV executor calls it.

Two answers, printed last, and the first timed pair's timeline (:func:`dualpipe.events.timeline_text`):

1. *Does communication-stream work run under compute-stream kernels?* The pair runs under the torch
   profiler; the Chrome trace is saved gzipped, and its GPU events (kernels and copies, each with its
   stream) are split into communication (every event on a stream that runs an NCCL kernel or the emulated
   link's spin kernel) and compute kernels (the rest). The answer is the union of communication intervals
   that lies inside the union of compute kernel intervals, over that union: the rule of
   :func:`dualpipe.events.hidden_fraction` at kernel level. That metric itself, from the recorder's CUDA
   events on both streams (each transfer from its start to its wait edge, under the compute sub-stages that
   did work), is printed per kind for the overlapped pair alone, pooled over the ``--reps`` pairs, beside
   the link time the emulated dispatcher charged for each kind (with ``alltoall`` over one rank no transfer
   is recorded: no answer).
2. *Host overhead per sub-stage*: every recorded edge gets both a host clock reading and (on CUDA) an
   event on the stream. For each compute sub-stage (attn, mlp, attn.dx, ...) the host milliseconds spent
   between its begin and end (issuing kernels, and any host sync inside) are set against the GPU
   milliseconds between the same edges. Host >= GPU means the sub-stage is host-bound: the GPU waits for
   Python. Medians over ``--reps`` pairs, after the Triton warm-up and one untimed pair.
"""

from __future__ import annotations

import argparse
import gzip
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

from dualpipe.events import HiddenFraction, hidden_fraction, interval_overlap, interval_union, timeline_text
from kernels.warmup import KernelShapes, warm_up
from moe import MoEStage, lm_loss, next_token_batch
from moe.dispatch import DEFAULT_COMM_SMS, DispatchOptions, EmulatedDispatcher, TokenDispatcher, make_dispatcher
from moe.dispatch.emulated import DEFAULT_EP, DEFAULT_GBPS, LINK_KERNEL
from moe.models.config import PRESETS, preset

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

    def rows(self, window: slice = slice(None)) -> list[tuple[str, str, int, str, Any]]:
        """``(name, direction, layer, edge, stamp)`` of the events in ``window``: the CUDA events on both
        streams on CUDA, the host clock elsewhere (what :mod:`dualpipe.events` reads)."""
        gpu = self.device.type == "cuda"
        return [(n, d, lay, e, ev if gpu else host) for n, d, lay, e, host, ev in self.events[window]]

    def hidden(self, window: slice = slice(None)) -> HiddenFraction:
        """:func:`dualpipe.events.hidden_fraction` of the events in ``window``."""
        return hidden_fraction(self.rows(window))

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


COMM_KERNELS = ("nccl", LINK_KERNEL)
"""A kernel whose name starts with (NCCL's) or contains (the emulated link's spin, a C++ name with its namespace)
one of these marks its stream as a communication stream."""


def _is_comm_kernel(name: str) -> bool:
    name = name.lower()
    return name.startswith(COMM_KERNELS[0]) or any(mark in name for mark in COMM_KERNELS[1:])


def comm_under_compute(trace: dict) -> dict:
    """From a Chrome trace of torch's profiler: communication time, and how much of it lies under compute kernels.

    Communication is every GPU event (kernel, copy, fill) on a stream that runs a communication kernel
    (:data:`COMM_KERNELS`): the emulated link's rows are copies beside its spin kernel, NCCL's are kernels.
    Compute is every kernel on the other streams. Returns {"comm_us", "hidden_us", "compute_us",
    "comm_streams", "compute_streams", "comm_kernels"} (``comm_kernels``: the communication events).
    """
    gpu = [e for e in trace.get("traceEvents", []) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    gpu = [e for e in gpu if "dur" in e]
    comm_streams = {_stream(e) for e in gpu if e["cat"] == "kernel" and _is_comm_kernel(e.get("name", ""))}
    comm = [e for e in gpu if _stream(e) in comm_streams]
    compute = [e for e in gpu if e["cat"] == "kernel" and _stream(e) not in comm_streams]
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


def _stream(event: dict) -> Any:
    return event.get("args", {}).get("stream")


def _hidden_json(h: HiddenFraction, device: torch.device) -> dict:
    def one(x: HiddenFraction) -> dict:
        return {"fraction": x.fraction, "comm_ms": x.comm_s * 1e3, "hidden_ms": x.hidden_s * 1e3,
                "count": x.count, "covered": x.covered}  # fmt: skip

    clock = "cuda events" if device.type == "cuda" else "host"
    return {**one(h), "clock": clock, "kinds": {k: one(x) for k, x in h.kinds.items()}}


def _one_rank_group(device: torch.device) -> bool:
    """A one-rank process group for ``alltoall``; False when one exists already (the caller's to destroy)."""
    if dist.is_initialized():
        return False
    with socket.socket() as s:  # a free port for the one-rank rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_overlap_trace",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default="small", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=2, help="override the preset's layer count (0: keep it)")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--comm-sms", type=int, default=DEFAULT_COMM_SMS, help="SMs the grouped GEMMs leave free")
    p.add_argument("--reps", type=int, default=5, help="timed pairs for the host-overhead table")
    p.add_argument(
        "--emulated-gbps",
        type=float,
        default=None,
        help=f"the emulated dispatcher over a link of this many GB/s (the check runs {DEFAULT_GBPS:g}: one GPU's share "
        "of DeepSeek-V3's inter-node InfiniBand); default: alltoall over one rank",
    )
    p.add_argument(
        "--emulated-ep", type=int, default=DEFAULT_EP, help="ranks of the all-to-all the emulated link models"
    )
    p.add_argument("--out", default="bench/results", help="directory for the trace and the JSON summary")
    return p


def _dispatcher(args: argparse.Namespace, cfg, dtype: torch.dtype) -> TokenDispatcher:
    if args.emulated_gbps is not None:
        return EmulatedDispatcher(cfg.num_experts, gbps=args.emulated_gbps, ep=args.emulated_ep)
    group = dist.group.WORLD
    return make_dispatcher(
        "alltoall", cfg.num_experts, group, DispatchOptions(hidden_size=cfg.hidden_size, dtype=dtype)
    )


def _stage(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    cfg = preset(args.preset)
    if args.layers:
        cfg = cfg.replace(num_layers=args.layers, num_dense_layers=min(cfg.num_dense_layers, args.layers - 1))
    dispatcher = _dispatcher(args, cfg, dtype)
    sms = args.comm_sms if device.type == "cuda" else 0  # the grouped GEMMs' share, whichever dispatcher
    stage = MoEStage(cfg, range(cfg.num_layers), first=True, last=True, dispatcher=dispatcher, comm_sms=sms)
    stage.reset_parameters(0)
    return cfg, stage.to(device=device, dtype=dtype)


# The emulated link's kinds of transfer (moe.dispatch.traffic.KINDS) as the recorder names them.
_RECORDED_AS = {
    "dispatch": "dispatch.fwd",
    "combine": "combine.fwd",
    "dispatch_backward": "dispatch.bwd",
    "combine_backward": "combine.bwd",
}


def _link_seconds(dispatcher: TokenDispatcher) -> dict[str, float]:
    """Link time the emulated dispatcher has charged so far, by recorded kind (empty for other dispatchers)."""
    if not isinstance(dispatcher, EmulatedDispatcher):
        return {}
    return {_RECORDED_AS[kind]: c.seconds for kind, c in dispatcher.charged.items()}


def _pair(stage: MoEStage, cfg, args, device: torch.device, seed: int) -> tuple[slice, dict[str, float]]:
    """Forward of micro-batch A, then one overlapped pair: B's forward with A's backward; then B's backward.
    Returns the slice of the stage recorder's events that the pair recorded (every transfer of the pair is
    started and waited inside it) and the link seconds the emulated dispatcher charged inside it, by kind."""
    (ids_a, lab_a), (ids_b, lab_b) = (
        (t.to(device) for t in next_token_batch(cfg, args.micro_batch, args.seq_len, seed=seed + i)) for i in (0, 1)
    )
    recorded = stage.recorder.events if stage.recorder is not None else []
    loss_a = lm_loss(stage(ids_a), lab_a)
    first, before = len(recorded), _link_seconds(stage.dispatcher)
    _, loss_b = MoEStage.overlapped_forward_backward(stage, [ids_b], lm_loss, [lab_b], stage, loss_a, None, None)
    window = slice(first, len(recorded))
    charged = {kind: s - before[kind] for kind, s in _link_seconds(stage.dispatcher).items()}
    loss_b.backward()
    return window, charged


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if device.type == "cuda":
        torch.cuda.set_device(device)
    emulated = args.emulated_gbps is not None
    owns_group = not emulated and _one_rank_group(device)  # the emulated dispatcher needs no process group
    try:
        cfg, stage = _stage(args, device, dtype)
    except ValueError as exc:  # a setting the model or the dispatcher refuses (a bandwidth <= 0, ...): one line
        raise SystemExit(f"error: {exc}") from None
    tokens = args.micro_batch * args.seq_len
    t0 = time.perf_counter()
    warmed = warm_up(KernelShapes.from_config(cfg, tokens=tokens, ep=1, dtype=dtype), device, comm_sms=args.comm_sms)
    # The emulated link measures its clock here (a host sync): before any timed pair.
    stage.dispatcher.warm_up(tokens, cfg.top_k, cfg.hidden_size, dtype=dtype, device=device)
    print(f"kernel warm-up: {len(warmed)} shape classes in {time.perf_counter() - t0:.1f} s")
    _pair(stage, cfg, args, device, seed=0)  # untimed: allocator, cuBLAS handles, the first NCCL call

    name = torch.cuda.get_device_name(device).replace(" ", "_") if device.type == "cuda" else "cpu"
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trace_path = out / f"overlap-trace-{name}-{stamp}.json.gz"
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        _pair(stage, cfg, args, device, seed=10)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    prof.export_chrome_trace(str(trace_path))  # gzipped: the name ends in .gz
    with gzip.open(trace_path, "rt") as f:
        overlap = comm_under_compute(json.load(f))

    per_stage: dict[str, list[tuple[float, float]]] = defaultdict(list)
    hidden = HiddenFraction()
    link_s: dict[str, float] = defaultdict(float)
    timeline = ""
    for rep in range(args.reps):
        recorder = HostDeviceRecorder(device)
        stage.recorder = recorder
        window, charged = _pair(stage, cfg, args, device, seed=100 + rep)
        stage.recorder = None
        for sub, host_ms, gpu_ms in recorder.spans():
            per_stage[sub].append((host_ms, gpu_ms))
        hidden += recorder.hidden(window)
        for kind, s in charged.items():
            link_s[kind] += s
        if rep == 0:
            timeline = timeline_text(recorder.rows(window))
    stage.dispatcher.close()
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
        "link": {
            "gbps": args.emulated_gbps,
            "ep": args.emulated_ep,
            "ms_per_pair": {kind: s * 1e3 / args.reps for kind, s in link_s.items()},
        }
        if emulated
        else None,
        "timeline": timeline.splitlines(),
        "host_vs_gpu": table,
    }
    (out / f"overlap-summary-{name}-{stamp}.json").write_text(json.dumps(summary, indent=1))

    print(f"\nhost vs GPU per sub-stage ({args.preset}, {cfg.num_layers} layers, {tokens} tokens, {args.dtype}):")
    print(f"{'sub-stage':<14}{'host ms':>10}{'GPU ms':>10}{'host/GPU':>10}")
    for sub, row in table.items():
        ratio = row["host_ms"] / row["gpu_ms"] if row["gpu_ms"] == row["gpu_ms"] and row["gpu_ms"] > 0 else float("nan")
        print(f"{sub:<14}{row['host_ms']:>10.3f}{row['gpu_ms']:>10.3f}{ratio:>10.2f}")
    print(f"\none overlapped pair (F: micro-batch B's forward, B: micro-batch A's backward):\n{timeline}")
    if overlap["comm_kernels"] == 0:
        print("\ncomm under compute: no communication kernels in the trace (CPU run, or none issued): no answer")
    else:
        share = overlap["hidden_us"] / overlap["comm_us"] if overlap["comm_us"] else 0.0
        verdict = "yes" if overlap["hidden_us"] > 0 else "no"
        print(
            f"\ncomm under compute: {verdict}: {overlap['hidden_us']:.0f} of {overlap['comm_us']:.0f} us on the "
            f"communication streams {overlap['comm_streams']} ({share:.0%}) ran while a compute kernel ran; "
            f"compute streams {overlap['compute_streams']}"
        )
    clock = "CUDA events on both streams" if device.type == "cuda" else "host clock"
    if hidden.count == 0:  # alltoall over one rank moves nothing between ranks, its pieces record no transfer
        print(f"hidden fraction (dualpipe.events.hidden_fraction, {clock}): no all-to-all recorded: no answer")
    else:
        kinds = ", ".join(f"{k} {h.fraction:.2f}" for k, h in hidden.kinds.items())
        print(
            f"hidden fraction of the overlapped pair (dualpipe.events.hidden_fraction, {clock}, {args.reps} "
            f"pairs): {hidden.fraction:.2f} ({hidden.hidden_s * 1e3:.3f} of {hidden.comm_s * 1e3:.3f} ms); "
            f"by kind: {kinds}"
        )
    if emulated:
        recorded = {k: h.comm_s for k, h in hidden.kinds.items()}
        per_kind = ", ".join(
            f"{k} {s * 1e3 / args.reps:.3f}/{recorded.get(k, 0.0) * 1e3 / args.reps:.3f}" for k, s in link_s.items()
        )
        print(
            f"emulated link ({args.emulated_gbps:g} GB/s, rank 0 of ep={args.emulated_ep}), ms per pair, "
            f"charged/recorded start..wait: {per_kind}"
        )
    print(f"trace: {trace_path}")
    if owns_group:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

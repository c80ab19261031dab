"""One rank of the overlap benchmark: build every mode on the same weights and data, time its steps.

Started by :mod:`bench.overlap` through torchrun (``python -m bench.overlap --worker ...``), on loopback or
inside the emulated cluster. Each rank writes ``rank<R>.json`` into the run directory: for every mode and
step, the step window and every recorded event with an absolute time in seconds (``time.perf_counter``,
one system-wide monotonic clock, so ranks on one machine share a time base; on CUDA the events are resolved
against a host time taken right after a synchronise at the step start).

Events per rank (one :class:`moe.events.EventRecorder` shared by the rank's stages):

- sub-stages from the piecewise MoE path: compute ``begin``/``end`` and all-to-all ``start``/``wait``;
- pipeline compute actions (direction ``"action"``, name the action as printed by the schedule, layer its
  nesting depth): recorded by wrapping the pipeline's handlers on the instance (the executor is unchanged)
  or, for torch's schedule, the stage's ``forward_one_chunk`` / ``backward_one_chunk`` /
  ``backward_weight_one_chunk``;
- waits for pipeline messages (direction ``"p2p"``, ``begin``/``end`` around the executor's receive
  completion, which runs inside the compute action that consumes the message): the bubble counts them as
  idle and the measured action costs exclude them;
- the executor issuing sends and receives between actions (direction ``"post"``), which counts as busy;
- ``step`` begin/end, taken after a barrier over all ranks.

Rank order: torchrun's ranks are node-major (node i holds ranks i*P .. i*P+P-1). The layout here is
ep-major (global rank ``ep_rank * pp + pp_rank``), so with P = pp ranks per node the pipeline of one ep
rank stays inside a node (its P2P on loopback) and every expert-parallel group spans the nodes: the
all-to-all crosses the shaped links. (:func:`moe.parallel.init_layout` is pp-major, which would keep each
ep group inside a node.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from dualpipe import PIPELINES, Pipeline
from moe.config import MoEConfig
from moe.data import ByteCorpus
from moe.events import EventRecorder
from moe.model import lm_loss
from moe.parallel import ParallelConfig, ParallelLayout, build_stages

__all__ = ["MODES", "WorkerOptions", "ep_major_layout", "model_config", "worker_main"]

MODES: dict[str, tuple[str, bool]] = {
    # mode -> (schedule, overlap); "torch-dualpipev" is torch.distributed.pipelining's ScheduleDualPipeV.
    "dualpipev-overlap": ("dualpipev", True),
    "dualpipev": ("dualpipev", False),
    "dualpipe-overlap": ("dualpipe", True),
    "dualpipe": ("dualpipe", False),
    "1f1b": ("1f1b", False),
    "torch-dualpipev": ("dualpipev", False),
}


@dataclass(kw_only=True, slots=True)
class WorkerOptions:
    """The model, batch and run every rank of one benchmark uses (passed as JSON on the command line)."""

    pp: int = 2
    """Pipeline ranks (per ep rank; the ranks of one node in the emulated cluster)."""
    ep: int = 2
    """Expert-parallel ranks (one per node in the emulated cluster)."""
    chunks: int = 16
    """Micro-batches per step, the same for every mode (DualPipe: half per direction)."""
    micro_batch: int = 4
    """Sequences per micro-batch per ep rank."""
    seq_len: int = 64
    hidden: int = 256
    layers: int = 4
    """Transformer blocks in total (DualPipeV and torch: 2*pp stages; DualPipe and 1F1B: pp)."""
    experts: int = 8
    top_k: int = 2
    moe_intermediate: int = 256
    heads: int = 4
    steps: int = 3
    """Timed steps per mode."""
    warmup: int = 1
    """Untimed steps per mode before them (connections, allocator, torch's shape inference)."""
    modes: list[str] = field(default_factory=lambda: list(MODES))
    seed: int = 0
    run_dir: str = "."
    profile: bool = False
    """Also export a torch profiler trace of the last step of each mode per rank."""

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise ValueError(f"unknown modes {unknown}; choose from {list(MODES)}")
        if self.chunks < 2 * self.pp or self.chunks % 2:
            raise ValueError(
                f"chunks must be even and >= 2*pp = {2 * self.pp} (DualPipe, DualPipeV), got {self.chunks}"
            )
        if self.layers < 2 * self.pp:
            raise ValueError(f"layers={self.layers} cannot fill the 2*pp={2 * self.pp} DualPipeV stages")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError("steps must be >= 1 and warmup >= 0")

    @property
    def tokens_per_step(self) -> int:
        return self.chunks * self.micro_batch * self.ep * self.seq_len


def model_config(o: WorkerOptions) -> MoEConfig:
    """Every block MoE (one shared expert), byte vocabulary; no balance loss (aux terms stay out of timing)."""
    return MoEConfig(
        vocab_size=ByteCorpus.vocab_size,
        hidden_size=o.hidden,
        num_layers=o.layers,
        num_heads=o.heads,
        num_kv_heads=o.heads,
        num_dense_layers=0,
        num_experts=o.experts,
        num_shared_experts=1,
        moe_intermediate_size=o.moe_intermediate,
        top_k=o.top_k,
    )


def ep_major_layout(config: ParallelConfig) -> ParallelLayout:
    """The (pp, ep) layout with global rank ``ep_rank * pp + pp_rank`` (see the module doc)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    pp, ep = config.pp, config.ep
    if pp * ep != world:
        raise ValueError(f"pp x ep = {pp} x {ep} does not equal the world size {world}")
    grid = torch.arange(world).view(ep, pp).t()  # grid[p, e] = e * pp + p
    groups: dict[str, dist.ProcessGroup] = {}
    # new_group is collective over the default group: every rank creates every group, in the same order.
    for e in range(ep):
        members = grid[:, e].tolist()
        g = dist.new_group(members)
        groups.update({"pp": g} if rank in members else {})
    for p in range(pp):
        members = grid[p].tolist()
        g = dist.new_group(members)
        groups.update({"ep": g} if rank in members else {})
    for e in range(ep):
        for p in range(pp // 2):
            members = [int(grid[p, e]), int(grid[pp - 1 - p, e])]
            g = dist.new_group(members)
            groups.update({"mirror": g} if rank in members else {})
    return ParallelLayout(
        config=config,
        pp_rank=rank % pp,
        ep_rank=rank // pp,
        pp_group=groups["pp"],
        ep_group=groups["ep"],
        mirror_group=groups.get("mirror"),
        mesh=None,
    )


def _for_schedule(base: ParallelLayout, schedule: str) -> ParallelLayout:
    """``base`` (groups created once) configured for ``schedule``; only DualPipe has mirror copies."""
    config = ParallelConfig(pp=base.config.pp, ep=base.config.ep, schedule=schedule, comm_sms=0)
    return dataclasses.replace(base, config=config, mirror_group=base.mirror_group if schedule == "dualpipe" else None)


class _ActionRecorder:
    """Wraps compute entry points so each call records ``begin``/``end`` (depth = nesting level)."""

    def __init__(self, recorder: EventRecorder) -> None:
        self.recorder = recorder
        self.depth = 0

    def wrap(self, fn, label_of, direction: str = "action"):
        def recorded(*args, **kwargs):
            label = label_of(*args, **kwargs)
            self.recorder.record(label, direction, self.depth, "begin")
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                self.recorder.record(label, direction, self.depth, "end")

        return recorded


def instrument_pipeline(pipe: Pipeline, recorder: EventRecorder) -> None:
    """Record every compute action of ``pipe``, every wait for a pipeline message inside one, and the
    executor issuing sends and receives between them (instance attributes shadow the executor's methods)."""
    actions = _ActionRecorder(recorder)
    for name in ("_forward", "_backward", "_forward_backward", "_weight"):
        setattr(pipe, name, actions.wrap(getattr(pipe, name), lambda a, st: str(a)))
    pipe._take = actions.wrap(pipe._take, lambda st, kind, key: f"recv {kind}{key[0]}.{key[1]}", "p2p")
    pipe._post = actions.wrap(pipe._post, lambda batch, st: " ".join(["post", *map(str, batch)]), "post")
    reap = pipe._reap_sends
    timed_reap = actions.wrap(reap, lambda st, block: "reap sends", "post")
    # the blocking reap at the end of the step waits for peers: left unrecorded, it counts as idle
    pipe._reap_sends = lambda st, block: reap(st, block) if block else timed_reap(st, block)


def _absolute_events(recorder: EventRecorder, host_t0: float) -> list[list]:
    """``[name, direction, layer, edge, seconds]`` on the host clock."""
    if recorder.device.type != "cuda":
        return [[e.name, e.direction, e.layer, e.edge, e.stamp] for e in recorder.events]
    rows = recorder.timeline()  # ms since the first event, the step's begin (recorded right after a sync)
    return [[n, d, layer, edge, host_t0 + ms / 1e3] for n, d, layer, edge, ms in rows]


@dataclass(slots=True)
class _Mode:
    """One mode, built on this rank: how to run one step and what to zero between steps."""

    name: str
    step: object  # (ids, labels) -> list of this rank's micro-batch losses
    params: list[torch.nn.Parameter]
    recorder: EventRecorder


def _build_ours(name: str, o: WorkerOptions, cfg: MoEConfig, layout: ParallelLayout, recorder: EventRecorder) -> _Mode:
    schedule, overlap = MODES[name]
    layout = _for_schedule(layout, schedule)
    device = recorder.device
    stages = build_stages(cfg, layout, seed=o.seed, device=device)
    for s in stages:
        s.recorder = recorder
        s.aux_loss_scale = 1.0 / o.chunks
    pipe = PIPELINES[schedule](list(stages), process_group=layout.pp_group, overlap=overlap, timeout=600)
    # declared boundary shapes: receives are posted ahead (no header round trip inside the consuming action)
    pipe.set_p2p_tensor_shapes([(o.micro_batch, o.seq_len, o.hidden)])
    pipe.set_p2p_tensor_dtype(next(stages[0].parameters()).dtype)
    instrument_pipeline(pipe, recorder)
    first = [m for m in range(len(stages)) if pipe.layout.is_first(pipe.rank, m)]
    last = [m for m in range(len(stages)) if pipe.layout.is_last(pipe.rank, m)]

    def step(ids: torch.Tensor, labels: torch.Tensor) -> list[float]:
        inputs, targets = _feed(pipe, schedule, first, last, ids, labels)
        loss, _ = pipe.step(*inputs, num_chunks=o.chunks, criterion=lm_loss, labels=targets, loss_reduction="mean")
        return [] if loss is None else loss.tolist()

    params = list({id(p): p for p in pipe.parameters()}.values())
    return _Mode(name, step, params, recorder)


def _feed(pipe: Pipeline, schedule: str, first: list[int], last: list[int], ids, labels) -> tuple[tuple, tuple]:
    """What this pipeline rank passes to ``step`` (as examples/train.py: DualPipe feeds a half at each end)."""
    if schedule != "dualpipe":
        return ((ids,) if first else ()), ((labels,) if last else ())
    half = ids.shape[0] // 2
    halves = {0: (ids[:half], labels[:half]), 1: (ids[half:], labels[half:])}
    inputs = (halves[pipe.layout.path_of(pipe.rank, first[0])][0],) if first else ()
    targets = (halves[pipe.layout.path_of(pipe.rank, last[0])][1],) if last else ()
    return inputs, targets


def _build(name: str, o: WorkerOptions, cfg: MoEConfig, layout: ParallelLayout, device: torch.device) -> _Mode:
    recorder = EventRecorder(device)
    if name == "torch-dualpipev":
        from bench.overlap_torch import build_torch_dualpipev

        layout = _for_schedule(layout, "dualpipev")
        step, params = build_torch_dualpipev(cfg, layout, o.chunks, o.seed, recorder, _ActionRecorder(recorder))
        return _Mode(name, step, params, recorder)
    return _build_ours(name, o, cfg, layout, recorder)


def _timed_step(mode: _Mode, step: int, ids: torch.Tensor, labels: torch.Tensor, profile_to: Path | None) -> dict:
    """One step after a barrier over all ranks: its losses, CPU seconds and absolute-time events."""
    device = mode.recorder.device
    for p in mode.params:
        p.grad = None
    mode.recorder.clear()
    profiler = _profiler() if profile_to is not None else contextlib.nullcontext()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    host_t0 = time.perf_counter()
    cpu_t0 = time.process_time()  # this process's CPU time, gloo's threads included
    mode.recorder.record("step", mode.name, step, "begin")
    with profiler:
        losses = mode.step(ids, labels)
    mode.recorder.record("step", mode.name, step, "end")
    cpu_s = time.process_time() - cpu_t0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if profile_to is not None:
        profiler.export_chrome_trace(str(profile_to))
    return {"losses": losses, "cpu_s": cpu_s, "events": _absolute_events(mode.recorder, host_t0)}


def _grad_sq(mode: _Mode) -> float:
    """Squared norm of every gradient of every rank (all ranks call it)."""
    total = torch.zeros((), dtype=torch.float64, device=mode.recorder.device)
    for p in mode.params:
        if p.grad is not None:
            total += p.grad.double().square().sum()
    dist.all_reduce(total)
    return total.item()


def _run_modes(modes: list[_Mode], o: WorkerOptions, corpus: ByteCorpus, ep_rank: int) -> list[dict]:
    """Every step index once in every mode, the modes interleaved in a rotating order: drift in the
    machine's load (shared, noisy machines) hits every mode alike, and no mode always runs after the same
    one."""
    records = []
    for step in range(o.warmup + o.steps):
        # The same global batch at the same step index in every mode: losses must agree across modes.
        global_batch = o.chunks * o.micro_batch * o.ep
        ids, labels = corpus.batch(step, global_batch, o.seq_len, seed=o.seed, dp_rank=ep_rank, dp_size=o.ep)
        last = step == o.warmup + o.steps - 1
        turn = step % len(modes)
        for mode in modes[turn:] + modes[:turn]:
            device = mode.recorder.device
            profile_to = None
            if o.profile and last:
                profile_to = Path(o.run_dir) / f"profile-{mode.name}-rank{dist.get_rank()}.json"
            record = _timed_step(mode, step, ids.to(device), labels.to(device), profile_to)
            record.update(mode=mode.name, step=step, warmup=step < o.warmup, grad_sq=_grad_sq(mode))
            records.append(record)
    return records


def _profiler():
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    return profile(activities=activities)


def worker_main(options_json: str) -> None:
    """Entry point of one torchrun rank."""
    o = WorkerOptions(**json.loads(options_json))
    cuda = torch.cuda.is_available() and "LOCAL_RANK" in os.environ
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(1)  # several ranks share the cores
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank = dist.get_rank()
    cfg = model_config(o)
    corpus = ByteCorpus()
    ep_rank = rank // o.pp
    layout = ep_major_layout(ParallelConfig(pp=o.pp, ep=o.ep, comm_sms=0))
    record = {
        "rank": rank,
        "pp_rank": rank % o.pp,
        "ep_rank": ep_rank,
        "node": int(os.environ.get("DUALPIPE_CLUSTER_NODE", "0")),
        "device": str(device),
        "cores": len(os.sched_getaffinity(0)),
        "options": asdict(o),
        "steps": [],
    }
    modes = [_build(name, o, cfg, layout, device) for name in o.modes]
    record["steps"] = _run_modes(modes, o, corpus, ep_rank)
    del modes
    Path(o.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(o.run_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()

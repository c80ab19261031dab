"""One rank of the overlap benchmark: build every mode on the same weights and data, time its steps.

Started by :mod:`bench.overlap` through torchrun (``python -m bench.overlap --worker ...``), on loopback or
inside the emulated cluster. Each rank writes ``rank<R>.json`` into the run directory: for every mode and
step, the step window and every recorded event with an absolute time in seconds (``time.perf_counter``,
one system-wide monotonic clock, so ranks on one machine share a time base; on CUDA the events are resolved
against a host time taken right after a synchronise at the step start).

Events per rank (one :class:`dualpipe.events.EventRecorder` shared by the rank's stages):

- sub-stages from the piecewise MoE path: compute ``begin``/``end`` and all-to-all ``start``/``wait``;
- pipeline compute actions (direction ``"action"``, name the action as printed by the schedule, layer its
  nesting depth): reported by our executor to an observer (:mod:`dualpipe.observer`) or, for torch's
  schedule, recorded by wrapping the stage's ``forward_one_chunk`` / ``backward_one_chunk`` /
  ``backward_weight_one_chunk``;
- waits for pipeline messages (direction ``"p2p"``, ``begin``/``end`` around the executor's receive
  completion, which runs inside the compute action that consumes the message): the bubble counts them as
  idle and the measured action costs exclude them;
- the executor issuing sends and receives between actions (direction ``"post"``), which counts as busy;
- ``step`` begin/end, taken after a barrier over all ranks.

Rank order: torchrun's ranks are node-major (node i holds ranks i*P .. i*P+P-1). The layout here is
ep-major (``rank_order=("ep", "pp")``, global rank ``ep_rank * pp + pp_rank``), so with P = pp ranks per
node the pipeline of one ep rank stays inside a node (its P2P on loopback) and every expert-parallel group
spans the nodes: the all-to-all crosses the shaped links. (The default, pp-major, would keep each ep group
inside a node.)

Modes: every registered schedule (:data:`dualpipe.schedule.SCHEDULES`) without overlap, those that pair
forward and backward chunks also with overlap (``<name>-overlap``), and torch's ScheduleDualPipeV as users
get it (``torch-dualpipev``) and with our overlapped pairs bridged in (``torch-dualpipev-overlap``). Each of our
modes also with FP8 dispatch (``<mode>+fp8``: the same schedule, FP8 rows in the dispatch-direction all-to-alls).
Every step also records what the rank's all-to-alls sent, per kind (:class:`moe.dispatch.Traffic`; not for
torch's schedule, which builds its own stages).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist

from bench.overlap.traffic import FP8_SUFFIX
from dualpipe import PIPELINES
from dualpipe.events import EventRecorder
from dualpipe.observer import PipelineObserver, SpanKind, span_label
from dualpipe.schedule import SCHEDULES, schedule_spec
from moe.data import BYTE_VOCAB_SIZE, Loader, open_data
from moe.dispatch import Traffic
from moe.models.config import MoEConfig
from moe.models.model import lm_loss
from moe.parallel import ParallelConfig, ParallelLayout, build_stages, init_layout, with_schedule

__all__ = [
    "CALIBRATION_MODE",
    "MODES",
    "TORCH_MODE",
    "TORCH_MODES",
    "WorkerOptions",
    "extra_warmup_of",
    "model_config",
    "worker_main",
]

TORCH_MODE = "torch-dualpipev"
"""torch.distributed.pipelining's ScheduleDualPipeV on our DualPipeV's stage split: the baseline."""
TORCH_MODES: dict[str, bool] = {TORCH_MODE: False, f"{TORCH_MODE}-overlap": True}
"""torch's schedule -> whether its paired actions run our overlapped pairs (:mod:`dualpipe.torch_bridge`)."""
CALIBRATION_MODE = "dualpipev"
"""The mode ``--calibrate`` times: the schedule torch's runs, without overlap (every all-to-all blocks)."""


def _modes() -> dict[str, tuple[str, bool]]:
    """mode -> (schedule, overlap), from the schedule registry."""
    modes: dict[str, tuple[str, bool]] = {}
    for name, spec in SCHEDULES.items():
        if spec.overlaps:
            modes[f"{name}-overlap"] = (name, True)
        modes[name] = (name, False)
    for name, overlap in TORCH_MODES.items():
        modes[name] = (CALIBRATION_MODE, overlap)
    for name in [m for m in modes if m not in TORCH_MODES]:
        modes[f"{name}{FP8_SUFFIX}"] = modes[name]  # FP8 dispatch: torch's schedule builds its own stages
    return modes


MODES: dict[str, tuple[str, bool]] = _modes()


def extra_warmup_of(schedule: str, extra_warmup: int) -> int:
    """The extra warm-up a mode of ``schedule`` runs when the run asks for ``extra_warmup``: that many where the
    schedule has a warm-up rule (the 1F1B family), else 0."""
    return extra_warmup if schedule_spec(schedule).warmup is not None else 0


PLAIN_MODES: list[str] = [m for m in MODES if not m.endswith(FP8_SUFFIX)]
"""The modes without FP8 dispatch (``--modes``' default)."""


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
    """Transformer blocks in total, at least one per stage of every mode's schedule (DualPipeV: 2*pp)."""
    experts: int = 8
    top_k: int = 2
    moe_intermediate: int = 256
    heads: int = 4
    dtype: str = "float32"
    """Parameters and activations: float32 or bfloat16 (the dtype FP8 dispatch halves)."""
    extra_warmup: int = 0
    """Warm-up forwards added on every rank for the modes whose schedule has a warm-up rule (1F1B, ZB1P,
    interleaved 1F1B: Kimi K2's extra micro-batches; 1F1B and ZB1P pair only with at least 1)."""
    steps: int = 3
    """Timed steps per mode."""
    warmup: int = 1
    """Untimed steps per mode before them (connections, allocator, torch's shape inference)."""
    modes: list[str] = field(default_factory=list)
    """The modes to run, interleaved step by step (empty: every mode without FP8 dispatch that runs at these
    numbers)."""
    seed: int = 0
    run_dir: str = "."
    profile: bool = False
    """Also export a torch profiler trace of the last step of each mode per rank."""

    def __post_init__(self) -> None:
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise ValueError(f"unknown modes {unknown}; choose from {list(MODES)}")
        refusals = {m: self.refusal(m) for m in self.modes or PLAIN_MODES}
        if not self.modes:  # every plain mode that runs at these numbers
            self.modes = [m for m, refusal in refusals.items() if refusal is None]
        for mode in self.modes:  # every mode's schedule takes these numbers (and pairs if it overlaps)
            if refusals[mode] is not None:
                raise ValueError(f"mode {mode} at pp={self.pp}, chunks={self.chunks}: {refusals[mode]}")
            spec = schedule_spec(MODES[mode][0])
            stages = spec.stage_layout(self.pp).num_stages
            if self.layers < stages:
                raise ValueError(f"layers={self.layers} cannot fill the {stages} stages of mode {mode}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.steps < 1 or self.warmup < 0:
            raise ValueError("steps must be >= 1 and warmup >= 0")

    def refusal(self, mode: str) -> str | None:
        """Why ``mode`` cannot run at these numbers (its schedule refuses them, or it overlaps and nothing
        pairs), as :class:`moe.parallel.ParallelConfig` says it; None: it runs."""
        schedule, overlap = MODES[mode]
        try:
            ParallelConfig(
                pp=self.pp, dp=self.ep, ep=self.ep, schedule=schedule, num_chunks=self.chunks, overlap=overlap,
                extra_warmup=self.warmup_of(schedule),
            )  # fmt: skip
        except ValueError as exc:
            return str(exc)
        return None

    def warmup_of(self, schedule: str) -> int:
        """The extra warm-up a mode of ``schedule`` runs (:func:`extra_warmup_of`)."""
        return extra_warmup_of(schedule, self.extra_warmup)

    @property
    def tokens_per_step(self) -> int:
        return self.chunks * self.micro_batch * self.ep * self.seq_len


def model_config(o: WorkerOptions) -> MoEConfig:
    """Every block MoE (one shared expert), byte vocabulary; no balance loss (aux terms stay out of timing)."""
    return MoEConfig(
        vocab_size=BYTE_VOCAB_SIZE,
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


class _ActionRecorder:
    """Records nested ``begin``/``end`` spans (layer = nesting depth); ``wrap`` does so around a callable."""

    def __init__(self, recorder: EventRecorder) -> None:
        self.recorder = recorder
        self.depth = 0

    def begin(self, label: str, direction: str) -> None:
        self.recorder.record(label, direction, self.depth, "begin")
        self.depth += 1

    def end(self, label: str, direction: str) -> None:
        self.depth -= 1
        self.recorder.record(label, direction, self.depth, "end")

    @contextlib.contextmanager
    def span(self, label: str, direction: str) -> Iterator[None]:
        self.begin(label, direction)
        try:
            yield
        finally:
            self.end(label, direction)

    def wrap(self, fn, label_of, direction: str = "action"):
        def recorded(*args, **kwargs):
            with self.span(label_of(*args, **kwargs), direction):
                return fn(*args, **kwargs)

        return recorded


class _PipelineEvents(PipelineObserver):
    """Our executor's spans as benchmark events: compute actions, waits for pipeline messages (``p2p``) and
    posting or reaping sends between actions (``post``, busy). The final drain of outstanding sends waits
    for peers: left unrecorded, it counts as idle."""

    _DIRECTIONS: ClassVar[dict[str, str]] = {"action": "action", "recv": "p2p", "post": "post", "reap": "post"}

    def __init__(self, recorder: EventRecorder) -> None:
        self.spans = _ActionRecorder(recorder)

    def begin(self, kind: SpanKind, subject) -> None:
        if kind in self._DIRECTIONS:
            self.spans.begin(span_label(kind, subject), self._DIRECTIONS[kind])

    def end(self, kind: SpanKind, subject) -> None:
        if kind in self._DIRECTIONS:
            self.spans.end(span_label(kind, subject), self._DIRECTIONS[kind])


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
    traffic: Traffic | None = None
    """What this rank's all-to-alls sent (None: not counted)."""


def _build_ours(name: str, o: WorkerOptions, cfg: MoEConfig, layout: ParallelLayout, recorder: EventRecorder) -> _Mode:
    schedule, overlap = MODES[name]
    layout = with_schedule(layout, schedule)
    device = recorder.device
    dtype, fp8 = getattr(torch, o.dtype), name.endswith(FP8_SUFFIX)
    stages = build_stages(cfg, layout, seed=o.seed, dtype=dtype, device=device, fp8_dispatch=fp8)
    traffic = stages[0].dispatcher.traffic = Traffic()  # one dispatcher for the rank's stages
    for s in stages:
        s.recorder = recorder
        s.aux_loss_scale = 1.0 / o.chunks
    pipe = PIPELINES[schedule](
        list(stages), process_group=layout.pp_group, overlap=overlap, timeout=600, extra_warmup=o.warmup_of(schedule)
    )
    # declared boundary shapes: receives are posted ahead (no header round trip inside the consuming action)
    pipe.set_p2p_tensor_shapes([(o.micro_batch, o.seq_len, o.hidden)])
    pipe.set_p2p_tensor_dtype(next(stages[0].parameters()).dtype)
    pipe.add_observer(_PipelineEvents(recorder))

    def step(ids: torch.Tensor, labels: torch.Tensor) -> list[float]:
        inputs, targets = pipe.split_batch((ids,), (labels,))
        loss, _ = pipe.step(*inputs, num_chunks=o.chunks, criterion=lm_loss, labels=targets, loss_reduction="mean")
        return [] if loss is None else loss.tolist()

    params = list({id(p): p for p in pipe.parameters()}.values())
    return _Mode(name, step, params, recorder, traffic)


def _build(name: str, o: WorkerOptions, cfg: MoEConfig, layout: ParallelLayout, device: torch.device) -> _Mode:
    recorder = EventRecorder(device)
    if name in TORCH_MODES:
        from bench.overlap.torch_peer import build_torch_dualpipev

        layout = with_schedule(layout, MODES[name][0])
        actions = _ActionRecorder(recorder)
        step, params = build_torch_dualpipev(
            cfg, layout, o.chunks, o.seed, recorder, actions, TORCH_MODES[name], getattr(torch, o.dtype)
        )
        return _Mode(name, step, params, recorder)
    return _build_ours(name, o, cfg, layout, recorder)


def _timed_step(mode: _Mode, step: int, ids: torch.Tensor, labels: torch.Tensor, profile_to: Path | None) -> dict:
    """One step after a barrier over all ranks: its losses, CPU seconds and absolute-time events."""
    device = mode.recorder.device
    for p in mode.params:
        p.grad = None
    mode.recorder.clear()
    if mode.traffic is not None:
        mode.traffic.clear()
    profiler = _profiler() if profile_to is not None else contextlib.nullcontext()
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    host_t0 = time.perf_counter()
    cpu_t0 = time.process_time()  # this process's CPU time, gloo's threads included
    thread_t0 = time.thread_time()  # this thread's: the rank's compute and host work, which nothing else can run
    mode.recorder.record("step", mode.name, step, "begin")
    with profiler:
        losses = mode.step(ids, labels)
    mode.recorder.record("step", mode.name, step, "end")
    cpu_s, thread_s = time.process_time() - cpu_t0, time.thread_time() - thread_t0
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if profile_to is not None:
        profiler.export_chrome_trace(str(profile_to))
    traffic = None if mode.traffic is None else mode.traffic.summary()
    events = _absolute_events(mode.recorder, host_t0)
    return {"losses": losses, "cpu_s": cpu_s, "thread_s": thread_s, "events": events, "traffic": traffic}


def _grad_sq(mode: _Mode) -> float:
    """Squared norm of every gradient of every rank (all ranks call it)."""
    total = torch.zeros((), dtype=torch.float64, device=mode.recorder.device)
    for p in mode.params:
        if p.grad is not None:
            total += p.grad.double().square().sum()
    dist.all_reduce(total)
    return total.item()


def _run_modes(modes: list[_Mode], o: WorkerOptions, loader: Loader) -> list[dict]:
    """Every step index once in every mode, the modes interleaved in a rotating order: drift in the
    machine's load (shared, noisy machines) hits every mode alike, and no mode always runs after the same
    one."""
    records = []
    for step in range(o.warmup + o.steps):
        # The same global batch at the same step index in every mode: losses must agree across modes. Each
        # step is a fresh global batch; this ep rank takes its slice of it.
        ids, labels = loader.batch(step * loader.global_batch)
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
    layout = init_layout(ParallelConfig(pp=o.pp, ep=o.ep, comm_sms=0, rank_order=("ep", "pp")), device.type)
    loader = open_data(None).loader(
        "train",
        seq_len=o.seq_len,
        global_batch=o.chunks * o.micro_batch * o.ep,
        dp_rank=layout.ep_rank,
        dp_size=o.ep,
        seed=o.seed,
    )
    record = {
        "rank": rank,
        "pp_rank": layout.pp_rank,
        "ep_rank": layout.ep_rank,
        "node": int(os.environ.get("DUALPIPE_CLUSTER_NODE", "0")),
        "device": str(device),
        "cores": len(os.sched_getaffinity(0)),
        "options": asdict(o),
        "steps": [],
    }
    modes = [_build(name, o, cfg, layout, device) for name in o.modes]
    record["act_bytes"] = modes[0].params[0].element_size()  # the activations' dtype is the parameters'
    record["steps"] = _run_modes(modes, o, loader)
    del modes
    Path(o.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(o.run_dir) / f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()

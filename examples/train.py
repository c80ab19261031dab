"""Train the MoE transformer with a DualPipe-family pipeline and expert parallelism.

    torchrun --standalone --nproc-per-node 8 examples/train.py --pp 2 --dp 4 --ep 2 --zero 1 --steps 40

World size = pp x dp; ep divides dp (dp/ep expert replicas per stage). CPU ranks use gloo, CUDA ranks
NCCL. Byte-level language modelling on text already on the machine (``--data`` for your own). Rank 0 prints
progress; ``--metrics-file`` gets one JSON line per step (loss, throughput, expert imbalance, gradient
norm, memory per rank); ``--ckpt-dir`` with ``--ckpt-every`` writes atomic distributed checkpoints and
``--resume`` continues from the newest one (also at another pp/dp/ep layout). A NaN or infinite loss or
gradient stops the run before its optimizer step (``--skip-nonfinite`` skips the step instead). A failure
the flags or the machine cause is one line on rank 0 (``--debug``: every rank's traceback).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from dualpipe import PIPELINES, Pipeline
from dualpipe.observer import ProfilerObserver
from dualpipe.schedule import DEFAULT_SCHEDULE, SCHEDULES, schedule_spec
from kernels.warmup import KernelShapes, warm_up
from moe.checkpoint import (
    CheckpointError,
    find_checkpoint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from moe.config import PRESETS, preset
from moe.data import ByteCorpus
from moe.dispatch import DEFAULT_COMM_SMS, DISPATCHERS, Launch
from moe.grad_sync import balance_routers, make_optimizer, reduce_gradients
from moe.guard import find_nonfinite, weights_are_finite
from moe.memory import MemoryMeter
from moe.model import lm_loss
from moe.optimizer import DistributedAdamW, grad_of
from moe.parallel import MESH_DIMS, ParallelConfig, build_stages, init_layout, nccl_options, rank_grid
from moe.router import Router, bias_rate_at, routing_imbalance


class OneLineError(SystemExit):
    """A failure the user can fix (a flag, a path, a package, a port, diverged training): its message says
    what to change. :func:`cli` prints it once, on global rank 0, with no traceback unless ``--debug``."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print its usage on every rank
        raise OneLineError(f"error: {message} (see --help)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = _Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS), help="model size (vocab forced to 256)")
    p.add_argument("--layers", type=int, default=0, help="override the preset's layer count")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks")
    p.add_argument(
        "--dp", type=int, default=0, help="data-parallel ranks per pipeline stage (default: world size / --pp)"
    )
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks; must divide --dp")
    p.add_argument(
        "--rank-order",
        default=",".join(MESH_DIMS),
        help="mesh dimensions pp, edp, ep, outermost first (default: ep innermost, an expert group on one node)",
    )
    p.add_argument(
        "--schedule",
        default=DEFAULT_SCHEDULE,
        choices=sorted(SCHEDULES),
        help="; ".join(f"{name}: {spec.summary}" for name, spec in sorted(SCHEDULES.items())),
    )
    p.add_argument(
        "--stages-per-rank",
        type=int,
        default=None,
        metavar="V",
        help="model chunks per pipeline rank, for schedules that take any number (interleaved-1f1b; default 2)",
    )
    p.add_argument(
        "--num-chunks",
        type=int,
        default=0,
        help="micro-batches per step (default: the fewest the schedule takes that is at least 2*pp)",
    )
    p.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="overlap paired forward/backward chunks (DualPipe family)",
    )
    p.add_argument("--dispatcher", default="alltoall", choices=tuple(DISPATCHERS))
    p.add_argument("--comm-sms", type=int, default=DEFAULT_COMM_SMS, help="SMs reserved for communication (GPU)")
    p.add_argument("--recompute", action="store_true", help="recompute attention and MLP in backward")
    p.add_argument(
        "--sync-free",
        action="store_true",
        help="worst-case all-to-all buffers: no host sync in routing and dispatch (ep x the bytes)",
    )
    p.add_argument(
        "--bias-update-rate",
        type=float,
        default=None,
        help="aux-loss-free balancing step per training step (default: the preset's)",
    )
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps, then cosine decay to 10%%")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="compute dtype; bfloat16 keeps fp32 master weights, gradient accumulation and AdamW states",
    )
    p.add_argument(
        "--master-weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --dtype bfloat16: fp32 master weights and gradients (--no-master-weights: pure bf16)",
    )
    p.add_argument(
        "--zero",
        type=int,
        default=0,
        choices=(0, 1),
        help="1: ZeRO-1, AdamW state sharded over the data-parallel group (experts over their replicas)",
    )
    p.add_argument(
        "--clip-grad", type=float, default=0.0, help="clip the global gradient norm to this (0: no clipping)"
    )
    p.add_argument("--data", default=None, help="a directory of text files or a uint16 .bin token file")
    p.add_argument("--val-every", type=int, default=20, help="held-out loss every N steps (0: never)")
    p.add_argument("--val-batches", type=int, default=2)
    p.add_argument("--ckpt-dir", default=None)
    p.add_argument("--ckpt-every", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir")
    p.add_argument(
        "--resume-strict",
        action="store_true",
        help="--resume, but a damaged newest checkpoint or an empty --ckpt-dir is an error (no fallback)",
    )
    p.add_argument(
        "--keep-last",
        type=int,
        default=3,
        metavar="N",
        help="keep the newest N checkpoints, removing older ones once a new one is in place (0: keep all)",
    )
    p.add_argument("--metrics-file", default=None, help="append one JSON line per step (rank 0)")
    p.add_argument("--trace-dir", default=None, help="write a torch profiler trace of step 2 per rank")
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any rank waits for a peer")
    p.add_argument(
        "--kill-rank-at-step",
        type=int,
        default=0,
        metavar="STEP",
        help="failure drill: SIGKILL global rank 1 at STEP on the first attempt (torchrun restart 0)",
    )
    p.add_argument(
        "--stop-rank-at-step",
        type=int,
        default=0,
        metavar="STEP",
        help="failure drill: SIGSTOP global rank 1 at STEP (a hung peer: the others fail within --timeout)",
    )
    p.add_argument(
        "--nan-at-step",
        type=int,
        default=0,
        metavar="STEP",
        help="failure drill: a NaN in one gradient of the last rank's first stage module at STEP",
    )
    p.add_argument(
        "--skip-nonfinite",
        action="store_true",
        help="skip a step whose loss or gradients are NaN/inf (no optimizer step) instead of stopping",
    )
    p.add_argument("--debug", action="store_true", help="print every rank's traceback for the one-line errors")
    return p.parse_args(argv)


def num_chunks(args: argparse.Namespace) -> int:
    """Micro-batches per step: ``--num-chunks``, or the schedule's default (at least ``2 x pp``)."""
    return args.num_chunks or schedule_spec(args.schedule).default_chunks(args.pp)


def check_args(args: argparse.Namespace, world: int) -> None:
    """Every constraint up front, with what to change."""
    for name in ("pp", "ep"):
        if getattr(args, name) < 1:
            raise OneLineError(f"error: --{name} must be 1 or more")
    if args.dp < 0:
        raise OneLineError("error: --dp must be 1 or more (0: the world size / --pp)")
    if not args.dp and world % args.pp:
        raise OneLineError(f"error: the world size {world} does not divide by --pp {args.pp}; launch pp x dp processes")
    args.dp = args.dp or world // args.pp
    if args.pp * args.dp != world:
        raise OneLineError(
            f"error: --pp {args.pp} x --dp {args.dp} = {args.pp * args.dp}, but the world size is "
            f"{world}; launch pp x dp processes (torchrun --nnodes ... --nproc-per-node ...)"
        )
    if sorted(rank_order(args)) != sorted(MESH_DIMS):
        raise OneLineError(f"error: --rank-order {args.rank_order}: name each of {','.join(MESH_DIMS)} once")
    if args.dp % args.ep:
        raise OneLineError(
            f"error: --ep {args.ep} must divide --dp {args.dp} (the world size is {world} = --pp {args.pp} x "
            f"--dp {args.dp}; each data-parallel group holds --dp / --ep expert replicas)"
        )
    spec = schedule_spec(args.schedule)
    try:  # the schedule's own rules (pipeline ranks = --pp, micro-batches = --num-chunks)
        spec.validate(args.pp, num_chunks(args), args.stages_per_rank)
    except ValueError as exc:
        stages = f" --stages-per-rank {args.stages_per_rank}" if args.stages_per_rank else ""
        raise OneLineError(
            f"error: --schedule {args.schedule} --pp {args.pp}{stages} --num-chunks {num_chunks(args)}: {exc}"
        ) from None
    if args.ckpt_every and not args.ckpt_dir:
        raise OneLineError("error: --ckpt-every needs --ckpt-dir")
    args.resume = args.resume or args.resume_strict
    if args.resume and not args.ckpt_dir:
        raise OneLineError(f"error: {'--resume-strict' if args.resume_strict else '--resume'} needs --ckpt-dir")
    if args.keep_last < 0:
        raise OneLineError("error: --keep-last must be 0 (keep all) or more")
    for name in ("steps", "seq_len", "micro_batch_size"):
        if getattr(args, name) <= 0:
            raise OneLineError(f"error: --{name.replace('_', '-')} must be positive")
    if args.overlap and not spec.overlaps:
        args.overlap = False  # nothing is paired in this schedule


def rank_order(args: argparse.Namespace) -> tuple[str, ...]:
    return tuple(d.strip() for d in args.rank_order.split(","))


def check_environment(args: argparse.Namespace) -> None:
    """What the machine must provide, checked on every rank before any collective, with what to change.

    ``--data`` is checked where it is read (:func:`load_corpus`).
    """
    if args.ep > 1:  # at ep == 1 no dispatcher is built
        missing = _dispatcher_problems(args)
        if missing:
            raise OneLineError(f"error: --dispatcher {args.dispatcher}: {'; '.join(missing)}")
    if args.ckpt_dir and (args.ckpt_every or args.resume):
        _check_ckpt_dir(Path(args.ckpt_dir), writes=bool(args.ckpt_every))


def _dispatcher_problems(args: argparse.Namespace) -> list[str]:
    """What the dispatcher cannot run here: the optional package (not CUDA: tests emulate it), the rows
    (dtype, width), ``--comm-sms``, and every ep group's placement on nodes (all of them, so that every rank
    reaches the same verdict)."""
    spec = DISPATCHERS.lookup(args.dispatcher)
    rows = Launch(dtype=getattr(torch, args.dtype), hidden_size=preset(args.preset).hidden_size, comm_sms=args.comm_sms)
    missing = spec.check(launch=rows)
    world = dist.get_world_size()
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    config = ParallelConfig(pp=args.pp, dp=args.dp, ep=args.ep, rank_order=rank_order(args), schedule=args.schedule)
    grid = rank_grid(config, world)
    for ep_ranks in grid.reshape(-1, args.ep).tolist():  # init_layout's ep groups: the grid's last axis
        found = spec.violations(Launch(ep_ranks=tuple(ep_ranks), local_world_size=local_world_size))
        missing.extend(p for p in found if p not in missing)
    return missing


def _check_ckpt_dir(path: Path, writes: bool) -> None:
    existing = next(p for p in (path, *path.parents) if p.exists())  # what a save's mkdir would start from
    if not existing.is_dir():
        raise OneLineError(f"error: --ckpt-dir {path}: {existing} is not a directory; pick another --ckpt-dir")
    if writes and not os.access(existing, os.W_OK | os.X_OK):
        raise OneLineError(f"error: --ckpt-dir {path}: {existing} is not writable; pick another --ckpt-dir")


def load_corpus(args: argparse.Namespace) -> ByteCorpus:
    if args.data is not None and not Path(args.data).exists():
        raise OneLineError(f"error: --data {args.data} does not exist; pass a directory of text files or a .bin file")
    try:
        return ByteCorpus(args.data)
    except (OSError, ValueError) as exc:  # unreadable, empty, or not text: the corpus says which
        raise OneLineError(f"error: --data {args.data}: {exc}") from exc


def init_distributed(cuda: bool, timeout: float, comm_sms: int) -> None:
    """The default process group; every collective waits at most ``timeout`` seconds for a peer. On NCCL it
    gets the same CTA cap as the layout's groups (``comm_sms``; 0 for none): it carries the per-step loss
    and gradient-norm reductions."""
    options = nccl_options(comm_sms) if cuda else None
    try:
        dist.init_process_group(
            "nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout), pg_options=options
        )
    except dist.DistNetworkError as exc:
        if "EADDRINUSE" not in str(exc):
            raise
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise OneLineError(f"error: the rendezvous port {where} is in use; set MASTER_PORT to a free port") from exc


@dataclass(slots=True)
class Run:
    """Everything one rank needs inside the loop."""

    args: argparse.Namespace
    layout: object
    pipe: Pipeline
    optimizer: DistributedAdamW
    corpus: ByteCorpus
    device: torch.device
    num_chunks: int
    owns_process_group: bool
    meter: MemoryMeter
    nonfinite_skips: int = 0
    grad_norm: float = float("nan")

    @property
    def global_batch(self) -> int:
        return self.num_chunks * self.args.micro_batch_size * self.args.dp


def setup(args: argparse.Namespace) -> Run:
    cuda = torch.cuda.is_available() and "LOCAL_RANK" in os.environ
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    owns_pg = not dist.is_initialized()
    if owns_pg:
        init_distributed(cuda, args.timeout, args.comm_sms if args.ep > 1 else 0)
    world = dist.get_world_size()
    check_args(args, world)
    check_environment(args)
    corpus = load_corpus(args)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(args.seed)
    overrides = {"vocab_size": ByteCorpus.vocab_size}
    if args.layers:
        overrides["num_layers"] = args.layers
    if args.bias_update_rate is not None:
        overrides["bias_update_rate"] = args.bias_update_rate
    cfg = preset(args.preset, **overrides)
    pc = ParallelConfig(
        pp=args.pp,
        dp=args.dp,
        ep=args.ep,
        rank_order=rank_order(args),
        schedule=args.schedule,
        modules_per_rank=args.stages_per_rank,
        dispatcher=args.dispatcher,
        comm_sms=args.comm_sms,
        recompute=args.recompute,
        sync_free=args.sync_free,
    )
    if cfg.num_layers < pc.num_stages:
        raise OneLineError(
            f"error: {args.schedule} at pp={args.pp} has {pc.num_stages} stages but the model has "
            f"{cfg.num_layers} layers; pass --layers {pc.num_stages} or more"
        )
    if cfg.num_experts % args.ep:
        raise OneLineError(f"error: {cfg.num_experts} experts do not divide over --ep {args.ep}")
    layout = init_layout(pc, device.type)
    dtype = getattr(torch, args.dtype)
    stages = build_stages(cfg, layout, seed=args.seed, dtype=dtype, device=device)
    # Triton compiles and autotunes at the real shapes now, on every rank alike, not inside the first
    # pipe.step while all-to-alls are in flight (a no-op off CUDA).
    tokens = args.micro_batch_size * args.seq_len
    warm_up(KernelShapes.from_config(cfg, tokens=tokens, ep=pc.ep, dtype=dtype), device, comm_sms=pc.reserved_sms)
    pipe = PIPELINES[args.schedule](
        list(stages), process_group=layout.pp_group, timeout=args.timeout, overlap=args.overlap
    )
    # Every stage boundary carries one hidden-state tensor per micro-batch: declaring it lets receives be
    # posted ahead of the compute that consumes them (no per-message shape header to wait for).
    pipe.set_p2p_tensor_shapes([(args.micro_batch_size, args.seq_len, cfg.hidden_size)])
    pipe.set_p2p_tensor_dtype(dtype)
    optimizer = make_optimizer(
        stages,
        layout,
        zero=bool(args.zero),
        master_weights=args.master_weights,
        lr=args.lr,
        weight_decay=args.weight_decay,
        betas=(0.9, 0.95),
    )
    chunks = num_chunks(args)
    for stage in stages:
        # The step averages the LM loss over micro-batches (loss_reduction="mean"); the balance loss, added
        # inside each stage per micro-batch, must be averaged the same way.
        stage.aux_loss_scale = 1.0 / chunks
    meter = MemoryMeter(list(pipe.module), optimizer)
    return Run(args, layout, pipe, optimizer, corpus, device, chunks, owns_pg, meter)


def lr_at(args: argparse.Namespace, step: int) -> float:
    if step <= args.warmup:
        return args.lr * step / max(args.warmup, 1)
    progress = (step - args.warmup) / max(args.steps - args.warmup, 1)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def step_inputs(run: Run, step: int, split: str) -> tuple[tuple, tuple]:
    """(inputs, labels) this pipeline rank feeds to ``pipe.step``.

    The global batch of the step depends on (seed, step) only; each ep rank takes its slice, and the pipeline
    cuts what this rank feeds from it (``Pipeline.split_batch``: DualPipe feeds half at each end).
    """
    args = run.args
    ids, labels = run.corpus.batch(
        step, run.global_batch, args.seq_len, seed=args.seed, dp_rank=run.layout.dp_rank, dp_size=args.dp, split=split
    )
    return run.pipe.split_batch((ids.to(run.device),), (labels.to(run.device),))


def global_mean_loss(run: Run, loss: torch.Tensor | None) -> float:
    """Mean micro-batch loss over every rank that computed one (all ranks call this)."""
    total = torch.zeros(2, dtype=torch.float64, device=run.device)
    if loss is not None:
        total[0], total[1] = loss.double().sum(), loss.numel()
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def routers(run: Run) -> list[Router]:
    return [b.router for stage in run.pipe.module for b in stage.blocks.values() if getattr(b, "is_moe", False)]


def worst_over_ranks(run: Run, figures: dict[str, float]) -> dict[str, float]:
    """Each figure's maximum over every rank (one all-reduce): the expert imbalance of the worst layer
    anywhere, and the memory of the fullest rank, the one that decides whether a layout fits."""
    values = torch.tensor(list(figures.values()), dtype=torch.float64, device=run.device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return {k: (v if k == "expert_imbalance" else int(v)) for k, v in zip(figures, values.tolist())}


def validate(run: Run, step: int) -> float:
    losses = []
    run.pipe.eval()  # routers count expert load only in training mode
    with torch.no_grad():
        for i in range(run.args.val_batches):
            inputs, labels = step_inputs(run, step * 1000 + i, "val")
            loss, _ = run.pipe.step(*inputs, num_chunks=run.num_chunks, criterion=lm_loss, labels=labels)
            losses.append(global_mean_loss(run, loss))
    run.pipe.train()
    return sum(losses) / len(losses)


def train_step(run: Run, step: int) -> dict[str, float]:
    """One optimizer step; its metrics: the global mean loss, the expert imbalance after the balancing step
    (max / mean tokens per expert over the global batch, the worst layer) and the memory figures of
    :class:`moe.memory.MemoryMeter` (the fullest rank's)."""
    lr = lr_at(run.args, step)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    run.optimizer.zero_grad(set_to_none=True)
    inputs, labels = step_inputs(run, step, "train")
    run.meter.start_step()
    try:
        loss, _ = run.pipe.step(
            *inputs, num_chunks=run.num_chunks, criterion=lm_loss, labels=labels, loss_reduction="mean"
        )
        maybe_nan(run, step)
        if guard_nonfinite(run, step, loss):
            modules = list(run.pipe.module)
            reduce_gradients(modules, run.layout)
            run.grad_norm = run.optimizer.clip_grad_norm_(run.args.clip_grad or math.inf)
            run.optimizer.step()
            # The bias moves with the learning rate: routing scores drift about as fast as the weights do.
            rate = bias_rate_at(modules[0].cfg.bias_update_rate, lr, run.args.lr)
            balance_routers(modules, run.layout, rate=rate)
            if run.args.ckpt_every and step % run.args.ckpt_every == 0 and not weights_are_finite(modules):
                raise OneLineError(
                    f"error: non-finite weights after step {step}; its checkpoint is not written: lower --lr"
                )
    finally:
        memory = run.meter.stop_step()
    figures = worst_over_ranks(run, {"expert_imbalance": routing_imbalance(routers(run)), **memory})
    return {"loss": global_mean_loss(run, loss), **figures}


def guard_nonfinite(run: Run, step: int, loss: torch.Tensor | None) -> bool:
    """True if the step may go on to its optimizer step. A NaN/inf loss or gradient on any rank stops the run
    (same decision on every rank), or with ``--skip-nonfinite`` drops the step's gradients and expert loads."""
    found = find_nonfinite(list(run.pipe.module), loss, run.layout.config.num_stages)
    if not found:
        return True
    if not run.args.skip_nonfinite:
        raise OneLineError(
            f"error: {found.describe(step)}; stopped before its optimizer step (checkpoints hold earlier steps "
            "only): lower --lr, or pass --skip-nonfinite to skip such steps"
        )
    run.optimizer.zero_grad(set_to_none=True)
    for router in routers(run):
        router.expert_load.zero_()  # the router bias does not move on a skipped step
    run.nonfinite_skips += 1
    if dist.get_rank() == 0:
        print(f"{found.describe(step)}: step skipped ({run.nonfinite_skips} so far)", flush=True)
    return False


def save(run: Run, step: int) -> None:
    meta = {"data_step": step, "args": vars(run.args), "pp": run.args.pp, "dp": run.args.dp, "ep": run.args.ep}
    modules, keep = list(run.pipe.module), run.args.keep_last
    try:
        save_checkpoint(run.args.ckpt_dir, step, modules, run.optimizer, meta, rng_state(), keep_last=keep)
    except CheckpointError as exc:  # every rank gets it: all stop, none waits on a dead peer
        raise OneLineError(f"error: {exc}; training stopped, the previous checkpoint is untouched") from None


def resume(run: Run) -> int:
    """The step to continue after: the newest intact checkpoint's, or 0 when there is none (one line says
    so; ``--resume-strict`` makes that, and a damaged newest checkpoint, an error)."""
    args, rank = run.args, dist.get_rank()
    strict = " (--resume-strict)" if args.resume_strict else ""
    try:
        path, warnings = find_checkpoint(args.ckpt_dir, strict=args.resume_strict)
    except CheckpointError as exc:
        raise OneLineError(f"error: {exc}{strict}") from None
    for warning in warnings if rank == 0 else []:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    if path is None and args.resume_strict:
        raise OneLineError(f"error: no checkpoint in {args.ckpt_dir} to resume from{strict}")
    if path is None:
        if rank == 0:
            print(f"--resume: no checkpoint in {args.ckpt_dir}, starting from step 0", flush=True)
        return 0
    try:
        meta, rank_state = load_checkpoint(path, list(run.pipe.module), run.optimizer)
    except CheckpointError as exc:
        raise OneLineError(f"error: {exc}") from None
    if rank_state is not None:
        set_rng_state(rank_state)
    if rank == 0:
        written = f"pp={meta['pp']} dp={meta.get('dp', meta['ep'])} ep={meta['ep']}"  # no dp: written at dp == ep
        print(f"resumed from {path} (step {meta['step']}, written at {written})", flush=True)
    return int(meta["step"])


def maybe_kill(args: argparse.Namespace, step: int) -> None:
    """The failure drill: a real SIGKILL of one rank, once, so torchrun's restart path gets exercised."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if args.kill_rank_at_step == step and first_attempt and dist.get_rank() == 1:
        print(f"failure drill: killing rank 1 at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def maybe_nan(run: Run, step: int) -> None:
    """The non-finite drill: a NaN in one gradient of the last rank's first stage module."""
    if run.args.nan_at_step != step or dist.get_rank() != dist.get_world_size() - 1:
        return
    stage = run.pipe.module[0]
    grad = grad_of(next(p for p in stage.parameters() if p.requires_grad))  # main_grad under bf16
    grad[(0,) * grad.dim()] = float("nan")
    print(f"failure drill: a NaN in a gradient of stage {stage.stage_index} at step {step}", flush=True)


def maybe_stop(args: argparse.Namespace, step: int) -> None:
    """The hang drill: global rank 1 stops (SIGSTOP) as if hung; its peers must fail within --timeout."""
    if args.stop_rank_at_step == step and dist.get_rank() == 1:
        print(f"failure drill: stopping rank 1 at step {step}", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)


def timed_step(run: Run, step: int, profile: bool) -> tuple[dict[str, float], float]:
    """(metrics, seconds) of one training step (:func:`train_step`), under the torch profiler when asked."""
    t0 = time.monotonic()
    if not profile:
        figures = train_step(run, step)
        return figures, time.monotonic() - t0
    from torch.profiler import profile as torch_profile

    observer = ProfilerObserver()  # schedule actions and pipeline messages as named spans in the trace
    run.pipe.add_observer(observer)
    try:
        with torch_profile() as prof:
            figures = train_step(run, step)
    finally:
        run.pipe.remove_observer(observer)
    dt = time.monotonic() - t0
    Path(run.args.trace_dir).mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(Path(run.args.trace_dir) / f"trace_rank{dist.get_rank()}.json"))
    return figures, dt


def progress_line(args: argparse.Namespace, record: dict, eta: float) -> str:
    val = f"  val {record['val_loss']:.4f}" if "val_loss" in record else ""
    return (
        f"step {record['step']:5d}/{args.steps}  loss {record['loss']:.4f}{val}  "
        f"{record['tokens_per_s']:8.0f} tok/s  imbalance {record['expert_imbalance']:4.2f}  eta {eta:6.1f}s"
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    run = setup(args)
    rank = dist.get_rank()
    start_step = resume(run) if args.resume else 0
    tokens_per_step = run.global_batch * args.seq_len
    metrics = open(args.metrics_file, "a") if args.metrics_file and rank == 0 else None  # noqa: SIM115
    if rank == 0:
        print(
            f"MoE {args.preset}: pp={args.pp} dp={args.dp} ep={args.ep} {args.schedule} overlap={args.overlap} "
            f"chunks={run.num_chunks} tokens/step={tokens_per_step} data: {run.corpus.description}",
            flush=True,
        )
    t_start = time.monotonic()
    for done, step in enumerate(range(start_step + 1, args.steps + 1), start=1):
        maybe_kill(args, step)
        maybe_stop(args, step)
        profile = bool(args.trace_dir) and step == start_step + 2
        figures, dt = timed_step(run, step, profile)
        record = {
            "step": step,
            "loss": figures.pop("loss"),
            "tokens_per_s": tokens_per_step / dt,
            "step_time_s": dt,
            "lr": lr_at(args, step),
            "expert_imbalance": figures.pop("expert_imbalance"),
            "nonfinite_skips": run.nonfinite_skips,
            "grad_norm": run.grad_norm,
            **figures,  # bytes: param, grad, optimizer_state, peak_activation (the fullest rank's)
        }
        if args.val_every and step % args.val_every == 0:
            record["val_loss"] = validate(run, step)
        if args.ckpt_every and step % args.ckpt_every == 0:
            save(run, step)
        if rank != 0:
            continue
        if metrics is not None:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        if step % args.log_every == 0 or done == 1 or step == args.steps or "val_loss" in record:
            eta = (time.monotonic() - t_start) / done * (args.steps - step)
            print(progress_line(args, record, eta), flush=True)
    if metrics is not None:
        metrics.close()
    dist.barrier()
    close_dispatchers(run)
    if run.owns_process_group:
        dist.destroy_process_group()


def close_dispatchers(run: Run) -> None:
    """The clean path only: release the dispatchers (DeepEP's ``destroy()`` syncs with its peers, so a rank
    leaving with an error never calls it; its peers then fail on their collective timeout instead)."""
    for dispatcher in {id(s.dispatcher): s.dispatcher for s in run.pipe.module}.values():
        dispatcher.close()


def _debug(argv: list[str]) -> bool:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--debug", action="store_true")
    return p.parse_known_args(argv)[0].debug


def cli() -> None:
    """``main`` as a command. Every rank meets a user-caused failure alike (flags, paths, packages, a non-finite
    step: decided on all ranks together), so only global rank 0 prints its one line; the others exit with
    the same status, silently. ``--debug`` prints every rank's traceback instead. Real bugs keep theirs."""
    try:
        main()
    except SystemExit as exc:
        if not isinstance(exc.code, str):  # a plain exit status (argparse's --help)
            raise
        if _debug(sys.argv[1:]):
            traceback.print_exc()
        elif os.environ.get("RANK", "0") == "0":
            print(exc.code, file=sys.stderr, flush=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    cli()

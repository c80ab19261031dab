"""Checks a job must pass before its first collective: memory, the machine, the data.

Each runs on every rank from the configuration and the launcher's environment alone (no process group), so
every rank reaches the same verdict and none waits on a peer that gave up; the launcher prints rank 0's one
line. A failure is a :class:`PreflightError` saying what to change.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from moe.dispatch import DISPATCHERS, Launch
from moe.parallel import rank_grid
from moe.plan import HEADROOM, Footprint, Parallelism, Precision, Workload, footprint
from moe.train.config import TrainConfig

__all__ = ["PreflightError", "check_checkpoint_dir", "check_dispatcher", "check_memory", "memory_estimate"]

GiB = 2**30


class PreflightError(SystemExit):
    """The job cannot run as configured on this machine; the message is one line saying what to change."""


def local_world_size(config: TrainConfig) -> int:
    """Ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``; the whole job when launched without it)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", config.parallel.world_size))


def memory_estimate(config: TrainConfig) -> float:
    """Bytes the most loaded rank needs: the planner's footprint (:func:`moe.plan.footprint`) of this job."""
    return job_footprint(config).total


def job_footprint(config: TrainConfig) -> Footprint:
    """The planner's footprint of this job's most loaded rank (GPU bytes by kind, and host bytes)."""
    pc, tr = config.parallel, config.training
    act_bytes = torch.finfo(getattr(torch, tr.dtype)).bits // 8
    par = Parallelism(
        pp=pc.pp,
        dp=pc.dp,
        ep=pc.ep,
        schedule=pc.schedule,
        modules_per_rank=pc.modules_per_rank,
        pipeline_layout=pc.pipeline_layout,
        extra_warmup=pc.extra_warmup,
        offload=pc.offload,
    )
    work = Workload(
        seq_len=tr.seq_len,
        micro_batch=tr.micro_batch_size,
        comm_sms=pc.reserved_sms,
        recompute=pc.recompute,
        act_bytes=act_bytes,
        master_weights=tr.master_weights,
        state_dtype=config.optimizer.state_dtype,
        fp8_activations=tr.fp8_activations,
        ema=config.optimizer.ema is not None,
        precision=Precision(fp8=tr.fp8, fp8_dispatch=tr.dispatch_fp8),
    )
    return footprint(
        config.model_config,
        par,
        work,
        num_chunks=pc.num_chunks,
        zero=bool(config.optimizer.zero),
        param_bytes=act_bytes,
        optimizer=config.optimizer.name,
    )


def device_memory(device: torch.device, local_ranks: int) -> tuple[float, str]:
    """(bytes one rank may use, what that is): a CUDA device's total, or the available RAM shared by the
    node's ranks."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return float(props.total_memory), f"{props.name}'s memory"
    available = _available_ram()
    return available / max(local_ranks, 1), f"available RAM / {local_ranks} local ranks"


def _available_ram() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def check_memory(config: TrainConfig, device: torch.device) -> float:
    """The estimate in bytes; raises :class:`PreflightError` when it exceeds what one rank has (minus the
    planner's headroom for fragmentation and workspaces), unless ``training.force``."""
    estimate = memory_estimate(config)
    limit, what = device_memory(device, local_world_size(config))
    usable = (1 - HEADROOM) * limit
    if estimate > usable and not config.training.force:
        tr, pc = config.training, config.parallel
        hints = [f"a smaller --seq-len ({tr.seq_len}) or --micro-batch-size ({tr.micro_batch_size})"]
        if pc.recompute != "full":
            hints.append("--recompute" if pc.recompute == "none" else "--recompute full")
        hints += ["more --pp", "--zero 1" if not config.optimizer.zero else "more --dp"]
        raise PreflightError(
            f"error: this run needs about {estimate / GiB:.1f} GiB per rank (moe.plan's footprint), above the "
            f"{usable / GiB:.1f} GiB usable ({1 - HEADROOM:.0%} of {limit / GiB:.1f} GiB, {what}); "
            f"try {', '.join(hints)}, or pass --force"
        )
    return estimate


def check_dispatcher(config: TrainConfig) -> None:
    """What the dispatcher cannot run on this machine: the optional package (not CUDA: tests emulate it) and
    every ep group's placement on nodes (all of them, so that every rank reaches the same verdict). The rows
    it moves (dtype, width, SM budget) are the configuration's to check. Nothing to check at ep == 1 (no
    dispatcher is built)."""
    pc = config.parallel
    if pc.ep == 1:
        return
    spec = DISPATCHERS.lookup(pc.dispatcher)
    missing = spec.check()
    local = local_world_size(config)
    grid = rank_grid(pc, pc.world_size)
    for ep_ranks in grid.reshape(-1, pc.ep).tolist():  # init_layout's ep groups: the grid's last axis
        found = spec.violations(Launch(ep_ranks=tuple(ep_ranks), local_world_size=local))
        missing.extend(p for p in found if p not in missing)
    if missing:
        raise PreflightError(f"error: --dispatcher {pc.dispatcher}: {'; '.join(missing)}")


def check_checkpoint_dir(config: TrainConfig) -> None:
    """``checkpoint.dir`` is a directory (or can become one) and writable when the job saves."""
    ck = config.checkpoint
    if not ck.dir or not (ck.every or ck.resume):
        return
    path = Path(ck.dir)
    existing = next(p for p in (path, *path.parents) if p.exists())  # what a save's mkdir would start from
    if not existing.is_dir():
        raise PreflightError(f"error: --ckpt-dir {path}: {existing} is not a directory; pick another --ckpt-dir")
    if ck.every and not os.access(existing, os.W_OK | os.X_OK):
        raise PreflightError(f"error: --ckpt-dir {path}: {existing} is not writable; pick another --ckpt-dir")


def check_tensorboard(config: TrainConfig) -> None:
    """The optional ``tensorboard`` package, when the job writes event files."""
    if config.metrics.tensorboard_dir is None:
        return
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise PreflightError(
            "error: --tensorboard-dir needs the tensorboard package: pip install 'dualpipe-moe[tensorboard]'"
        ) from None

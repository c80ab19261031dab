"""One rank's runtime for any job over the pipeline (training, evaluation): its device, the default process
group, and the pipeline over its stages. :class:`moe.train.Trainer` and ``python -m moe.eval`` both build on it.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist

from dualpipe import PIPELINES, Pipeline
from moe.groups import with_timeout
from moe.models.stage import MoEStage
from moe.parallel import ParallelLayout, nccl_options

__all__ = ["RendezvousError", "init_process_group", "make_pipeline", "pick_device"]


class RendezvousError(SystemExit):
    """The launcher's rendezvous cannot start (a port in use); one line saying what to change."""


def pick_device() -> torch.device:
    """CUDA device ``LOCAL_RANK`` under a launcher, device 0 for a plain ``python``; the CPU otherwise, and
    whenever the caller made a process group without a launcher (tests' gloo ranks)."""
    launched = "LOCAL_RANK" in os.environ
    standalone = "RANK" not in os.environ and not dist.is_initialized()
    if torch.cuda.is_available() and (launched or standalone):
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_process_group(device: torch.device, timeout_s: float, reserved_sms: int) -> bool:
    """The default group unless the caller made one (returns whether this call made it); every collective
    waits at most ``timeout_s``. On NCCL it gets the layout's CTA cap ``reserved_sms`` (it carries the per-step
    loss and norm reductions). Without a launcher (a plain ``python``) it is a one-rank group over an
    in-memory store."""
    if dist.is_initialized():
        return False
    cuda = device.type == "cuda"
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = "nccl" if cuda else "gloo"
    if "RANK" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return True
    try:
        options = with_timeout(nccl_options(reserved_sms), timeout) if cuda else None
        dist.init_process_group(backend, timeout=timeout, pg_options=options)
    except dist.DistNetworkError as exc:
        if "EADDRINUSE" not in str(exc):
            raise
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        raise RendezvousError(f"error: the rendezvous port {where} is in use; set MASTER_PORT to a free port") from exc
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    return True


def make_pipeline(
    stages: Sequence[MoEStage],
    layout: ParallelLayout,
    *,
    micro_batch: int,
    seq_len: int,
    dtype: torch.dtype,
    timeout_s: float,
) -> Pipeline:
    """The schedule's pipeline (``layout.config.schedule``) over this rank's stages."""
    pc = layout.config
    pipe = PIPELINES[pc.schedule](
        list(stages), process_group=layout.pp_group, timeout=timeout_s, overlap=pc.overlap, extra_warmup=pc.extra_warmup
    )
    # Every stage boundary carries one hidden-state tensor per micro-batch: declaring it lets receives be
    # posted ahead of the compute that consumes them (no per-message shape header to wait for).
    pipe.set_p2p_tensor_shapes([(micro_batch, seq_len, stages[0].cfg.hidden_size)])
    pipe.set_p2p_tensor_dtype(dtype)
    return pipe

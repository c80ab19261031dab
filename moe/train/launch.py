"""The trainer as a command: flags and ``--config`` in, one line out for any mistake the user can fix.

``python -m moe.train`` and ``examples/train.py`` run :func:`cli`; tests call :func:`main` with a list of
flags inside ranks whose process group already exists.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch.distributed as dist

from moe.command import run_command
from moe.train.cli import config_from_args, dump_toml, world_size_from_env
from moe.train.trainer import Trainer

__all__ = ["cli", "main"]

DESCRIPTION = """Train an MoE transformer with a DualPipe-family pipeline and expert parallelism.

    torchrun --standalone --nproc-per-node 8 examples/train.py --pp 2 --dp 4 --ep 2 --zero 1 --steps 40
    python examples/train.py                                  # one process, the byte-level demo
    examples/train.py --config examples/configs/tiny.toml --lr 1e-3 --print-config

World size = pp x dp; ep divides dp (dp/ep expert replicas per stage). CPU ranks use gloo, CUDA ranks
NCCL. Every option is a field of a table of the TOML file (--section.field) and most have a short flag;
flags override the file. Rank 0 prints progress; --metrics-file gets one JSON line per step,
--tensorboard-dir TensorBoard event files. SIGINT (Ctrl-C) or SIGTERM stops every rank after the same step,
with a checkpoint when --ckpt-dir is set, and exits with status 128 + the signal's number. A failure the flags
or the machine cause is one line on rank 0 (--debug: every rank's traceback)."""


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv``, then train (or, with ``--print-config``, print the resolved TOML and return)."""
    argv = sys.argv[1:] if argv is None else argv
    if dist.is_initialized():
        world = dist.get_world_size()
    elif "WORLD_SIZE" in os.environ or "--print-config" not in argv:
        world = world_size_from_env()
    else:  # printing a job outside its launcher: the world it asks for
        world = None
    config, ns = config_from_args(argv, world, description=DESCRIPTION)
    if ns.print_config:
        if (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))) == 0:
            print(dump_toml(config), end="", flush=True)
        return
    trainer = Trainer(config)
    trainer.train()
    trainer.close()
    if trainer.stopped_by is not None:  # stopped cleanly on a signal: the status a shell gives a process it ended
        raise SystemExit(128 + int(trainer.stopped_by))


def _debug(argv: list[str]) -> bool:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--debug", "--fault.debug", action="store_true")
    return p.parse_known_args(argv)[0].debug


def cli(argv: list[str] | None = None) -> None:
    """:func:`main` as a command. Every rank meets a user-caused failure alike (flags, paths, packages, memory,
    a non-finite step: decided on all ranks together), so only global rank 0 prints its one line; the others
    exit with the same status, silently. ``--debug`` prints every rank's traceback instead. Real bugs keep
    theirs."""
    argv = sys.argv[1:] if argv is None else argv
    owned = not dist.is_initialized()  # the trainer makes the process group; the clean path releases it
    try:
        run_command(lambda: main(argv), debug=_debug(argv))
    except SystemExit:
        # A user-caused failure, met by every rank alike (nothing in flight), its message already printed:
        # release the group here rather than in the interpreter's exit, where a backend thread still running
        # can abort the process and turn the error's exit status into a signal.
        if owned and dist.is_initialized():
            dist.destroy_process_group()
        raise

"""How every ``python -m moe.*`` command ends on a user's mistake: one line, once.

A command's ``main`` raises ``SystemExit("error: ...")`` for a mistake in its flags, paths or data, decided
alike on every rank before any communication. :func:`run_command` prints that line on global rank 0 only (the
other ranks exit with the same status, silently) and exits 1; a plain exit status (argparse's ``--help``) and
real bugs keep their own behaviour.

Under torchrun the first worker to exit brings the others down (SIGTERM): a rank that fails a moment sooner
would end rank 0 before it has printed. So every failing rank, once it has printed what it prints, checks in
on torchrun's own store (the agent's, which every worker can reach) and waits for the others to check in,
for at most :data:`EXIT_WAIT_S` (a rank that did not fail never checks in); then they all exit together.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta

__all__ = ["EXIT_WAIT_S", "run_command"]

EXIT_WAIT_S = 15.0
"""How long a failing rank waits for the others to have printed before it exits (under torchrun only)."""


def run_command(main: Callable[[], object], *, debug: bool = False) -> None:
    """Run ``main``; a ``SystemExit`` carrying a message becomes that one line on rank 0 and exit status 1.
    ``debug``: print every rank's traceback instead."""
    try:
        main()
    except SystemExit as exc:
        if not isinstance(exc.code, str):
            raise
        if debug:
            traceback.print_exc()
            sys.stderr.flush()
        elif os.environ.get("RANK", "0") == "0":
            print(exc.code, file=sys.stderr, flush=True)
        _exit_together()
        raise SystemExit(1) from None


def _exit_together(wait_s: float = EXIT_WAIT_S) -> None:
    """Check in on torchrun's agent store and wait (bounded) until every rank of the world has; nothing outside
    torchrun, with one rank, or when the store cannot be reached (the exit goes on as before)."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    if world < 2 or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in env:
        return
    try:
        import torch.distributed as dist

        store = dist.TCPStore(
            env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=wait_s)
        )
        key = f"dualpipe_moe/failed/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        deadline = time.monotonic() + wait_s
        arrived = store.add(key, 1)
        while arrived < world and time.monotonic() < deadline:
            time.sleep(0.05)
            arrived = store.add(key, 0)
    except Exception:  # the store is a courtesy: never let it change how the command fails
        return

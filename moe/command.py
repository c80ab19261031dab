"""How every ``python -m moe.*`` command ends on a user's mistake: one line, once.

A command's ``main`` raises ``SystemExit("error: ...")`` for a mistake in its flags, paths or data, decided
alike on every rank before any communication. :func:`run_command` prints that line on global rank 0 only (the
other ranks exit with the same status, silently) and exits 1; a plain exit status (argparse's ``--help``) and
real bugs keep their own behaviour.

Under torchrun the first worker to exit brings the others down (SIGTERM): a rank that fails a moment sooner
would end rank 0 before it has printed. So a failing rank does not exit before the others have printed:
where torchrun shares its store with the workers, every failing rank checks in on it once it has printed and
waits for the rest to check in (a rank that did not fail never does); where it does not
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, as examples/launch/cluster_env.sh sets for restarts), the ranks
other than 0 wait and rank 0 exits once it has printed, which ends the others at once (with ``--debug``, rank 0
first gives them :data:`DEBUG_GRACE_S` to print their tracebacks). No wait is longer than :data:`EXIT_WAIT_S`.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from datetime import timedelta
from difflib import get_close_matches

__all__ = ["DEBUG_GRACE_S", "EXIT_WAIT_S", "did_you_mean", "run_command"]

EXIT_WAIT_S = 15.0
"""How long a failing rank waits at most for the others to have printed before it exits (under torchrun only)."""
DEBUG_GRACE_S = 3.0
"""With ``--debug`` and no shared store: how long rank 0 waits for the others' tracebacks before it exits."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``" (did you mean 'lr'?)"`` for the choice nearest ``word``, or ``""`` when none is near: the tail every
    one-line error about an unknown name carries."""
    near = get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {near[0]!r}?)" if near else ""


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
        _exit_together(debug=debug)
        raise SystemExit(1) from None


def _exit_together(wait_s: float = EXIT_WAIT_S, *, debug: bool = False) -> None:
    """Return once every failing rank has printed, as far as torchrun lets us know (the module docstring);
    at once outside torchrun or with one rank."""
    env = os.environ
    world = int(env.get("WORLD_SIZE", "1"))
    if world < 2 or "TORCHELASTIC_RUN_ID" not in env:
        return
    if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and _check_in(env, world, wait_s):
        return
    if env.get("RANK", "0") != "0":
        time.sleep(wait_s)  # torchrun ends this rank as soon as rank 0 exits
    elif debug:
        time.sleep(min(DEBUG_GRACE_S, wait_s))


def _check_in(env: os._Environ[str], world: int, wait_s: float) -> bool:
    """Check in on torchrun's agent store and wait (bounded) until every rank of the world has; False when the
    store cannot be reached (the caller falls back to waiting on rank 0)."""
    try:
        import torch.distributed as dist

        store = dist.TCPStore(
            env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=wait_s)
        )
        key = f"dualpipe_moe/failed/{env['TORCHELASTIC_RUN_ID']}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        deadline = time.monotonic() + wait_s
        arrived = store.add(key, 1)
        while arrived < world and time.monotonic() < deadline:
            time.sleep(0.05)
            arrived = store.add(key, 0)
    except Exception:  # the store is a courtesy: never let it change how the command fails
        return False
    return True

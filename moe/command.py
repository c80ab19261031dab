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

import argparse
import os
import sys
import time
import traceback
import typing
from collections.abc import Callable, Iterable
from datetime import timedelta
from difflib import get_close_matches

__all__ = ["DEBUG_GRACE_S", "EXIT_WAIT_S", "CommandParser", "UsageError", "did_you_mean", "run_command"]

EXIT_WAIT_S = 15.0
"""How long a failing rank waits at most for the others to have printed before it exits (under torchrun only)."""
DEBUG_GRACE_S = 3.0
"""With ``--debug`` and no shared store: how long rank 0 waits for the others' tracebacks before it exits."""


def did_you_mean(word: str, choices: Iterable[str], *, strip: str = "") -> str:
    """``" (did you mean 'lr'?)"`` for the choice nearest ``word``, or ``""`` when none is near: the tail every
    one-line error about an unknown name carries. ``strip``: leading characters the comparison leaves out
    (``"-"`` for flags, whose shared ``--`` would make ``--bogus`` look like ``--gpu``)."""
    by_core = {choice.lstrip(strip): choice for choice in choices}
    near = get_close_matches(word.lstrip(strip), list(by_core), n=1, cutoff=0.6)
    return f" (did you mean {by_core[near[0]]!r}?)" if near else ""


class UsageError(SystemExit):
    """A command-line or config-file mistake: one line (``"error: ..."``), printed once by :func:`run_command`."""


class CommandParser(argparse.ArgumentParser):
    """The argument parser of every ``python -m moe.*`` command: a mistake is one :class:`UsageError` line
    instead of argparse's usage block on every rank, and an unknown flag or choice names the nearest known one
    (``unrecognized arguments: --lrr 0.1 (did you mean '--lr'?)``). Subcommand parsers are of the same class."""

    def error(self, message: str) -> typing.NoReturn:
        tail = "" if message.endswith("?)") else " (see --help)"  # a suggestion already says what to do
        raise UsageError(f"error: {message}{tail}")

    def parse_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def,override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._nearest_flags(extras)}")
        return parsed

    def _nearest_flags(self, extras: list[str]) -> str:
        """``" (did you mean '--lr'?)"`` for the one unknown flag among ``extras``, ``" (--lrr: did you mean
        '--lr'?; ...)"`` for several; ``""`` when none is near a known flag."""
        flags = [a.split("=", 1)[0] for a in extras if a[:1] == "-" and a.lstrip("-")[:1].isalpha()]  # not -1
        known = self._option_strings()
        hints = {flag: did_you_mean(flag, known, strip="-") for flag in flags}
        hints = {flag: hint for flag, hint in hints.items() if hint}
        if len(flags) == 1:
            return hints.get(flags[0], "")
        return " (" + "; ".join(f"{flag}: {hint[2:-1]}" for flag, hint in hints.items()) + ")" if hints else ""

    def _check_value(self, action: argparse.Action, value: object) -> None:
        try:
            super()._check_value(action, value)  # type: ignore[misc]
        except argparse.ArgumentError as exc:
            if not isinstance(value, str) or action.choices is None:
                raise
            hint = did_you_mean(value, [str(c) for c in action.choices])
            raise argparse.ArgumentError(action, f"{exc.message}{hint}") from None

    def _option_strings(self) -> list[str]:
        """Every flag of this parser and of its subcommands' parsers (an unknown one reaches the top parser)."""
        flags = list(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():  # add_subparsers makes them of this class
                    flags += sub._option_strings()
        return flags


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

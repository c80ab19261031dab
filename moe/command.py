"""How every ``python -m moe.*`` command ends on a user's mistake: one line, once.

A command's ``main`` raises ``SystemExit("error: ...")`` for a mistake in its flags, paths or data, decided
alike on every rank before any communication. :func:`run_command` prints that line on global rank 0 only (the
other ranks exit with the same status, silently) and exits 1; a plain exit status (argparse's ``--help``) and
real bugs keep their own behaviour.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

__all__ = ["run_command"]


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
        elif os.environ.get("RANK", "0") == "0":
            print(exc.code, file=sys.stderr, flush=True)
        raise SystemExit(1) from None

"""Run a command and, whatever happens, leave none of its processes behind.

torchrun starts each worker in a session of its own, so killing torchrun (what ``subprocess.run`` does on
a timeout) or its process group leaves the workers running, for hours if they wait on a peer. The tree is
collected from /proc instead, before and after asking torchrun to stop its workers itself.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["descendants", "kill_tree", "run"]


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (children found through /proc, depth-first, bounded)."""
    found: list[int] = []
    todo = [pid]
    while todo and len(found) < 10_000:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = [int(k) for k in (task / "children").read_text().split()]
                found += kids
                todo += kids
    return found


def _alive(pid: int) -> bool:
    """Running, not a zombie waiting for its parent's wait() (a zombie still has a /proc entry)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def kill_tree(pid: int, grace_s: float = 3.0) -> None:
    """SIGTERM ``pid`` (torchrun then stops its workers), then SIGKILL whatever of its tree is left."""
    tree = [pid, *descendants(pid)]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in tree):
        time.sleep(0.05)
    for p in [*tree, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def run(argv: Sequence[str], *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kwargs)``, except that a
    timeout or an interrupt (Ctrl-C, a test framework's own timeout) kills the command's whole process
    tree before it propagates."""
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            kill_tree(proc.pid, grace_s=1.0)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)

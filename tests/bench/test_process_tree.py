"""bench.process_tree.run: a timeout kills the whole tree, workers in sessions of their own included (as
torchrun starts them)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench import process_tree

# a "launcher" that starts a worker in a new session (torchrun's way), says its pid, then waits on it forever
LAUNCHER = """
import subprocess, sys, time
w = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(w.pid, flush=True)
w.wait()
"""


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_timeout_kills_the_worker_in_its_own_session(tmp_path: Path) -> None:
    out = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        process_tree.run(
            [sys.executable, "-c", LAUNCHER.replace("flush=True", f"file=open({str(out)!r}, 'w'), flush=True")],
            timeout=3,
        )
    worker = int(out.read_text())
    deadline = time.monotonic() + 5
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(worker)


def test_a_finished_command_is_a_completed_process() -> None:
    done = process_tree.run([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "")

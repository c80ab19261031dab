"""Fault drills on examples/train.py: a non-finite step, a hung peer, launches the machine cannot serve.

(The killed rank that restarts from its checkpoint is in test_launch.py.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench import process_tree
from tests.examples.test_launch import ROOT, _env, _free_port
from tests.moe.train.test_trainer import COMMON

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
TRAIN = str(ROOT / "examples/train.py")


def _fails(argv: list[str], timeout: float = 120) -> str:
    """Run ``argv`` from the repository root; it must fail. Returns stdout + stderr."""
    done = process_tree.run(argv, env=_env(), cwd=ROOT, timeout=timeout)  # no worker outlives a timeout
    log = done.stdout + done.stderr
    assert done.returncode != 0, log[-3000:]
    return log


def _no_rank_traceback(log: str) -> bool:
    # torchrun prints its own traceback (ChildFailedError) after any failed worker; the ranks print none
    return 'train.py", line' not in log


def test_a_nonfinite_gradient_stops_the_run_and_no_checkpoint_holds_it(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    args = [*COMMON, "--pp", "2", "--ep", "1", "--steps", "4", "--ckpt-dir", str(ckpt), "--ckpt-every", "1"]
    log = _fails([*TORCHRUN, "--nproc-per-node", "2", TRAIN, *args, "--nan-at-step", "3"])
    # the drill puts the NaN in the last rank's first module: DualPipeV's stage 1 of 4 at pp=2
    line = "error: non-finite gradient at step 3, first in stage 1; stopped before its optimizer step"
    assert log.count(line) == 1, log[-3000:]
    assert _no_rank_traceback(log), log[-3000:]
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000001", "step_00000002"]
    assert (ckpt / "latest").read_text() == "step_00000002"
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(ckpt / "step_00000002", tmp_path / "flat.pt")
    state = torch.load(tmp_path / "flat.pt", weights_only=False)
    weights = [v for k, v in state.items() if k.startswith("model.") and v.is_floating_point()]
    assert weights and all(torch.isfinite(w).all() for w in weights)


def test_a_missing_data_path_is_one_line_and_debug_shows_the_traceback() -> None:
    argv = [*TORCHRUN, "--nproc-per-node", "2", TRAIN, "--pp", "2", "--ep", "1", "--data", "/nowhere/corpus"]
    log = _fails(argv)
    assert log.count("error: --data: /nowhere/corpus: no such file") == 1, log[-3000:]
    assert _no_rank_traceback(log), log[-3000:]
    debug = _fails([*argv, "--debug"])
    assert debug.count("in build_data") == 2, debug[-3000:]  # every rank's traceback


def test_a_taken_rendezvous_port_is_one_line() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        # torchrun's own rendezvous: the launch script checks the port before starting torchrun
        env = {**_env(), "NNODES": "1", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        script = ROOT / "examples/launch/torchrun_static.sh"
        done = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0
        assert done.stderr.strip().splitlines() == [
            f"error: port {port} is in use on this node (NODE_RANK=0 serves the rendezvous); set MASTER_PORT to "
            "a free one"
        ]
        # ranks started by another launcher (srun, env://): rank 0 serves the store itself
        env = {**_env(), "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        done = subprocess.run([sys.executable, TRAIN], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert done.returncode == 1
        message = f"error: the rendezvous port 127.0.0.1:{port} is in use; set MASTER_PORT to a free port"
        assert done.stderr.strip() == message


def test_a_stopped_peer_is_named_within_the_timeout() -> None:
    """SIGSTOP: a hung rank, not a dead one; its connections stay open, so only the timeout can end the wait."""
    timeout = 3.0
    port = str(_free_port())
    args = [*COMMON, "--pp", "2", "--ep", "1", "--steps", "4", "--timeout", str(timeout), "--stop-rank-at-step", "2"]
    procs = []
    for rank in (0, 1):
        env = {**_env(), "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        procs.append(
            subprocess.Popen(
                [sys.executable, TRAIN, *args],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        assert procs[1].stdout is not None
        for line in procs[1].stdout:  # rank 1 stops itself right after saying so
            if line.startswith("failure drill: stopping rank 1 at step 2"):
                break
        stopped = time.monotonic()
        log, _ = procs[0].communicate(timeout=60)
        waited = time.monotonic() - stopped
    finally:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.wait(timeout=30)
    assert procs[0].returncode != 0
    assert "PipelineCommError: pipeline rank waited in vain for" in log, log[-3000:]
    assert "from pipeline rank 1" in log, log[-3000:]
    assert timeout <= waited < timeout + 5, waited

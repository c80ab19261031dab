"""Launching on the emulated cluster: :class:`EmulatedCluster` builds the nodes (:mod:`bench.cluster.net`),
starts processes inside them and runs one torchrun per node; the job's result per node; killing a process
tree that torchrun spread over several sessions.

Ranks bind to their node's veth address (``GLOO_SOCKET_IFNAME=eth0`` in every node, see
:meth:`EmulatedCluster.node_env`); torchrun's ranks are node-major (node i holds ranks i*P .. i*P+P-1).
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from bench.cluster import net
from bench.cluster.net import ClusterConfig, ClusterError
from bench.process_tree import kill_tree

__all__ = ["EmulatedCluster", "JobResult", "NodeResult", "torchrun_argv"]

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, slots=True)
class NodeResult:
    """What one node's process of a job left behind."""

    node: int
    returncode: int | None
    """None when the job was killed at its timeout."""
    output: str
    """stdout and stderr, interleaved."""


@dataclass(frozen=True, slots=True)
class JobResult:
    """One process per node, e.g. a torchrun launcher."""

    nodes: list[NodeResult]
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.returncode == 0 for r in self.nodes)

    def raise_for_status(self) -> None:
        if self.ok:
            return
        what = f"timed out after {self.seconds:.0f} s" if self.timed_out else "failed"
        tails = "\n".join(f"--- node {r.node} (rc={r.returncode}) ---\n{r.output[-3000:]}" for r in self.nodes)
        raise ClusterError(f"cluster job {what}\n{tails}")


def torchrun_argv(
    *, nnodes: int, node_rank: int, nproc_per_node: int, master_addr: str, master_port: int, argv: list[str]
) -> list[str]:
    """One node's launcher; ``argv`` is what follows torchrun's options (a script and its arguments, or
    ``-m module ...``)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={nproc_per_node}",
        f"--master-addr={master_addr}",
        f"--master-port={master_port}",
        *argv,
    ]


# ---------------------------------------------------------------------------------------------- the cluster


class EmulatedCluster:
    """N shaped nodes on this machine; a context manager that always tears down what it built."""

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        self.tag = net.new_tag(self.config.prefix)
        self.nodes = net.node_specs(self.config, self.tag)
        self.delay_applied = False
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._lock_file: IO[str] | None = None
        self._next_port = 29500

    # lifecycle -------------------------------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def setup(self) -> None:
        net.check_prerequisites()
        self._lock_file = net.hold_lock(self.tag)
        try:
            with_delay = bool(self.config.delay) and self._netem_works()
            if self.config.delay and not with_delay:
                log.warning("netem is not available in this kernel: delay=%s ignored, tbf only", self.config.delay)
            self.delay_applied = with_delay
            for cmd in net.plan_setup(self.config, self.tag, with_delay=with_delay):
                if cmd[:3] == ["ip", "netns", "add"]:
                    self._created.append(cmd[3])  # recorded first: a half-built namespace is still removed
                net.run_cmd(cmd)
        except BaseException:
            self.teardown()
            raise

    def teardown(self) -> None:
        """Stop our processes, delete our namespaces (with them the bridge and veths), release the lock.
        Safe to call twice and after a failed setup."""
        for proc in self._procs:
            if proc.poll() is None:
                kill_tree(proc.pid, grace_s=1.0)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        self._procs.clear()
        for netns in reversed(self._created):
            net.delete_netns(netns)
        self._created.clear()
        if self._lock_file is not None:
            net.release_lock(self.tag, self._lock_file)
            self._lock_file = None

    def _netem_works(self) -> bool:
        probe = f"{self.tag}-n{self.config.nodes}"  # matches the stale pattern, so a crash here is cleaned too
        self._created.append(probe)
        ok = net.netem_works(probe)
        self._created.remove(probe)
        return ok

    # processes -------------------------------------------------------------------------------------------

    def node_env(self, node: int) -> dict[str, str]:
        """Environment that makes torch.distributed use the cluster's network on ``node``."""
        return {
            "GLOO_SOCKET_IFNAME": self.nodes[node].ifname,
            "MASTER_ADDR": self.nodes[0].address,
            "DUALPIPE_CLUSTER_NODE": str(node),
            "DUALPIPE_CLUSTER_NODES": str(len(self.nodes)),
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p),
        }

    def spawn(self, node: int, argv: list[str], env: dict[str, str] | None = None, **popen_kwargs) -> subprocess.Popen:
        """Start ``argv`` inside ``node``'s namespace with os.environ + node_env + ``env``. The process is
        killed at teardown if still running."""
        full_env = {**os.environ, **self.node_env(node), **(env or {})}
        popen_kwargs.setdefault("cwd", REPO_ROOT)
        proc = subprocess.Popen(["ip", "netns", "exec", self.nodes[node].netns, *argv], env=full_env, **popen_kwargs)
        self._procs.append(proc)
        return proc

    def run_torchrun(
        self,
        argv: list[str],
        *,
        nproc_per_node: int = 1,
        env: dict[str, str] | None = None,
        timeout: float = 120.0,
        master_port: int | None = None,
    ) -> JobResult:
        """One torchrun per node (static rendezvous on node 0), waited for at most ``timeout`` seconds; on
        timeout every launcher and its workers are killed. Ranks are node-major: node i holds ranks
        i*P .. i*P+P-1."""
        if master_port is None:
            # A fresh port per job: the previous job's store socket may linger in TIME_WAIT.
            master_port, self._next_port = self._next_port, self._next_port + 1
        procs: list[subprocess.Popen] = []
        timed_out = False
        start = time.monotonic()
        with contextlib.ExitStack() as files:
            logs = [files.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in self.nodes]
            try:
                for node, out in zip(self.nodes, logs):
                    cmd = torchrun_argv(
                        nnodes=len(self.nodes),
                        node_rank=node.index,
                        nproc_per_node=nproc_per_node,
                        master_addr=self.nodes[0].address,
                        master_port=master_port,
                        argv=argv,
                    )
                    procs.append(self.spawn(node.index, cmd, env, stdout=out, stderr=subprocess.STDOUT))
                for proc in procs:
                    try:
                        proc.wait(timeout=max(0.0, start + timeout - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        timed_out = True
                        break
            finally:
                for proc in procs:
                    if proc.poll() is None:
                        kill_tree(proc.pid)
                        proc.wait(timeout=5)
                    self._procs.remove(proc)
            results = []
            for i, (proc, out) in enumerate(zip(procs, logs)):
                out.seek(0)
                rc = None if timed_out else proc.returncode
                results.append(NodeResult(node=i, returncode=rc, output=out.read()))
        return JobResult(nodes=results, timed_out=timed_out, seconds=time.monotonic() - start)

    def qdisc_stats(self, node: int) -> dict[str, int]:
        """Counters of the shaping on ``node``'s link: bytes the node sent through its tbf, and packets
        dropped in either direction (nonzero drops mean the queue is too shallow: see :mod:`bench.cluster`)."""
        ours = net.tc_counters(self.nodes[node].netns, self.nodes[node].ifname)
        theirs = net.tc_counters(net.switch_netns(self.tag), f"p{node}")
        return {"sent_bytes": ours[0], "dropped": ours[1] + theirs[1]}

    def qdisc_bytes(self, node: int) -> int:
        """Bytes the shaping qdisc on ``node``'s egress has sent (tells shaped traffic from loopback)."""
        return self.qdisc_stats(node)["sent_bytes"]

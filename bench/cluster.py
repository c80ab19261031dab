"""An emulated multi-node cluster on one machine, for measuring how much all-to-all traffic compute hides.

On one host, ranks talk over loopback at memory speed, so async communication has nothing to hide behind
and "overlap" measures only CPU contention. Real clusters have a network that is slow next to compute.
This module rebuilds that gap: each "node" is a Linux network namespace whose one link (a veth pair) goes
to a Linux bridge that lives in a dedicated "switch" namespace; both directions of every link are shaped
with a ``tbf`` qdisc, so a node sends and receives at ``rate`` like a NIC.

    with EmulatedCluster(ClusterConfig(nodes=4, rate="400mbit")) as cluster:
        job = cluster.run_torchrun(["-m", "bench.overlap", "--steps", "10"], nproc_per_node=1, timeout=300)
        job.raise_for_status()
        print(job.nodes[0].output)

Why these choices:

* Everything lives in namespaces this module creates (node namespaces and the switch namespace): the root
  namespace gets no interface, address or route, and the addresses (10.213.0.0/24 by default) exist only
  inside the cluster. Nothing can leave the machine, and two clusters with the same addresses never meet
  (each has its own bridge). Teardown is deleting the namespaces: that removes the bridge and the veths.
* ``tbf`` with a deep queue (``burst 256kb latency 400ms``): tbf's ``latency`` is the longest a packet may
  wait in its queue, i.e. the queue length (400 ms at 400 Mbit/s is 20 MB, more than any all-to-all burst
  here). When the bursts of an all-to-all overflow a shallow queue, packets drop, TCP waits for
  retransmit timeouts (hundreds of ms) and the measured overlap can turn negative; the selftest prints the
  drop count so a run in that regime shows itself. A deep queue keeps TCP in its steady state, which is
  what a real fabric with flow control looks like. ``burst`` exceeds a 64 KB GSO segment, so big segments
  pass whole.
* The price of a deep queue: a loaded link delays everything behind its backlog, including gloo's small
  control messages on the same connection. That is the likely reason a 2-node gloo all-to-all often runs
  near half the line rate while raw TCP reaches it in both directions at once (measured: 6 MB each way in
  122-135 ms at 400 Mbit/s, ideal 120 ms; gloo's 12 MB all-to-all: 128 ms or 180-245 ms, bimodal).
* Latency emulation is tbf's queueing only: ``netem`` is not built into the kernel of the development
  machines. ``ClusterConfig.delay`` asks for netem's added one-way delay; when netem is missing the cluster
  logs a warning, shapes with tbf alone and reports ``delay_applied = False``.
* Ranks bind to their node's veth address (``GLOO_SOCKET_IFNAME=eth0`` in every node; gloo uses one
  interface for all of a rank's peers). Messages between two ranks of the same node go to that node's own
  address, which the kernel delivers through loopback: they never reach the shaped veth. The cluster test
  checks this by measurement (an intra-node transfer runs at loopback speed and leaves tbf's byte counter
  untouched).

Names carry a random suffix (``dpm-3fa9c1-n0``), so parallel and crashed runs never collide. A live cluster
holds an ``flock`` on a lock file; ``cleanup_stale`` removes only namespaces whose lock nobody holds.

``python -m bench.cluster --nodes 2 4 --rate 400mbit --selftest`` measures the hidden fraction of a gloo
``all_to_all_single`` against a matmul loop; ``python -m bench.cluster --cleanup`` removes leftovers.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "ClusterConfig",
    "ClusterError",
    "EmulatedCluster",
    "JobResult",
    "Node",
    "NodeResult",
    "check_prerequisites",
    "cleanup_stale",
    "plan_setup",
    "selftest",
]

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
NODE_IFNAME = "eth0"
"""The veth end inside every node namespace; names are per namespace, so every node uses the same one."""
LOCK_DIR = Path(tempfile.gettempdir()) / "dualpipe-cluster"
_CMD_TIMEOUT_S = 10.0
"""No single ip/tc command should take more than milliseconds; a hang means a broken kernel setup."""
_RESULT_MARKER = "DUALPIPE_SELFTEST_RESULT "


class ClusterError(RuntimeError):
    """The cluster cannot be built, or a command of its setup failed."""


@dataclass(kw_only=True, slots=True)
class ClusterConfig:
    """Shape of the emulated cluster."""

    nodes: int = 2
    """Number of nodes (network namespaces)."""
    rate: str | None = "400mbit"
    """tbf rate of each node's link, each direction (tc syntax); None leaves links unshaped."""
    burst: str = "256kb"
    """tbf bucket size: larger than a 64 KB GSO segment, so big segments pass unsplit at line rate."""
    latency: str = "400ms"
    """tbf queue length as time: deep, so all-to-all bursts queue instead of dropping (see module doc)."""
    delay: str | None = None
    """One-way delay added with netem (e.g. '1ms'), applied only where the kernel has netem."""
    subnet: str = "10.213.0.0/24"
    """Private range for node addresses; they exist only inside the cluster's namespaces."""
    prefix: str = "dpm"
    """Start of every namespace name; ``cleanup_stale`` looks for it."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"nodes={self.nodes} must be >= 1")
        net = ipaddress.ip_network(self.subnet)
        if not net.is_private:
            raise ValueError(f"subnet {self.subnet} is not a private range")
        if net.num_addresses - 2 < self.nodes:
            raise ValueError(f"subnet {self.subnet} has too few addresses for {self.nodes} nodes")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,15}", self.prefix):
            raise ValueError(f"prefix {self.prefix!r} must be 1-16 lowercase letters or digits")


@dataclass(frozen=True, slots=True)
class Node:
    """One emulated node: a namespace, its interface and address."""

    index: int
    netns: str
    ifname: str
    address: str
    prefixlen: int


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


# ---------------------------------------------------------------------------------------------- pure parts


def new_tag(prefix: str) -> str:
    """A fresh instance name, e.g. 'dpm-3fa9c1' (24 random bits: collisions need thousands of live runs)."""
    return f"{prefix}-{secrets.token_hex(3)}"


def node_specs(config: ClusterConfig, tag: str) -> list[Node]:
    net = ipaddress.ip_network(config.subnet)
    hosts = net.hosts()
    return [
        Node(index=i, netns=f"{tag}-n{i}", ifname=NODE_IFNAME, address=str(next(hosts)), prefixlen=net.prefixlen)
        for i in range(config.nodes)
    ]


def switch_netns(tag: str) -> str:
    return f"{tag}-sw"


def _shaping(netns: str, dev: str, config: ClusterConfig, *, with_delay: bool) -> list[list[str]]:
    """tc commands shaping the egress of ``dev`` in ``netns``; netem (if asked and usable) sits above tbf."""
    if config.rate is None and not (with_delay and config.delay):
        return []
    tbf = ["tbf", "rate", config.rate, "burst", config.burst, "latency", config.latency] if config.rate else []
    if with_delay and config.delay:
        cmds = [["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay", config.delay]]
        if tbf:
            cmds.append(["tc", "-n", netns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf])
        return cmds
    return [["tc", "-n", netns, "qdisc", "add", "dev", dev, "root", *tbf]]


def plan_setup(config: ClusterConfig, tag: str, *, with_delay: bool = False) -> list[list[str]]:
    """Every command that builds the cluster, in order. Each ``ip link``/``tc`` call names a namespace
    (``-n``): nothing is configured in the root namespace."""
    sw = switch_netns(tag)
    cmds = [
        ["ip", "netns", "add", sw],
        ["ip", "-n", sw, "link", "set", "lo", "up"],
        ["ip", "-n", sw, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", sw, "link", "set", "br0", "up"],
    ]
    for node in node_specs(config, tag):
        port = f"p{node.index}"
        cmds += [
            ["ip", "netns", "add", node.netns],
            ["ip", "-n", node.netns, "link", "set", "lo", "up"],
            # Created inside the switch namespace, the peer end born directly in the node's: no veth ever
            # appears in the root namespace, even for a moment.
            ["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", node.ifname, "netns", node.netns],
            ["ip", "-n", sw, "link", "set", port, "master", "br0"],
            ["ip", "-n", sw, "link", "set", port, "up"],
            ["ip", "-n", node.netns, "addr", "add", f"{node.address}/{node.prefixlen}", "dev", node.ifname],
            ["ip", "-n", node.netns, "link", "set", node.ifname, "up"],
            *_shaping(node.netns, node.ifname, config, with_delay=with_delay),  # node -> switch
            *_shaping(sw, port, config, with_delay=with_delay),  # switch -> node
        ]
    return cmds


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


def check_prerequisites() -> None:
    """Raise a ClusterError that says what to do when this process cannot build namespaces."""
    if os.geteuid() != 0:
        raise ClusterError(
            "the emulated cluster creates network namespaces, which needs root: run as root (e.g. with sudo)"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"{' and '.join(missing)} not found: install iproute2 (e.g. apt-get install iproute2)")


# ---------------------------------------------------------------------------------------------- processes


def _run(cmd: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"command hung: {' '.join(cmd)}") from e
    if check and proc.returncode != 0:
        raise ClusterError(f"command failed (rc={proc.returncode}): {' '.join(cmd)}\n{proc.stderr.strip()}")
    return proc


def _descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (children first found through /proc, depth-first, bounded)."""
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


def _kill_tree(pid: int, grace_s: float = 3.0) -> None:
    """SIGTERM ``pid`` (torchrun then stops its workers), then SIGKILL whatever of its tree is left.

    torchrun starts each worker in a new session, so a process-group kill would miss them: the tree is
    collected from /proc first."""
    tree = [pid, *_descendants(pid)]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_alive(p) for p in tree):
        time.sleep(0.05)
    for p in [*tree, *_descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def _netns_pids(netns: str) -> list[int]:
    proc = _run(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def _delete_netns(netns: str) -> None:
    """Kill what still runs in one of our namespaces (it would keep the namespace and its veth alive), then
    delete it."""
    for pid in _netns_pids(netns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    _run(["ip", "netns", "del", netns], check=False)


def _list_netns() -> list[str]:
    return [line.split()[0] for line in _run(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def cleanup_stale(prefix: str = "dpm") -> list[str]:
    """Delete namespaces of clusters whose owner died (no process holds their lock). Returns their names."""
    pattern = re.compile(rf"({re.escape(prefix)}-[0-9a-f]{{6}})-(sw|n\d+)")
    removed = []
    for netns in _list_netns():
        match = pattern.fullmatch(netns)
        if match is None:
            continue
        lock_path = LOCK_DIR / f"{match.group(1)}.lock"
        if lock_path.exists():
            with open(lock_path, "a") as f:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live cluster owns it
        _delete_netns(netns)
        removed.append(netns)
    for lock_path in LOCK_DIR.glob(f"{prefix}-*.lock"):
        tag = lock_path.name.removesuffix(".lock")
        if not any(n.startswith(f"{tag}-") for n in _list_netns()):
            with open(lock_path, "a") as f, contextlib.suppress(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                lock_path.unlink(missing_ok=True)
    return removed


# ---------------------------------------------------------------------------------------------- the cluster


class EmulatedCluster:
    """N shaped nodes on this machine; a context manager that always tears down what it built."""

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        self.tag = new_tag(self.config.prefix)
        self.nodes = node_specs(self.config, self.tag)
        self.delay_applied = False
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._lock_file = None
        self._next_port = 29500

    # lifecycle -------------------------------------------------------------------------------------------

    def __enter__(self) -> EmulatedCluster:
        self.setup()
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def setup(self) -> None:
        check_prerequisites()
        self._take_lock()
        try:
            with_delay = bool(self.config.delay) and self._netem_works()
            if self.config.delay and not with_delay:
                log.warning("netem is not available in this kernel: delay=%s ignored, tbf only", self.config.delay)
            self.delay_applied = with_delay
            for cmd in plan_setup(self.config, self.tag, with_delay=with_delay):
                if cmd[:3] == ["ip", "netns", "add"]:
                    self._created.append(cmd[3])  # recorded first: a half-built namespace is still removed
                _run(cmd)
        except BaseException:
            self.teardown()
            raise

    def _take_lock(self) -> None:
        """Hold ``<tag>.lock`` for our lifetime. A concurrent ``cleanup_stale`` may unlink the file between
        our open and our flock; then the lock we hold is on a dead inode, so open again (bounded)."""
        LOCK_DIR.mkdir(parents=True, exist_ok=True)
        path = LOCK_DIR / f"{self.tag}.lock"
        for _ in range(5):
            f = open(path, "w")  # noqa: SIM115 (held until teardown)
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                    self._lock_file = f
                    return
            f.close()
        raise ClusterError(f"could not hold {path}: something keeps deleting it")

    def teardown(self) -> None:
        """Stop our processes, delete our namespaces (with them the bridge and veths), release the lock.
        Safe to call twice and after a failed setup."""
        for proc in self._procs:
            if proc.poll() is None:
                _kill_tree(proc.pid, grace_s=1.0)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=5)
        self._procs.clear()
        for netns in reversed(self._created):
            _delete_netns(netns)
        self._created.clear()
        if self._lock_file is not None:
            (LOCK_DIR / f"{self.tag}.lock").unlink(missing_ok=True)
            self._lock_file.close()
            self._lock_file = None

    def _netem_works(self) -> bool:
        """Try netem in a scratch namespace of ours (deleted with the cluster)."""
        probe = f"{self.tag}-n{self.config.nodes}"  # matches the stale pattern, so a crash here is cleaned too
        self._created.append(probe)
        _run(["ip", "netns", "add", probe])
        ok = _run(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], check=False)
        _delete_netns(probe)
        self._created.remove(probe)
        return ok.returncode == 0

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
                        _kill_tree(proc.pid)
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
        dropped in either direction (nonzero drops mean the queue is too shallow: see module doc)."""
        ours = self._tc_counters(self.nodes[node].netns, self.nodes[node].ifname)
        theirs = self._tc_counters(switch_netns(self.tag), f"p{node}")
        return {"sent_bytes": ours[0], "dropped": ours[1] + theirs[1]}

    def qdisc_bytes(self, node: int) -> int:
        """Bytes the shaping qdisc on ``node``'s egress has sent (tells shaped traffic from loopback)."""
        return self.qdisc_stats(node)["sent_bytes"]

    @staticmethod
    def _tc_counters(netns: str, dev: str) -> tuple[int, int]:
        out = _run(["tc", "-n", netns, "-s", "qdisc", "show", "dev", dev]).stdout
        # The last qdisc printed is the innermost (tbf under netem); an unshaped link shows only noqueue.
        stats = re.findall(r"Sent (\d+) bytes \d+ pkt \(dropped (\d+)", out)
        return (int(stats[-1][0]), int(stats[-1][1])) if stats else (0, 0)


# ---------------------------------------------------------------------------------------------- selftest


@dataclass(kw_only=True, slots=True)
class SelftestOptions:
    """What each rank of the selftest measures."""

    mbytes: float = 12.0
    """all_to_all_single input per rank, in MB (10^6 bytes); (W-1)/W of it crosses the network."""
    repeats: int = 5
    """Timed repeats (after one warm-up); medians are reported."""
    matmul: int = 256
    """Side of the square fp32 matmuls of the compute loop; the loop is sized to last about t_comm."""


def _worker(opts: SelftestOptions) -> None:
    """One rank: time all-to-all alone, matmuls alone and both overlapped, interleaved per repeat."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # several ranks share two cores
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    numel = int(opts.mbytes * 1e6 / 4) // world * world
    x, y = torch.randn(numel), torch.empty(numel)
    a, b = torch.randn(opts.matmul, opts.matmul), torch.randn(opts.matmul, opts.matmul)

    def slowest(seconds: float) -> float:  # a step lasts as long as its slowest rank
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def timed(fn) -> float:
        dist.barrier()
        start = time.perf_counter()
        fn()
        return slowest(time.perf_counter() - start)

    def comm() -> None:
        dist.all_to_all_single(y, x)

    # Warm-up (connections, buffers, TCP windows), then size the matmul loop to last about as long as the
    # all-to-all: the hidden fraction is only informative when neither side dwarfs the other.
    for _ in range(2):
        timed(comm)
    t_comm0 = statistics.median(timed(comm) for _ in range(3))
    t_mm = statistics.median(timed(lambda: [a @ b for _ in range(50)]) for _ in range(3)) / 50
    iters = torch.tensor([max(1, round(t_comm0 / t_mm))])
    dist.all_reduce(iters, op=dist.ReduceOp.MAX)  # every rank runs the same loop

    def compute() -> None:
        for _ in range(int(iters)):
            a @ b

    def both() -> None:
        work = dist.all_to_all_single(y, x, async_op=True)
        compute()
        work.wait()

    rows = []
    for _ in range(opts.repeats):
        tc, tk, tb = timed(comm), timed(compute), timed(both)
        rows.append((tc, tk, tb, (tc + tk - tb) / min(tc, tk)))
    if dist.get_rank() == 0:
        med = [statistics.median(r[i] for r in rows) for i in range(4)]
        result = {
            "world": world,
            "mbytes": opts.mbytes,
            "matmuls": int(iters),
            "t_comm": med[0],
            "t_compute": med[1],
            "t_both": med[2],
            "hidden": med[3],
            "hidden_min": min(r[3] for r in rows),
            "hidden_max": max(r[3] for r in rows),
        }
        print(_RESULT_MARKER + json.dumps(result), flush=True)
    dist.destroy_process_group()


def selftest(
    config: ClusterConfig, *, nproc_per_node: int = 1, opts: SelftestOptions | None = None, timeout: float = 180.0
) -> dict[str, float]:
    """Build a cluster, run the overlap measurement on it, tear it down; return rank 0's medians."""
    opts = opts or SelftestOptions()
    args = ["-m", "bench.cluster", "--worker", f"--mbytes={opts.mbytes}", f"--repeats={opts.repeats}"]
    args.append(f"--matmul={opts.matmul}")
    with EmulatedCluster(config) as cluster:
        job = cluster.run_torchrun(args, nproc_per_node=nproc_per_node, env={"OMP_NUM_THREADS": "1"}, timeout=timeout)
        dropped = sum(cluster.qdisc_stats(i)["dropped"] for i in range(config.nodes))
    job.raise_for_status()
    for line in job.nodes[0].output.splitlines():
        if line.startswith(_RESULT_MARKER):
            result = json.loads(line[len(_RESULT_MARKER) :])
            return {"nodes": config.nodes, "ranks_per_node": nproc_per_node, **result, "dropped": dropped}
    raise ClusterError(f"selftest printed no result:\n{job.nodes[0].output[-3000:]}")


def _table(rows: list[dict[str, float]], rate: str | None) -> str:
    head = f"{'nodes':>5} {'ranks/n':>7} {'rate':>8} {'MB/rank':>7} {'t_comm ms':>9} {'t_comp ms':>9} "
    head += f"{'t_both ms':>9} {'hidden':>6} {'(min..max)':>12} {'drops':>6}"
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['nodes']:>5} {r['ranks_per_node']:>7} {rate or 'none':>8} {r['mbytes']:>7.1f} "
            f"{r['t_comm'] * 1e3:>9.0f} {r['t_compute'] * 1e3:>9.0f} {r['t_both'] * 1e3:>9.0f} "
            f"{r['hidden']:>6.2f} {r['hidden_min']:>5.2f}..{r['hidden_max']:<5.2f} {r['dropped']:>6}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n\n")[0])
    p.add_argument("--selftest", action="store_true", help="measure all-to-all overlap on 1+ cluster sizes")
    p.add_argument("--cleanup", action="store_true", help="remove namespaces left by killed runs")
    p.add_argument("--nodes", type=int, nargs="+", default=[2, 4], help="cluster sizes for --selftest")
    p.add_argument("--ranks-per-node", type=int, default=1)
    p.add_argument("--rate", default="400mbit", help="tbf rate per link direction ('none': unshaped)")
    p.add_argument("--latency", default="400ms", help="tbf queue length as time (keep it deep)")
    p.add_argument("--delay", default=None, help="netem one-way delay, if the kernel has netem")
    p.add_argument("--mbytes", type=float, default=12.0, help="all-to-all input per rank, MB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--matmul", type=int, default=256)
    p.add_argument("--timeout", type=float, default=180.0, help="seconds per cluster run")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    opts = SelftestOptions(mbytes=args.mbytes, repeats=args.repeats, matmul=args.matmul)
    if args.worker:
        _worker(opts)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.cleanup:
            check_prerequisites()
            removed = cleanup_stale()
            print(f"removed {len(removed)} stale namespace(s)" + (": " + " ".join(removed) if removed else ""))
        if args.selftest:
            rate = None if args.rate == "none" else args.rate
            rows = []
            for n in args.nodes:
                config = ClusterConfig(nodes=n, rate=rate, latency=args.latency, delay=args.delay)
                rows.append(selftest(config, nproc_per_node=args.ranks_per_node, opts=opts, timeout=args.timeout))
            print(_table(rows, rate))
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not (args.cleanup or args.selftest):
        p.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())

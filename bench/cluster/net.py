"""Namespaces and links of the emulated cluster: its shape, the commands that build it, the lock that marks
it live, the cleanup of dead ones and the shaping counters.

The pure parts (:func:`plan_setup`, :func:`node_specs`, names) run anywhere; the rest calls ``ip`` and
``tc`` and needs root. Every ``ip link``/``tc`` call names a namespace (``-n``): nothing is configured in
the root namespace. Why the shaping looks as it does: see :mod:`bench.cluster`.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

__all__ = [
    "LOCK_DIR",
    "NODE_IFNAME",
    "ClusterConfig",
    "ClusterError",
    "Node",
    "check_prerequisites",
    "cleanup_stale",
    "delete_netns",
    "hold_lock",
    "list_netns",
    "netem_works",
    "netns_pids",
    "new_tag",
    "node_specs",
    "plan_setup",
    "release_lock",
    "run_cmd",
    "switch_netns",
    "tc_counters",
]

NODE_IFNAME = "eth0"
"""The veth end inside every node namespace; names are per namespace, so every node uses the same one."""
LOCK_DIR = Path(tempfile.gettempdir()) / "dualpipe-cluster"
_CMD_TIMEOUT_S = 10.0
"""No single ip/tc command should take more than milliseconds; a hang means a broken kernel setup."""


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
    """tbf queue length as time: deep, so all-to-all bursts queue instead of dropping (see bench.cluster)."""
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


def check_prerequisites() -> None:
    """Raise a ClusterError that says what to do when this process cannot build namespaces."""
    if os.geteuid() != 0:
        raise ClusterError(
            "the emulated cluster creates network namespaces, which needs root: run as root (e.g. with sudo)"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(f"{' and '.join(missing)} not found: install iproute2 (e.g. apt-get install iproute2)")


# ---------------------------------------------------------------------------------------------- commands


def run_cmd(cmd: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ``ip``/``tc`` command; a failure (with ``check``) or a hang is a ClusterError."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"command hung: {' '.join(cmd)}") from e
    if check and proc.returncode != 0:
        raise ClusterError(f"command failed (rc={proc.returncode}): {' '.join(cmd)}\n{proc.stderr.strip()}")
    return proc


def netns_pids(netns: str) -> list[int]:
    proc = run_cmd(["ip", "netns", "pids", netns], check=False)
    return [int(p) for p in proc.stdout.split()] if proc.returncode == 0 else []


def delete_netns(netns: str) -> None:
    """Kill what still runs in one of our namespaces (it would keep the namespace and its veth alive), then
    delete it."""
    for pid in netns_pids(netns):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    run_cmd(["ip", "netns", "del", netns], check=False)


def list_netns() -> list[str]:
    return [line.split()[0] for line in run_cmd(["ip", "netns", "list"]).stdout.splitlines() if line.strip()]


def netem_works(probe: str) -> bool:
    """Try netem in a scratch namespace named ``probe`` (the caller records it, so a crash here is cleaned
    up with the cluster); the namespace is deleted again."""
    run_cmd(["ip", "netns", "add", probe])
    ok = run_cmd(["tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"], check=False)
    delete_netns(probe)
    return ok.returncode == 0


def tc_counters(netns: str, dev: str) -> tuple[int, int]:
    """``(bytes sent, packets dropped)`` by the shaping on ``dev``'s egress in ``netns``."""
    out = run_cmd(["tc", "-n", netns, "-s", "qdisc", "show", "dev", dev]).stdout
    # The last qdisc printed is the innermost (tbf under netem); an unshaped link shows only noqueue.
    stats = re.findall(r"Sent (\d+) bytes \d+ pkt \(dropped (\d+)", out)
    return (int(stats[-1][0]), int(stats[-1][1])) if stats else (0, 0)


# ---------------------------------------------------------------------------------------------- ownership


def hold_lock(tag: str) -> IO[str]:
    """Hold ``<tag>.lock`` for the cluster's lifetime (the open file is the hold). A concurrent
    ``cleanup_stale`` may unlink the file between our open and our flock; then the lock we hold is on a dead
    inode, so open again (bounded)."""
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    path = LOCK_DIR / f"{tag}.lock"
    for _ in range(5):
        f = open(path, "w")  # noqa: SIM115 (held until release_lock)
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                return f
        f.close()
    raise ClusterError(f"could not hold {path}: something keeps deleting it")


def release_lock(tag: str, f: IO[str]) -> None:
    (LOCK_DIR / f"{tag}.lock").unlink(missing_ok=True)
    f.close()


def cleanup_stale(prefix: str = "dpm") -> list[str]:
    """Delete namespaces of clusters whose owner died (no process holds their lock). Returns their names."""
    pattern = re.compile(rf"({re.escape(prefix)}-[0-9a-f]{{6}})-(sw|n\d+)")
    removed = []
    for netns in list_netns():
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
        delete_netns(netns)
        removed.append(netns)
    for lock_path in LOCK_DIR.glob(f"{prefix}-*.lock"):
        tag = lock_path.name.removesuffix(".lock")
        if not any(n.startswith(f"{tag}-") for n in list_netns()):
            with open(lock_path, "a") as f, contextlib.suppress(BlockingIOError):
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                lock_path.unlink(missing_ok=True)
    return removed

"""The emulated cluster: pure parts (command plans, names, errors) without root; the real thing under `cluster`.

The `cluster` tests build network namespaces, so they need root and DUALPIPE_CLUSTER_TESTS=1 (see conftest).
They measure instead of trusting the configuration: a shaped transfer must take at least about
bytes*8/rate, an intra-node one must bypass the shaped link, and teardown must leave no namespace.
"""

from __future__ import annotations

import fcntl
import re
import subprocess
import sys
import textwrap
import time

import pytest

from bench.cluster import ClusterConfig, ClusterError, EmulatedCluster, JobResult, NodeResult, launch, net

# ------------------------------------------------------------------------------------------ unit (no root)


def test_plan_shapes_both_directions_inside_namespaces_only():
    config = ClusterConfig(nodes=3, rate="400mbit")
    plan = net.plan_setup(config, "dpm-abc123")
    for cmd in plan:
        if cmd[0] == "tc" or cmd[:2] == ["ip", "-n"]:
            assert cmd[1] == "-n" and cmd[2].startswith("dpm-abc123-"), cmd
        else:
            assert cmd[:3] == ["ip", "netns", "add"], f"touches the root namespace: {cmd}"
    tbf = [cmd for cmd in plan if "tbf" in cmd]
    assert len(tbf) == 2 * 3  # node egress + switch-port egress, per node
    for cmd in tbf:
        assert cmd[cmd.index("tbf") :] == ["tbf", "rate", "400mbit", "burst", "256kb", "latency", "400ms"]
    assert {(cmd[2], cmd[cmd.index("dev") + 1]) for cmd in tbf} == {
        *((f"dpm-abc123-n{i}", "eth0") for i in range(3)),
        *(("dpm-abc123-sw", f"p{i}") for i in range(3)),
    }
    addrs = [cmd[5] for cmd in plan if cmd[3:5] == ["addr", "add"]]
    assert addrs == ["10.213.0.1/24", "10.213.0.2/24", "10.213.0.3/24"]
    # Loopback is brought up in every namespace and never shaped.
    assert sum(cmd[3:] == ["link", "set", "lo", "up"] for cmd in plan) == 4
    assert not any("lo" in cmd for cmd in plan if cmd[0] == "tc")


def test_plan_without_rate_has_no_qdisc_and_delay_stacks_netem_over_tbf():
    assert not [cmd for cmd in net.plan_setup(ClusterConfig(nodes=2, rate=None), "dpm-000000") if cmd[0] == "tc"]
    plan = net.plan_setup(ClusterConfig(nodes=1, delay="2ms"), "dpm-000000", with_delay=True)
    tc = [cmd[3:] for cmd in plan if cmd[0] == "tc" and cmd[2] == "dpm-000000-n0"]
    tbf = ["tbf", "rate", "400mbit", "burst", "256kb", "latency", "400ms"]
    assert tc == [
        ["qdisc", "add", "dev", "eth0", "root", "handle", "1:", "netem", "delay", "2ms"],
        ["qdisc", "add", "dev", "eth0", "parent", "1:1", "handle", "10:", *tbf],
    ]
    # Without a usable netem (with_delay=False) a requested delay falls back to tbf alone.
    plan = net.plan_setup(ClusterConfig(nodes=1, delay="2ms"), "dpm-000000", with_delay=False)
    assert not any("netem" in cmd for cmd in plan)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"nodes": 0}, "nodes"),
        ({"subnet": "8.8.8.0/24"}, "private"),
        ({"nodes": 3, "subnet": "10.213.0.0/30"}, "too few"),
        ({"prefix": "Bad-Prefix"}, "prefix"),
    ],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ClusterConfig(**kwargs)


def test_names_are_unique_per_instance():
    # 24 random bits: 64 draws collide with probability ~1e-4 (500 did ~0.7% of runs, a flaky test).
    tags = {net.new_tag("dpm") for _ in range(64)}
    assert len(tags) == 64
    assert all(re.fullmatch(r"dpm-[0-9a-f]{6}", t) for t in tags)
    a, b = EmulatedCluster(ClusterConfig(nodes=2)), EmulatedCluster(ClusterConfig(nodes=2))
    names_a = {n.netns for n in a.nodes} | {net.switch_netns(a.tag)}
    names_b = {n.netns for n in b.nodes} | {net.switch_netns(b.tag)}
    assert len(names_a) == 3 and not names_a & names_b


def test_torchrun_argv_and_node_env():
    argv = launch.torchrun_argv(
        nnodes=4, node_rank=2, nproc_per_node=2, master_addr="10.213.0.1", master_port=29555, argv=["-m", "x", "--a"]
    )
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert argv[3:] == [
        "--nnodes=4",
        "--node-rank=2",
        "--nproc-per-node=2",
        "--master-addr=10.213.0.1",
        "--master-port=29555",
        "-m",
        "x",
        "--a",
    ]
    env = EmulatedCluster(ClusterConfig(nodes=3)).node_env(2)
    assert env["GLOO_SOCKET_IFNAME"] == "eth0" and env["MASTER_ADDR"] == "10.213.0.1"
    assert env["DUALPIPE_CLUSTER_NODE"] == "2" and env["DUALPIPE_CLUSTER_NODES"] == "3"


def test_not_root_is_a_clear_error_and_builds_nothing(monkeypatch):
    monkeypatch.setattr(net.os, "geteuid", lambda: 1000)

    def no_commands(*args, **kwargs):
        raise AssertionError(f"ran a command without root: {args}")

    monkeypatch.setattr(net.subprocess, "run", no_commands)
    with pytest.raises(ClusterError, match="needs root: run as root"), EmulatedCluster(ClusterConfig()):
        pass


def test_missing_iproute2_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(net.os, "geteuid", lambda: 0)
    monkeypatch.setattr(net.shutil, "which", lambda tool: None if tool == "tc" else f"/usr/sbin/{tool}")
    with pytest.raises(ClusterError, match="tc not found: install iproute2"):
        net.check_prerequisites()


def test_job_result_status():
    good = JobResult(nodes=[NodeResult(node=0, returncode=0, output="")], timed_out=False, seconds=1.0)
    good.raise_for_status()
    bad = JobResult(nodes=[NodeResult(node=0, returncode=1, output="Traceback: boom")], timed_out=False, seconds=1.0)
    with pytest.raises(ClusterError, match="boom"):
        bad.raise_for_status()
    late = JobResult(nodes=[NodeResult(node=0, returncode=None, output="")], timed_out=True, seconds=9.0)
    assert not late.ok


def test_cleanup_stale_spares_locked_clusters(monkeypatch, tmp_path):
    listed = ["dpm-aaaaaa-n0", "dpm-aaaaaa-sw", "dpm-bbbbbb-n0", "dpm-cccccc-n1", "other-ns", "dpm-zz-n0"]
    deleted = []
    monkeypatch.setattr(net, "LOCK_DIR", tmp_path)
    monkeypatch.setattr(net, "list_netns", lambda: [n for n in listed if n not in deleted])
    monkeypatch.setattr(net, "delete_netns", deleted.append)
    (tmp_path / "dpm-cccccc.lock").touch()  # owner died: lock file left, nobody holds it
    with open(tmp_path / "dpm-bbbbbb.lock", "w") as live:
        fcntl.flock(live, fcntl.LOCK_EX | fcntl.LOCK_NB)
        removed = net.cleanup_stale("dpm")
    assert removed == deleted == ["dpm-aaaaaa-n0", "dpm-aaaaaa-sw", "dpm-cccccc-n1"]
    assert not (tmp_path / "dpm-cccccc.lock").exists()
    assert (tmp_path / "dpm-bbbbbb.lock").exists()


def test_qdisc_counters_read_the_innermost_qdisc(monkeypatch):
    shown = (
        "qdisc netem 1: root refcnt 2 limit 1000 delay 2ms\n"
        " Sent 9000 bytes 10 pkt (dropped 1, overlimits 0 requeues 0)\n"
        "qdisc tbf 10: parent 1:1 rate 400Mbit burst 256Kb lat 400ms\n"
        " Sent 8000 bytes 9 pkt (dropped 3, overlimits 5 requeues 0)\n"
    )
    monkeypatch.setattr(net, "run_cmd", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, shown, ""))
    assert net.tc_counters("ns", "eth0") == (8000, 3)
    monkeypatch.setattr(net, "run_cmd", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 0, "", ""))
    assert net.tc_counters("ns", "eth0") == (0, 0)


# ------------------------------------------------------------------------------------------ cluster (root)

# Receiver: accept one connection, read N bytes, answer one byte. Sender: send N bytes, wait for the
# answer, print seconds. Plain sockets: starts in milliseconds, unlike torch.
_XFER = textwrap.dedent(
    """
    import socket, sys, time
    mode, addr, port, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    if mode == "recv":
        srv = socket.create_server((addr, port))
        srv.settimeout(20)
        print("ready", flush=True)
        conn, _ = srv.accept()
        conn.settimeout(20)
        got = 0
        while got < n:
            chunk = conn.recv(1 << 20)
            if not chunk:
                break
            got += len(chunk)
        conn.sendall(b"k")
        print(got, flush=True)
    else:
        conn = socket.create_connection((addr, port), timeout=20)
        start = time.perf_counter()
        conn.sendall(b"x" * n)
        assert conn.recv(1) == b"k"
        print(time.perf_counter() - start, flush=True)
    """
)

_ALL_REDUCE = textwrap.dedent(
    """
    import os, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    assert t.item() == world * (world + 1) / 2, t
    print(f"rank {rank}/{world} node {os.environ['DUALPIPE_CLUSTER_NODE']} sum {t.item():.0f}", flush=True)
    dist.destroy_process_group()
    """
)


def _transfer(cluster: EmulatedCluster, script: str, src: int, dst: int, nbytes: int, port: int) -> float:
    """Seconds to send ``nbytes`` from node ``src`` to node ``dst``'s address over TCP."""
    addr = cluster.nodes[dst].address
    args = [addr, str(port), str(nbytes)]
    recv = cluster.spawn(dst, [sys.executable, script, "recv", *args], stdout=subprocess.PIPE)
    try:
        assert recv.stdout.readline().strip() == b"ready"
        send = cluster.spawn(src, [sys.executable, script, "send", *args], stdout=subprocess.PIPE)
        out, _ = send.communicate(timeout=20)
        assert send.returncode == 0
        assert int(recv.communicate(timeout=5)[0]) == nbytes
        return float(out)
    finally:
        recv.kill()


def _netns_names() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout


@pytest.mark.cluster
def test_links_connect_shape_and_keep_intra_node_traffic_off_the_wire(tmp_path):
    script = tmp_path / "xfer.py"
    script.write_text(_XFER)
    nbytes, rate_bps = 4_000_000, 100e6
    floor = nbytes * 8 / rate_bps  # 0.32 s: no faster than the configured rate
    with EmulatedCluster(ClusterConfig(nodes=2, rate="100mbit")) as cluster:
        tag = cluster.tag
        assert all(n.netns in _netns_names() for n in cluster.nodes)
        there = _transfer(cluster, str(script), 0, 1, nbytes, 5001)
        back = _transfer(cluster, str(script), 1, 0, nbytes, 5002)
        for t in (there, back):
            assert 0.8 * floor <= t <= 5 * floor + 1.0, f"{t:.3f} s for {nbytes} B at 100mbit (floor {floor:.3f})"
        # Two ranks of one node talk over the node's own address: the kernel delivers it through loopback,
        # so it is neither counted by the node's tbf nor held to its rate.
        shaped_before = cluster.qdisc_bytes(0)
        local = _transfer(cluster, str(script), 0, 0, nbytes, 5003)
        assert cluster.qdisc_bytes(0) - shaped_before < 64_000
        assert local < floor / 4, f"intra-node {local:.3f} s: went through the shaped link?"
    assert tag not in _netns_names()
    assert not (net.LOCK_DIR / f"{tag}.lock").exists()


@pytest.mark.cluster
def test_torchrun_gloo_job_spans_nodes(tmp_path):
    script = tmp_path / "all_reduce.py"
    script.write_text(_ALL_REDUCE)
    with EmulatedCluster(ClusterConfig(nodes=2)) as cluster:
        job = cluster.run_torchrun([str(script)], nproc_per_node=2, env={"OMP_NUM_THREADS": "1"}, timeout=60)
    job.raise_for_status()
    out = "".join(r.output for r in job.nodes)
    for rank in range(4):
        assert f"rank {rank}/4 node {rank // 2} sum 10" in out


@pytest.mark.cluster
def test_timeout_kills_the_job_and_errors_still_tear_down(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import time\ntime.sleep(120)\n")
    with pytest.raises(RuntimeError, match="inside"), EmulatedCluster(ClusterConfig(nodes=2)) as cluster:
        tag = cluster.tag
        start = time.monotonic()
        job = cluster.run_torchrun([str(script)], timeout=4)
        assert job.timed_out and not job.ok and time.monotonic() - start < 20
        for node in cluster.nodes:  # launchers and workers are gone, not just orphaned
            assert net.netns_pids(node.netns) == []
        raise RuntimeError("an error inside the with-block")
    assert tag not in _netns_names()


@pytest.mark.cluster
def test_failed_setup_and_stale_namespaces_are_removed(monkeypatch):
    real_plan = net.plan_setup
    monkeypatch.setattr(net, "plan_setup", lambda *a, **k: [*real_plan(*a, **k), ["ip", "link", "nonsense"]])
    broken = EmulatedCluster(ClusterConfig(nodes=2))
    with pytest.raises(ClusterError, match="nonsense"):
        broken.setup()
    assert broken.tag not in _netns_names()
    monkeypatch.undo()

    stale = f"{net.new_tag('dpm')}-n0"  # what a killed run leaves: a namespace and no lock holder
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=10)
    with EmulatedCluster(ClusterConfig(nodes=1)) as live:
        removed = net.cleanup_stale("dpm")
        assert stale in removed
        assert not any(n.startswith(live.tag) for n in removed)
        assert live.nodes[0].netns in _netns_names()
    assert stale not in _netns_names()

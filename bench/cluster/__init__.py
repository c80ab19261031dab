"""An emulated multi-node cluster on one machine, for measuring how much all-to-all traffic compute hides.

On one host, ranks talk over loopback at memory speed, so async communication has nothing to hide behind
and "overlap" measures only CPU contention. Real clusters have a network that is slow next to compute.
This package rebuilds that gap: each "node" is a Linux network namespace whose one link (a veth pair) goes
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

Modules: :mod:`bench.cluster.net` (the shape, the ``ip``/``tc`` plan, locks, cleanup, shaping counters),
:mod:`bench.cluster.launch` (:class:`EmulatedCluster`, processes inside the nodes, torchrun per node),
:mod:`bench.cluster.selftest` (the overlap measurement) and ``__main__`` (the command line).

``python -m bench.cluster --nodes 2 4 --rate 400mbit --selftest`` measures the hidden fraction of a gloo
``all_to_all_single`` against a matmul loop; ``python -m bench.cluster --cleanup`` removes leftovers.
"""

from __future__ import annotations

from bench.cluster.launch import EmulatedCluster, JobResult, NodeResult
from bench.cluster.net import ClusterConfig, ClusterError, Node, check_prerequisites, cleanup_stale, plan_setup
from bench.cluster.selftest import SelftestOptions, selftest

__all__ = [
    "ClusterConfig",
    "ClusterError",
    "EmulatedCluster",
    "JobResult",
    "Node",
    "NodeResult",
    "SelftestOptions",
    "check_prerequisites",
    "cleanup_stale",
    "plan_setup",
    "selftest",
]

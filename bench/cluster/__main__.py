"""``python -m bench.cluster``: the selftest over one or more cluster sizes, and the cleanup of leftovers."""

from __future__ import annotations

import argparse
import logging
import sys

import bench.cluster
from bench.cluster.net import ClusterConfig, ClusterError, check_prerequisites, cleanup_stale
from bench.cluster.selftest import SelftestOptions, selftest, table, worker


def main(argv: list[str] | None = None) -> int:
    description = bench.cluster.__doc__.split("\n\n")[0]
    p = argparse.ArgumentParser(prog="python -m bench.cluster", description=description)
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
        worker(opts)
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
            print(table(rows, rate))
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not (args.cleanup or args.selftest):
        p.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The cluster's selftest: how much of a gloo ``all_to_all_single`` hides behind a matmul loop.

:func:`selftest` builds a cluster, runs :func:`worker` on every rank through torchrun
(``python -m bench.cluster --worker``), tears the cluster down and returns rank 0's medians with the
shaping's drop count (nonzero drops: the queue is too shallow, see :mod:`bench.cluster`).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass

from bench.cluster.launch import EmulatedCluster
from bench.cluster.net import ClusterConfig, ClusterError

__all__ = ["SelftestOptions", "selftest", "table", "worker"]

_RESULT_MARKER = "DUALPIPE_SELFTEST_RESULT "


@dataclass(kw_only=True, slots=True)
class SelftestOptions:
    """What each rank of the selftest measures."""

    mbytes: float = 12.0
    """all_to_all_single input per rank, in MB (10^6 bytes); (W-1)/W of it crosses the network."""
    repeats: int = 5
    """Timed repeats (after one warm-up); medians are reported."""
    matmul: int = 256
    """Side of the square fp32 matmuls of the compute loop; the loop is sized to last about t_comm."""


def worker(opts: SelftestOptions) -> None:
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


def table(rows: list[dict[str, float]], rate: str | None) -> str:
    """The selftest results, a line per cluster size."""
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

"""Run a test body on N CPU ranks over gloo, with tracebacks from children and a hard deadline.

    results = run_ranks(fn, world_size=4, args=(...,), timeout=60)

``fn(rank, world_size, *args)`` runs in a fresh process per rank with the default process group already
initialised (gloo, file rendezvous, so no ports are taken). Its return value (tensors included, copied)
comes back in ``results[rank]``. If any rank raises, the others are killed and :class:`RankFailure` carries the child's
formatted traceback; if the ranks do not finish within ``timeout`` seconds (a deadlock), all are killed
and :class:`RankTimeout` says which ranks were still running.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["RankFailure", "RankTimeout", "exit_message", "run_ranks"]


class RankFailure(AssertionError):
    """A rank raised; the message holds its traceback."""


class RankTimeout(AssertionError):
    """Ranks did not finish in time (a deadlock or a hang)."""


PRELOAD = [
    "torch", "torch.distributed", "torch.distributed.pipelining", "tests.distributed",
    "moe", "moe.train.trainer", "moe.eval", "moe.hf", "kernels.ops", "kernels.functional", "transformers",
]  # fmt: skip


def _context() -> mp.context.BaseContext:
    # forkserver: children fork from a clean server that has imported torch once (fast start, and no
    # inherited OpenMP or process-group state from the pytest process). It imports what rank bodies use too
    # (1-3 s of CPU per rank otherwise: test_ep and test_pipeline took 90 CPU-seconds, now 48); none of it reads
    # the environment at import time except Triton (TRITON_INTERPRET, set by the root conftest before this).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    init_file: str,
    args: tuple,
    env: dict[str, str],
    pg_timeout: float,
    backend: str,
    out: mp.Queue,
) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    ok = False
    try:
        torch.set_num_threads(1)
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout),
        )
        result = fn(rank, world_size, *args)
        # Plain pickle copies tensors by value; the queue's own pickler would share their storage through
        # file descriptors that die with this process.
        out.put((rank, True, pickle.dumps(result)))
        ok = True
    except BaseException:
        # Reported before the process group closes, so the root cause reaches the parent before the
        # "connection closed" errors it causes on the peers.
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            if ok:
                # No rank closes its connections while a peer may still be connecting a group with it
                # (gloo's full-mesh setup reads "connection closed by peer" otherwise). A failed peer never
                # gets here: the parent kills the ranks still waiting.
                with contextlib.suppress(Exception):
                    dist.barrier()
            dist.destroy_process_group()


# Errors that usually only echo another rank's failure (its connections closed under us).
_ECHOES = ("Connection closed by peer", "Connection reset by peer", "PipelineCommError")


def _failure_report(failures: dict[int, str]) -> str:
    ranked = sorted(failures.items(), key=lambda kv: (any(e in kv[1] for e in _ECHOES), kv[0]))
    first, rest = ranked[0], ranked[1:]
    report = f"rank {first[0]} raised:\n{first[1]}"
    for rank, tb in rest:
        report += f"\n(rank {rank} also failed: {tb.strip().splitlines()[-1]})"
    return report


def _collect_failures(out: mp.Queue, failures: dict[int, str], grace: float) -> dict[int, str]:
    """Gather the other ranks' reports for ``grace`` seconds after the first failure."""
    end = time.monotonic() + grace
    while (left := end - time.monotonic()) > 0:
        try:
            rank, ok, payload = out.get(timeout=left)
        except queue.Empty:
            break
        if not ok:
            failures[rank] = payload
    return failures


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: tuple = (),
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    pg_timeout: float | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the per-rank results.

    ``fn`` and ``args`` must be picklable (module-level functions). ``pg_timeout`` bounds every collective
    and P2P wait inside the ranks (defaults to ``timeout``). ``backend="nccl"`` puts rank r on GPU r.
    """
    ctx = _context()
    out: mp.Queue = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="dualpipe-ranks-") as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_child,
                args=(fn, r, world_size, init_file, args, env or {}, pg_timeout or timeout, backend, out),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(results) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(results))
                    raise RankTimeout(f"ranks {missing} did not finish within {timeout:.0f}s (deadlock?)")
                try:
                    rank, ok, payload = out.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                    if dead:
                        raise RankFailure(
                            f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode} "
                            "before reporting (crash or kill)"
                        ) from None
                    continue
                if not ok:
                    raise RankFailure(_failure_report(_collect_failures(out, {rank: payload}, grace=2.0)))
                results[rank] = pickle.loads(payload)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=10)
    return [results[r] for r in range(world_size)]


def exit_message(rank: int, world: int, module: str, argv: list[str]) -> str:
    """A rank body for :func:`run_ranks`: ``module.main(argv)`` (a command's entry point, e.g. ``moe.train``),
    returning the message it exits with (``"no error"`` when it returns)."""
    import importlib

    try:
        importlib.import_module(module).main(argv)
    except SystemExit as exc:
        return str(exc.code)
    return "no error"

"""Bad input gets a clear ValueError before any communication; a failing rank never hangs its peers."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist
from torch import nn

from dualpipe import DualPipe, DualPipeV, OneFOneB, PipelineCommError, set_p2p_tensor_shapes
from dualpipe.p2p import wait_work
from tests.distributed import RankFailure, run_ranks
from tests.dualpipe.toy import NoInputGrad, ToyStage, ToyStageOverlap, criterion, make_stages

H = 4


def _expect(exc_type: type[BaseException], fn) -> str:
    try:
        fn()
    except exc_type as exc:
        return str(exc)
    raise AssertionError(f"expected {exc_type.__name__}")


def _local_errors(rank: int, world: int) -> dict[str, str]:
    """Errors every rank detects on its own (no peer is contacted, so no rank can hang)."""
    stages = make_stages(2, H, seed=0)
    pipe = DualPipeV(stages, timeout=20)
    x = torch.randn(8, 3, H, dtype=torch.float64)
    msgs = {}
    msgs["chunks"] = _expect(
        ValueError, lambda: pipe.step(x, num_chunks=2 * world - 1, criterion=criterion, labels=(x,))
    )
    if rank == 0:
        msgs["criterion"] = _expect(ValueError, lambda: pipe.step(x, num_chunks=2 * world, labels=(x,)))
        msgs["inputs"] = _expect(ValueError, lambda: pipe.step(num_chunks=2 * world, criterion=criterion))
    msgs["one_module"] = _expect(ValueError, lambda: DualPipeV(stages[:1]))
    if world % 2 == 1:
        msgs["odd"] = _expect(ValueError, lambda: DualPipe(stages))
    msgs["mapping"] = _expect(ValueError, lambda: DualPipeV(stages, rank_mapping=[world] * world))
    mixed = [ToyStage(H).double(), ToyStage(H).to("meta")]
    msgs["devices"] = _expect(ValueError, lambda: DualPipeV(mixed))
    dist.barrier()
    return msgs


@pytest.mark.parametrize("world", [1, 3])
def test_local_errors_are_clear(world: int) -> None:
    results = run_ranks(_local_errors, world, timeout=120)
    msgs = results[0]
    assert f"num_chunks >= 2 * ranks = {2 * world}" in msgs["chunks"]
    assert "pass criterion" in msgs["criterion"]
    assert "pass the batch inputs" in msgs["inputs"]
    assert "takes 2 module(s) per rank" in msgs["one_module"]
    assert "permutation" in msgs["mapping"]
    assert "one device" in msgs["devices"]
    if world == 3:
        assert "even number of pipeline ranks" in msgs["odd"]


def _one_rank_fails(rank: int, world: int, what: str) -> tuple[str, str, float]:
    import time

    stages = make_stages(2, H, seed=0)
    pipe = DualPipeV(stages, timeout=3)
    batch = 7 if what.startswith("batch") else 8  # 7 rows do not split into 4 micro-batches
    x = torch.randn(batch, 3, H, dtype=torch.float64)
    if what == "shapes":
        pipe.set_p2p_tensor_shapes([(2, 5, H)])  # the stages really produce (2, 3, H)
        pipe.set_p2p_tensor_dtype(torch.float64)
    start = time.monotonic()
    try:
        pipe.step(*((x,) if rank == 0 else ()), num_chunks=4, criterion=criterion, labels=(x,) if rank == 0 else ())
    except (ValueError, PipelineCommError) as exc:
        if what == "batch-stays-alive" and rank == 0:
            time.sleep(10)  # the failed rank keeps its connections open: the peer must rely on the timeout
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok", "", time.monotonic() - start


@pytest.mark.parametrize("what", ["batch", "batch-stays-alive", "shapes"])
def test_a_failing_rank_does_not_hang_its_peer(what: str) -> None:
    (kind0, msg0, _), (kind1, msg1, waited) = run_ranks(_one_rank_fails, 2, args=(what,), timeout=90)
    assert kind0 == "ValueError"
    # The peer gives up when the failed rank's connection closes, or at the pipeline's 3 s timeout.
    assert waited < 8, f"peer waited {waited:.1f}s"
    if what.startswith("batch"):
        assert "not divisible into 4 micro-batches" in msg0
    else:
        assert "was declared (set_p2p_tensor_shapes" in msg0
    assert kind1 == "PipelineCommError", msg1
    assert "peer rank probably failed" in msg1


def _two_pipelines(rank: int, world: int) -> bool:
    """Two pipelines in one process, with different P2P declarations and interleaved steps."""
    from tests.dualpipe.toy import reference_step

    set_p2p_tensor_shapes(None)
    results = []
    for seq in (3, 5, 3):
        for hidden, sched in ((4, "v"), (6, "1f1b")):
            full = make_stages(2 * world if sched == "v" else world, hidden, seed=hidden)
            if sched == "v":
                local = [full[rank], full[2 * world - 1 - rank]]
                pipe = _PIPES.setdefault(("v", hidden), DualPipeV(make_stages(2, hidden, seed=1), timeout=30))
                if seq == 3:
                    pipe.set_p2p_tensor_shapes([(2, 3, hidden)])
                    pipe.set_p2p_tensor_dtype(torch.float64)
                else:
                    pipe.set_p2p_tensor_shapes(None)
            else:
                local = [full[rank]]
                pipe = _PIPES.setdefault(("1", hidden), OneFOneB(make_stages(1, hidden, seed=1), timeout=30))
            for mod, ref in zip(pipe.module, local):
                mod.load_state_dict(ref.state_dict())
                mod.zero_grad()
            x = torch.randn(8, seq, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(seq))
            loss_ref, _ = reference_step(full, x, x.flip(0), 4)
            loss_rank = 0 if sched == "v" else world - 1
            loss, _ = pipe.step(
                *((x,) if rank == 0 else ()),
                num_chunks=4,
                criterion=criterion,
                labels=(x.flip(0),) if rank == loss_rank else (),
            )
            if rank == loss_rank:
                results.append(torch.equal(loss, loss_ref))
            for mod, ref in zip(pipe.module, local):
                for p, q in zip(mod.parameters(), ref.parameters()):
                    results.append(torch.allclose(p.grad, q.grad, rtol=1e-12, atol=0))
    return all(results) and len(results) > 0


_PIPES: dict[tuple[str, int], nn.Module] = {}


def test_two_pipelines_in_one_process_do_not_interfere() -> None:
    assert all(run_ranks(_two_pipelines, 2, timeout=120))


def _hook_forgets_input_grad(rank: int, world: int) -> tuple[str, str]:
    stages = make_stages(2, H, seed=0, cls=NoInputGrad)
    pipe = DualPipeV(stages, timeout=5)
    x = torch.randn(8, 3, H, dtype=torch.float64)
    try:
        pipe.step(*((x,) if rank == 0 else ()), num_chunks=4, criterion=criterion, labels=(x,) if rank == 0 else ())
    except (RuntimeError, PipelineCommError) as exc:
        return type(exc).__name__, str(exc)
    return "ok", ""


def test_a_hook_that_does_not_deliver_the_input_gradient_is_named_on_its_rank() -> None:
    results = run_ranks(_hook_forgets_input_grad, 2, timeout=90)
    named = [msg for kind, msg in results if kind == "RuntimeError"]
    assert named, results
    assert "NoInputGrad.overlapped_forward_backward returned without delivering the input gradient" in named[0]
    # No rank hangs or dies with an unrelated error: the other one names the hook too or loses its peer.
    assert all(kind in ("RuntimeError", "PipelineCommError") for kind, _ in results), results


class FailsOnRank1(ToyStageOverlap):
    """A user's hook with a bug that shows on one rank only."""

    @classmethod
    def overlapped_forward_backward(cls, module0, *args):
        if dist.get_rank() == 1:
            raise KeyError("user hook bug on rank 1")
        return super().overlapped_forward_backward(module0, *args)


def _hook_raises_on_rank_1(rank: int, world: int, stays_alive: bool) -> tuple[str, str, float]:
    import time

    pipe = DualPipeV(make_stages(2, H, seed=0, cls=FailsOnRank1), timeout=3)
    x = torch.randn(8, 3, H, dtype=torch.float64)
    start = time.monotonic()
    try:
        pipe.step(*((x,) if rank == 0 else ()), num_chunks=4, criterion=criterion, labels=(x,) if rank == 0 else ())
    except (KeyError, PipelineCommError) as exc:
        if rank == 1 and not stays_alive:
            raise  # the process dies with its connections: the peer learns at once
        return type(exc).__name__, str(exc), time.monotonic() - start
    return "ok", "", time.monotonic() - start


def test_an_exception_in_one_ranks_hook_is_the_one_reported() -> None:
    (kind0, msg0, waited), (kind1, msg1, _) = run_ranks(_hook_raises_on_rank_1, 2, args=(True,), timeout=90)
    assert (kind1, msg1) == ("KeyError", "'user hook bug on rank 1'")
    # rank 1 keeps its connections open (it caught its error): rank 0 fails at the 3 s pipeline timeout
    assert kind0 == "PipelineCommError" and "from pipeline rank 1" in msg0, msg0
    assert waited < 8, f"peer waited {waited:.1f}s"
    with pytest.raises(RankFailure) as failed:  # rank 1 dies of it: its error leads the report
        run_ranks(_hook_raises_on_rank_1, 2, args=(False,), timeout=90)
    report = str(failed.value)
    assert report.startswith("rank 1 raised:") and "KeyError: 'user hook bug on rank 1'" in report, report


class _Work:
    """Records how it was waited for."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def wait(self, *args) -> bool:
        self.calls.append(args)
        return True


@pytest.mark.parametrize(
    ("backend", "timeout", "expected"),
    [
        ("gloo", datetime.timedelta(seconds=3), (datetime.timedelta(seconds=3),)),
        ("gloo", None, ()),
        # NCCL: a timed wait would block the host; the process group's timeout bounds a hang instead.
        ("nccl", datetime.timedelta(seconds=3), ()),
        ("cpu:gloo,cuda:nccl", datetime.timedelta(seconds=3), ()),
    ],
)
def test_waits_are_timed_on_gloo_only(backend: str, timeout: datetime.timedelta | None, expected: tuple) -> None:
    work = _Work()
    wait_work(work, backend, timeout)
    assert work.calls == [expected]

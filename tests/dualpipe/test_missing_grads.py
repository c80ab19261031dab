"""A gradient a piece fails to give is one error naming the block, the piece and the input: a communication
whose backward gives None, or a tensor of another shape or dtype, and a compute piece that cuts its input off
the graph. Plain backward, the overlapped pair, our DualPipeV and torch's ScheduleDualPipeV through the bridge
alike; an input declared ``no_grad`` passes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from dualpipe import DualPipeV, GradStoreStage, PipelineCommError, overlap_torch_schedule
from dualpipe import _torch_pipelining as tp
from dualpipe.collectives import Pending
from dualpipe.overlap import OverlapStage
from dualpipe.pieces import Comm, Compute, Context, Pieces
from tests.distributed import RankFailure, run_ranks

H = 4
FAULTS = {
    "comm-none": r"block 5: Comm 'c' gave no gradient for its input 'h' \(\(2, 3, 4\), torch.float64\); a "
    r"floating-point input that needs none is declared Comm\(\.\.\., no_grad=\('h',\)\)",
    "comm-shape": r"block 5: Comm 'c' gave a gradient of \(1, 3, 4\), torch.float64 for its input 'h', which is "
    r"\(2, 3, 4\), torch.float64",
    "comm-dtype": r"block 5: Comm 'c' gave a gradient of \(2, 3, 4\), torch.float32 for its input 'h'",
    "compute-none": r"block 5: Compute 'f' gave no gradient for its input 'x' \(\(2, 3, 4\), torch.float64\)",
}


class Faulty(OverlapStage):
    """x -> f (scale) -> h -> c (identity transfer) -> y -> g (scale) -> out, with one fault of :data:`FAULTS`
    (or none); ``declared``: the input the fault starves is declared ``no_grad``."""

    def __init__(self, fault: str | None, declared: bool = False, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w = nn.Parameter(torch.randn(H, generator=gen, dtype=torch.float64))
        self.v = nn.Parameter(torch.randn(H, generator=gen, dtype=torch.float64))
        self.fault, self.declared = fault, declared

    def _f(self, ctx: Context, x: torch.Tensor) -> torch.Tensor:
        return (x.detach() if self.fault == "compute-none" else x) * self.w

    def _back(self, ctx: Context, g: torch.Tensor) -> Pending[Any]:
        bad = {"comm-none": None, "comm-shape": g[:1], "comm-dtype": g.float()}
        return Pending.done(bad.get(self.fault, g) if self.fault in bad else g)

    def pieces(self) -> list[Pieces]:
        starved = (self.declared and self.fault) or ""
        # a transfer that gives h no gradient starves f's input too: both say so
        f = Compute("f", self._f, "x", "h", no_grad="x" if starved else ())
        c = Comm(
            "c", lambda ctx, h: Pending.done(h), self._back, "h", "y", no_grad="h" if starved == "comm-none" else ()
        )
        g = Compute("g", lambda ctx, y: y * self.v, "y", "out")
        return [Pieces((f, c, g), input="x", output="out", layer=5)]


def _x(seed: int) -> torch.Tensor:
    return torch.randn(2, 3, H, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_plain_backward_names_the_piece(fault: str) -> None:
    stage = Faulty(fault)
    out = stage(_x(0).requires_grad_())
    with pytest.raises((RuntimeError, TypeError), match=FAULTS[fault]):
        out.sum().backward()


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_the_overlapped_pair_names_the_piece(fault: str) -> None:
    stage = Faulty(fault)
    out1 = stage(_x(1).requires_grad_())
    with pytest.raises((RuntimeError, TypeError), match=FAULTS[fault]):
        Faulty.overlapped_forward_backward(stage, [_x(2)], None, [], stage, None, [out1], [torch.ones_like(out1)])


@pytest.mark.parametrize("fault", ["comm-none", "compute-none"])
def test_a_declared_input_needs_no_gradient(fault: str) -> None:
    stage = Faulty(fault, declared=True)
    x = _x(0).requires_grad_()
    stage(x).sum().backward()
    assert stage.v.grad is not None and x.grad is None  # nothing reached x, as declared


def _criterion(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def _pipeline(rank: int, world: int, run: str) -> tuple[str, str]:
    """The fault on rank 1's stages only, under our DualPipeV or under torch's ScheduleDualPipeV through the
    bridge: what the rank raised."""
    from torch.distributed.pipelining import ScheduleDualPipeV

    x, y = _x(3).repeat(2, 1, 1), _x(4).repeat(2, 1, 1)  # 4 micro-batches of 1 sequence
    ids = [rank, 2 * world - 1 - rank]
    mods = [Faulty("comm-none" if rank == 1 else None, seed=i) for i in ids]
    first = (x,) if rank == 0 else ()
    try:
        if run == "dualpipev":
            pipe = DualPipeV(mods, timeout=5)
            pipe.step(*first, num_chunks=4, **(dict(criterion=_criterion, labels=(y,)) if rank == 0 else {}))
        else:
            boundary = torch.empty(1, 3, H, dtype=torch.float64, device="meta", requires_grad=True)
            stages = [
                GradStoreStage(m, i, 2 * world, torch.device("cpu"), input_args=boundary, output_args=boundary)
                for m, i in zip(mods, ids)
            ]
            schedule = ScheduleDualPipeV(stages, n_microbatches=4, loss_fn=_criterion)
            overlap_torch_schedule(schedule)
            schedule.step(*first, **(dict(target=y) if rank == 0 else {}))
    except (RuntimeError, TypeError, PipelineCommError) as exc:
        if run != "dualpipev":
            raise  # torch's schedule waits without a timeout: the rank dies, so its peer learns at once
        return type(exc).__name__, str(exc).splitlines()[0]
    return "ok", ""


def test_the_pipelines_name_the_piece_on_the_rank_where_it_happened() -> None:
    results = run_ranks(_pipeline, 2, args=("dualpipev",), timeout=120)
    kind, msg = results[1]
    assert kind == "RuntimeError" and "block 5: Comm 'c' gave no gradient for its input 'h'" in msg, results
    assert results[0][0] == "PipelineCommError", results  # the peer learns at the pipeline timeout
    with pytest.raises(RankFailure) as failed:  # through the bridge: rank 1 dies of it, its error leads
        run_ranks(_pipeline, 2, args=("torch-bridge",), timeout=120)
    report = str(failed.value)
    if tp.internals().greets_own_rank:  # a torch whose ScheduleDualPipeV cannot start on gloo: the bridge refuses
        assert "cannot start on CPU ranks over gloo" in report, report
        return
    assert report.startswith("rank 1 raised:") and "block 5: Comm 'c' gave no gradient for its input 'h'" in report

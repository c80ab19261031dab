"""dualpipe.piece_check.check_pieces: each piece's backward against a reference, naming the first that differs.

The wrong pieces here pass check_overlap (they are wrong the same way in both of its runs): a communication
whose backward is not the transfer back, and a layer whose deferred weight gradient overwrites instead of
accumulating."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dualpipe.collectives import Pending
from dualpipe.overlap import OverlapStage
from dualpipe.piece_check import check_pieces
from dualpipe.pieces import Comm, Compute, Pieces
from dualpipe.testing import check_overlap
from dualpipe.weight_grad import WeightGradStore
from tests.distributed import run_ranks


class _Deferred(torch.autograd.Function):
    """x @ W^T whose weight gradient follows DualPipe's protocol; ``overwrite`` is the bug: a deferred closure
    that assigns ``.grad`` instead of adding to it (the immediate path lets autograd accumulate)."""

    @staticmethod
    def forward(ctx, x, weight, overwrite: bool):
        ctx.save_for_backward(x, weight)
        ctx.overwrite = overwrite
        return x @ weight.t()

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        if not WeightGradStore.enabled:
            return dy @ weight, dy.t() @ x, None
        param = ctx.weight_param

        def closure() -> None:
            dw = dy.t() @ x
            param.grad = dw if ctx.overwrite or param.grad is None else param.grad + dw

        WeightGradStore.put(closure)
        return dy @ weight, None, None


def _linear(x: torch.Tensor, weight: nn.Parameter, overwrite: bool) -> torch.Tensor:
    y = _Deferred.apply(x, weight, overwrite)
    y.grad_fn.weight_param = weight  # the closure writes the parameter itself, as moe.models.layers.Linear does
    return y


class _Toy(OverlapStage):
    """One block: a compute piece using its weight twice, then a "transfer" (a scaling by 3) whose backward
    multiplies by ``back`` (3 is its adjoint)."""

    def __init__(self, *, overwrite: bool = False, back: float = 3.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8, generator=torch.Generator().manual_seed(0)) / 3)
        self.overwrite, self.back = overwrite, back

    def pieces(self):
        def compute(ctx, x):
            return _linear(_linear(x, self.weight, self.overwrite), self.weight, self.overwrite)

        return [
            Pieces(
                (
                    Compute("mm", compute, "x", "h"),
                    Comm(
                        "send", lambda ctx, h: Pending.done(3 * h), lambda ctx, g: Pending.done(self.back * g), "h", "y"
                    ),
                ),
                input="x",
                output="y",
                layer=0,
            )
        ]


def _inputs() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float32)


def test_right_pieces_pass():
    report = check_pieces(_Toy(), _inputs()).raise_if_failed()
    assert [c.name for c in report.checks] == ["dX x", "dW weight", "adjoint h"]


def test_a_backward_that_is_not_the_transfer_back_is_named():
    report = check_pieces(_Toy(back=2.0), _inputs())
    assert [(c.phase, c.name) for c in report.failures] == [("block 0 send", "adjoint h")]
    assert "not the transfer back" in str(report)
    # check_overlap runs the same wrong backward both ways and sees nothing
    inputs = (_inputs(), _inputs() + 1)
    assert check_overlap(lambda: _Toy(back=2.0), inputs).ok


def test_a_deferred_weight_gradient_that_overwrites_is_named():
    report = check_pieces(_Toy(overwrite=True), _inputs())
    assert [(c.phase, c.name) for c in report.failures] == [("block 0 mm", "dW weight")]


def test_a_gradient_of_the_wrong_shape_is_named():
    class Wrong(_Toy):
        def pieces(self):
            (block,) = super().pieces()
            compute, send = block.pieces
            bad = Comm("send", send.forward, lambda ctx, g: Pending.done(3 * g[:, :4]), "h", "y")
            return [Pieces((compute, bad), input="x", output="y", layer=0)]

    report = check_pieces(Wrong(), _inputs())
    assert report.failures[0].name == "adjoint h" and "gradient (4, 4)" in report.failures[0].note


def test_the_moe_stage_passes_in_one_process():
    from moe.dispatch import DispatchOptions, make_dispatcher
    from moe.models.config import MoEConfig
    from moe.models.stage import MoEStage

    cfg = MoEConfig(num_layers=2, num_dense_layers=1)
    dispatcher = make_dispatcher("local", cfg.num_experts, None, DispatchOptions(hidden_size=cfg.hidden_size))
    stage = MoEStage(cfg, range(2), first=True, last=False, dispatcher=dispatcher, piecewise=True)
    stage.reset_parameters(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    report = check_pieces(stage, ids).raise_if_failed()
    assert {"adjoint z", "adjoint weights", "adjoint y_recv", "dW blocks.1.experts.w1"} <= {
        c.name for c in report.checks
    }


def test_fp8_dispatch_is_the_transfer_back_up_to_its_rounding():
    """FP8 dispatch quantizes the dispatch and the combine's gradient: adjoint within 1e-2, not exactly."""
    from kernels.fp8 import FP8Recipe
    from moe.dispatch import DispatchOptions, make_dispatcher
    from moe.models.config import MoEConfig
    from moe.models.layers import use_fp8
    from moe.models.stage import MoEStage

    cfg = MoEConfig(num_layers=1, hidden_size=128)
    dispatcher = make_dispatcher("local", cfg.num_experts, None, DispatchOptions(hidden_size=cfg.hidden_size, fp8=True))
    stage = use_fp8(MoEStage(cfg, range(1), first=True, last=False, dispatcher=dispatcher, piecewise=True), FP8Recipe())
    stage.reset_parameters(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    check_pieces(stage, ids, rtol=1e-2).raise_if_failed()
    strict = check_pieces(stage, ids)
    assert {c.name for c in strict.failures} >= {"adjoint z", "adjoint y_recv"}, str(strict)


def _ep_rank(rank: int, world: int) -> tuple[bool, list[str]]:
    from moe.dispatch import DispatchOptions, make_dispatcher
    from moe.models.config import MoEConfig
    from moe.models.stage import MoEStage

    cfg = MoEConfig(num_layers=1)
    dispatcher = make_dispatcher(
        "alltoall", cfg.num_experts, dist.group.WORLD, DispatchOptions(hidden_size=cfg.hidden_size)
    )
    stage = MoEStage(cfg, range(1), first=True, last=False, dispatcher=dispatcher, piecewise=True)
    stage.reset_parameters(0)
    ids = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(rank))
    report = check_pieces(stage, ids)
    return report.ok, [f"{c.phase} {c.name}" for c in report.failures]


def test_expert_parallel_transfers_are_adjoint_over_the_group():
    """At ep=2 over gloo the dispatch's and combine's dot products are summed over both ranks."""
    for ok, failures in run_ranks(_ep_rank, 2, timeout=120):
        assert ok, failures

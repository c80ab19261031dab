"""dualpipe.pair_order: the roles a block's compute pieces take in an overlapped pair, and two runtime
errors and behaviours around the pieces (a tensor handed between pieces through ctx, a recorder attached
after the forward)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dualpipe.collectives import Pending
from dualpipe.overlap import OverlapStage
from dualpipe.pair_order import PAIR_ORDER, START_PREPARED, Roles, Step, roles
from dualpipe.pieces import Comm, Compute, Context, Pieces
from tests.dualpipe.test_pieces import Log, Net, _floats, _ids, mse

f64 = torch.float64


def _fn(ctx: Context, *xs: torch.Tensor):
    return xs[0] if len(xs) == 1 else xs


def _comm(name: str, inputs, outputs) -> Comm:
    return Comm(
        name, lambda ctx, *x: Pending.done(_fn(ctx, *x)), lambda ctx, *g: Pending.done(_fn(ctx, *g)), inputs, outputs
    )


def test_roles_of_the_compute_pieces() -> None:
    moe = Pieces(
        [
            Compute("attn", _fn, "h", ("a", "z")),
            _comm("dispatch", "z", "zr"),
            Compute("shared", _fn, "z", "s"),  # reads the first piece's output, only the block output reads its
            Compute("mlp", _fn, "zr", "yr"),
            _comm("combine", "yr", "y"),
        ],
        input="h",
        output=("a", "y", "s"),
    )
    assert roles(moe) == Roles(first=(0,), side=(2,), main=(3,))
    assert roles(moe).order("fwd") == (0, 2, 3) and roles(moe).order("bwd") == (2, 3, 0)
    # a dense block: its MLP is a side piece, and the pair runs F.attn, B.mlp, F.mlp, B.attn as before
    dense = Pieces([Compute("attn", _fn, "h", ("a", "z")), Compute("mlp", _fn, "z", "y")], input="h", output=("a", "y"))
    assert roles(dense) == Roles((0,), (1,), ())
    # on the path: a piece another piece reads, or one that reads what a communication brings, stays main
    chain = Pieces(
        [
            Compute("attn", _fn, "h", "z"),
            Compute("norm", _fn, "z", "n"),
            _comm("send", "n", "r"),
            Compute("post", _fn, "r", "y"),
            Compute("last", _fn, ("y", "z"), "out"),
        ],
        input="h",
        output="out",
    )
    assert roles(chain) == Roles((0,), (), (1, 3, 4))
    assert roles(Pieces([Compute("only", _fn, "h", "y")], input="h", output="y")) == Roles((0,), (), ())


def test_the_order_runs_every_role_once_per_direction() -> None:
    steps = [s for s in PAIR_ORDER if isinstance(s, Step)]
    assert sorted((s.direction, s.role) for s in steps) == sorted(
        (d, r) for d in ("fwd", "bwd") for r in ("first", "side", "main")
    )
    # the prepared communications start before the backward MLP, which then runs under the forward dispatch
    assert PAIR_ORDER.index(START_PREPARED) == PAIR_ORDER.index(Step("bwd", "main")) - 1


class _Stashing(OverlapStage):
    """A block whose attention hands the MLP a tensor with autograd history through ctx."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.full((4,), 0.5, dtype=f64))

    def pieces(self) -> list[Pieces]:
        def attn(ctx: Context, h: torch.Tensor) -> torch.Tensor:
            ctx.scale = torch.tanh(h * self.w)  # should be a named value, or detached
            return h * self.w

        def mlp(ctx: Context, a: torch.Tensor) -> torch.Tensor:
            return a * ctx.scale

        return [Pieces([Compute("attn", attn, "h", "a"), Compute("mlp", mlp, "a", "y")], input="h", output=("a", "y"))]


def test_a_tensor_handed_between_pieces_through_ctx_is_one_clear_error() -> None:
    stage = _Stashing()
    out = stage(_floats(1).requires_grad_())
    with pytest.raises(RuntimeError, match=r"block -1: the backward of Compute 'mlp' reached the input 'h' of Compute"):
        out.sum().backward()
    # overlapped: the same error from the hook
    stage = _Stashing()
    loss1 = stage(_floats(1).requires_grad_()).sum()
    with pytest.raises(RuntimeError, match=r"outside the named values \(through ctx\?\)"):
        _Stashing.overlapped_forward_backward(stage, [_floats(2)], None, [], stage, loss1, None, None)


def test_a_recorder_attached_after_the_forward_records_the_backward() -> None:
    net = Net(2)
    loss = mse(net(_ids(1)), _floats(3))
    net.recorder = log = Log()
    loss.backward()
    assert log.events and {d for _, d, _, _ in log.events} == {"bwd"}
    assert ("dispatch", "bwd", 0, "wait") in log.events

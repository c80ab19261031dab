"""dualpipe.pair_order: the roles a block's compute pieces take in an overlapped pair."""

from __future__ import annotations

import torch

from dualpipe.collectives import Pending
from dualpipe.pair_order import PAIR_ORDER, START_PREPARED, Roles, Step, roles
from dualpipe.pieces import Comm, Compute, Context, Pieces

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

"""The order of an overlapped pair, written once: :mod:`dualpipe.overlap` runs it, the planner
(``moe.plan.pair``) times it.

In a pair, forward block i of one micro-batch (F) runs beside backward block L-1-i of another (B). The
compute pieces of a paired block (:class:`dualpipe.pieces.Pieces`) take one of three roles, read from its
declaration alone (so every rank derives the same order):

- ``first``: the first compute piece (attention and router: what the block sends is computed here);
- ``side``: a later compute piece that reads only the block input or the first piece's outputs and whose
  outputs only the block output reads (a shared expert: a branch beside the routed path, free to run at
  any point after the first piece, and its backward at any point of B's block);
- ``main``: every other compute piece (the routed experts), in declaration order.

F runs a block's pieces first, side, main; B runs side, main, first, each role in reverse declaration order,
each piece's input gradient (dX) then its weight gradient (dW). :data:`PAIR_ORDER` says how the two walks
interleave; every communication starts as soon as its inputs exist and is waited where its result is read,
so each flies under the compute pieces placed between its start and its wait. For an MoE block (attention,
shared expert, routed MLP; DeepSeek-V3 Figure 4, the shared expert placed beside it)::

    step               compute                   communication in flight
    F first            F.attention               B.combine
    B side             B.shared (dX, dW)         F's row counts (the dispatch's prepare step)
    START_PREPARED     (F.dispatch starts)
    B main             B.mlp (dX, dW)            F.dispatch; B.dispatch from the dX on
    F side             F.shared                  F.dispatch, B.dispatch
    F main             F.mlp                     B.dispatch
    B first            B.attention (dX, dW)      F.combine; the next block's B.combine from the dX on

The backward MLP runs under the forward dispatch, as in DeepSeek-V3, with or without a ``prepare`` step. A
communication whose ``prepare`` left an exchange in flight (row counts) starts at ``START_PREPARED``, so
the exchange flies under B's side pieces, dX and dW (the dX alone is too short to cover it); a block without
side pieces waits the exchange right after F's first piece, and its dispatch still gets the backward MLP. When
B's block has no main pieces (a dense block beside an MoE one, at a stage's boundary), the communication
starts after B's last side dX instead, so that it still has that piece's dW to fly under.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dualpipe.pieces import Compute, Pieces

__all__ = ["FIRST", "MAIN", "PAIR_ORDER", "SIDE", "START_PREPARED", "Roles", "Step", "roles"]

FIRST, SIDE, MAIN = "first", "side", "main"
Role = Literal["first", "side", "main"]


@dataclass(frozen=True, slots=True)
class Step:
    """One step of a pair: every compute piece of ``role`` in F's block (``direction="fwd"``) or B's (``"bwd"``:
    each piece's dX, then its dW)."""

    direction: Literal["fwd", "bwd"]
    role: Role


START_PREPARED = "start prepared"
"""F's communications whose ``prepare`` left an exchange in flight start here at the latest (earlier only
beside a B block without main pieces: the module docstring)."""

PAIR_ORDER: tuple[Step | str, ...] = (
    Step("fwd", FIRST),  # F.attention           | B.combine
    Step("bwd", SIDE),  # B.shared (dX, dW)      | F's row counts
    START_PREPARED,  # F.dispatch starts
    Step("bwd", MAIN),  # B.mlp (dX, dW)         | F.dispatch; B.dispatch from the dX on
    Step("fwd", SIDE),  # F.shared               | F.dispatch, B.dispatch
    Step("fwd", MAIN),  # F.mlp                  | B.dispatch
    Step("bwd", FIRST),  # B.attention (dX, dW)  | F.combine; the next B.combine from the dX on
)
"""The pair, step by step (the module docstring's table)."""


@dataclass(frozen=True, slots=True)
class Roles:
    """Indices of a block's compute pieces by role, each in declaration order."""

    first: tuple[int, ...]
    side: tuple[int, ...]
    main: tuple[int, ...]

    def of(self, step: Step) -> tuple[int, ...]:
        """The pieces ``step`` runs, in the order its direction runs them."""
        found: tuple[int, ...] = getattr(self, step.role)
        return found if step.direction == "fwd" else found[::-1]

    def order(self, direction: str) -> tuple[int, ...]:
        """Every compute piece in the order one direction walks the block in a pair."""
        if direction == "fwd":
            return (*self.first, *self.side, *self.main)
        return (*self.side[::-1], *self.main[::-1], *self.first)


def roles(block: Pieces) -> Roles:
    """The roles of ``block``'s compute pieces (the module docstring says which is which)."""
    pieces = block.pieces
    computes = [i for i, p in enumerate(pieces) if isinstance(p, Compute)]
    first = computes[0]  # a block has at least one (Pieces checks)
    early = {block.input, *pieces[first].outputs}  # what exists once F's first piece has run
    side = tuple(
        i
        for i in computes[1:]
        if set(pieces[i].inputs) <= early
        and all(j == len(pieces) for name in pieces[i].outputs for j in block.consumers[name])
    )
    return Roles((first,), side, tuple(i for i in computes[1:] if i not in side))

"""The planner times the pair in the order the runtime runs it: both read dualpipe.pair_order.PAIR_ORDER."""

from __future__ import annotations

import pytest

from moe.plan.pair import BlockTimes, _backward_ops, _forward_ops, _pair_ops, chunk_times
from tests.dualpipe.test_pieces import _overlapped_hook


def _runtime_pair(shared: bool) -> tuple[list[str], list[str]]:
    """Compute spans begun and transfers started inside the first pair of the runtime's overlapped hook
    (forward block 0 beside backward block 1 of the test stage; the row counts left out)."""
    _, log = _overlapped_hook(shared=shared, prepare=True)
    ev = log.events
    first, last = ev.index(("attn", "fwd", 0, "begin")), ev.index(("attn.dw", "bwd", 1, "begin"))
    pair = [e for e in ev[first : last + 1] if (e[2] == 0) == (e[1] == "fwd")]
    computes = [f"{'F' if d == 'fwd' else 'B'}.{n.replace('.', '_')}" for n, d, _, e in pair if e == "begin"]
    comms = [f"{'F' if d == 'fwd' else 'B'}.{n}" for n, d, _, e in pair if e == "start" and n != "counts"]
    b_combine = ev.index(("combine", "bwd", 1, "start"))  # started before the pair, when the gradient arrived
    assert b_combine < first
    return computes, ["B.combine", *comms]


@pytest.mark.parametrize("shared", [False, True], ids=["two-computes", "shared-expert"])
def test_the_planner_issues_the_pair_in_the_runtimes_order(shared: bool) -> None:
    s = 1.0 if shared else 0.0
    block = BlockTimes(1, 1, 1, 1, 1, 1, 1, 1, shared_f=s, shared_dx=s, shared_dw=s)
    ops = _pair_ops(_forward_ops([block], "F"), _backward_ops([block], "B"))
    name = {op.name: f"{op.name[0]}.{op.name.split('.', 1)[1]}" for op in ops}  # F0.attn -> F.attn
    # without shared experts the planner keeps zero-length shared ops, the runtime has no such piece
    computes = [name[op.name] for op in ops if op.stream == "compute" and (shared or "shared" not in op.name)]
    comms = [name[op.name] for op in ops if op.stream == "comm"]
    assert (computes, comms) == _runtime_pair(shared)


def test_the_forward_dispatch_runs_under_the_backward_mlp() -> None:
    # One block, every sub-stage 1 s and each transfer 1 s: F.dispatch starts after B.shared (the counts' cover)
    # and flies under B.mlp dX; every transfer is hidden and the pair is its compute.
    block = BlockTimes(1, 1, 1, 1, 1, 1, 1, 1, shared_f=1, shared_dx=1, shared_dw=1)
    t = chunk_times([block])
    assert t.FB == 9.0 and t.exposed_fb == 0.0
    placed = {op.name: op for op in _pair_ops(_forward_ops([block], "F"), _backward_ops([block], "B"))}
    assert placed["F0.dispatch"].after == ("F0.attn", "B0.shared_dw")

"""dualpipe.events.hidden_fraction: the one hidden-communication metric, on hand-made timelines and on the
runtime's own recording (a dW piece with nothing to compute is marked, and hides nothing)."""

from __future__ import annotations

import math
import time

import pytest
import torch

from dualpipe.collectives import Pending
from dualpipe.events import Event, EventRecorder, HiddenFraction, hidden_fraction, record_span
from dualpipe.pieces import BlockRun, Comm, Compute, Pieces
from dualpipe.weight_grad import WeightGradStore

MS = 1e-3


def _issue_timeline(dw_edge: str) -> list[tuple[str, str, int, str, float]]:
    """B's combine under F's attention (4 ms), then F's dispatch (5 ms) with only B's mlp.dW under it, a
    piece whose layers handed no weight-gradient closures over (``dw_edge="empty"``, as the runtime marks it)."""
    rows = [
        ("step", "mode", 0, "begin", 0.0),  # a container the caller records: not compute
        ("combine", "bwd", 1, "start", 0.0),
        ("attn", "fwd", 0, "begin", 0.0),
        ("attn", "fwd", 0, "end", 4.0),
        ("combine", "bwd", 1, "wait", 4.0),
        ("dispatch", "fwd", 0, "start", 4.0),
        ("mlp.dw", "bwd", 1, "begin", 4.5),
        ("mlp.dw", "bwd", 1, dw_edge, 5.0),
        ("dispatch", "fwd", 0, "wait", 9.0),
        ("step", "mode", 0, "end", 9.0),
    ]
    return [(*r[:4], r[4] * MS) for r in rows]


def test_an_empty_span_hides_nothing_on_the_issue_timeline():
    # The count this replaced said 2 of 2 here: an `end` of the other micro-batch inside each transfer.
    h = hidden_fraction(_issue_timeline("empty"))
    assert (h.count, h.covered) == (2, 1)
    assert h.comm_s == pytest.approx(9 * MS) and h.hidden_s == pytest.approx(4 * MS)
    assert h.fraction == pytest.approx(4 / 9)
    assert list(h.kinds) == ["combine.bwd", "dispatch.fwd"]
    assert h.kinds["combine.bwd"].fraction == pytest.approx(1.0) and h.kinds["combine.bwd"].comm_s == pytest.approx(
        4 * MS
    )
    assert h.kinds["dispatch.fwd"].hidden_s == 0 and h.kinds["dispatch.fwd"].comm_s == pytest.approx(5 * MS)
    # the same span with work in it hides the half millisecond it lasted, no more
    worked = hidden_fraction(_issue_timeline("end"))
    assert worked.hidden_s == pytest.approx(4.5 * MS) and worked.covered == 2


def test_unions_not_sums_and_only_sub_stage_spans_are_compute():
    # two transfers in flight at once (union 0..6 ms), nested compute, a pipeline action containing it all
    rows = [
        ("F0&B1", "action", 0, "begin", 0.0),
        ("dispatch", "fwd", 0, "start", 0.0),
        ("mlp.dx", "bwd", 1, "begin", 1.0),
        ("inner", "bwd", 1, "begin", 1.5),
        ("inner", "bwd", 1, "end", 2.5),
        ("dispatch", "bwd", 1, "start", 2.0),
        ("mlp.dx", "bwd", 1, "end", 3.0),
        ("dispatch", "fwd", 0, "wait", 4.0),
        ("mlp", "fwd", 0, "begin", 5.0),
        ("dispatch", "bwd", 1, "wait", 6.0),
        ("mlp", "fwd", 0, "end", 7.0),
        ("F0&B1", "action", 0, "end", 7.0),
    ]
    h = hidden_fraction([(*r[:4], r[4] * MS) for r in rows])
    assert h.comm_s == pytest.approx(6 * MS) and h.hidden_s == pytest.approx(3 * MS)  # [1, 3] and [5, 6]
    assert h.kinds["dispatch.fwd"].hidden_s == pytest.approx(2 * MS)
    assert h.kinds["dispatch.bwd"].hidden_s == pytest.approx(2 * MS) and h.kinds["dispatch.bwd"].fraction == 0.5


def test_events_and_recorders_and_pooling():
    events = [Event(n, d, layer, e, t) for n, d, layer, e, t in _issue_timeline("empty")]
    rec = EventRecorder()
    rec.events.extend(events)
    a, b = hidden_fraction(events), hidden_fraction(rec)
    assert a == b == hidden_fraction(_issue_timeline("empty"))
    pooled = sum([a, hidden_fraction(_issue_timeline("end"))], HiddenFraction())
    assert (pooled.count, pooled.covered) == (4, 3)
    assert pooled.fraction == pytest.approx(8.5 / 18)
    assert pooled.kinds["dispatch.fwd"].fraction == pytest.approx(0.5 / 10)
    assert math.isnan(hidden_fraction([]).fraction) and not hidden_fraction([]).kinds


def test_unmatched_edges_are_errors():
    with pytest.raises(ValueError, match=r"dispatch\.fwd \(layer 0\) was waited without a start"):
        hidden_fraction([("dispatch", "fwd", 0, "wait", 1.0)])
    with pytest.raises(ValueError, match=r"attn\.fwd \(layer 2\) ended without a begin"):
        hidden_fraction([("attn", "fwd", 2, "end", 1.0)])


class _Deferred(torch.autograd.Function):
    """``x * w`` whose weight gradient goes to WeightGradStore when it is enabled (DualPipe's protocol)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors

        def dw() -> None:
            w.grad = (g * x).sum(0) if w.grad is None else w.grad + (g * x).sum(0)

        if WeightGradStore.enabled:
            WeightGradStore.put(dw)
        else:
            dw()
        return g * w, None


@pytest.mark.parametrize("deferred", [False, True], ids=["autograd-dw", "deferred-dw"])
def test_the_runtime_marks_a_dw_without_work_and_it_hides_nothing(deferred: bool):
    w = torch.nn.Parameter(torch.ones(3))
    fn = (lambda ctx, x: _Deferred.apply(x, w)) if deferred else (lambda ctx, x: x * w)
    # a transfer of the block input beside f: its backward is started after f's dX, so only f's dW runs
    # while it is in flight
    send = Comm("send", lambda ctx, x: Pending.done(x * 2), lambda ctx, g: Pending.done(g * 2), "x", "z")
    rec = EventRecorder()
    run = BlockRun(Pieces([Compute("f", fn, "x", "y"), send], input="x", output=("y", "z"), layer=0), recorder=rec)
    run.begin(torch.randn(2, 3, requires_grad=True))
    run.compute(0)
    run.start(1)
    run.output()
    run.begin_backward(torch.ones(2, 3))
    run.compute_dx(0)
    assert (w.grad is None) == deferred  # a deferred weight gradient waits for dW
    run.start_backward(1)
    run.compute_dw(0)
    run.wait_backward(1)
    assert w.grad is not None and run.input_grad_final()
    assert [e.edge for e in rec.events if e.name == "f.dw"] == ["begin", "end" if deferred else "empty"]
    h = hidden_fraction(rec).kinds["send.bwd"]
    assert h.count == 1 and h.covered == deferred and (h.hidden_s > 0) == deferred


def test_a_transfer_is_in_flight_once_its_issuing_call_returns():
    """The call that starts a transfer packs the rows first: that work is not flight (forward and backward)."""
    issued: dict[str, float] = {}

    def issue(direction: str):
        def call(ctx, x):
            time.sleep(0.005)  # packing the rows to send
            issued[direction] = time.perf_counter()
            return Pending.done(x * 2)

        return call

    rec = EventRecorder()
    send = Comm("send", issue("fwd"), issue("bwd"), "x", "z")
    pieces = [Compute("f", lambda ctx, x: x * 3, "x", "y"), send]
    run = BlockRun(Pieces(pieces, input="x", output=("y", "z"), layer=0), recorder=rec)
    run.begin(torch.randn(2, 3, requires_grad=True))
    run.compute(0)
    run.start(1)
    run.output()
    run.begin_backward(torch.ones(2, 3))
    run.start_backward(1)
    run.wait_backward(1)
    starts = {e.direction: e.stamp for e in rec.events if e.edge == "start"}
    assert starts.keys() == issued.keys() == {"fwd", "bwd"}
    assert all(starts[d] >= issued[d] for d in starts)


@pytest.mark.gpu
def test_cuda_events_on_two_streams():
    # a transfer stands in as matmuls on a side stream, waited there; compute on the current stream under it
    rec = EventRecorder("cuda")
    side, a = torch.cuda.Stream(), torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    rec.record("send", "fwd", 0, "start")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(10):
            a @ a
    with record_span(rec, "mlp", "bwd", 1):
        for _ in range(10):
            a @ a
    with record_span(rec, "mlp.dw", "bwd", 1, work=False):
        pass
    rec.record("send", "fwd", 0, "wait", stream=side)
    h = hidden_fraction(rec)
    assert h.count == h.covered == 1 and h.comm_s > 0 and 0 < h.fraction <= 1

"""Where the exposed all-to-all time comes from: the split by kind and the expert-parallel peer skew, on
small event lists whose answers are worked out by hand in the comments.
"""

from __future__ import annotations

import json

import pytest

from bench.overlap.report import KindExposure, kind_table, main, skew_table, summarise, where_table
from bench.overlap.stats import StepParts, comm_by_kind, parse_events, peer_skews, step_parts


def _ev(name, direction, layer, edge, t):
    return [name, direction, layer, edge, t]


# One forward through one MoE block on two expert-parallel ranks (times in seconds).
# Rank 0 routes fast, then waits for rank 1 to join the row-count exchange; rank 1's MLP is faster, so it
# waits for rank 0 to join the combine.
RANK0 = [
    _ev("step", "m", 0, "begin", 0.0),
    _ev("attn", "fwd", 0, "begin", 0.0),
    _ev("attn", "fwd", 0, "end", 1.0),
    _ev("counts", "fwd", 0, "start", 1.0),
    _ev("counts", "fwd", 0, "wait", 3.0),  # exposed 1..3; rank 1 starts at 3: all of it waits for the peer
    _ev("dispatch", "fwd", 0, "start", 3.0),
    _ev("dispatch", "fwd", 0, "wait", 4.0),  # exposed 3..4, both started at 3: no skew
    _ev("mlp", "fwd", 0, "begin", 4.0),
    _ev("mlp", "fwd", 0, "end", 6.0),
    _ev("combine", "fwd", 0, "start", 6.0),
    _ev("combine", "fwd", 0, "wait", 7.0),  # exposed 6..7, started last
    _ev("step", "m", 0, "end", 7.0),
]
RANK1 = [
    _ev("step", "m", 0, "begin", 0.0),
    _ev("attn", "fwd", 0, "begin", 0.0),
    _ev("attn", "fwd", 0, "end", 3.0),
    _ev("counts", "fwd", 0, "start", 3.0),
    _ev("counts", "fwd", 0, "wait", 3.0),  # started last: in flight 0
    _ev("dispatch", "fwd", 0, "start", 3.0),
    _ev("dispatch", "fwd", 0, "wait", 4.0),
    _ev("mlp", "fwd", 0, "begin", 4.0),
    _ev("mlp", "fwd", 0, "end", 5.0),
    _ev("combine", "fwd", 0, "start", 5.0),
    _ev("combine", "fwd", 0, "wait", 7.0),  # exposed 5..7; rank 0 starts at 6: 5..6 waits for the peer
    _ev("step", "m", 0, "end", 7.0),
]


def test_exposed_time_splits_by_kind():
    ranks = [parse_events(RANK0), parse_events(RANK1)]
    # kind -> (count, in flight, exposed) over both ranks
    assert comm_by_kind(ranks) == {
        "counts.fwd": (2, 2.0, 2.0),
        "dispatch.fwd": (2, 2.0, 2.0),
        "combine.fwd": (2, 3.0, 3.0),
    }


def test_peer_skew_is_the_spread_of_starts_and_the_wait_before_the_last_one():
    skews = peer_skews([parse_events(RANK0), parse_events(RANK1)])
    assert [(s.kind, s.skew, s.peer_wait) for s in skews] == [
        ("counts.fwd", 2.0, 2.0),
        ("dispatch.fwd", 0.0, 0.0),
        ("combine.fwd", 1.0, 1.0),
    ]


def test_all_to_alls_match_by_issue_order_not_by_wait_order():
    # An overlapped pair: the backward combine starts first, the forward dispatch after it is waited first.
    r0 = parse_events(
        [
            _ev("combine", "bwd", 1, "start", 0.0),
            _ev("dispatch", "fwd", 0, "start", 1.0),
            _ev("mlp.dx", "bwd", 1, "begin", 1.0),
            _ev("mlp.dx", "bwd", 1, "end", 1.5),
            _ev("dispatch", "fwd", 0, "wait", 2.0),  # blocked 1.5..2; rank 1 starts the dispatch at 1.5
            _ev("combine", "bwd", 1, "wait", 3.0),
        ]
    )
    r1 = parse_events(
        [
            _ev("combine", "bwd", 1, "start", 0.5),
            _ev("dispatch", "fwd", 0, "start", 1.5),
            _ev("combine", "bwd", 1, "wait", 3.0),
            _ev("dispatch", "fwd", 0, "wait", 3.5),
        ]
    )
    assert [c.name for c in r0.comm] == ["dispatch", "combine"]  # recorded in wait order
    # combine: r0 blocked from 2 (its previous event), after r1 started at 0.5: no wait for the peer
    assert [(s.kind, s.skew, s.peer_wait) for s in peer_skews([r0, r1])] == [
        ("combine.bwd", 0.5, 0.0),
        ("dispatch.fwd", 0.5, 0.0),
    ]


def test_ranks_that_recorded_different_all_to_alls_are_an_error():
    r0, r1 = parse_events(RANK0), parse_events(RANK1)
    with pytest.raises(ValueError, match="differs across"):
        peer_skews([r0, parse_events([e if e[0] != "counts" else ["dispatch", *e[1:]] for e in RANK1])])
    with pytest.raises(ValueError, match=r"recorded \[3, 2\] all-to-alls"):
        peer_skews([r0, parse_events(RANK1[:-3])])
    # a group of one rank (ep=1) has no peer to wait for
    assert [(s.skew, s.peer_wait) for s in peer_skews([r1])] == [(0.0, 0.0)] * 3


def _rank_file(rank: int, events: list) -> dict:
    options = {"pp": 1, "ep": 2, "chunks": 2, "micro_batch": 1, "seq_len": 1, "steps": 1, "warmup": 0}
    step = {"mode": "torch-dualpipev", "step": 0, "warmup": False, "events": events, "losses": [1.0]}
    step.update(cpu_s=1.0, grad_sq=1.0)
    return {"rank": rank, "cores": 2, "options": {**options, "modes": ["torch-dualpipev"]}, "steps": [step]}


def test_mode_rows_carry_the_breakdown_and_the_skew():
    (row,) = summarise([_rank_file(0, RANK0), _rank_file(1, RANK1)])
    # per rank and step = over 2 rank-steps; exposed 2 + 2 + 3 = 7 s in all, 2 + 0 + 1 = 3 s waiting for a peer
    assert row.exposed_by_kind == {
        "dispatch.fwd": KindExposure(
            count=1.0, in_flight_ms=1000.0, exposed_ms=1000.0, hidden=0.0, under_work=0.0, share=2 / 7, peer_wait_ms=0.0
        ),
        "combine.fwd": KindExposure(
            count=1.0,
            in_flight_ms=1500.0,
            exposed_ms=1500.0,
            hidden=0.0,
            under_work=0.0,
            share=3 / 7,
            peer_wait_ms=500.0,
        ),
        "counts.fwd": KindExposure(
            count=1.0,
            in_flight_ms=1000.0,
            exposed_ms=1000.0,
            hidden=0.0,
            under_work=0.0,
            share=2 / 7,
            peer_wait_ms=1000.0,
        ),
    }
    assert list(row.exposed_by_kind) == ["dispatch.fwd", "combine.fwd", "counts.fwd"]  # the report's order
    # skews 2000, 0, 1000 ms: median 1000; p90 at 0.9 * 2 = 1.8 of the sorted list, 1000 + 0.8 * 1000
    assert row.peer_skew_ms == 1000.0
    assert row.peer_skew_p90_ms == pytest.approx(1800.0)
    assert (row.peer_wait_ms, row.peer_wait_share) == (1500.0, 3 / 7)
    assert row.a2a_exposed_ms == 3500.0  # the breakdown adds up to the main table's figure (one step)


def test_tables_and_the_command_reproduce_them_from_saved_events(tmp_path, capsys):
    events = tmp_path / "events"
    events.mkdir()
    for rank, ev in enumerate((RANK0, RANK1)):
        (events / f"rank{rank}.json").write_text(json.dumps(_rank_file(rank, ev)))
    rows = summarise([_rank_file(0, RANK0), _rank_file(1, RANK1)])
    assert (
        "| torch-dualpipev | row-count exchange | 1.0 | 1000.0 | 1000.0 | 1000.00 | 0.00 | 0.00 | 0.29 | 1000.0 |"
        in (kind_table(rows))
    )
    assert "| torch-dualpipev | 1000.00 | 1800.00 | 1500.0 | 0.43 |" in skew_table(rows)
    assert main([str(events), "--json", str(tmp_path / "summary.json")]) == 0
    printed = capsys.readouterr().out
    assert kind_table(rows) in printed and skew_table(rows) in printed
    (saved,) = json.loads((tmp_path / "summary.json").read_text())["rows"]
    assert saved["exposed_by_kind"]["counts.fwd"]["peer_wait_ms"] == 1000.0
    assert saved["peer_wait_share"] == 3 / 7


def test_where_the_step_went_adds_up_to_the_step():
    # rank 0 (7 s): attention 1, MLP 2 = compute 3; blocked 1..3 (counts), 3..4 (dispatch), 6..7 (combine) = 4
    assert step_parts(parse_events(RANK0)) == StepParts(compute=3.0, a2a_blocked=4.0, p2p_blocked=0.0, host=0.0)
    # host work between pieces and a pipeline wait: an action around the block, 0.5 s of issuing after the
    # attention, a receive wait of 1 s before it, and a dW piece with nothing to compute (not work)
    events = [
        _ev("step", "m", 0, "begin", 0.0),
        _ev("F0.0", "action", 0, "begin", 0.0),
        _ev("recv", "p2p", 0, "begin", 0.0),
        _ev("recv", "p2p", 0, "end", 1.0),
        _ev("attn", "fwd", 0, "begin", 1.0),
        _ev("attn", "fwd", 0, "end", 2.0),
        _ev("dispatch", "fwd", 0, "start", 2.5),
        _ev("mlp.dw", "bwd", 1, "begin", 2.5),
        _ev("mlp.dw", "bwd", 1, "empty", 3.0),
        _ev("dispatch", "fwd", 0, "wait", 4.0),  # blocked 3..4
        _ev("F0.0", "action", 0, "end", 4.0),
        _ev("step", "m", 0, "end", 4.0),
    ]
    assert step_parts(parse_events(events)) == StepParts(compute=1.0, a2a_blocked=1.0, p2p_blocked=1.0, host=1.0)
    # a plain graph records no pieces: what it did not wait is its compute, its host work unknown
    plain = [e for e in RANK0 if e[1] != "fwd" or e[0] in ("counts", "dispatch", "combine")]
    parts = step_parts(parse_events(plain))
    assert (parts.compute, parts.a2a_blocked) == (3.0, 4.0) and parts.host != parts.host  # NaN


def test_the_step_table_carries_the_threads_cpu_and_the_idle_cores():
    files = [_rank_file(0, RANK0), _rank_file(1, RANK1)]
    for f, thread in zip(files, (0.5, 0.75)):
        f["steps"][0]["thread_s"] = thread  # of cpu_s = 1.0 each
    (row,) = summarise(files)
    # rank 1: compute 3 + 1 = 4 s, blocked 0 (counts) + 1 + 2 = 3 s; the mean over the ranks: 3.5 and 3.5
    assert row.step_parts_ms == {
        "compute": 3500.0, "a2a_blocked": 3500.0, "p2p_blocked": 0.0, "host": 0.0,
        "comm_threads_cpu": (0.5 + 0.25) / 2 * 1e3,  # the process's CPU beyond its compute thread's
        "idle_cores": (2 * 7.0 - 2 * 1.0) * 1e3,  # 2 cores for a 7 s step, 2 s of CPU used
    }  # fmt: skip
    assert row.rank_use == pytest.approx(0.75 / 7.0)
    assert "| torch-dualpipev | 7000 | 3500 | 0 | 3500 | 0 | 375 | 12000 |" in where_table([row])

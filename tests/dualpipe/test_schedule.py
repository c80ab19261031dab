"""Schedules as data: the reference's compute order, static checks, and that the checks can fail."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest

from dualpipe.authoring import Emitter
from dualpipe.checks import (
    DeadlockError,
    ScheduleError,
    check_complete,
    check_matching,
    check_schedule,
    simulate_progress,
)
from dualpipe.schedule import (
    SCHEDULES,
    Action,
    Layout,
    Op,
    Schedule,
    ScheduleSpec,
    build_schedule,
    compute_order,
    post_receives_early,
    register_schedule,
    unregister_schedule,
)

ORDERS = json.loads((Path(__file__).parent.parent / "fixtures" / "orders.json").read_text())


def _parse(key: str) -> tuple[str, int, int]:
    name, ranks, chunks = key.split()
    return name, int(ranks.split("=")[1]), int(chunks.split("=")[1])


@pytest.mark.parametrize("key", sorted(ORDERS))
def test_compute_order_matches_reference(key: str) -> None:
    name, ranks, chunks = _parse(key)
    schedule = build_schedule(name, ranks, chunks)
    assert [compute_order(actions) for actions in schedule.ranks] == ORDERS[key]


V_FAMILY = ("zbv", "v-half", "v-min")
"""Planned for the whole pipeline per shape and longer per step (deferred W): a sample of chunk counts each
(tests/dualpipe/test_v_family.py sizes them further), so the two sweeps below stay fast."""


def _chunk_counts(name: str, ranks: int) -> list[int]:
    if name in V_FAMILY:
        return sorted({1, 2, ranks, 2 * ranks - 1, 2 * ranks, 2 * ranks + 1, 3 * ranks + 1, 4 * ranks + 2})
    return list(range(1, 4 * ranks + 3))


EXTRA_WARMUP_RANKS = (2, 4, 8)
"""Pipeline sizes the 1F1B family is also checked at with extra warm-up forwards (1 and 3)."""


def _all_cases(max_ranks: int = 8):
    for name, spec in SCHEDULES.items():  # every registered schedule (and more than one v where it takes any)
        for modules in (None, 3) if spec.flexible_modules else (None,):
            for ranks in range(1, max_ranks + 1):
                extras = (0, 1, 3) if spec.warmup is not None and ranks in EXTRA_WARMUP_RANKS else (0,)
                for chunks, extra in itertools.product(_chunk_counts(name, ranks), extras):
                    try:
                        yield build_schedule(name, ranks, chunks, False, modules, extra)
                    except ValueError:
                        continue


def test_every_schedule_passes_static_checks_under_both_models() -> None:
    count = 0
    names = set()
    for schedule in _all_cases():
        check_schedule(schedule, ("async", "grouped"))
        count += 1
        names.add(schedule.name)
    assert count > 400  # all schedules over many (ranks, chunks) were really checked
    assert names == set(SCHEDULES)
    assert {(s.name, s.extra_warmup) for s in _all_cases()} >= {(n, 3) for n, sp in SCHEDULES.items() if sp.warmup}


def _expected_pairs(name: str, n: int, m: int, v: int, extra: int, rank: int) -> int:
    """Overlapped pairs per step on ``rank`` (``m`` micro-batches, ``v`` modules per rank), by formula.

    1F1B and ZB1P: only the last rank pairs (another rank's pair would hold its forward's output back from
    the next rank for a step), and only with an extra warm-up: then every steady step, m - extra.
    Interleaved 1F1B: every steady step, T - w_r with T = m v module passes and w_r = 2(N-1-r) + (v-1)N + extra
    warm-up forwards (at most T), but on the last rank without extra warm-up, where the first N steps of every
    N v are the last stage's forward and its own backward: m of them, leaving (m - N)(v - 1).
    """
    last = rank == n - 1
    if name in ("1f1b", "zb1p"):
        return m - extra if last and extra else 0
    total = m * v
    steady = total - min(2 * (n - 1 - rank) + (v - 1) * n + extra, total)
    return (m - n) * (v - 1) if last and not extra else steady


@pytest.mark.parametrize("name", ["1f1b", "zb1p", "interleaved-1f1b"])
@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_pairs_per_rank_follow_the_formula(name: str, ranks: int) -> None:
    checked = 0
    for modules, extra, chunks in itertools.product((None, 3), (0, 1, 2), range(1, 4 * ranks + 1)):
        try:
            s = build_schedule(name, ranks, chunks, False, modules, extra)
        except ValueError:
            continue
        v = s.layout.modules_per_rank
        pairs = [sum(a.op is Op.FB for a in actions) for actions in s.ranks]
        assert pairs == [_expected_pairs(name, ranks, chunks, v, extra, r) for r in range(ranks)], (modules, extra)
        # ZB1P's pairs defer their weight gradients as the I they replace; the others' run a full B
        deferred = {a.deferred for actions in s.ranks for a in actions if a.op is Op.FB}
        assert deferred <= {name == "zb1p"}
        checked += 1
    assert checked > 2 * ranks


def test_extra_warmup_the_batch_cannot_hold_is_refused() -> None:
    build_schedule("1f1b", 4, 5, extra_warmup=1)  # rank 0: 3 + 1 warm-up forwards, one steady step
    with pytest.raises(ValueError, match=r"extra_warmup=2: 1F1B's rank 0 would run all 5 .* num_chunks >= 6"):
        build_schedule("1f1b", 4, 5, extra_warmup=2)
    with pytest.raises(ValueError, match=r"interleaved 1F1B's rank 0 would run all 8 .* num_chunks >= 6"):
        build_schedule("interleaved-1f1b", 2, 4, extra_warmup=4)  # 2 + 2 warm-up forwards of 8, then 4 more
    with pytest.raises(ValueError, match="DualPipeV takes no extra warm-up"):
        build_schedule("dualpipev", 2, 4, extra_warmup=1)
    with pytest.raises(ValueError, match="extra_warmup must be >= 0"):
        build_schedule("zb1p", 2, 4, extra_warmup=-1)


def test_early_receives_are_safe_for_gloo_but_not_for_in_order_nccl() -> None:
    # Early receives keep every schedule deadlock-free when operations progress independently (gloo)...
    grouped_failures = 0
    for schedule in _all_cases(6):
        layout = schedule.layout
        early = build_schedule(schedule.name, layout.num_ranks, schedule.num_chunks, True, layout.modules_per_rank)
        check_complete(early)
        check_matching(early)
        simulate_progress(early, "async")
        try:
            simulate_progress(early, "grouped")
        except DeadlockError:
            grouped_failures += 1
    # ...but a receive queued ahead of a send to the same peer blocks NCCL's in-order stream, which is why
    # pipelines on NCCL keep the reference's placement.
    assert grouped_failures > 0


def test_early_receives_move_only_receives() -> None:
    schedule = build_schedule("dualpipev", 4, 10)
    for actions in schedule.ranks:
        early = post_receives_early(actions)
        assert sorted(map(str, early)) == sorted(map(str, actions))
        assert compute_order(early) == compute_order(actions)
        assert [a for a in early if not a.op.name.startswith("RECV")] == [
            a for a in actions if not a.op.name.startswith("RECV")
        ]


def _replace_rank(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    ranks = list(schedule.ranks)
    ranks[rank] = tuple(actions)
    return dataclasses.replace(schedule, ranks=tuple(ranks))


def test_checks_catch_a_missing_weight_pass() -> None:
    s = build_schedule("zb1p", 4, 8)
    actions = list(s.ranks[0])
    actions.remove(next(a for a in actions if a.op is Op.W))
    with pytest.raises(ScheduleError, match="never popped"):
        check_complete(_replace_rank(s, 0, actions))


def test_checks_catch_a_missing_backward() -> None:
    s = build_schedule("1f1b", 2, 4)
    actions = [a for a in s.ranks[1] if not (a.op is Op.B and a.chunk == 3)]
    with pytest.raises(ScheduleError, match="backward not run exactly once"):
        check_complete(_replace_rank(s, 1, actions))


def test_checks_catch_reordered_sends() -> None:
    s = build_schedule("1f1b", 2, 4)
    actions = list(s.ranks[0])
    sends = [i for i, a in enumerate(actions) if a.op is Op.SEND_F]
    actions[sends[0]], actions[sends[1]] = actions[sends[1]], actions[sends[0]]
    with pytest.raises(ScheduleError, match="differ between sender and receiver"):
        check_matching(_replace_rank(s, 0, actions))


def test_checks_catch_a_deadlock() -> None:
    # Rank 0 runs its backward before sending the activation that rank 1 needs to produce that gradient:
    # the messages still match, but the ranks wait on each other.
    s = build_schedule("1f1b", 2, 1)
    cycle = _replace_rank(
        s,
        0,
        [Action(Op.F, 0, 0), Action(Op.RECV_B, 0, 0, peer=1), Action(Op.B, 0, 0), Action(Op.SEND_F, 0, 0, peer=1)],
    )
    check_complete(cycle)
    check_matching(cycle)
    for model in ("async", "grouped"):
        with pytest.raises(DeadlockError, match="no rank can progress"):
            simulate_progress(cycle, model)


def test_layouts() -> None:
    v = Layout.v_shape(3)
    assert v.paths == (((0, 0), (1, 0), (2, 0), (2, 1), (1, 1), (0, 1)),)
    assert v.next(2, 0) == (2, 1)  # the turn is local
    d = Layout.bidirectional(4)
    assert d.paths[1][0] == (3, 1) and d.is_last(0, 1) and d.is_first(0, 0)
    with pytest.raises(ValueError, match="even number"):
        Layout.bidirectional(3)


@pytest.mark.parametrize(
    ("name", "ranks", "chunks", "message"),
    [
        ("dualpipe", 3, 12, "even number of pipeline ranks"),
        ("dualpipe", 4, 6, "num_chunks >= 2 \\* ranks = 8"),
        ("dualpipe", 2, 5, "even num_chunks"),
        ("dualpipev", 3, 5, "num_chunks >= 2 \\* ranks = 6"),
        ("1f1b", 2, 0, "num_chunks must be >= 1"),
        ("zbv", 2, 0, "num_chunks must be >= 1"),
        ("interleaved-1f1b", 4, 6, "num_chunks a multiple of ranks = 4 \\(got 6\\)"),
        ("gpipe", 2, 4, "unknown schedule"),
    ],
)
def test_bad_schedule_arguments(name: str, ranks: int, chunks: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_schedule(name, ranks, chunks)


def test_interleaved_1f1b_runs_megatrons_order() -> None:
    # 2 ranks, v = 2 (stage s on rank s % 2), 4 micro-batches: rank 0 warms up with 2(N-1-r) + (v-1)N = 4
    # forwards, N micro-batches through one module before the next; backwards visit the modules in reverse.
    # A steady step is one pair, but where the last stage's backward starts from the same step's forward.
    s = build_schedule("interleaved-1f1b", 2, 4)
    rank0 = "F0.0 F0.1 F1.0 F1.1 (F0.2&B1.0) (F0.3&B1.1) (F1.2&B0.0) (F1.3&B0.1) B1.2 B1.3 B0.2 B0.3"
    rank1 = "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 (F0.2&B0.0) (F0.3&B0.1) F1.2 B1.2 F1.3 B1.3 B0.2 B0.3"
    assert [" ".join(compute_order(actions)) for actions in s.ranks] == [rank0, rank1]
    # Megatron-Core's combined 1F1B adds one warm-up forward: then every steady step pairs.
    s = build_schedule("interleaved-1f1b", 2, 4, extra_warmup=1)
    rank1 = "F0.0 F0.1 F1.0 (F1.1&B1.0) (F0.2&B1.1) (F0.3&B0.0) (F1.2&B0.1) (F1.3&B1.2) B1.3 B0.2 B0.3"
    assert " ".join(compute_order(s.ranks[1])) == rank1
    assert s.layout.paths == (((0, 0), (1, 0), (0, 1), (1, 1)),)
    assert build_schedule("interleaved-1f1b", 2, 4, False, 3).layout.modules_per_rank == 3


def test_interleaved_layout_names_every_stage_boundary() -> None:
    # Ranks 0 and 1 exchange two stages' messages (0->1 and 2->3): the boundary tells them apart.
    layout = build_schedule("interleaved-1f1b", 2, 4).layout
    assert [layout.boundary(0, m, towards_next=True) for m in (0, 1)] == [0, 2]
    assert [layout.boundary(1, m, towards_next=False) for m in (0, 1)] == [0, 2]
    assert layout.entries(0) == [0] and layout.exits(1) == [1] and layout.exits(0) == []
    assert not layout.mirrored and layout.mirror(0, 0) is None


def test_mirrored_layout() -> None:
    d = Layout.bidirectional(4)
    assert d.mirrored and d.mirror(0, 0) == (3, 1) and d.mirror(1, 1) == (2, 0)
    assert d.entries(3) == [1] and d.exits(3) == [0]
    assert all(d.stage_of(*d.mirror(r, m)) == d.stage_of(r, m) for r in range(4) for m in range(2))


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_every_spec_gives_a_valid_default(name: str) -> None:
    spec = SCHEDULES[name]
    for ranks in (2, 4, 8):
        chunks = spec.default_chunks(ranks)
        assert chunks >= 2 * ranks
        spec.validate(ranks, chunks)
        with pytest.raises(ValueError):
            spec.validate(ranks, spec.min_chunks(ranks) - 1)


def _gpipe(layout: Layout, rank: int, num_chunks: int) -> list[Action]:
    """GPipe: every forward, then every backward (a schedule written only here)."""
    e = Emitter(layout, rank)
    for _ in range(num_chunks):
        e.forward_chunk(0)
    for _ in range(num_chunks):
        e.backward_chunk(0)
    return e.actions


def test_a_schedule_is_one_generator_and_one_registry_entry() -> None:
    from dualpipe import PIPELINES
    from moe.train import config_from_args

    spec = ScheduleSpec(
        name="gpipe",
        title="GPipe",
        class_name="GPipe",
        summary="all forwards, then all backwards",
        generate=_gpipe,
        layout=lambda ranks, modules: Layout.linear(ranks),
    )
    register_schedule(spec)
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_schedule(spec)
        s = build_schedule("gpipe", 3, 4)
        check_schedule(s, ("async", "grouped"))
        assert compute_order(s.ranks[2]) == ["F0.0", "F0.1", "F0.2", "F0.3", "B0.0", "B0.1", "B0.2", "B0.3"]
        cls = PIPELINES["gpipe"]  # a pipeline class exists for it, and train.py offers it
        assert cls.__name__ == "GPipe" and cls.schedule_name == "gpipe" and "gpipe" in list(PIPELINES)
        assert config_from_args(["--schedule", "gpipe", "--pp", "3"], world=3)[0].parallel.schedule == "gpipe"
    finally:
        unregister_schedule("gpipe")
    assert "gpipe" not in SCHEDULES
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule("gpipe", 3, 4)


def test_generators_build_on_the_schedule_module_never_the_reverse() -> None:
    import dualpipe
    from tests.imports import imports as imports_of

    root = Path(dualpipe.__file__).parent

    def imports(name: str) -> set[str]:
        return imports_of(root / f"{name}.py")

    assert not {"dualpipe.generators", "dualpipe.authoring"} & imports("schedule")
    assert "dualpipe.schedule" in imports("authoring") and "dualpipe.authoring" in imports("generators")
    import dualpipe.schedule as schedule_module

    assert not hasattr(schedule_module, "_Emitter")  # the authoring API is public, in dualpipe.authoring

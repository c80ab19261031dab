"""The schedule comparison (``python -m dualpipe.simulate --compare``) against hand-computed figures."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from dualpipe.compare import common_chunks, compare, exposed_a2a, loops, pictured, step_costs
from dualpipe.schedule import SCHEDULES, build_schedule
from dualpipe.simulate import Costs, main

STAGE = Costs(F=1, B=2, W=1)


def _rows(a2a: float = 0.0, stage: Costs = STAGE, **kw) -> dict[tuple[str, bool], object]:
    return {(row.schedule, row.overlap): row for row, _ in compare(4, stage, a2a=a2a, **kw)}


def test_1f1b_is_the_textbook_step_and_bubble() -> None:
    # pp = 4, m = 8, F = 1, B = 2: step (m + pp - 1)(F + B) = 33, bubble (pp - 1)(F + B) = 9 of it on every rank.
    # Without overlap (whether or not 1F1B pairs, a pair then runs as F, then B).
    rows = _rows()
    r = rows["1f1b", False]
    assert (r.chunks, r.step_time, r.pairs, r.copies, r.peak_activations) == (8, 33, 0, 1, 4)
    assert r.bubble_fraction == pytest.approx(9 / 33)
    if rows["1f1b", True].pairs == 0:
        assert rows["1f1b", True] == dataclasses.replace(r, overlap=True)
        assert r.note == "no FB pairs: both rows the same"
    # each chunk waits for its all-to-all: (m + pp - 1)(F + B + 2 a2a), every a2a exposed (16 chunks of 0.5)
    r = _rows(a2a=0.5)["1f1b", False]
    assert (r.step_time, r.exposed_a2a, r.exposed_a2a_fraction) == (44, 8, 1)


def test_copies_come_from_the_layout() -> None:
    rows = _rows()
    assert {name: rows[name, True].copies for name in SCHEDULES} == {
        name: 2 if build_schedule(name, 4, 8).layout.mirrored else 1 for name in SCHEDULES
    }
    assert rows["dualpipe", True].copies == 2 and rows["dualpipev", True].copies == 1


def test_every_registered_schedule_appears_twice() -> None:
    results = compare(4, STAGE)
    assert [(r.schedule, r.overlap) for r, _ in results] == [(n, o) for n in SCHEDULES for o in (True, False)]


def test_pairs_hide_their_all_to_all() -> None:
    # DualPipe at pp = 4, m = 8: each rank runs 8 F and 8 B chunks, 8 x 2 x 0.5 = 8 of all-to-all; without overlap
    # all of it is exposed, with F&B = F + B each of its 12 pairs (3 per rank) hides 2 x 0.5.
    rows = _rows(a2a=0.5)
    with_, without = rows["dualpipe", True], rows["dualpipe", False]
    assert (with_.pairs, without.pairs) == (12, 0)
    assert (without.exposed_a2a, with_.exposed_a2a) == (8, 5)
    assert with_.exposed_a2a_fraction == pytest.approx(5 / 8)
    assert with_.step_time < without.step_time
    for name in SCHEDULES:  # whichever schedule pairs, pairing hides: never more exposed
        if rows[name, True].pairs:
            assert rows[name, True].exposed_a2a < rows[name, False].exposed_a2a


@pytest.mark.parametrize(("fb", "pair_exposed"), [(3.0, 0.0), (3.5, 0.5), (4.0, 1.0), (5.0, 1.0), (2.5, 0.0)])
def test_a_pair_exposes_its_duration_beyond_its_compute(fb: float, pair_exposed: float) -> None:
    schedule = build_schedule("dualpipe", 4, 8)
    stage = Costs(F=1, B=2, W=1, FB=fb)
    per_rank, total = exposed_a2a(schedule, stage, 0.5, overlap=True)
    plain, same_total = exposed_a2a(schedule, stage, 0.5, overlap=False)
    assert total == same_total == 4 * 8
    assert sum(plain) - sum(per_rank) == pytest.approx(12 * (1.0 - pair_exposed))


def test_costs_scale_to_the_share_of_a_stage() -> None:
    # A DualPipeV module is half a stage: half the compute and half the all-to-all.
    costs = step_costs(build_schedule("dualpipev", 4, 8), Costs(F=1, B=2, W=1, FB=2.5), 0.5, overlap=True)
    assert (costs.F, costs.B, costs.W, costs.FB) == (0.75, 1.25, 0.5, 1.25)
    alone = step_costs(build_schedule("dualpipev", 4, 8), Costs(F=1, B=2, W=1, FB=2.5), 0.5, overlap=False)
    assert alone.FB == 0.75 + 1.25


def test_chunks_every_schedule_accepts_or_the_reason() -> None:
    assert common_chunks(4) == 8 and common_chunks(3) == 6  # DualPipe(V): 2 x ranks; interleaved: a multiple
    rows = _rows(num_chunks=10)
    assert rows["interleaved-1f1b", True].step_time is None
    assert "refuses: interleaved 1F1B needs num_chunks a multiple of ranks" in rows["interleaved-1f1b", True].note
    assert rows["1f1b", True].step_time == 13 * 3


def test_the_1f1b_family_loops_over_the_ranks() -> None:
    family = {name for name in SCHEDULES if loops(build_schedule(name, 4, 8))}
    assert family == {"1f1b", "zb1p", "interleaved-1f1b"}
    pictures = [sim.schedule for sim in pictured(compare(4, STAGE))]
    assert pictures[0] in family and pictures[1] == "dualpipev"


def _text_rows(text: str) -> dict[tuple[str, bool], list[str]]:
    lines = text.splitlines()[2:]
    out = {}
    for line in lines:
        cells = re.split(r"\s{2,}", line.strip())
        out[cells[0], cells[1] == "yes"] = cells[1:]
    return out


def test_json_rows_match_the_text(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cmp.json"
    assert main(["--compare", "--a2a", "0.5", "--FB", "3.5", "--json", str(path)]) == 0
    text = _text_rows(capsys.readouterr().out)
    doc = json.loads(path.read_text())
    assert doc["costs"]["a2a"] == 0.5 and doc["costs"]["FB"] == 3.5
    assert len(doc["rows"]) == len(text) == 2 * len(SCHEDULES)
    for r in doc["rows"]:
        cells = text[r["schedule"], r["overlap"]]
        assert cells[1:8] == [
            str(r["pairs"]),
            f"{r['step_time']:g}",
            f"{r['bubble_fraction']:.1%}",
            f"{r['peak_activations']:g}",
            f"{r['copies']:g}",
            f"{r['exposed_a2a']:g}",
            f"{r['exposed_a2a_fraction']:.0%}",
        ]


def test_cli_pngs_and_errors(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    assert main(["--compare", "--ranks", "2", "--png", str(tmp_path / "t.png")]) == 0
    drawn = sorted(p.name for p in tmp_path.iterdir())
    family = [f"t-{name}.png" for name in SCHEDULES if loops(build_schedule(name, 2, 4))]
    assert len(drawn) == 2 and "t-dualpipev.png" in drawn and set(drawn) - {"t-dualpipev.png"} <= set(family)
    with pytest.raises(SystemExit, match="--a2a needs --compare"):
        main(["--a2a", "1"])
    with pytest.raises(SystemExit, match="drop --schedule"):
        main(["--compare", "--schedule", "1f1b"])
    with pytest.raises(SystemExit, match="a2a must be >= 0"):
        main(["--compare", "--a2a", "-1"])


def test_an_extra_warm_up_pairs_the_1f1b_last_rank_and_names_the_rows(capsys: pytest.CaptureFixture[str]) -> None:
    """With one extra warm-up forward, 1F1B's and ZB1P's last rank pairs every steady step (8 micro-batches - 1);
    the schedules without a warm-up rule are as without it."""
    stage = Costs(F=1, B=2, W=1)
    plain = {(r.schedule, r.overlap): r for r, _ in compare(4, stage, a2a=0.5)}
    warm = {(r.schedule, r.overlap): r for r, _ in compare(4, stage, a2a=0.5, extra_warmup=1)}
    for name in ("1f1b", "zb1p"):
        assert plain[(name, True)].pairs == 0 and warm[(name, True)].pairs == 7
        assert warm[(name, True)].extra_warmup == 1
        assert warm[(name, True)].exposed_a2a < warm[(name, False)].exposed_a2a
    assert warm[("dualpipev", True)] == plain[("dualpipev", True)]
    main(["--compare", "--ranks", "4", "--a2a", "0.5", "--extra-warmup", "1"])
    out = capsys.readouterr().out
    assert re.search(r"^1f1b\+w1 +yes +7 ", out, re.MULTILINE) and re.search(r"^dualpipev +yes", out, re.MULTILINE)

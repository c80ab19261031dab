"""The schedule comparison benchmark (simulated): its table agrees with the published formulas."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.schedules import compare, main
from dualpipe.schedule import SCHEDULES


@pytest.mark.parametrize("pp", [4, 8])
def test_published_bubbles_without_communication(pp: int) -> None:
    f, b, w = 1.0, 2.0, 1.0
    rows = {row.schedule: row for row, _ in compare(pp, 4 * pp, f, b, w, overlap=1.0)}
    assert rows["1f1b"].bubble == pytest.approx((pp - 1) * (f + b))
    assert rows["zb1p"].bubble == pytest.approx((pp - 1) * (f + b - 2 * w))
    assert rows["dualpipe"].bubble == pytest.approx((pp / 2 - 1) * ((f + b) + b - 3 * w))
    assert rows["dualpipe"].parameter_copies == 2 and rows["dualpipev"].parameter_copies == 1
    assert rows["dualpipe"].peak_activations == pp + 1 and rows["1f1b"].peak_activations == pp
    # interleaved 1F1B, v = 2 virtual stages per rank: Megatron's (PP-1)(F+B)/v, PP + (PP-1)/v activations less
    # the module a steady F-then-B holds between its halves (its steps are pairs: FB adds one and frees one)
    assert rows["interleaved-1f1b"].bubble == pytest.approx((pp - 1) * (f + b) / 2)
    assert rows["interleaved-1f1b"].peak_activations == pp + (pp - 2) / 2
    # the zero-bubble V family (a module is half a stage, so here F = I = W per module pass): ZBV idles only the
    # last rank's wait for the first forward, pp - 1 module forwards, half of ZB1P's bubble at its memory;
    # V-Half and V-Min give bubble back for a half and about a third of that memory
    assert rows["zbv"].bubble == pytest.approx((pp - 1) * f / 2)
    assert rows["zbv"].peak_activations == pp and rows["zbv"].parameter_copies == 1
    assert rows["v-half"].peak_activations <= pp / 2 + 1 and rows["v-min"].peak_activations <= math.ceil((pp + 4) / 3)
    assert rows["zbv"].bubble < rows["v-half"].bubble < rows["v-min"].bubble


def test_hidden_communication_shortens_the_dualpipe_family() -> None:
    rows = {row.schedule: row for row, _ in compare(8, 32, 1.0, 2.0, 1.0, overlap=1.0, comm=0.5)}
    assert rows["dualpipe"].makespan < rows["zb1p"].makespan < rows["1f1b"].makespan
    assert rows["dualpipev"].makespan < rows["zb1p"].makespan


def test_cli_writes_json_and_timelines(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert main(["--pp", "4", "--picture-pp", "4", "--out", str(tmp_path)]) == 0
    (data,) = tmp_path.glob("schedules-simulated-*.json")
    rows = json.loads(data.read_text())["rows"]
    assert {r["schedule"] for r in rows} == set(SCHEDULES)  # every registered schedule, nothing named here
    assert len(list(tmp_path.glob("timeline-*-pp4.png"))) == len(SCHEDULES)

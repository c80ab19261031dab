"""``python -m moe.plan --compare-schedules``: every schedule at one layout, with and without overlap, as the
planner evaluates one candidate."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from dualpipe.schedule import SCHEDULES, schedule_spec
from moe.models.config import preset
from moe.plan.cli import main
from moe.plan.compare import layout_candidate
from moe.plan.hardware import Cluster, gpu
from moe.plan.report import GIB, RunShape, evaluate
from tests.moe.plan.test_cli import SMALL

COMPARE = [*SMALL, "--compare-schedules", "--pp", "2", "--ep", "2", "--recompute", "none"]


@pytest.fixture(scope="module")
def doc(tmp_path_factory: pytest.TempPathFactory) -> dict:
    path = tmp_path_factory.mktemp("cmp") / "cmp.json"
    assert main([*COMPARE, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_every_schedule_with_and_without_overlap(doc: dict) -> None:
    assert doc["layout"] == {"schedule": "dualpipev", "pp": 2, "dp": 4, "ep": 2, "num_chunks": 8, "comm_sms": 20,
                             "recompute": "none", "pipeline_layout": "auto", "extra_warmup": 0,
                             "overlap": True, "offload": ""}  # fmt: skip
    ran = [(r["label"], r["overlap"]) for r in doc["rows"] if "overlap" in r]
    refused = [r["label"] for r in doc["rows"] if "overlap" not in r]
    # the 1F1B family again with one extra warm-up forward, right after its own rows (where it runs at all)
    again = {s for s in SCHEDULES if schedule_spec(s).warmup is not None and s not in refused}
    names = [n for s in SCHEDULES for n in (s, f"{s}+w1")[: 1 + (s in again)]]
    assert again == {"1f1b", "zb1p", "interleaved-1f1b"}
    assert sorted({name for name, _ in ran} | set(refused)) == sorted(names)
    assert ran == [(name, o) for name in names if name not in refused for o in (True, False)]
    rows = {(r["label"], r["overlap"]): r for r in doc["rows"] if "overlap" in r}
    assert {name: rows[name, True]["parameter_copies"] for name, _ in ran} == {
        name: 2 if name == "dualpipe" else 1 for name, _ in ran
    }
    for name, _ in ran:
        with_, without = rows[name, True], rows[name, False]
        assert with_["memory_gib"] == without["memory_gib"] == with_["memory_bytes"]["total"] / GIB
        if with_["pairs"]:  # the pairs hide all-to-all, and only they change the step
            assert with_["exposed_a2a_fraction"] < without["exposed_a2a_fraction"]
            if not schedule_spec(with_["schedule"]).pairs_for_overlap:  # the same order both ways
                assert with_["step_time_s"] < without["step_time_s"]
        else:
            assert with_ | {"overlap": False} == without
    assert rows["dualpipev", True]["pairs"] > 0
    # the V family's pairs exist only to be overlapped: without overlap it runs its plan unpaired, which at this
    # tiny shape, where the all-to-all is next to nothing, v-half's two pairs do not pay for the sends they hold back
    assert rows["zbv", True]["step_time_s"] < rows["zbv", False]["step_time_s"]
    assert rows["v-half", True]["pairs"] == 2
    assert rows["v-half", True]["step_time_s"] > rows["v-half", False]["step_time_s"]


def test_rows_are_the_planners_evaluation(doc: dict) -> None:
    cfg = preset("tiny")
    cluster = Cluster(gpu("h100"), 8, 4)
    run = RunShape(64, 64, 2)
    layout = layout_candidate(cfg, cluster, run, pp=2, ep=2, recompute="none", comm_sms=20)
    rows = {(r["label"], r["overlap"]): r for r in doc["rows"] if "overlap" in r}
    for overlap in (True, False):
        p = evaluate(cfg, cluster, run, dataclasses.replace(layout, schedule="dualpipe"), overlap=overlap)
        row = rows["dualpipe", overlap]
        assert row["step_time_s"] == p.step_time and row["exposed_a2a_fraction"] == p.exposed_a2a_fraction
    # the search (overlap on) predicts what the table's overlapped row says
    assert (
        rows["dualpipe", True]["step_time_s"]
        == evaluate(cfg, cluster, run, dataclasses.replace(layout, schedule="dualpipe")).step_time
    )


def test_the_text_matches_the_json(doc: dict, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(COMPARE) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("every schedule at pp=2 dp=4 ep=2 chunks=8")
    cells = {}
    for line in lines[2:]:
        c = re.split(r"\s{2,}", line.strip())
        cells[c[0], c[1]] = c
    for r in doc["rows"]:
        if "overlap" not in r:
            assert r["note"] in cells[r["label"], "-"][-1]
            continue
        c = cells[r["label"], "yes" if r["overlap"] else "no"]
        assert c[2] == str(r["pairs"]) and c[5] == f"{r['bubble_fraction']:.1%}"
        assert c[8] == f"{r['memory_gib']:.1f}" and c[10] == f"{r['parameter_copies']:g}"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--pp", "3"], "--pp 3 does not divide --gpus 8"),
        (["--ep", "3"], "--ep 3 must divide dp"),
        (["--recompute", "all"], "takes one --recompute granularity"),
    ],
)
def test_bad_layouts_are_one_line_errors(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*COMPARE, *extra])
    assert message in str(exc.value) + capsys.readouterr().err


def test_pp_belongs_to_the_comparison() -> None:
    with pytest.raises(SystemExit, match="--pp is --compare-schedules's layout"):
        main([*SMALL, "--pp", "2"])
    with pytest.raises(SystemExit, match="--compare-schedules needs --pp"):
        main([*SMALL, "--compare-schedules"])

"""``moe.plan --published``: the registry of published runs (moe/plan/published.py) and their reruns
(moe/plan/reruns.py)."""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import pytest

from moe.models.config import preset
from moe.plan import report
from moe.plan.cli import main
from moe.plan.hardware import Cluster, gpu
from moe.plan.published import DEEPSEEK_V3_REPORT, RUNS, SKIPPED, PublishedRun
from moe.plan.report import RunShape, evaluate, v3_side_by_side
from moe.plan.reruns import GAP_SHOWN, gap, published_side_by_side, published_table, rerun


@functools.cache
def _rows() -> tuple[dict, ...]:
    return tuple(published_side_by_side())


def test_every_run_has_a_source_that_states_its_published_number() -> None:
    for r in RUNS:
        published = f"{r.tokens_per_s_per_gpu:,.0f}"
        quotes = [s.quote for s in r.sources]
        assert any(published in q or published.replace(",", "") in q for q in quotes), (r.name, published)
        assert all(s.where.strip() and s.quote.strip() for s in r.sources), r.name


def test_a_run_with_tensor_or_context_parallelism_is_refused() -> None:
    with pytest.raises(ValueError, match="TP=2 CP=1 is not expressible"):
        dataclasses.replace(DEEPSEEK_V3_REPORT, tensor_parallel=2)
    with pytest.raises(ValueError, match="CP=2 is not expressible"):
        dataclasses.replace(DEEPSEEK_V3_REPORT, context_parallel=2)
    assert all(r.tensor_parallel == r.context_parallel == 1 for r in RUNS)
    assert any("TP 2" in why for _, why in SKIPPED)


def test_a_run_whose_layout_does_not_hold_its_batch_is_refused() -> None:
    with pytest.raises(ValueError, match="global batch"):
        dataclasses.replace(DEEPSEEK_V3_REPORT, global_batch=2048)


def test_the_table_prints_every_run_with_its_sources() -> None:
    text = published_table(list(_rows()))
    for r in RUNS:
        assert r.name in text
        for s in r.sources:
            assert f"source: {s.where}: {s.quote}" in text
    for name, why in SKIPPED:
        assert f"{name}: {why}" in text


def _check_gap(r: PublishedRun) -> None:
    """The gap is the published step (recomputed from the record) less the planner's step (an evaluation of its
    own), its planner parts sum to that step, and the terms and the residual sum to the gap."""
    x = rerun(r)
    g = gap(x)
    again = evaluate(
        preset(r.model), Cluster(gpu(r.gpu), r.gpus, r.gpus_per_node),
        RunShape(r.seq_len, r.global_batch, r.micro_batch, r.precision), x.prediction.candidate, options=r.options,
    )  # fmt: skip
    assert g.planner_step == pytest.approx(again.step_time, rel=1e-12)
    published = r.seq_len * r.global_batch / (r.tokens_per_s_per_gpu * r.gpus)
    assert g.published_step == pytest.approx(published, rel=1e-12)
    assert sum(g.parts.values()) == pytest.approx(g.planner_step, rel=1e-9)
    assert all(v >= -1e-9 for v in g.parts.values()), g.parts
    assert sum(t for _, t, _ in g.terms) + g.residual == pytest.approx(published - again.step_time, rel=1e-9)
    assert all(src.strip() for _, _, src in g.terms)


@pytest.mark.parametrize("r", RUNS, ids=[r.name for r in RUNS])
def test_the_gap_terms_and_residual_sum_to_the_gap(r: PublishedRun) -> None:
    _check_gap(r)


def test_the_gap_is_broken_down_past_the_margin_only() -> None:
    for row in _rows():
        assert ("gap" in row) == (abs(row["ratio"] - 1) > GAP_SHOWN), row["name"]
        if "gap" in row:
            g = row["gap"]
            terms = sum(t["seconds"] for t in g["terms"])
            assert terms + g["residual_s"] == pytest.approx(g["gap_s"], rel=1e-9)


def test_the_v3_entry_is_the_deepseek_v3_side_by_side(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same evaluation as ``--deepseek-v3``'s (not a copy of its number): the report's layout at the planner's
    stage layout. The other schedules it sets beside (``schedules``, the slow part) are left out."""
    monkeypatch.setattr(report, "_beside", lambda *args: [])
    side = v3_side_by_side(preset("deepseek-v3"), Cluster(gpu("h800"), 2048, 8), RunShape(4096, 15360, 1))
    (row,) = [row for row in _rows() if row["name"] == DEEPSEEK_V3_REPORT.name]
    assert row["tokens_per_s_per_gpu"]["planner"] == side["tokens_per_s_per_gpu"]["planner"]
    assert row["tokens_per_s_per_gpu"]["published"] == side["tokens_per_s_per_gpu"]["report"]
    assert row["memory_gib"]["planner"] == side["memory_gib"]["planner"]


def test_the_cli_prints_the_table_and_writes_the_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "published.json"
    assert main(["--published", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "planner tok/s/GPU" in text and "skipped (not expressible):" in text
    doc = json.loads(out.read_text())
    assert [row["name"] for row in doc["published"]] == [r.name for r in RUNS]
    assert len(doc["skipped"]) == len(SKIPPED)


def test_the_cli_refuses_published_with_the_search_flags() -> None:
    with pytest.raises(SystemExit, match=r"^error: --published reruns the published runs at their own layouts"):
        main(["--published", "--deepseek-v3"])

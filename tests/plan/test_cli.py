"""``python -m moe.plan``: its JSON schema, its table and picture, and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe.plan.cli import JSON_SCHEMA_VERSION, main

SMALL = ["--preset", "tiny", "--gpus", "8", "--gpus-per-node", "4", "--gpu", "h100", "--seq-len", "64"]
SMALL += ["--global-batch", "64", "--micro-batch", "2"]

ROW_KEYS = {
    "schedule", "pp", "dp", "ep", "edp", "num_chunks", "comm_sms", "recompute", "memory_options", "step_time_s",
    "pipeline_time_s",
    "dp_reduce_time_s", "tokens_per_s_per_gpu", "mfu", "bubble_fraction", "exposed_a2a_fraction", "memory_bytes",
    "fits",
}  # fmt: skip


def test_json_schema(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert main([*SMALL, "--json", str(out), "--png", str(tmp_path / "plan.png")]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == JSON_SCHEMA_VERSION
    assert set(doc) == {"schema", "inputs", "num_candidates", "num_fitting", "best", "top"}
    assert doc["inputs"]["gpus"] == 8 and "H100" in doc["inputs"]["gpu"]["name"].upper()
    assert 0 < doc["num_fitting"] <= doc["num_candidates"]
    assert doc["best"] == doc["top"][0] and len(doc["top"]) <= 10
    for row in doc["top"]:
        assert set(row) == ROW_KEYS
        assert row["pp"] * row["dp"] == 8 and row["dp"] % row["ep"] == 0
        assert row["memory_bytes"]["total"] == pytest.approx(
            sum(v for k, v in row["memory_bytes"].items() if k != "total")
        )
        assert 0 <= row["bubble_fraction"] < 1 and 0 <= row["exposed_a2a_fraction"] <= 1 and 0 < row["mfu"] < 1
    fitting = [r["step_time_s"] for r in doc["top"] if r["fits"]]
    assert fitting == sorted(fitting)  # the fitting ones first, fastest first
    assert (tmp_path / "plan.png").stat().st_size > 1000


def test_table_and_deepseek_v3_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--gpus", "2048", "--schedules", "dualpipe", "--recompute", "on", "--deepseek-v3", "--top", "3"])
    text = capsys.readouterr().out
    assert "candidates," in text and "why it loses" in text
    for line in ("bubble per step", "compute : all-to-all", "memory per GPU", "tokens/s per GPU", "1,543"):
        assert line in text


def test_errors_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="2"):
        main([*SMALL, "--gpus", "0"])
    bad = tmp_path / "bad.json"
    bad.write_text('{"hidden_sizes": 3}')
    with pytest.raises(SystemExit, match="--config"):
        main([*SMALL[2:], "--config", str(bad)])
    with pytest.raises(SystemExit, match="no layout runs a global batch of 7"):
        main([*SMALL[:-4], "--global-batch", "7", "--micro-batch", "2"])


def test_measured_costs_describe_the_machine_they_came_from(tmp_path: Path) -> None:
    """The emulated cluster's costs file alone: its model, its achieved rates and links, no SMs to reserve."""
    costs = next(Path(__file__).resolve().parents[2].glob("bench/results/costs-cpu-*-emulated-*.json"))
    out = tmp_path / "plan.json"
    argv = ["--costs", str(costs), "--gpus", "2", "--gpus-per-node", "1", "--seq-len", "64", "--recompute", "both"]
    assert main([*argv, "--global-batch", "192", "--micro-batch", "4", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    measured = json.loads(costs.read_text())
    assert doc["inputs"]["model"]["hidden_size"] == measured["config"]["hidden_size"]
    assert doc["inputs"]["gpu"]["internode_bytes_per_s"] == measured["internode_bytes_per_s"]
    assert all(row["comm_sms"] == 0 for row in doc["top"])  # a CPU rank's transfers take no SMs
    assert {row["ep"] for row in doc["top"]} >= {1, 2}

"""``python -m moe.plan``: its JSON schema, its table and picture, and its errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dualpipe.schedule import SCHEDULES
from moe.models.config import PRESETS
from moe.pipeline_layout import expand
from moe.plan.cli import JSON_SCHEMA_VERSION, main
from moe.plan.layouts import LAYOUT_SHIFTS
from moe.plan.params import auto_layout
from moe.plan.report import V3_LAYOUT

SMALL = ["--preset", "tiny", "--gpus", "8", "--gpus-per-node", "4", "--gpu", "h100", "--seq-len", "64"]
SMALL += ["--global-batch-size", "64", "--micro-batch-size", "2"]

ROW_KEYS = {
    "schedule", "pp", "dp", "ep", "edp", "num_chunks", "comm_sms", "recompute", "pipeline_layout", "extra_warmup",
    "overlap", "offload", "memory_options",
    "step_time_s",
    "pipeline_time_s",
    "dp_reduce_time_s", "tokens_per_s_per_gpu", "mfu", "bubble_fraction", "exposed_a2a_fraction", "memory_bytes",
    "fits",
}  # fmt: skip


def test_json_schema(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    assert main([*SMALL, "--json", str(out), "--png", str(tmp_path / "plan.png")]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == JSON_SCHEMA_VERSION
    assert set(doc) == {
        "schema",
        "inputs",
        "num_candidates",
        "num_fitting",
        "num_skipped",
        "num_untimed",
        "best",
        "top",
    }
    assert doc["num_fitting"] + doc["num_skipped"] <= doc["num_candidates"] and doc["num_untimed"] >= 0
    assert doc["inputs"]["gpus"] == 8 and "H100" in doc["inputs"]["gpu"]["name"].upper()
    assert 0 < doc["num_fitting"] <= doc["num_candidates"]
    assert doc["best"] == doc["top"][0] and len(doc["top"]) <= 10
    for row in doc["top"]:
        assert set(row) == ROW_KEYS
        assert row["pp"] * row["dp"] == 8 and row["dp"] % row["ep"] == 0
        assert row["memory_bytes"]["total"] == pytest.approx(
            sum(v for k, v in row["memory_bytes"].items() if k not in ("total", "host"))
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


def test_one_line_per_class_of_losing_candidates(capsys: pytest.CaptureFixture[str]) -> None:
    """Every candidate but the best falls in one class (memory, bubble, comm, dp or close), each class one line
    with its count and its closest candidate."""
    main([*SMALL, "--top", "1000"])  # every timed candidate in the table
    text = capsys.readouterr().out
    total = int(re.search(r"^(\d+) candidates, (\d+) fit", text, flags=re.M)[1])
    fit = int(re.search(r"^(\d+) candidates, (\d+) fit", text, flags=re.M)[2])
    counts = dict(re.findall(r"^(memory|bubble|comm|dp|close): (\d+) ", text, flags=re.M))
    assert counts and all(text.count(f"\n{k}: ") == 1 for k in counts)
    assert int(counts.get("memory", 0)) == total - fit
    rows = text.split("why it loses\n")[1].split("\n\n")[0].splitlines()
    assert sum(int(v) for k, v in counts.items() if k != "memory") == len(rows) - 1  # every timed one but the best


def test_the_ema_is_host_memory_beside_the_gpus(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--ema``: the same plan, GPU bytes for GPU bytes; the average's bytes reported as host memory."""
    docs = {}
    for name, extra in (("off", []), ("on", ["--ema"])):
        out = tmp_path / f"{name}.json"
        assert main([*SMALL, "--recompute", "off", "--top", "3", *extra, "--json", str(out)]) == 0
        docs[name] = json.loads(out.read_text())
    text = capsys.readouterr().out
    assert text.count("host memory per rank") == 1 and "the moving average of the weights (no GPU memory)" in text
    for off, on in zip(docs["off"]["top"], docs["on"]["top"], strict=True):
        host = on["memory_bytes"].pop("host")
        assert off["memory_bytes"].pop("host") == 0 and host > 0
        assert on["memory_bytes"] == off["memory_bytes"] and on["memory_options"]["ema_on_host"]
        assert on["step_time_s"] == off["step_time_s"]


def test_errors_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"^error: --gpus must be positive \(see --help\)$"):
        main([*SMALL, "--gpus", "0"])
    bad = tmp_path / "bad.json"
    bad.write_text('{"hidden_sizes": 3}')
    with pytest.raises(SystemExit, match="--config"):
        main([*SMALL[2:], "--config", str(bad)])
    with pytest.raises(SystemExit, match="no layout runs a global batch of 7"):
        main([*SMALL[:-4], "--global-batch-size", "7", "--micro-batch-size", "2"])


def test_an_unevenly_loaded_expert_group_runs_at_its_busiest_rank(tmp_path: Path, capsys) -> None:
    """``--expert-imbalance``: every candidate with expert parallelism is timed at its busiest rank's pace; a
    value under 1 is one line naming the flag."""
    docs = {}
    for x in ("1", "1.5"):
        out = tmp_path / f"{x}.json"
        assert main([*SMALL, "--expert-imbalance", x, "--top", "100", "--json", str(out)]) == 0
        docs[x] = json.loads(out.read_text())
    assert docs["1.5"]["inputs"]["expert_imbalance"] == 1.5
    even, skewed = ({_key(r): r for r in d["top"]} for d in docs.values())
    with_ep = [k for k in even if even[k]["ep"] > 1 and k in skewed]
    assert with_ep and all(skewed[k]["step_time_s"] > even[k]["step_time_s"] for k in with_ep)
    assert all(skewed[k]["step_time_s"] == even[k]["step_time_s"] for k in even if even[k]["ep"] == 1 and k in skewed)
    with pytest.raises(
        SystemExit, match=r"^error: --expert-imbalance 0\.5: the busiest rank over the mean is at least 1"
    ):
        main([*SMALL, "--expert-imbalance", "0.5"])


def test_the_batch_flags_share_the_trainers_names_and_keep_the_old_ones(tmp_path: Path) -> None:
    """``--global-batch-size`` and ``--micro-batch-size`` as in moe.train; ``--global-batch`` and ``--micro-batch``
    still read; an unknown flag names the nearest one."""
    docs = []
    for names in (("--global-batch-size", "--micro-batch-size"), ("--global-batch", "--micro-batch")):
        out = tmp_path / "plan.json"
        argv = [*SMALL[:-4], names[0], "32", names[1], "4", "--recompute", "off", "--top", "3", "--json", str(out)]
        assert main(argv) == 0
        docs.append(json.loads(out.read_text()))
    assert docs[0] == docs[1] and docs[0]["inputs"]["global_batch"] == 32 and docs[0]["inputs"]["micro_batch"] == 4
    with pytest.raises(
        SystemExit, match=r"^error: unrecognized arguments: --seq-lenn 64 \(did you mean '--seq-len'\?\)$"
    ):
        main([*SMALL, "--seq-lenn", "64"])
    with pytest.raises(SystemExit, match=r"invalid choice: 'h1000' .*\(did you mean 'h100'\?\)$"):
        main([*SMALL, "--gpu", "h1000"])


def _key(row: dict) -> tuple:
    return tuple(
        str(row[k])
        for k in ("schedule", "pp", "dp", "ep", "num_chunks", "comm_sms", "recompute", "extra_warmup", "overlap")
    )


def test_measured_costs_describe_the_machine_they_came_from(tmp_path: Path) -> None:
    """The emulated cluster's costs file alone: its model, its achieved rates and links, no SMs to reserve."""
    costs = next(Path(__file__).resolve().parents[3].glob("bench/results/costs-cpu-*-emulated-*.json"))
    out = tmp_path / "plan.json"
    argv = ["--costs", str(costs), "--gpus", "2", "--gpus-per-node", "1", "--seq-len", "64", "--recompute", "both"]
    assert (
        main([*argv, "--global-batch-size", "192", "--micro-batch-size", "4", "--top", "40", "--json", str(out)]) == 0
    )
    doc = json.loads(out.read_text())
    measured = json.loads(costs.read_text())
    assert doc["inputs"]["model"]["hidden_size"] == measured["config"]["hidden_size"]
    assert doc["inputs"]["gpu"]["internode_bytes_per_s"] == measured["internode_bytes_per_s"]
    assert all(row["comm_sms"] == 0 for row in doc["top"])  # a CPU rank's transfers take no SMs
    assert {row["ep"] for row in doc["top"]} >= {1, 2}


def test_model_takes_a_preset_or_a_checkpoint_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--model NAME`` (``--preset`` is the same flag) or a Hugging Face directory, read by moe.hf; an unknown
    name is one line."""
    from moe.hf import to_hf_config
    from moe.models.config import PRESETS

    argv = SMALL[2:]
    out = tmp_path / "plan.json"
    assert main(["--model", "qwen3-moe-tiny", *argv, "--recompute", "off", "--json", str(out)]) == 0
    by_name = json.loads(out.read_text())
    assert by_name["inputs"]["model_source"] == {"kind": "preset", "name": "qwen3-moe-tiny"}
    assert by_name["inputs"]["preset"] == "qwen3-moe-tiny"
    assert main(["--preset", "qwen3-moe-tiny", *argv, "--recompute", "off", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["best"] == by_name["best"]
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(to_hf_config(PRESETS["qwen3-moe-tiny"])))
    assert main(["--model", str(ckpt), *argv, "--recompute", "off", "--json", str(out)]) == 0
    from_dir = json.loads(out.read_text())
    assert from_dir["inputs"]["model_source"] == {"kind": "hf", "name": str(ckpt)}
    assert from_dir["inputs"]["model"]["attention"] == "gqa-qk-norm" and from_dir["best"] == by_name["best"]
    capsys.readouterr()
    with pytest.raises(SystemExit, match=r"^error: --model qwen9: neither a preset \(.*\) nor a checkpoint directory$"):
        main(["--model", "qwen9", *argv])
    (ckpt / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(SystemExit, match=r"^error: --model .*ckpt: model_type 'llama' is not supported"):
        main(["--model", str(ckpt), *argv])


def _first_stage_layers(layout: str) -> int:
    return expand(layout).split("|")[0].count("t")


def test_deepseek_v3_side_by_side_in_the_json(tmp_path: Path) -> None:
    """The report's layout and memory options for the deepseek-v3 preset (its MTP module on the last stage),
    each figure beside the report's: the memory the footprint gives, the tokens/s of 14.8T tokens in 2,664K
    H800 GPU hours, the bubble."""
    out = tmp_path / "v3.json"
    argv = ["--model", "deepseek-v3", "--gpus", "2048", "--gpu", "h800", "--schedules", "dualpipe"]
    assert main([*argv, "--recompute", "selective", "--top", "1", "--deepseek-v3", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == JSON_SCHEMA_VERSION and doc["inputs"]["model"]["mtp_layers"] == 1
    v3 = doc["deepseek_v3"]
    layout = v3["layout"]
    assert (layout["schedule"], layout["pp"], layout["dp"], layout["ep"], layout["num_chunks"]) == (
        "dualpipe", 16, 128, 64, 120,
    )  # fmt: skip
    assert v3["options"] == {
        "recompute": "selective",
        "optimizer_state_dtype": "bfloat16",
        "mtp_shares_embedding_and_head": True,
        "fp8_activations": True,
        "ema_on_host": False,
    }
    assert layout["memory_options"] == v3["options"]
    mem = v3["memory_gib"]
    assert mem["planner"] == pytest.approx(layout["memory_bytes"]["total"] / 2**30)
    assert mem["report"] == pytest.approx(80e9 / 2**30) and mem["fits"] == layout["fits"]
    assert mem["planner"] < 0.6 * mem["without_options"]
    # both figures: the planner's layout (auto's, or one with layers moved off the first stage: a shift of auto's
    # or, where none fits, a memory descent) and Megatron-Core's V3 example at 16 stages, each its fullest rank of
    # 16; auto's beside them
    lay = v3["memory_gib_layout"]
    auto = auto_layout(PRESETS["deepseek-v3"], 16, "dualpipe")
    assert mem["auto_layout"] == auto and lay["pipeline_layout"] == V3_LAYOUT
    assert mem["pipeline_layout"] == "auto" or _first_stage_layers(mem["pipeline_layout"]) < _first_stage_layers(auto)
    assert mem["planner"] <= mem["auto"] or not mem["fits"]
    # nothing fits the planner's headroom at this layout: the least memory of the layouts it tried, below auto's
    least = mem["least"]
    assert least["layouts_tried"] > 1 + len(LAYOUT_SHIFTS) and least["planner"] <= mem["planner"] < mem["auto"]
    for m in (mem, lay):
        assert len(m["per_rank"]) == 16 and max(r["total"] for r in m["per_rank"]) == pytest.approx(m["planner"])
        assert m["per_rank"][m["pp_rank"]]["total"] == pytest.approx(m["planner"])
        assert m["within_hbm"] == (m["planner"] <= mem["report"])
    # auto balances compute and leaves five layers on the first stage, the one with the most micro-batches in
    # flight: a lighter first stage holds less, and the planner takes it
    assert mem["pipeline_layout"] != "auto" and mem["planner"] < mem["auto"]
    tok = v3["tokens_per_s_per_gpu"]
    assert tok["report"] == pytest.approx(14.8e12 / (2664e3 * 3600)) and round(tok["report"]) == 1543
    assert tok["planner"] == pytest.approx(layout["tokens_per_s_per_gpu"]) and 500 < tok["planner"] < 5000
    assert v3["bubble_s"]["planner"] > 0 and v3["bubble_s"]["report_formula_with_our_costs"] > 0
    assert {"compute_to_a2a", "mfu", "exposed_a2a_fraction"} <= set(v3)
    # every other registered schedule beside DualPipe at the same parallelism, or why it cannot run there
    assert [o["schedule"] for o in v3["schedules"]] == [s for s in SCHEDULES if s != "dualpipe"]
    for o in v3["schedules"]:
        assert "note" in o or (o["memory_gib"] > 0 and 0 < o["tokens_per_s_per_gpu"] < 5000), o
    # the report's layout does not fit the planner's headroom as it is; moving half of each stage's blocks' saved
    # tensors to the host does, at the same speed (the copies hide under compute); without recompute it needs all
    # of them moved, and the host link then sets the pace
    off = v3["offload"]
    assert not mem["fits"] and off["selective"]["policy"] == "fraction=0.5" and off["selective"]["fits"]
    assert off["selective"]["memory_gib"] < mem["planner"] - 10
    assert off["selective"]["tokens_per_s_per_gpu"] == pytest.approx(tok["planner"], rel=1e-3)
    assert off["none"]["policy"] == "all" and off["none"]["fits"]
    assert off["none"]["tokens_per_s_per_gpu"] < 0.6 * tok["planner"]


def test_default_global_batch_fits_the_cluster() -> None:
    """Without ``--global-batch-size`` the batch is ``--tokens-per-gpu`` on every GPU in whole micro-batches (not
    DeepSeek-V3's 15,360 sequences, which ``--deepseek-v3`` keeps)."""
    from moe.plan.cli import default_global_batch, global_batch, parse_args

    assert default_global_batch(64, 4096, 1) == 256  # 16,384 tokens per GPU: 4 sequences of 4,096
    assert default_global_batch(2048, 4096, 2) == 2 * 2 * 2048  # 2 micro-batches of 2 per GPU
    assert default_global_batch(8, 65536, 1) == 8  # at least one micro-batch per GPU
    base = ["--gpus", "64", "--seq-len", "4096"]
    assert global_batch(parse_args(base)) == 256
    assert global_batch(parse_args([*base, "--tokens-per-gpu", "4096"])) == 64
    assert global_batch(parse_args([*base, "--deepseek-v3"])) == 15360
    assert global_batch(parse_args([*base, "--global-batch", "96"])) == 96

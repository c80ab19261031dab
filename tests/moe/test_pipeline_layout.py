"""Pipeline layouts (Megatron-Core's syntax): what each stage holds, the one-line refusals, and training under an
uneven layout (a stage holding only the head and the MTP module) equal to one process, its checkpoint resumed
under another layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe.models.config import preset
from moe.parallel import ParallelConfig
from moe.pipeline_layout import expand, plan_stages


def test_megatrons_deepseek_v3_example_expands_to_its_32_stages() -> None:
    stages = expand("Et*3|(tt|)*29m|L").split("|")
    assert len(stages) == 32 and stages[0] == "Ettt" and stages[1:30] == ["tt"] * 29 and stages[30:] == ["m", "L"]
    assert expand(" E t*2 | (t|) * 2 L ") == "Ett|t|t|L"
    plans = plan_stages("Et|tt|t|mL", num_stages=4, num_layers=4, mtp_layers=1)
    assert [(p.first, list(p.layers), p.mtp, p.last) for p in plans] == [
        (True, [0], 0, False),
        (False, [1, 2], 0, False),
        (False, [3], 0, False),
        (False, [], 1, True),
    ]


def test_a_layout_that_does_not_fit_is_one_line() -> None:
    cfg = preset("deepseek-v3-tiny")  # 4 layers, 1 MTP module
    cases = {
        "Et|tt|tmL": "3 stages, the schedule has 4",
        "Et|tt|t|L": "0 MTP modules (m), the model has 1",
        "Et|t|t|mL": "3 layers (t), the model has 4",
        "tE|tt|t|mL": "the embedding (E) comes once, first in the first stage",
        "Et|tt|tL|m": "the head (L) comes once, last in the last stage",
        "Ett|tt||mL": "stage 2 is empty",
        "E|tttm|t|L": "the MTP modules (m) go together after the last layer, on the stage of the head (L) or",
        "Et|tt|m|tL": "on the stage before a last stage of the head alone ('m|L')",
        "1f1b:Ett|tt|m|L": "an MTP stage of its own ('m|L') needs a schedule that runs the first and the last stage",
        "Et(t|tt|mL": "'(' is never closed",
        "Et|t*|tt|mL": "cannot read '*' at position 4",
    }
    for case, message in cases.items():
        schedule, _, layout = case.rpartition(":")
        pc = ParallelConfig(pp=4 if schedule else 2, schedule=schedule or "dualpipev", pipeline_layout=layout)
        with pytest.raises(ValueError) as err:
            pc.check_model(cfg)
        text = str(err.value)
        assert text.startswith(f"parallel.pipeline_layout = {layout!r}: ") and message in text, text
        assert "\n" not in text


@pytest.mark.slow
def test_an_uneven_layout_trains_like_one_process_and_resumes_under_another(tmp_path: Path) -> None:
    from tests.moe.train.test_trainer import losses, train, train_records

    args = ["--model", "deepseek-v3-tiny", "--seq-len", "16"]
    one = train(1, tmp_path, "one", *args, "--schedule", "1f1b", "--steps", "3", "--num-chunks", "8")
    ckpt = ["--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "2"]
    # DualPipeV at pp=2 x ep=2: stage 3 (on rank 0, beside the embedding's stage) holds only MTP and the head
    uneven = ["--pp", "2", "--ep", "2", "--num-chunks", "4", "--pipeline-layout", "Et|tt|t|mL"]
    # then the step-2 checkpoint, resumed under auto (Et|t|tt|mL: another split of the layers); in turn, one spawn
    auto = ["--pp", "2", "--ep", "2", "--num-chunks", "4", "--steps", "3"]
    runs = {"uneven": [*args, *uneven, "--steps", "3", *ckpt], "auto": [*args, *auto, *ckpt, "--resume"]}
    got = train_records(4, tmp_path, runs)
    for a, b in zip(one, got["uneven"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-5) and b["mtp_loss"] == pytest.approx(
            a["mtp_loss"], rel=2e-5
        )
    resumed = losses(got["auto"])
    assert sorted(resumed) == [3] and resumed[3] == pytest.approx(one[2]["loss"], rel=2e-5)


@pytest.mark.slow
def test_mtp_on_a_stage_of_its_own_trains_like_one_process(tmp_path: Path) -> None:
    """Megatron-Core's ``m|L``: the MTP module on the stage before a stage of the head alone, which takes the
    labels in forward and hands the hidden state on with the MTP loss attached. DualPipeV at pp=2 x ep=2 (the
    MTP stage on rank 1, its embedding copy kept equal over the embedding group) and DualPipe at pp=4 (the MTP
    stage on ranks 2 and 1, one per direction, each paired with its direction's first stage), both with
    overlap: the single process's losses and MTP losses."""
    from tests.moe.train.test_trainer import train, train_records

    args = ["--model", "deepseek-v3-tiny", "--seq-len", "16", "--steps", "2"]
    one = train(1, tmp_path, "one", *args, "--schedule", "1f1b", "--num-chunks", "8")
    v = ["--pp", "2", "--ep", "2", "--schedule", "dualpipev", "--num-chunks", "4", "--pipeline-layout", "Et|ttt|m|L"]
    dual = ["--pp", "4", "--schedule", "dualpipe", "--num-chunks", "8", "--pipeline-layout", "Ett|tt|m|L"]
    got = train_records(4, tmp_path, {name: [*args, *extra, "--overlap"] for name, extra in (("v", v), ("dual", dual))})
    for name, piped in got.items():  # both in turn on one spawn of 4 ranks
        for a, b in zip(one, piped, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=2e-5), name
            assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], rel=2e-5), name


@pytest.mark.slow
def test_the_embedding_and_the_head_on_stages_of_their_own_train_like_one_process(tmp_path: Path) -> None:
    """``E|tt|tt|L``: the first stage only looks the tokens up, the last only runs the head and the loss (no
    block on either), under DualPipeV with overlap at pp=2: the single process's losses."""
    from tests.moe.train.test_trainer import train

    args = ["--seq-len", "16", "--steps", "2"]
    one = train(1, tmp_path, "one", *args, "--schedule", "1f1b", "--num-chunks", "4")
    own = ["--pp", "2", "--schedule", "dualpipev", "--overlap", "--num-chunks", "4", "--pipeline-layout", "E|tt|tt|L"]
    piped = train(2, tmp_path, "own", *args, *own)
    for a, b in zip(one, piped, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-5)

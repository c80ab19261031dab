"""``python -m moe.convert`` both ways and the trainer's ``--save-hf``: a transformers-written checkpoint converted
to ours and back is the same tensors under the same names; a trained model exported at the end of training is
what converting its last checkpoint gives; a converted checkpoint resumes training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from moe.convert import ConvertError
from moe.convert import main as convert
from moe.hf import read_hf_config, read_safetensors
from tests.moe.hf import test_hf_deepseek_v3, test_hf_qwen3_moe
from tests.moe.train.test_trainer import train, train_each

pytest.importorskip("transformers")
pytest.importorskip("safetensors")


@pytest.mark.parametrize("build", [test_hf_qwen3_moe._hf_model, test_hf_deepseek_v3._hf_model], ids=["qwen", "dsv3"])
def test_hf_to_ours_and_back_is_the_same_tensors(build, tmp_path: Path) -> None:
    build().save_pretrained(tmp_path / "hf")
    step = convert([str(tmp_path / "hf"), str(tmp_path / "ours")])
    assert step == tmp_path / "ours" / "step_00000000" and (tmp_path / "ours" / "latest").read_text() == step.name
    meta = json.loads((step / "meta.json").read_text())
    assert meta["step"] == 0 and "world_size" not in meta  # no per-rank state to restore
    convert([str(tmp_path / "ours"), str(tmp_path / "back"), "--max-shard-size", "300000"])
    want, got = read_safetensors(tmp_path / "hf"), read_safetensors(tmp_path / "back")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert len(list((tmp_path / "back").glob("model-*-of-*.safetensors"))) > 1
    assert read_hf_config(tmp_path / "back") == read_hf_config(tmp_path / "hf")


@pytest.mark.slow
def test_save_hf_at_the_end_of_training_and_a_converted_checkpoint_resumes(tmp_path: Path) -> None:
    run = ["--model", "qwen3-moe-tiny", "--schedule", "1f1b", "--num-chunks", "2", "--steps", "2"]
    ckpt = ["--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "2"]
    zero = ["--pp", "1", "--dp", "2", "--zero", "1", "--dtype", "bfloat16"]  # fp32 masters saved as 2 chunks of rows
    train(2, tmp_path, "trained", *run, *zero, *ckpt, "--save-hf", str(tmp_path / "hf"))
    stored = dcp.FileSystemReader(tmp_path / "ckpt" / "step_00000002").read_metadata().state_dict_metadata
    assert len(stored["model.embed.weight"].chunks) == len(stored["model.blocks.0.experts.w1.e0"].chunks) == 2
    # the export equals our last checkpoint converted (fp32 masters rounded as the bf16 weights were), tensor for
    # tensor: each key read from the chunks of both ranks' files
    convert([str(tmp_path / "ckpt"), str(tmp_path / "converted"), "--dtype", "bfloat16"])
    exported, converted = read_safetensors(tmp_path / "hf"), read_safetensors(tmp_path / "converted")
    assert sorted(exported) == sorted(converted) and all(torch.equal(exported[k], converted[k]) for k in converted)
    assert (tmp_path / "hf" / "config.json").read_text() == (tmp_path / "converted" / "config.json").read_text()
    # back to ours: training resumes from it (step 0, fresh AdamW state) as it starts from the directory itself
    convert([str(tmp_path / "hf"), str(tmp_path / "ours")])
    again = ["--steps", "1", "--schedule", "1f1b", "--num-chunks", "2"]
    # (the preset's own initial weights differ from the trained ones: the loss below needs the checkpoint's)
    resume = ["--model", "qwen3-moe-tiny", "--ckpt-dir", str(tmp_path / "ours"), "--resume"]
    got = train_each(1, tmp_path, {"resumed": [*again, *resume], "direct": [*again, "--model", str(tmp_path / "hf")]})
    assert got["resumed"][1] == pytest.approx(got["direct"][1], rel=1e-6)  # both in turn on one spawn


def test_bad_sources_and_targets_are_one_line(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("")
    test_hf_qwen3_moe._hf_model().save_pretrained(tmp_path / "hf")
    cases = [
        ([str(tmp_path / "empty"), str(tmp_path / "out")], "nor one of our checkpoints (a step_* directory"),
        ([str(tmp_path / "hf"), str(tmp_path / "used")], "used exists and is not an empty directory"),
        ([str(tmp_path / "hf"), str(tmp_path / "o"), "--max-shard-size", "9"], "--max-shard-size is for ours -> HF"),
    ]
    for argv, message in cases:
        with pytest.raises(ConvertError) as err:
            convert(argv)
        assert err.value.code.startswith("error: ") and message in err.value.code and "\n" not in err.value.code
    assert not (tmp_path / "out").exists() and sorted(p.name for p in (tmp_path / "used").iterdir()) == ["x"]


def test_save_hf_of_a_model_no_published_architecture_has_is_refused_before_training(tmp_path: Path) -> None:
    from moe.train.cli import config_from_args

    with pytest.raises(SystemExit) as err:  # the tiny preset's grouped-query attention is ours only
        config_from_args(["--preset", "tiny", "--save-hf", str(tmp_path / "hf")], 1)
    assert err.value.code == (
        "error: checkpoint.save_hf: MoEConfig.attention = 'gqa': no published architecture has it; "
        "qwen3_moe ('gqa-qk-norm'), deepseek_v3 ('mla') do"
    )

"""An export keeps what the model started from: config.json (changed only where training changed it), the
tokenizer files and generation_config.json, byte for byte, and files written with the user's umask. Both export
paths: ``python -m moe.convert`` (HF -> ours -> HF, the source gone before the way back) and ``--save-hf`` at the
end of training (in this process, world 1), then ``moe.convert`` of that run's checkpoint after the source is
gone; every export loads in transformers."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moe.convert import main as convert
from moe.hf import read_safetensors
from moe.train.manifest import MANIFEST, CheckpointError, verify_checkpoint
from tests.moe.hf import test_hf_qwen3_moe

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

pytestmark = pytest.mark.slow  # the fixture trains twice and converts three times (about 10 s on 2 cores)

KEPT = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")
"""What PreTrainedTokenizerFast.save_pretrained and the model's save_pretrained write besides config + weights."""


@contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _source(path: Path) -> None:
    """A Qwen3-MoE as transformers saves it, with what the export must keep: a context of 1024 (not the 32768
    default), bos/eos ids, a generation config and a BPE tokenizer trained on a few lines."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    model = test_hf_qwen3_moe._hf_model()
    model.config.max_position_embeddings = 1024
    model.config.bos_token_id, model.config.eos_token_id = 1, 2
    model.generation_config = transformers.GenerationConfig(bos_token_id=1, eos_token_id=2, max_new_tokens=7)
    model.save_pretrained(path)
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    lines = ["the pipeline hides the all-to-all behind compute", "experts route tokens", "a tiny model"]
    tok.train_from_iterator(lines * 4, trainers.BpeTrainer(vocab_size=100, special_tokens=["<unk>", "<s>", "</s>"]))
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, **special).save_pretrained(path)


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The source and its exports (by name), each written under its umask (:data:`MASKS`)."""
    tmp = tmp_path_factory.mktemp("source")
    src = tmp / "src"
    _source(src)
    kept = tmp / "kept"  # the source as it was, for comparing after it is gone
    shutil.copytree(src, kept)
    out = {"source": kept}
    with umask(MASKS["converted"]):
        convert([str(src), str(tmp / "ours")])
        moved = tmp / "moved"
        src.rename(moved)  # the way back does not need the source
        convert([str(tmp / "ours"), str(out.setdefault("converted", tmp / "converted"))])
        moved.rename(src)
    with umask(MASKS["trained"]):
        _train_and_export(src, tmp)
    out["trained"] = tmp / "trained"
    out["run"] = tmp / "run"
    shutil.rmtree(src)  # the run's checkpoint carries what its export needs
    with umask(MASKS["from_run"]):
        convert([str(tmp / "run"), str(tmp / "from_run")])
    out["from_run"] = tmp / "from_run"
    return out


MASKS = {"converted": 0o027, "trained": 0o022, "from_run": 0o022}


def _train_and_export(src: Path, tmp: Path) -> None:
    """Train from ``src`` with one layer fewer (a [model] override) in this process: 2 steps saving a
    checkpoint, then resumed for 1 more (keeping 1 checkpoint: the first is pruned) and exported (--save-hf)."""
    from moe.train import Trainer, config_from_args

    np.save(tmp / "tokens.npy", np.random.default_rng(0).integers(0, 128, size=2048).astype(np.uint16))
    common = ["--model", str(src), "--layers", "3", "--data", str(tmp / "tokens.npy"), "--seq-len", "16"]
    common += ["--schedule", "1f1b", "--num-chunks", "2", "--val-every", "0", "--log-every", "100"]
    common += ["--ckpt-dir", str(tmp / "run"), "--ckpt-every", "1", "--keep-last", "1"]
    runs = [["--steps", "2"], ["--steps", "3", "--resume", "--save-hf", str(tmp / "trained")]]
    for extra in runs:
        trainer = Trainer(config_from_args([*common, *extra], 1)[0])
        try:
            trainer.train()
        finally:
            trainer.close()


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


@pytest.mark.parametrize("name", ["converted", "trained", "from_run"])
def test_max_position_embeddings_is_kept(exports, name: str) -> None:
    assert _config(exports[name])["max_position_embeddings"] == 1024


@pytest.mark.parametrize("name", ["converted", "trained", "from_run"])
def test_bos_and_eos_and_every_other_key_are_kept(exports, name: str) -> None:
    got, want = _config(exports[name]), _config(exports["source"])
    assert (got["bos_token_id"], got["eos_token_id"]) == (1, 2)
    if name == "converted":
        assert got == want  # nothing changed: the source's config.json, key for key
    else:  # trained with --layers 3: the one key that changed
        assert {k for k in want if got.get(k) != want[k]} == {"num_hidden_layers"}
        assert got["num_hidden_layers"] == 3 and set(got) == set(want)


@pytest.mark.parametrize("name", ["converted", "trained", "from_run"])
def test_the_tokenizer_and_generation_config_are_copied(exports, name: str) -> None:
    for file in KEPT:
        assert (exports[name] / file).read_bytes() == (exports["source"] / file).read_bytes(), file
    tok = transformers.AutoTokenizer.from_pretrained(exports[name])
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.decode(tok("experts route tokens")["input_ids"]) == "experts route tokens"
    generation = transformers.GenerationConfig.from_pretrained(exports[name])
    assert (generation.bos_token_id, generation.eos_token_id, generation.max_new_tokens) == (1, 2, 7)


@pytest.mark.parametrize("name", ["converted", "trained", "from_run"])
def test_files_follow_the_umask(exports, name: str) -> None:
    want = 0o666 & ~MASKS[name]
    modes = {p.name: p.stat().st_mode & 0o777 for p in exports[name].iterdir()}
    assert any(n.endswith(".safetensors") for n in modes) and modes == dict.fromkeys(modes, want)


def test_the_exports_load_in_transformers(exports) -> None:
    source = transformers.AutoModelForCausalLM.from_pretrained(exports["source"])
    converted = transformers.AutoModelForCausalLM.from_pretrained(exports["converted"])
    assert converted.config.max_position_embeddings == 1024
    want = source.state_dict()
    assert all(torch.equal(t, want[k]) for k, t in converted.state_dict().items())
    trained = transformers.AutoModelForCausalLM.from_pretrained(exports["trained"])
    assert trained.config.num_hidden_layers == 3
    tok = transformers.AutoTokenizer.from_pretrained(exports["trained"])
    prompt = tok("experts route", return_tensors="pt")
    made = trained.generate(**prompt, do_sample=False)  # the copied generation config: 7 new tokens at most
    assert prompt["input_ids"].shape[1] < made.shape[1] <= prompt["input_ids"].shape[1] + 7
    # the checkpoint converted after the source was deleted is the export at the end of training
    a, b = read_safetensors(exports["trained"]), read_safetensors(exports["from_run"])
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpoint_carries_the_source_under_its_manifest(exports, tmp_path: Path) -> None:
    from moe.hf.export import HFSource

    run = exports["run"]
    assert sorted(p.name for p in run.glob("step_*")) == ["step_00000003"]  # pruned with its source files
    step = shutil.copytree(run / "step_00000003", tmp_path / "step_00000003")  # a copy to damage
    meta = json.loads((step / "meta.json").read_text())
    assert meta["hf_config"] == _config(exports["source"])
    listed = json.loads((step / MANIFEST).read_text())["files"]
    assert {f"hf_source/{f}" for f in KEPT} <= set(listed) and verify_checkpoint(step)
    source = HFSource.from_checkpoint(step, meta)
    assert source is not None and source.files["tokenizer.json"] == (exports["source"] / "tokenizer.json").read_bytes()
    (step / "hf_source" / "tokenizer.json").write_bytes(b"{}")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
        verify_checkpoint(step)


def test_save_hf_of_a_change_the_source_cannot_carry_is_refused_before_training(tmp_path: Path) -> None:
    from moe.train import Trainer, config_from_args
    from tests.moe.hf import test_hf_deepseek_v3

    test_hf_deepseek_v3._hf_model().save_pretrained(tmp_path / "v3")  # YaRN spelled as rope_parameters
    np.save(tmp_path / "tokens.npy", np.zeros(1024, dtype=np.uint16))
    argv = ["--model", str(tmp_path / "v3"), "--rope-factor", "8", "--data", str(tmp_path / "tokens.npy")]
    config = config_from_args([*argv, "--seq-len", "16", "--save-hf", str(tmp_path / "out")], 1)[0]
    with pytest.raises(SystemExit) as err:
        Trainer(config)
    assert err.value.code.startswith("error: --save-hf: cannot write max_position_embeddings, rope_scaling into")
    assert not dist.is_initialized()  # before any process group

"""``--model`` in every form the trainer writes (``moe.train.checkpoint.model_source``): ``moe.eval`` and
``moe.convert`` take the checkpoint directory (its ``latest``, or the newest intact ``step_*``), a ``step_*``
directory and a Hugging Face directory, in one process and under torchrun; an evaluation runs any batch size on
any layout, with one process's loss; a mistyped path, a preset misspelt or a directory of ``.bin`` weights is one
line saying what to do."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from moe.convert import main as convert
from moe.eval import main as evaluate
from moe.eval import my_windows
from tests.moe.hf import test_hf_qwen3_moe

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(Hugging Face dir, our checkpoint directory converted from it, token file)."""
    tmp = tmp_path_factory.mktemp("source")
    test_hf_qwen3_moe._hf_model().save_pretrained(tmp / "hf")
    convert([str(tmp / "hf"), str(tmp / "ckpt")])
    np.save(tmp / "tokens.npy", np.random.default_rng(0).integers(0, 128, size=512).astype(np.uint16))
    return tmp / "hf", tmp / "ckpt", tmp / "tokens.npy"


def _argv(model: Path, tokens: Path, batch: int = 2) -> list[str]:
    return ["--model", str(model), "--data", str(tokens), "--seq-len", "8", "--global-batch-size", str(batch)]


def test_eval_takes_every_form_the_trainer_writes_in_one_process(tiny, tmp_path: Path) -> None:
    hf, ckpt, tokens = tiny
    run = tmp_path / "run"
    shutil.copytree(ckpt, run)
    (run / "step_00000000").rename(run / "step_00000005")  # latest now names no directory
    forms = {"hf": hf, "root": ckpt, "step": ckpt / "step_00000000", "no latest": run}
    got = {name: evaluate([*_argv(path, tokens), "--batches", "2", "--dtype", "fp32"]) for name, path in forms.items()}
    assert got["hf"]["tokens"] == 2 * 2 * 8
    assert all(r["loss"] == pytest.approx(got["hf"]["loss"], rel=1e-6) for r in got.values()), got


@pytest.mark.parametrize(("batch", "dp"), [(b, d) for b in range(1, 6) for d in range(1, 4)])
def test_every_window_of_a_batch_is_counted_once_on_any_dp(batch: int, dp: int) -> None:
    parts = [my_windows(batch, dp, r) for r in range(dp)]
    assert len({len(rows) for rows, _ in parts}) == 1  # the same micro-batches on every rank: ep peers in step
    assert sorted(i for rows, n in parts for i in rows[:n]) == list(range(batch))


def test_mistakes_in_model_are_one_line(tiny, tmp_path: Path) -> None:
    from moe.hf import HFCheckpointError, hf_tensors
    from moe.train.config import ConfigError, ModelConfig

    hf, _, tokens = tiny
    bins = tmp_path / "bins"
    bins.mkdir()
    shutil.copy(hf / "config.json", bins)
    torch.save({}, bins / "pytorch_model.bin")
    nope = tmp_path / "ckpts" / "qwen"
    cases = [
        (lambda: evaluate([*_argv(nope, tokens), "--batches", "1"]), f"error: --model {nope}: no such directory"),
        (lambda: convert([str(nope), str(tmp_path / "o")]), f"error: {nope}: no such directory"),
        (lambda: evaluate([*_argv(bins, tokens), "--batches", "1"]), "safe_serialization=True"),
        (lambda: convert([str(bins), str(tmp_path / "o")]), "safe_serialization=True"),
    ]
    for call, message in cases:
        with pytest.raises(SystemExit) as err:
            call()
        assert err.value.code.startswith("error: ") and message in err.value.code and "\n" not in err.value.code
    with pytest.raises(HFCheckpointError, match="save_pretrained"):  # train loads with this
        hf_tensors(bins)
    for name, message in [
        ("./ckpts/qwen", "model.name = './ckpts/qwen': no such directory"),
        ("qwen3-moe-tny", "model.name = 'qwen3-moe-tny': choose one of ("),
    ]:
        with pytest.raises(ConfigError) as err:
            ModelConfig(name=name)
        assert str(err.value).startswith(message), err.value
    assert str(err.value).endswith("or a Hugging Face directory (did you mean 'qwen3-moe-tiny'?)")


def test_eval_of_a_checkpoint_directory_under_torchrun_at_pp2_ep2_equals_one_process(tiny) -> None:
    """``--model RUN/ckpt`` from a bare start under torchrun (no process group before it resolves), 3 windows
    over 2 data-parallel ranks (one rank runs a copy it does not count), 1 micro-batch per rank at 2 x 1."""
    _, ckpt, tokens = tiny
    argv = [*_argv(ckpt, tokens, batch=3), "--batches", "2", "--json", "-"]
    want = evaluate(argv)["loss"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(port)]
    cmd += ["-m", "moe.eval", *argv, "--pp", "2", "--ep", "2"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = done.stdout.strip().splitlines()  # rank 0 only
    assert json.loads(line)["loss"] == pytest.approx(want, rel=1e-5)

"""Jobs on a Hugging Face checkpoint of each published architecture (Qwen3-MoE, DeepSeek-V3): ``python -m
moe.eval`` equals transformers' loss, in one process and through the pipeline at pp=2 x ep=2; ``--model DIR``
trains from the checkpoint's weights, pipelined (DualPipeV with overlap) as in one process."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.distributed import exit_message, run_ranks
from tests.moe.hf import test_hf_deepseek_v3, test_hf_qwen3_moe
from tests.moe.models import test_mtp
from tests.moe.train.test_trainer import losses

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

SEQ, BATCH, BATCHES = 16, 8, 2


ARCHITECTURES = {"qwen3_moe": test_hf_qwen3_moe._hf_model, "deepseek_v3": test_hf_deepseek_v3._hf_model}


@pytest.fixture(scope="module", params=sorted(ARCHITECTURES))
def job(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, float, float | None]:
    """(checkpoint dir, token file, transformers' loss over the eval windows, its MTP loss: the DeepSeek-V3
    checkpoint holds a multi-token-prediction module, as the published one does)."""
    tmp = tmp_path_factory.mktemp(request.param)
    hf = ARCHITECTURES[request.param]()
    hf.save_pretrained(tmp / "ckpt")
    mtp = test_mtp.add_mtp(hf, tmp / "ckpt") if request.param == "deepseek_v3" else None
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 128, size=4096).astype(np.uint16)
    np.save(tmp / "tokens.npy", tokens)
    total, total_mtp = [], []
    for b in range(BATCHES):  # window i = tokens[i*S : i*S + S + 1]; batch b = windows b*B .. b*B + B - 1
        w = torch.from_numpy(np.stack([tokens[i * SEQ : i * SEQ + SEQ + 1] for i in range(b * BATCH, (b + 1) * BATCH)]))
        ids, labels = w[:, :-1].long(), w[:, 1:].long()
        with torch.no_grad():
            logits = hf(ids).logits
        total.append(F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item())
        if mtp is not None:
            total_mtp.append(test_mtp.reference_mtp_loss(hf, mtp, ids, labels).item())
    want_mtp = sum(total_mtp) / len(total_mtp) if total_mtp else None
    return tmp / "ckpt", tmp / "tokens.npy", sum(total) / len(total), want_mtp


def _eval(rank: int, world: int, argv: list[str]) -> dict:
    from moe.eval import main

    return main(argv)


def _argv(ckpt: Path, tokens: Path, *extra: str) -> list[str]:
    common = ["--model", str(ckpt), "--data", str(tokens), "--seq-len", str(SEQ)]
    return [*common, "--batch-size", str(BATCH), "--batches", str(BATCHES), *extra]


def test_eval_equals_transformers_in_one_process_and_pipelined(job) -> None:
    ckpt, tokens, want, want_mtp = job
    one = run_ranks(_eval, 1, args=(_argv(ckpt, tokens, "--schedule", "1f1b"),), timeout=120)[0]
    assert one["tokens"] == BATCHES * BATCH * SEQ
    assert one["loss"] == pytest.approx(want, rel=1e-5)
    # DualPipeV at pp=2 x ep=2: 4 ranks, 2 data-parallel ranks of 4 one-sequence micro-batches each
    piped = run_ranks(_eval, 4, args=(_argv(ckpt, tokens, "--pp", "2", "--ep", "2"),), timeout=180)
    assert all(r["loss"] == pytest.approx(want, rel=1e-5) for r in piped)
    for result in (one, *piped):
        assert result.get("mtp_loss") == (None if want_mtp is None else pytest.approx(want_mtp, rel=1e-5))


def test_eval_refuses_what_it_cannot_run_in_one_line(job, tmp_path: Path) -> None:
    ckpt, tokens, *_ = job
    cases = [
        (_argv(ckpt, tokens, "--batches", "1000"), "tokens, 128001 needed for --batches x --batch-size windows"),
        (_argv(tmp_path, tokens), "neither a Hugging Face directory (config.json) nor a checkpoint"),
        (_argv(ckpt, tokens, "--batch-size", "1"), "DualPipeV needs num_chunks >= 2 * ranks = 2 (got 1)"),
    ]
    for argv, message in cases:
        out = run_ranks(exit_message, 1, args=("moe.eval", argv), timeout=60)[0]
        assert out.startswith("error: ") and message in out and "\n" not in out, out


def test_training_from_a_checkpoint_pipelined_equals_one_process(job, tmp_path: Path) -> None:
    from tests.moe.train.test_trainer import train

    ckpt, tokens, _, want_mtp = job
    args = ["--model", str(ckpt), "--data", str(tokens), "--seq-len", "16", "--steps", "3", "--val-every", "0"]
    one = train(1, tmp_path, "one", *args, "--schedule", "1f1b", "--num-chunks", "8")
    # DualPipeV with overlapped all-to-all (the default) at pp=2 x ep=2; DeepSeek-V3's MTP module on rank 0
    piped = train(4, tmp_path, "piped", *args, "--pp", "2", "--ep", "2", "--num-chunks", "4")
    assert sorted(losses(piped)) == [1, 2, 3]
    for a, b in zip(one, piped):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-5)
        assert ("mtp_loss" in a) == ("mtp_loss" in b) == (want_mtp is not None)
        if want_mtp is not None:
            assert b["mtp_loss"] == pytest.approx(a["mtp_loss"], rel=2e-5)


def _loaded(rank: int, world: int, argv: list[str], path: str) -> bool:
    """Whether this rank's stages hold the checkpoint's tensors: its layers and, of the experts, its own."""
    from moe.hf import read_safetensors
    from moe.train import Trainer, config_from_args

    trainer = Trainer(config_from_args(argv, world)[0])
    files = read_safetensors(path)
    stage = trainer.stages[0]
    local = stage.dispatcher.local_experts
    layer = stage.cfg.moe_layers[0]
    down = torch.stack([files[f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight"].t() for e in local])
    ok = torch.equal(stage.embed.weight, files["model.embed_tokens.weight"])
    ok &= torch.equal(stage.blocks[str(layer)].experts.w2, down)
    trainer.close()
    return ok and len(local) == stage.cfg.num_experts // 2


def test_each_rank_starts_from_its_share_of_the_checkpoint(job) -> None:
    ckpt, tokens, *_ = job
    argv = ["--model", str(ckpt), "--data", str(tokens), "--seq-len", "16", "--ep", "2", "--val-every", "0"]
    assert run_ranks(_loaded, 2, args=(argv, str(ckpt)), timeout=120) == [True, True]

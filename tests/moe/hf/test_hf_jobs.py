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

pytestmark = pytest.mark.slow  # every test here launches ranks

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


def _argv(ckpt: Path, tokens: Path, *extra: str, batch: int = BATCH) -> list[str]:
    common = ["--model", str(ckpt), "--data", str(tokens), "--seq-len", str(SEQ)]
    return [*common, "--global-batch-size", str(batch), "--batches", str(BATCHES), *extra]


def _refused_cases(ckpt: Path, tokens: Path, empty: Path) -> list[tuple[list[str], str]]:
    return [
        (_argv(ckpt, tokens, "--batches", "1000"), "128001 needed for --batches x --global-batch-size windows"),
        (_argv(empty, tokens), "neither a Hugging Face directory (config.json + safetensors) nor one of our"),
        (_argv(empty / "nope", tokens), f"error: --model {empty / 'nope'}: no such directory"),
    ]


@pytest.fixture(scope="module")
def runs(job, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Per architecture, the three tests below in two spawns: on 1 rank, in turn, the one-process eval, the
    one-process training and the refused evals; on 4 ranks (pp=2 x ep=2), in turn, the pipelined eval and
    training. Their results by name; the training's are rank 0's metrics records."""
    from tests.moe.train.test_trainer import COMMON, _in_turn, _train

    ckpt, tokens, *_ = job
    tmp = tmp_path_factory.mktemp("runs")
    empty = tmp / "empty"
    empty.mkdir()
    args = ["--model", str(ckpt), "--data", str(tokens), "--seq-len", "16", "--steps", "3", "--val-every", "0"]
    one = [(_eval, (_argv(ckpt, tokens),)), (_eval, (_argv(ckpt, tokens, batch=2),))]
    one += [
        (
            _train,
            ([*COMMON, "--metrics-file", str(tmp / "one.jsonl"), *args, "--schedule", "1f1b", "--num-chunks", "8"],),
        )
    ]
    one += [(exit_message, ("moe.eval", argv)) for argv, _ in _refused_cases(ckpt, tokens, empty)]
    eval_one, small_one, train_one, *refused = run_ranks(_in_turn, 1, args=(one,), timeout=300)[0]
    # pp=2 x ep=2: 4 ranks, 2 data-parallel ranks of 4 one-sequence micro-batches each (eval), then of 1 (a batch
    # of 2: no pairing rule in a forward-only eval); DualPipeV with overlapped all-to-all (the default) in
    # training, DeepSeek-V3's MTP module on rank 0
    piped = [(_eval, (_argv(ckpt, tokens, "--pp", "2", "--ep", "2", batch=b),)) for b in (BATCH, 2)]
    piped += [
        (
            _train,
            (
                [
                    *COMMON,
                    "--metrics-file",
                    str(tmp / "piped.jsonl"),
                    *args,
                    "--pp",
                    "2",
                    "--ep",
                    "2",
                    "--num-chunks",
                    "4",
                ],
            ),
        )
    ]
    per_rank = run_ranks(_in_turn, 4, args=(piped,), timeout=360)
    return {
        "eval-one": eval_one,
        "eval-piped": [r[0] for r in per_rank],
        "small-one": small_one,
        "small-piped": [r[1] for r in per_rank],
        "train-one": train_one,
        "train-piped": per_rank[0][2],
        "refused": dict(zip((message for _, message in _refused_cases(ckpt, tokens, empty)), refused, strict=True)),
    }


def test_eval_equals_transformers_in_one_process_and_pipelined(job, runs: dict) -> None:
    _, _, want, want_mtp = job
    one = runs["eval-one"]
    assert one["tokens"] == BATCHES * BATCH * SEQ
    assert one["loss"] == pytest.approx(want, rel=1e-5)
    piped = runs["eval-piped"]
    assert len(piped) == 4 and all(r["loss"] == pytest.approx(want, rel=1e-5) for r in piped)
    for result in (one, *piped):
        assert result.get("mtp_loss") == (None if want_mtp is None else pytest.approx(want_mtp, rel=1e-5))
    small = runs["small-one"]
    for result in runs["small-piped"]:  # a batch of 2 at pp=2 x ep=2: one micro-batch per pipeline
        assert result["loss"] == pytest.approx(small["loss"], rel=1e-5)
        assert result.get("mtp_loss") == (None if want_mtp is None else pytest.approx(small["mtp_loss"], rel=1e-5))


def test_eval_refuses_what_it_cannot_run_in_one_line(runs: dict) -> None:
    assert len(runs["refused"]) == 3
    for message, out in runs["refused"].items():
        assert out.startswith("error: ") and message in out and "\n" not in out, out


def test_training_from_a_checkpoint_pipelined_equals_one_process(job, runs: dict) -> None:
    want_mtp = job[3]
    one, piped = runs["train-one"], runs["train-piped"]
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

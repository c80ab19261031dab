"""DeepSeek-V3's multi-token prediction against transformers' own MTP module (``MtpModel``, what its speculative
decoding loads from the published checkpoint): the same key names (transformers reads the tensors we name), the
same MTP loss in fp32, the pieces equal to the plain graph, and the layouts that cannot share the embedding
refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moe.hf import load_hf_model, read_hf_config, read_safetensors, to_hub
from moe.hf.keys import checkpoint_shapes
from moe.models.config import preset
from moe.models.model import MoEModel, lm_loss, next_token_batch
from moe.parallel import ParallelConfig, embedding_pairs
from tests.moe.hf import test_hf_deepseek_v3

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
from transformers.modeling_layers import MtpModel  # noqa: E402

LAYERS = test_hf_deepseek_v3.LAYERS


def _published_names(mtp: MtpModel, layers: int) -> dict[str, torch.Tensor]:
    """transformers' MTP module under the names DeepSeek-V3 publishes (layer ``num_hidden_layers``, one tensor per
    expert, the shared embedding and head repeated there), written from its state dict by hand."""
    out: dict[str, torch.Tensor] = {}
    for key, value in mtp.state_dict().items():
        if key in ("embed_tokens.weight", "shared_head.weight"):
            hub = {"embed_tokens.weight": "embed_tokens.weight", "shared_head.weight": "shared_head.head.weight"}
            out[f"model.layers.{layers}.{hub[key]}"] = value
            continue
        assert key.startswith("layers.0."), key
        rest = key.removeprefix("layers.0.").removeprefix("mtp_block.")
        rest = rest.replace("post_norm.", "shared_head.norm.")
        if rest.endswith("experts.gate_up_proj"):  # [E, 2F, D], gate rows first
            half = value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"model.layers.{layers}.mlp.experts.{e}.gate_proj.weight"] = value[e, :half]
                out[f"model.layers.{layers}.mlp.experts.{e}.up_proj.weight"] = value[e, half:]
        elif rest.endswith("experts.down_proj"):  # [E, D, F]
            for e in range(value.shape[0]):
                out[f"model.layers.{layers}.mlp.experts.{e}.down_proj.weight"] = value[e]
        else:
            out[f"model.layers.{layers}.{rest}"] = value
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def add_mtp(hf, path: Path) -> MtpModel:
    """An MTP module of random (large) weights beside ``hf``'s checkpoint at ``path`` (saved already), as the
    published checkpoint holds it: a second safetensors file and an index over both."""
    from safetensors.torch import save_file

    mtp = MtpModel(hf, 1).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        shared = {id(hf.lm_head.weight), id(hf.get_input_embeddings().weight)}
        for name, p in sorted(mtp.named_parameters()):
            if id(p) not in shared:
                noise = torch.randn(p.shape, generator=gen)
                p.copy_(1 + 0.3 * noise if name.endswith("norm.weight") else noise / p.shape[-1] ** 0.5)
        for name, b in mtp.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))
    tensors = _published_names(mtp, hf.config.num_hidden_layers)
    main = list(read_safetensors(path))
    files = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    (path / "model.safetensors").rename(path / files[0])  # else the single file is all transformers reads
    save_file(tensors, str(path / files[1]))
    weight_map = {**dict.fromkeys(main, files[0]), **dict.fromkeys(tensors, files[1])}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return mtp


def reference_mtp_loss(hf, mtp: MtpModel, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """transformers' depth-1 loss: its MTP layer on the main model's final (normed) hidden state and the next
    tokens (``labels``), the shared head, cross-entropy against the token after (the last position has none)."""
    with torch.no_grad():
        h = hf.model(ids).last_hidden_state
        pos = torch.arange(1, ids.shape[1] + 1)[None]  # MTP's positions: one ahead of the main model's
        h1 = mtp.forward_layer(0, h, pos, None, input_ids=labels)
        logits = hf.lm_head(h1)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    hf = test_hf_deepseek_v3._hf_model()
    path = tmp_path_factory.mktemp("deepseek_v3_mtp")
    hf.save_pretrained(path)
    mtp = add_mtp(hf, path)
    return path, hf, mtp


def test_transformers_reads_the_names_we_read_and_write(checkpoint, monkeypatch) -> None:
    path, hf, mtp = checkpoint
    # transformers finds MTP tensors by the main model's ignore pattern, written for the 61-layer model
    monkeypatch.setattr(type(hf), "_keys_to_ignore_on_load_unexpected", [rf"model\.layers\.{LAYERS}\..*"])
    main = transformers.DeepseekV3ForCausalLM.from_pretrained(path, attn_implementation="eager")
    loaded = MtpModel.from_pretrained(main)  # raises on a missing tensor
    want = mtp.state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, want[key]), key
    ours = load_hf_model(path)
    assert read_hf_config(path).mtp_layers == 1 and ours.cfg.mtp_layers == 1
    state = ours.state_dict()
    written = {k: v for k, v in read_safetensors(path).items() if k.startswith(f"model.layers.{LAYERS}.")}
    exported = to_hub({k: state[k] for k in checkpoint_shapes(ours)})
    assert {k for k in exported if k.startswith(f"model.layers.{LAYERS}.")} == set(written)
    assert all(torch.equal(exported[k], v) for k, v in written.items())


def test_mtp_loss_equals_transformers(checkpoint) -> None:
    path, hf, mtp = checkpoint
    ours = load_hf_model(path).eval()
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 128, (2, test_hf_deepseek_v3.SEQ + 1), generator=gen)
    ids, labels = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        main = lm_loss(ours(ids, labels), labels)
        want_main = F.cross_entropy(hf(ids).logits.flatten(0, 1), labels.flatten())
    (mtp_loss,) = ours.pop_mtp_losses().tolist()[0]
    assert main.item() == pytest.approx(want_main.item(), rel=1e-5)
    assert mtp_loss == pytest.approx(reference_mtp_loss(hf, mtp, ids, labels).item(), rel=1e-5)
    assert abs(mtp_loss - main.item()) > 1e-3  # a different prediction, not the main head's loss again


def test_pieces_equal_the_graph_and_lambda_weighs_the_mtp_gradient() -> None:
    cfg = preset("deepseek-v3-tiny", mtp_layers=2)
    ids, labels = next_token_batch(cfg, 2, 12, seed=1)
    grads = {}
    for piecewise, weight in ((False, 0.3), (True, 0.3), (True, 0.0)):
        model = MoEModel(cfg, seed=2, piecewise=piecewise)
        model.mtp_loss_weight = weight
        lm_loss(model(ids, labels), labels).backward()
        assert model.pop_mtp_losses().shape == (1, 2)
        grads[piecewise, weight] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    graph, pieces, off = grads[False, 0.3], grads[True, 0.3], grads[True, 0.0]
    assert graph.keys() == pieces.keys()
    for name in graph:
        assert torch.allclose(pieces[name], graph[name], rtol=1e-4, atol=1e-6), name
    mtp = [n for n in graph if n.startswith(f"blocks.{cfg.num_layers}.")]
    assert mtp and all(n not in off or off[n].abs().max() == 0 for n in mtp)  # lambda = 0: no MTP gradient
    assert not torch.allclose(graph["embed.weight"], off["embed.weight"])  # the MTP reaches the shared embedding


def test_the_embedding_is_copied_only_where_the_mtp_stage_is_on_another_rank() -> None:
    # DualPipe and DualPipeV hold the first stage and the head on one rank (one parameter); the linear and
    # interleaved schedules put them on pipeline ranks 0 and pp-1, whose copies the embedding group keeps equal
    def pairs(schedule: str, layout: str = "auto") -> list[tuple[int, int]]:
        pc = ParallelConfig(pp=4, dp=1, ep=1, schedule=schedule, pipeline_layout=layout)
        return embedding_pairs(pc.stage_layout, pc.mtp_stage)

    assert {s: pairs(s) for s in ("dualpipe", "dualpipev", "1f1b", "zb1p", "interleaved-1f1b")} == {
        "dualpipe": [], "dualpipev": [], "1f1b": [(0, 3)], "zb1p": [(0, 3)], "interleaved-1f1b": [(0, 3)],
    }  # fmt: skip
    # Megatron-Core's "m|L": the MTP stage before a stage of the head alone. DualPipe's stage 2 runs on rank 2
    # (path 0, first stage on rank 0) and on rank 1 (path 1, first stage on rank 3); DualPipeV's stage 6 on rank 1
    assert pairs("dualpipe", "Et|t|m|L") == [(0, 2), (3, 1)]
    assert pairs("dualpipev", "Et|(t|)*5m|L") == [(0, 1)]
    assert pairs("1f1b", "Ett|t|m|L") == [(0, 2)]


def test_an_mtp_stage_without_labels_is_one_line() -> None:
    cfg = preset("deepseek-v3-tiny")
    assert cfg.mtp_layers == 1
    ids, _ = next_token_batch(cfg, 1, 8)
    with pytest.raises(ValueError, match=r"multi-token-prediction modules: call it with the labels"):
        MoEModel(cfg)(ids)


@pytest.mark.slow
def test_the_embedding_copies_train_as_one_parameter(tmp_path: Path) -> None:
    """1F1B at pp=2 puts the MTP stage (and its copy of the embedding) on the other rank than the first stage:
    with the gradient clipped (the norm counts the embedding once) and bf16 moments, its losses and norms are
    the single process's."""
    from tests.moe.train.test_trainer import train

    args = ["--model", "deepseek-v3-tiny", "--steps", "3", "--clip-grad", "0.05", "--state-dtype", "bfloat16"]
    one = train(1, tmp_path, "one", *args, "--schedule", "1f1b", "--num-chunks", "4")
    two = train(2, tmp_path, "two", *args, "--pp", "2", "--schedule", "1f1b", "--num-chunks", "4")
    assert [r["step"] for r in two] == [1, 2, 3]
    for a, b in zip(one, two, strict=True):
        assert a["grad_norm"] > 0.05  # clipping acts, so a norm counting the copy twice would change the steps
        for key in ("loss", "mtp_loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=2e-5), (a["step"], key)

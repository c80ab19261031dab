"""A Qwen3-MoE checkpoint written by transformers, loaded into our model: the same logits and loss in fp32."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from moe.hf import HFCheckpointError, HFConfigError, from_hf_config, load_hf_model, read_safetensors, to_hub, to_ours
from moe.models.model import MoEModel, lm_loss
from tests.moe.models.helpers import large_random_weights

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

BATCH, SEQ = 2, 24


def _hf_model(norm_topk_prob: bool = True):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # not hidden / heads
        num_experts=8,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        mlp_only_layers=[1],  # a dense layer between MoE layers
        norm_topk_prob=norm_topk_prob,
        attn_implementation="eager",
    )
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    large_random_weights(model)
    return model


@pytest.fixture(scope="module", params=[True, False], ids=["norm_topk", "raw_topk"])
def checkpoint(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    model = _hf_model(request.param)
    path = tmp_path_factory.mktemp("qwen3_moe")
    model.save_pretrained(path)
    return path, model


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def test_logits_and_loss_equal_transformers(checkpoint) -> None:
    path, hf = checkpoint
    ours = load_hf_model(path).eval()
    assert ours.cfg.attention == "gqa-qk-norm" and ours.cfg.moe_layers == [0, 2, 3]
    ids = _ids()
    with torch.no_grad():
        want = hf(ids, labels=ids)
        got = ours(ids)
    torch.testing.assert_close(got, want.logits, rtol=1e-4, atol=1e-4 * want.logits.abs().max().item())
    loss = lm_loss(got[:, :-1], ids[:, 1:])  # transformers shifts the labels inside
    assert loss.item() == pytest.approx(want.loss.item(), rel=1e-5)
    # sensitive: the routing weights matter (the other normalisation moves the logits far past the tolerance)
    flipped = dataclasses.replace(ours.cfg, norm_topk_prob=not ours.cfg.norm_topk_prob)
    other = MoEModel(flipped)
    other.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (other(ids) - want.logits).abs().max() > 1e-2 * want.logits.abs().max()


def test_fused_in_memory_experts_and_the_hub_layout_agree(checkpoint) -> None:
    path, hf = checkpoint
    ours = load_hf_model(path)
    shapes = {k: p.shape for k, p in ours.named_parameters()}
    fused = to_ours(hf.state_dict(), shapes)  # transformers' in-memory layout: gate_up_proj [E, 2F, D]
    for key, p in ours.named_parameters():
        assert torch.equal(fused[key], p), key
    # and back: our tensors in the hub layout are exactly the files' tensors, key for key
    hub = read_safetensors(path)
    exported = to_hub({k: p.detach() for k, p in ours.named_parameters()})
    assert sorted(exported) == sorted(hub)
    assert all(torch.equal(exported[k], hub[k]) for k in hub)


def test_both_config_styles_read_the_same() -> None:
    written = _hf_model().config.to_dict()  # transformers 5.x: rope_parameters, num_local_experts
    hub = {k: v for k, v in written.items() if k not in ("rope_parameters", "num_local_experts")}
    hub.update(rope_theta=written["rope_parameters"]["rope_theta"], rope_scaling=None, num_experts=8)
    assert from_hf_config(hub) == from_hf_config(written)


def test_bad_checkpoints_are_one_line(checkpoint) -> None:
    path, _ = checkpoint
    shapes = {k: p.shape for k, p in load_hf_model(path).named_parameters()}
    hub = read_safetensors(path)
    missing = dict(hub)
    del missing["model.layers.2.mlp.experts.3.up_proj.weight"]
    with pytest.raises(HFCheckpointError, match=r"lacks model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight$"):
        to_ours(missing, shapes)
    extra = {**hub, "model.layers.9.self_attn.q_proj.weight": torch.zeros(1)}
    with pytest.raises(HFCheckpointError, match=r"no place here: model\.layers\.9\.self_attn\.q_proj\.weight"):
        to_ours(extra, shapes)
    wrong = {**hub, "model.norm.weight": torch.zeros(65)}
    with pytest.raises(HFCheckpointError, match=r"model\.norm\.weight: shape \(65,\) for our norm\.weight of shape"):
        to_ours(wrong, shapes)
    raw = json.loads((path / "config.json").read_text())
    for change, message in [
        ({"model_type": "llama"}, "model_type 'llama' is not supported; supported: qwen3_moe"),
        ({"tie_word_embeddings": True}, "qwen3_moe: tie_word_embeddings = True is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn' is not supported"),
    ]:
        with pytest.raises(HFConfigError, match=re.escape(message)):
            from_hf_config({**raw, **change})

"""Activation recompute granularity: none, selective (the DeepSeek-V3 report's RMSNorms and MLA up-projections),
full. Every granularity gives the same gradients; selective keeps fewer bytes; its outputs freed after their
readers come back in backward; deferred weight gradients stay deferred. The pipeline run at pp=2 x ep=2 is in
test_pipeline.py."""

from __future__ import annotations

import pytest
import torch

from dualpipe.weight_grad import GradStore
from moe import MoEModel, lm_loss
from moe.dispatch.local import LocalDispatcher
from moe.models.block import Block
from moe.models.layers import recompute, release, selective_recompute
from moe.parallel import ParallelConfig
from moe.train.cli import config_from_args
from tests.moe.helpers import SEED, assert_rel_close, batch, tiny_config
from tests.moe.models.helpers import large_random_weights

ATTENTIONS = {
    "mla": dict(attention="mla", q_lora_rank=16),
    "gqa": {},
    "gqa-qk-norm": dict(attention="gqa-qk-norm"),
}


def _model(cfg, granularity: str, piecewise: bool = True) -> MoEModel:
    model = MoEModel(cfg, seed=SEED, piecewise=piecewise, recompute=granularity == "full")
    selective_recompute(model, granularity == "selective")
    return model


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_every_granularity_gives_the_same_gradients(attention: str) -> None:
    cfg = tiny_config(**ATTENTIONS[attention])
    ids, labels = batch(cfg)
    ref = _model(cfg, "none")
    want_loss = lm_loss(ref(ids), labels)
    want_loss.backward()
    want = _grads(ref)
    # the overlap runtime's pieces, recomputed either way, and the one-graph block (the oracle's path)
    for granularity, piecewise in (("selective", True), ("full", True), ("selective", False)):
        model = _model(cfg, granularity, piecewise)
        loss = lm_loss(model(ids), labels)
        loss.backward()
        assert loss.item() == want_loss.item(), granularity
        for name, g in _grads(model).items():
            assert_rel_close(g, want[name], 1e-6, f"{granularity} {name}")


def test_selective_recompute_keeps_weight_gradients_deferred() -> None:
    """The up-projections run again in a nested backward; their weight gradients still go to WeightGradStore."""
    cfg = tiny_config(**ATTENTIONS["mla"])
    ids, labels = batch(cfg)
    ref = _model(cfg, "none")
    lm_loss(ref(ids), labels).backward()
    model = _model(cfg, "selective")
    store = GradStore()
    with store.activate(enabled=True):
        lm_loss(model(ids), labels).backward()
        store.flush()
    attn = model.blocks["1"].attn
    assert attn.q_b_proj.weight.grad is None and attn.kv_b_proj.weight.grad is None
    assert attn.kv_a_layernorm.weight.grad is not None  # norm weights get theirs from autograd, at once
    store.pop()
    want = _grads(ref)
    for name, g in _grads(model).items():
        assert_rel_close(g, want[name], 1e-6, name)


def _saved(block: Block, h_BSD: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(block output, bytes of the distinct storages autograd holds once the forward is done, how many saved
    tensors have had their storage freed by then); parameters and buffers left out."""
    own = {t.untyped_storage().data_ptr() for t in [*block.parameters(), *block.buffers()]}
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.detach())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = block(h_BSD)
    live: dict[int, int] = {}
    freed = 0
    for t in saved:
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            freed += 1
        elif storage.data_ptr() not in own:
            live[storage.data_ptr()] = storage.nbytes()
    return out, sum(live.values()), freed


def test_selective_keeps_fewer_bytes_in_an_mla_block() -> None:
    cfg = tiny_config(**ATTENTIONS["mla"])
    h_BSD = torch.randn(2, 64, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    kept, freed, grads = {}, {}, {}
    for granularity in ("none", "selective"):
        block = Block(cfg, 1, LocalDispatcher(cfg.num_experts))
        large_random_weights(block, seed=0)
        selective_recompute(block, granularity == "selective")
        h = h_BSD.clone().requires_grad_()
        out, kept[granularity], freed[granularity] = _saved(block, h)
        out.square().sum().backward()
        grads[granularity] = [h.grad, *(p.grad for p in block.parameters())]
    assert freed["none"] == 0 and freed["selective"] > 0  # the attention norm's output, saved by q_a / kv_a
    # At least what the norms and the up-projections hand on is gone: the attention norm's output (D wide) and
    # the two normed latents (q_lora_rank, kv_lora_rank wide), fp32, one row per token.
    tokens = h_BSD.shape[0] * h_BSD.shape[1]
    assert kept["none"] - kept["selective"] >= 4 * tokens * (cfg.hidden_size + cfg.q_lora_rank + cfg.kv_lora_rank)
    for got, want in zip(grads["selective"], grads["none"]):  # the freed storages came back in backward
        assert_rel_close(got, want, 1e-6)


def test_release_frees_outputs_and_refills_them_before_their_readers_backward() -> None:
    x = torch.randn(16, 8, requires_grad=True)
    w = torch.randn(8, requires_grad=True)
    plain = (x.exp() * 2) * w  # the reader (``* w``) saves exp's output
    plain.sum().backward()
    want = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    y = recompute(lambda t: t.exp() * 2, x)
    z = y * w
    release(y, after=z)
    assert y.untyped_storage().nbytes() == 0
    z.sum().backward()
    assert y.untyped_storage().nbytes() == 16 * 8 * 4  # refilled, with the same bytes
    torch.testing.assert_close(x.grad, want[0], rtol=0, atol=0)
    torch.testing.assert_close(w.grad, want[1], rtol=0, atol=0)
    with torch.no_grad():  # nothing to recompute without a graph: plain
        assert recompute(torch.exp, x).grad_fn is None
    with pytest.raises(ValueError, match="new tensors"):
        recompute(lambda t: t.view(-1), x)


def test_granularity_from_the_config_and_the_flags() -> None:
    assert [ParallelConfig(recompute=v).recompute for v in (True, False, "selective")] == ["full", "none", "selective"]
    with pytest.raises(ValueError, match="recompute = 'partial': choose one of none, selective, full"):
        ParallelConfig(recompute="partial")
    for argv, want in (
        (["--recompute"], "full"),
        (["--no-recompute"], "none"),
        (["--recompute", "selective"], "selective"),
        (["--parallel.recompute", "none"], "none"),
    ):
        config, _ = config_from_args(argv, world=1)
        assert config.parallel.recompute == want, argv
    with pytest.raises(SystemExit, match="recompute = 'some'"):
        config_from_args(["--recompute", "some"], world=1)

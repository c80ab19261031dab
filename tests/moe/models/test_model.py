"""Single-process model tests: decomposition == one graph, deferred weight gradients, router, balancing."""

from __future__ import annotations

import pytest
import torch

from dualpipe.pieces import Compute
from dualpipe.weight_grad import GradStore
from moe import MoEConfig, MoEModel, lm_loss, preset
from moe.models.layers import Linear
from moe.models.router import Router
from moe.train.grad_sync import balance_routers
from tests.moe.helpers import SEED, assert_rel_close, batch, tiny_config


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("recompute", [False, True])
def test_piecewise_equals_one_graph(recompute: bool):
    cfg = tiny_config()
    ids, labels = batch(cfg)
    ref = MoEModel(cfg, seed=SEED)
    ref_loss = lm_loss(ref(ids), labels)
    ref_loss.backward()
    got = MoEModel(cfg, seed=SEED, piecewise=True, recompute=recompute)
    loss = lm_loss(got(ids), labels)
    loss.backward()
    assert loss.item() == ref_loss.item()
    want = _grads(ref)
    for name, g in _grads(got).items():
        assert_rel_close(g, want[name], 1e-6, name)


def test_weight_grads_deferred_through_weight_grad_store():
    cfg = tiny_config()
    ids, labels = batch(cfg)
    ref = MoEModel(cfg, seed=SEED, piecewise=True)
    lm_loss(ref(ids), labels).backward()

    model = MoEModel(cfg, seed=SEED, piecewise=True)
    store = GradStore()
    with store.activate(enabled=True):
        lm_loss(model(ids), labels).backward()
        store.flush()
    deferred = [n for n, m in model.named_modules() if isinstance(m, Linear)] + ["experts.w1", "experts.w2"]
    for name, p in model.named_parameters():
        if any(name.startswith(d) or d in name for d in deferred) and "norm" not in name:
            assert p.grad is None, f"{name} got its weight gradient during backward"
    assert model.blocks["0"].attn_norm.weight.grad is not None  # small weights are not deferred
    with torch.enable_grad():  # the pipeline may pop with grad mode on: no graph may grow
        store.pop()
    want = _grads(ref)
    for name, p in model.named_parameters():
        assert not p.grad.requires_grad
        assert_rel_close(p.grad, want[name], 1e-6, name)


def test_group_limited_routing_and_weights():
    cfg = tiny_config(num_experts=8, n_group=4, topk_group=2, top_k=3, route_scale=2.5, seq_aux_loss_coef=0.0)
    router = Router(cfg)
    torch.nn.init.normal_(router.gate.weight, std=1.0, generator=torch.Generator().manual_seed(0))
    z = torch.randn(2, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    routing = router(z)
    groups = routing.topk_idx_TK // (cfg.num_experts // cfg.n_group)
    assert all(len(set(row.tolist())) <= cfg.topk_group for row in groups)
    scores = torch.sigmoid(z.reshape(-1, cfg.hidden_size) @ router.gate.weight.t())
    chosen = scores.gather(1, routing.topk_idx_TK)
    torch.testing.assert_close(routing.topk_weights_TK, chosen / chosen.sum(1, keepdim=True) * 2.5)
    routing.topk_weights_TK.sum().backward()  # the weights are differentiable w.r.t. the gate
    assert router.gate.weight.grad is not None and router.gate.weight.grad.abs().sum() > 0


def test_sequence_aux_loss_value_and_gradient():
    cfg = tiny_config(seq_aux_loss_coef=0.1, n_group=1, topk_group=1)
    router = Router(cfg)
    torch.nn.init.normal_(router.gate.weight, std=0.5, generator=torch.Generator().manual_seed(2))
    b, s = 3, 8
    z = torch.randn(b, s, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    routing = router(z)
    scores = torch.sigmoid(z @ router.gate.weight.t())
    want = 0.0
    for i in range(b):
        idx = routing.topk_idx_TK.view(b, s, -1)[i]
        f = torch.bincount(idx.flatten(), minlength=cfg.num_experts).float() * cfg.num_experts / (cfg.top_k * s)
        p = (scores[i] / scores[i].sum(-1, keepdim=True)).mean(0)
        want += (f * p).sum() / b
    torch.testing.assert_close(routing.aux_loss, 0.1 * want)

    # The aux loss reaches the gate's gradient in the model: coefficient on vs off changes it.
    ids, labels = batch(cfg)
    grads = []
    for coef in (0.0, 0.1):
        model = MoEModel(cfg.replace(seq_aux_loss_coef=coef), seed=SEED, piecewise=True)
        lm_loss(model(ids), labels).backward()
        grads.append(model.blocks["1"].router.gate.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])


def test_bias_update_from_load():
    cfg = tiny_config(bias_update_rate=0.01)
    model = MoEModel(cfg, seed=SEED, piecewise=True)
    ids, labels = batch(cfg)
    lm_loss(model(ids), labels).backward()
    router = model.blocks["1"].router
    load = router.expert_load.clone()
    assert load.sum().item() == ids.numel() * cfg.top_k
    balance_routers([model], None)
    torch.testing.assert_close(router.expert_bias, 0.01 * torch.sign(load.mean() - load))
    assert not router.expert_load.any()
    with torch.no_grad():
        model.eval()
        model(ids)  # evaluation does not count load
    assert not router.expert_load.any()


def test_config_validation_and_presets():
    with pytest.raises(ValueError, match="top_k=9 is larger than num_experts=8"):
        MoEConfig(num_experts=8, top_k=9)
    with pytest.raises(ValueError, match="n_group"):
        MoEConfig(num_experts=8, n_group=3)
    with pytest.raises(ValueError, match="num_kv_heads"):
        MoEConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(KeyError, match="tiny"):
        preset("nope")
    v3 = preset("v3")
    assert (v3.num_experts, v3.top_k, v3.n_group, v3.topk_group, v3.num_dense_layers) == (256, 8, 8, 4, 3)
    assert preset("tiny", num_layers=3).num_layers == 3


def test_bf16_model_keeps_balancing_state_in_fp32():
    cfg = tiny_config()
    model = MoEModel(cfg, seed=SEED, piecewise=True).to(torch.bfloat16)
    router = model.blocks["1"].router
    assert model.blocks["1"].experts.w1.dtype == torch.bfloat16
    assert router.expert_bias.dtype == router.expert_load.dtype == torch.float32
    ids, labels = batch(cfg)
    loss = lm_loss(model(ids), labels)
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_aux_loss_scale_follows_the_loss_scale():
    # Averaging micro-batch losses (loss * 1/n) must scale the balance-loss gradient alike: with
    # aux_loss_scale = 1/n every gradient is exactly 1/n of the summed-loss one.
    cfg = tiny_config(seq_aux_loss_coef=0.5)
    ids, labels = batch(cfg)
    grads = []
    for scale in (1.0, 0.25):
        for piecewise in (False, True):
            model = MoEModel(cfg, seed=SEED, piecewise=piecewise)
            model.aux_loss_scale = scale
            (scale * lm_loss(model(ids), labels)).backward()
            grads.append(_grads(model))
    for name, g in grads[0].items():
        for other in grads[2:]:
            assert_rel_close(other[name], 0.25 * g, 1e-5, name)
        assert_rel_close(grads[1][name], g, 1e-6, name)


def test_replace_re_derives_head_dim():
    assert preset("tiny", hidden_size=64).attn_head_dim == 64 // preset("tiny").num_heads
    assert preset("v3").attn_head_dim == 128


def test_recompute_keeps_only_sub_stage_inputs():
    cfg = tiny_config()
    ids, labels = batch(cfg)
    model = MoEModel(cfg, seed=SEED, piecewise=True, recompute=True)
    logits = model(ids)
    run = logits.grad_fn.run
    blocks = [br for br in run.blocks if br.decl.paired]  # the embedding and head keep their graphs
    assert len(blocks) == cfg.num_layers
    for br in blocks:
        # No activations beyond the piece inputs, and no autograd graph inside the blocks.
        computed = {n for p in br.decl.pieces if isinstance(p, Compute) for n in p.outputs}
        assert not computed & set(br.values), computed & set(br.values)
        assert not br.holds_graph
        assert all(v.grad_fn is None for v in br.values.values() if isinstance(v, torch.Tensor))
    lm_loss(logits, labels).backward()
    assert logits.grad_fn.run is None  # the stage's state was released by its backward


def test_moe_comm_pieces_record_on_the_dispatchers_comm_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    from dualpipe.pieces import Comm

    model = MoEModel(tiny_config(), seed=SEED)
    block = next(b for b in model.blocks.values() if b.is_moe)
    comms = [p for p in block.pieces(1.0).pieces if isinstance(p, Comm)]
    assert [p.name for p in comms] == ["dispatch", "combine"]
    assert [p.stream() for p in comms] == [None, None]  # the local dispatcher exposes none
    sentinel = object()  # a DeepEP buffer's get_comm_stream() on CUDA
    monkeypatch.setattr(type(block._dispatcher), "comm_stream", property(lambda self: sentinel))
    assert [p.stream() for p in comms] == [sentinel, sentinel]  # asked at record time, not at declaration

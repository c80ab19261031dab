"""The planner on the published architectures: parameter lists equal to the modules', the published totals,
MLA and Qwen3 FLOPs by hand, saved-activation bytes against the tracker, multi-token prediction on the last
stage, and the memory options."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe import MoEModel
from moe.dispatch.local import LocalDispatcher
from moe.models.block import Block
from moe.models.config import PRESETS, preset
from moe.models.mla import MLAttention
from moe.models.mtp import MTPBlock
from moe.models.stage import MoEStage
from moe.plan import flops as fl
from moe.plan.costs import Parallelism, Precision, Workload, substage_costs
from moe.plan.footprint import LEAVES, footprint, layer_activations, module_activation_bytes, state_bytes
from moe.plan.hardware import GPUS, Cluster
from moe.plan.params import (
    active_params,
    attention_params,
    layer_params,
    mtp_params,
    rank_params,
    stage_params,
    total_params,
)
from moe.train.memory import MemoryMeter
from moe.train.optimizer import DistributedAdamW, ShardGroup
from tests.moe.helpers import tracked_peak_bytes

# DeepSeek-V3 tiny (MLA with a query latent, an MTP module), the same without a query latent (V2-Lite's MLA),
# Qwen3-MoE tiny (q/k norms, no shared expert).
V3 = PRESETS["deepseek-v3-tiny"].replace(mtp_layers=1)
NO_Q_LATENT = V3.replace(q_lora_rank=None, mtp_layers=0)
QWEN = PRESETS["qwen3-moe-tiny"]


def _named(module: torch.nn.Module, prefix: str = "") -> list[tuple[str, int]]:
    return sorted((prefix + n, p.numel()) for n, p in module.named_parameters())


@pytest.mark.parametrize("cfg", [V3, NO_Q_LATENT, QWEN], ids=["mla", "mla-no-q-latent", "qwen3"])
def test_parameter_lists_are_the_modules(cfg) -> None:
    """Every block (dense, MoE, the MTP module), name by name, at ep = 1 and ep = 2; and whole stages."""
    for ep in (1, 2):
        dispatcher = LocalDispatcher(cfg.num_experts)
        dispatcher.num_local_experts = cfg.num_experts // ep  # what one rank of an ep group holds
        for layer in range(cfg.num_layers + cfg.mtp_layers):
            if layer < cfg.num_layers:
                block, specs = Block(cfg, layer, dispatcher), layer_params(cfg, layer, ep)
            else:
                block, specs = MTPBlock(cfg, layer, dispatcher), mtp_params(cfg, layer - cfg.num_layers, ep)
            assert sorted((p.name, p.numel) for p in specs) == _named(block, f"blocks.{layer}.")
    if cfg.attention == "mla":
        attn = Block(cfg, 0, None).attn
        assert isinstance(attn, MLAttention)
        assert sum(p.numel() for p in attn.parameters()) == sum(p.numel for p in attention_params(cfg))
    # the last stage holds the embedding for its MTP module, the head, its blocks
    for first, last, layers in ((True, False, [0, 1]), (False, True, [2, 3]), (True, True, [0, 1, 2, 3])):
        stage = MoEStage(cfg, layers, first=first, last=last)
        assert sorted((p.name, p.numel) for p in stage_params(cfg, layers, first=first, last=last)) == _named(stage)


def test_a_rank_counts_the_tied_embedding_once() -> None:
    """DualPipeV puts the first and the last stage on rank 0: one embedding; 1F1B's last rank keeps a copy."""
    tied = [p.name for p in rank_params(V3, 2, 1, "dualpipev", 0)]
    assert tied.count("embed.weight") == 1 and "head.weight" in tied and "blocks.4.eh_proj.weight" in tied
    assert [p.name for p in rank_params(V3, 2, 1, "1f1b", 1)].count("embed.weight") == 1
    own = rank_params(V3, 2, 1, "dualpipev", 0, mtp_shared=False)
    extra = sum(p.numel for p in own) - sum(p.numel for p in rank_params(V3, 2, 1, "dualpipev", 0))
    assert extra == 2 * V3.vocab_size * V3.hidden_size


@pytest.mark.parametrize(
    ("name", "total", "active", "digits", "embedding"),
    [
        # DeepSeek-V3 report: 671B total, 37B activated per token (the main model: its 14B MTP module apart).
        ("deepseek-v3", 671e9, 37e9, 1e9, False),
        # Qwen3-235B-A22B's model card: 235B total, 22B activated.
        ("qwen3-235b-a22b", 235e9, 22e9, 1e9, False),
        # DeepSeek-V2 report: V2-Lite has 15.7B; Qwen3-30B-A3B's card: 30.5B (their activated figures round
        # another way than either reading of ours, with or without the embedding: left out).
        ("deepseek-v2-lite", 15.7e9, None, 0.1e9, False),
        ("qwen3-30b-a3b", 30.5e9, None, 0.1e9, False),
    ],
)
def test_the_published_totals(name: str, total: float, active: float | None, digits: float, embedding: bool) -> None:
    """Within the rounding of the published figure (half its last digit)."""
    cfg = preset(name)
    assert abs(total_params(cfg) - total) <= digits / 2
    if active is not None:
        assert abs(active_params(cfg, embedding=embedding) - active) <= digits / 2


def test_deepseek_v3_has_its_mtp_module() -> None:
    cfg = preset("deepseek-v3")
    assert cfg.mtp_layers == 1
    # the MTP module: a block (MLA and the MoE, 4 of 256 experts...) plus eh_proj and 3 norms; 11.6B without
    # the embedding and head it shares
    module = total_params(cfg, mtp=True) - total_params(cfg)
    assert module == sum(p.numel for p in layer_params(cfg, 61)) + 2 * 7168 * 7168 + 3 * 7168
    assert 11.5e9 < module < 11.7e9


def _gemm_flops(ops: list[fl.Op]) -> float:
    return sum(op.fwd_flops for op in ops if op.name != "sdpa")


@pytest.mark.parametrize("cfg", [V3, NO_Q_LATENT, QWEN], ids=["mla", "mla-no-q-latent", "qwen3"])
def test_attention_flops_by_hand(cfg) -> None:
    """Every projection is 2 T x its weights; SDPA is H S^2 (C + Cv) per sequence (causal half of QK^T, PV), and
    for MLA, which runs it at one head dim max(C, Cv) (the narrower side padded with zeros), 2 H S^2 max(C, Cv)."""
    t, s = 64, 32
    ops = fl.attention_ops(cfg, t, s, 2)
    weights = sum(p.numel for p in attention_params(cfg) if not p.name.endswith("norm.weight"))
    assert _gemm_flops(ops) == 2 * t * weights
    c, cv = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim) if cfg.attention == "mla" else (16, 16)
    if cfg.attention == "mla":
        c = cv = max(c, cv)
    sdpa = next(op for op in ops if op.name == "sdpa")
    assert sdpa.fwd_flops == (t // s) * cfg.num_heads * s * s * (c + cv)
    # what selective recompute runs again: the norms, and MLA's up-projections with the rotary
    again = {op.name for op in ops if op.selective}
    norms = {"attn_norm", "mlp_norm"} | ({"qk_norm"} if cfg.attention == "gqa-qk-norm" else set())
    if cfg.attention == "mla":
        norms |= {"kv_a_norm", "kv_b_proj", "rotary"} | (
            {"q_proj"} if cfg.q_lora_rank is None else {"q_a_norm", "q_b_proj"}
        )
    assert again == norms


def test_mtp_flops_and_the_last_stage() -> None:
    """MFU counts the MTP module: its block, eh_proj and the shared head once more; the head's sub-stage
    carries its work around the block."""
    plain = V3.replace(mtp_layers=0)
    c = V3.qk_nope_head_dim + V3.qk_rope_head_dim + V3.v_head_dim
    extra = fl.model_flops_per_token(V3, 32) - fl.model_flops_per_token(plain, 32)
    block = sum(p.numel * (V3.top_k / V3.num_experts if p.expert else 1) for p in layer_params(V3, 4))
    head = 2 * V3.hidden_size**2 + V3.vocab_size * V3.hidden_size + 3 * V3.hidden_size
    assert extra == pytest.approx(6 * (block + head) + 3 * V3.num_heads * c * 32)
    cluster, par = Cluster(GPUS["h100"], 8, 8), Parallelism(pp=1, dp=1, ep=1, schedule="1f1b")
    work = Workload(seq_len=32, micro_batch=2)
    with_mtp, without = substage_costs(V3, cluster, par, work), substage_costs(plain, cluster, par, work)
    assert with_mtp.head_F > 1.9 * without.head_F and with_mtp.attn_F == without.attn_F


# MLA with Cv = C: SDPA's v stays a view of kv_b_proj's output (with Cv != C MLA pads to one head dim, so that
# the fused kernel runs: tests/moe/models/test_mla_fused.py measures that case).
MLA_FUSED = V3.replace(v_head_dim=V3.qk_nope_head_dim + V3.qk_rope_head_dim)


@pytest.mark.parametrize(
    "cfg",
    [MLA_FUSED, MLA_FUSED.replace(q_lora_rank=None, mtp_layers=0), QWEN],
    ids=["mla-mtp", "mla-no-q-latent", "qwen3"],
)
@pytest.mark.parametrize(("dtype", "b"), [(torch.float32, 4), (torch.bfloat16, 2)])
def test_activation_bytes_match_the_tracker(cfg, dtype: torch.dtype, b: int) -> None:
    """One micro-batch through the whole model (MTP included): the saved tensors listed per sub-stage (the
    runtime's kept piece inputs aside) within 5% of moe.train.memory's tracker, as tests/moe/plan/test_footprint.py
    does for our GQA blocks."""
    model = MoEModel(cfg, seed=0, piecewise=True).to(dtype)
    measured = tracked_peak_bytes(model, cfg, size=2, seq=32, mtp=bool(cfg.mtp_layers))
    tokens, layers = 64, range(cfg.num_layers)
    listed = module_activation_bytes(cfg, layers, tokens, 32, b, 1, first=True, last=True, recompute="none")
    blocks = [*layers, *range(cfg.num_layers, cfg.num_layers + cfg.mtp_layers)]
    leaves = sum(v for i in blocks for k, v in layer_activations(cfg, i, tokens, 32, b).items() if k in LEAVES)
    assert listed - leaves == pytest.approx(measured, rel=0.05)


def test_memory_options_each_lower_the_footprint() -> None:
    """Selective recompute drops the norms' tensors and MLA's q, k, v; bf16 moments halve the moments; FP8
    caching shrinks what the GEMMs keep; full recompute keeps least. Parameters never change."""
    cfg = preset("deepseek-v3")
    par = Parallelism(pp=16, dp=128, ep=64, schedule="dualpipe")
    base = Workload(seq_len=4096, micro_batch=1, comm_sms=20)
    fp = {
        name: footprint(cfg, par, dataclasses.replace(base, **change), num_chunks=120)
        for name, change in {
            "none": {},
            "selective": {"recompute": "selective"},
            "full": {"recompute": True},  # a bool still reads as before granularities
            "bf16": {"state_dtype": "bfloat16"},
            "fp8": {"fp8_activations": True, "precision": Precision(fp8=True)},
        }.items()
    }
    acts = {k: v.activations for k, v in fp.items()}
    assert acts["full"] < acts["selective"] < acts["none"] and acts["fp8"] < acts["none"]
    assert fp["bf16"].optimizer < fp["none"].optimizer
    # bf16 moments may make another rank the fullest: on the same rank, the activations do not change
    bf16 = dataclasses.replace(base, state_dtype="bfloat16")
    assert footprint(cfg, par, bf16, num_chunks=120, pp_rank=fp["none"].pp_rank).activations == acts["none"]
    assert len({(f.params, f.grads) for f in fp.values() if f.pp_rank == fp["none"].pp_rank}) == 1
    assert fp["selective"].options["recompute"] == "selective" and fp["full"].options["recompute"] == "full"
    # selective drops exactly MLA's SDPA q, k, v and the norms' fp32 tensors, and keeps the latents instead
    plain = layer_activations(cfg, 10, 4096, 4096, 2, 64)
    sel = layer_activations(cfg, 10, 4096, 4096, 2, 64, recompute="selective")
    assert {"attn.sdpa_q", "attn.sdpa_k", "attn.sdpa_v", "attn.norm_fp32_input"} <= set(plain) - set(sel)
    assert {"attn.q_latent", "attn.kv_latent", "attn.mlp_norm_input"} <= set(sel) - set(plain)
    assert sel["attn.mlp_norm_output"] == plain["attn.mlp_norm_output"]  # the piece's output z stays


def test_bf16_moments_equal_the_optimizer() -> None:
    """state_bytes with bf16 moments against DistributedAdamW's own figure (moe.train.optimizer)."""
    cfg = V3.replace(mtp_layers=0)
    model = MoEModel(cfg, seed=0).to(torch.bfloat16)
    dense = [p for n, p in model.named_parameters() if ".experts." not in n]
    experts = model.expert_parameters()
    opt = DistributedAdamW([ShardGroup(dense), ShardGroup(experts)], zero=True, state_dtype="bfloat16")
    meter = MemoryMeter([model], opt)
    meter.start_step()
    got = meter.stop_step()
    specs = stage_params(cfg, range(cfg.num_layers), first=True, last=True)
    want = state_bytes(specs, param_bytes=2, master_weights=True, dp=1, edp=1, zero=True, state_dtype="bfloat16")
    assert (got["param_bytes"], got["grad_bytes"], got["optimizer_state_bytes"]) == want
    assert want[2] == (2 * 2 + 4) * sum(p.numel for p in specs)

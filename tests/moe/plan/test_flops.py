"""FLOP and byte counts of one layer against hand computation for a tiny config."""

from __future__ import annotations

import pytest

from moe.models.config import MoEConfig
from moe.plan import flops as fl
from moe.plan.params import active_params, total_params

# D=32, H=4 query heads, G=2 kv heads, C=8, E=8 experts of F=16, top-2, one shared expert (Fs=16),
# dense width Fd=48, V=64; a micro-batch of 2 sequences of S=32: T=64 tokens.
CFG = MoEConfig(
    vocab_size=64,
    hidden_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    num_dense_layers=1,
    dense_intermediate_size=48,
    num_experts=8,
    num_shared_experts=1,
    moe_intermediate_size=16,
    top_k=2,
)
T, S, B = 64, 32, 2


def _by_name(ops: list[fl.Op]) -> dict[str, fl.Op]:
    return {op.name: op for op in ops}


def test_attention_flops() -> None:
    ops = _by_name(fl.attention_ops(CFG, T, S, B))
    # QKV: [64, 32] x [32, (4 + 2*2) * 8 = 64] -> 2*64*32*64
    assert ops["qkv"].fwd_flops == 2 * 64 * 32 * 64 == 262144
    assert ops["qkv"].dx_flops == ops["qkv"].dw_flops == 262144
    # O: [64, 32] x [32, 32]
    assert ops["o_proj"].fwd_flops == 2 * 64 * 32 * 32 == 131072
    # SDPA, causal half: QK^T and PV, 2 FLOPs a MAC, 2 sequences x 4 heads x 32^2 / 2 pairs x 8 wide:
    # 2 * (2 * 2*4*32*32*8) / 2 = 131072; backward 2.5x, no weights.
    assert ops["sdpa"].fwd_flops == 131072
    assert ops["sdpa"].dx_flops == 2.5 * 131072 and ops["sdpa"].dw_flops == 0
    assert fl.total(list(ops.values()), "fwd_flops") == 262144 + 131072 + 131072
    # QKV bytes forward, bf16: x [64, 32] + W [32, 64] + y [64, 64] = 2 * (2048 + 2048 + 4096)
    assert ops["qkv"].fwd_bytes == 16384
    # its weight gradient: reads dy and x (bf16), reads and writes the fp32 main_grad
    assert ops["qkv"].dw_bytes == 2 * (64 * 64 + 64 * 32) + 8 * 32 * 64


def test_router_moe_and_dense_mlp_flops() -> None:
    router = _by_name(fl.router_ops(CFG, T, B))
    assert router["router_gate"].fwd_flops == 2 * 64 * 32 * 8 == 32768
    mlp = _by_name(fl.moe_mlp_ops(CFG, T, rows_received=T, b=B))
    # 64 tokens x top-2 = 128 expert rows: gate/up [128, 32] x [32, 32], down [128, 16] x [16, 32]
    assert mlp["experts_gate_up"].fwd_flops == 2 * 128 * 32 * 32 == 262144
    assert mlp["experts_down"].fwd_flops == 2 * 128 * 16 * 32 == 131072
    assert mlp["experts_gate_up"].experts and not mlp["shared_gate_up"].experts
    # shared expert over the 64 own tokens: [64, 32] x [32, 32] and [64, 16] x [16, 32]
    assert mlp["shared_gate_up"].fwd_flops + mlp["shared_down"].fwd_flops == 131072 + 65536
    # permute: 64 received rows read, 128 sorted rows written (bf16), 128 int64 row ids
    assert mlp["permute"].fwd_bytes == 2 * (64 + 128) * 32 + 8 * 128 == 13312
    # experts' weights at ep=2: 4 local experts x 32 x 32 gate/up elements
    half = _by_name(fl.moe_mlp_ops(CFG, T, rows_received=T, b=B, ep=2))
    assert half["experts_gate_up"].fwd_bytes == 2 * (128 * 32 + 4 * 32 * 32 + 128 * 32)
    dense = fl.dense_mlp_ops(CFG, T, B)
    assert fl.total(dense, "fwd_flops") == 2 * 64 * 32 * 96 + 2 * 64 * 48 * 32 == 589824
    assert fl.total(dense, "dw_flops") == 589824
    head = _by_name(fl.head_ops(CFG, T, B))
    assert head["head"].fwd_flops == 2 * 64 * 32 * 64
    assert head["cross_entropy"].fwd_bytes == 2 * 64 * 64 + 4 * 64
    assert fl.total(fl.embed_ops(CFG, T, B), "fwd_flops") == 0


def test_model_flops_per_token() -> None:
    # active parameters (no embedding): per layer attention 32*64 + 32*32 (+ 2 norms of 32);
    # dense MLP 32*96 + 48*32; MoE layer: router 8*32, 2 of 8 experts' (32*32 + 16*32), shared 32*32 + 16*32;
    # final norm 32 and head 64*32.
    attn = 32 * 64 + 32 * 32 + 2 * 32
    dense = 32 * 96 + 48 * 32
    moe = 8 * 32 + 2 * (32 * 32 + 16 * 32) + (32 * 32 + 16 * 32)
    active = 2 * attn + dense + moe + 32 + 64 * 32
    assert active_params(CFG) == active
    assert total_params(CFG) == active - 2 * (32 * 32 + 16 * 32) + 8 * (32 * 32 + 16 * 32) + 64 * 32
    # attention: 6 x layers x heads x head dim x S = 6 * 2 * 4 * 8 * 32 (causal half of PaLM's 12)
    assert fl.model_flops_per_token(CFG, S) == pytest.approx(6 * active + 6 * 2 * 4 * 8 * 32)


def test_tokens_must_fill_sequences() -> None:
    with pytest.raises(ValueError, match="whole number of sequences"):
        fl.attention_ops(CFG, 48, 32, 2)

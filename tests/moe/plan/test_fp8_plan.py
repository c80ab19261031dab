"""The planner's FP8 (#26): GEMM time at the FP8 peak, the quantization's bytes, the dispatch direction's bytes,
the backward all-to-alls by direction, FP8-cached activations against the tracker, and the DeepSeek-V3
comparison in the report's precision."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kernels.fp8 import FP8Recipe
from moe import MoEModel
from moe.models.config import PRESETS, MoEConfig
from moe.models.layers import use_fp8
from moe.models.mla import sdpa_head_dim
from moe.plan import flops as fl
from moe.plan.cli import main
from moe.plan.costs import NO_FP8, Parallelism, Precision, Workload, substage_costs
from moe.plan.footprint import LEAVES, footprint, layer_activations, module_activation_bytes
from moe.plan.hardware import GPU, GPUS, Cluster, gpu
from moe.plan.measured import MeasuredCosts
from moe.plan.pair import BlockTimes, chunk_times
from moe.plan.report import RunShape, evaluate, v3_comparison, v3_side_by_side
from moe.plan.search import Candidate
from tests.moe.helpers import tiny_config, tracked_peak_bytes

# GQA, hidden 32, 4 heads of 8 (2 key/value heads), 8 experts, top-2, expert width 16, one shared expert: the
# sizes the by-hand numbers below use, stated here.
CFG = dataclasses.replace(
    tiny_config(),
    num_layers=2,
    hidden_size=32,
    num_heads=4,
    num_kv_heads=2,
    num_experts=8,
    top_k=2,
    moe_intermediate_size=16,
    num_shared_experts=1,
)
FP8 = Precision(fp8=True)
SCALED = 1 + 4 / 128  # an E4M3 element and its share of a 1x128 tile's fp32 scale


def _device(*, flops: float = 1e12, hbm: float = 1e30) -> GPU:
    """Round rates: bf16 at 1e12 FLOP/s x 0.5 = 0.5e12 achieved, FP8 twice that."""
    return GPU("test", flops, hbm, 80e9, 100, 1e11, 1e10, fp8_flops=2 * flops, gemm_efficiency=0.5)


def test_fp8_peaks_are_in_the_table() -> None:
    for name in ("h100", "h800", "h200"):  # datasheets: FP8 3,958 TFLOPS with sparsity, dense half of it
        assert gpu(name).fp8_flops == 1979e12 and gpu(name).fp8_gemm_flops == pytest.approx(
            2 * gpu(name).gemm_flops, rel=1e-3
        )
    with pytest.raises(ValueError, match="has no FP8 peak"):
        _ = dataclasses.replace(GPUS["h100"], fp8_flops=None).fp8_gemm_flops


def test_fp8_halves_the_linears_and_nothing_else() -> None:
    """Compute-bound (an HBM with no limit): one MoE layer's attention for 2 x 32 tokens. Its linears, qkv
    [64, 32] x [32, (4 + 2 x 2) x 8] and o_proj [64, 32] x [32, 32], are 2 x 64 x 32 x 64 + 2 x 64 x 32 x 32 =
    393,216 FLOPs each phase; SDPA (2 x 4 x 32^2 x 16 = 131,072 forward) and the router's gate (2 x 64 x 32 x 8)
    stay at the bf16 rate. So every phase loses 393,216 / 0.5e12 / 2 seconds, and the head loses nothing."""
    cluster = Cluster(_device(), 1, 1)
    par = Parallelism(pp=1, dp=1, ep=1, schedule="1f1b")
    base = Workload(seq_len=32, micro_batch=2)
    bf16 = substage_costs(CFG, cluster, par, base)
    fp8 = substage_costs(CFG, cluster, par, dataclasses.replace(base, precision=FP8))
    saved = 393_216 / 0.5e12 / 2
    assert bf16.attn_F - fp8.attn_F == pytest.approx(saved)
    assert bf16.attn_dW - fp8.attn_dW == pytest.approx(saved)
    assert bf16.attn_F == pytest.approx((393_216 + 131_072 + 2 * 64 * 32 * 8) / 0.5e12)
    assert fp8.detail["sdpa.fwd"] == bf16.detail["sdpa.fwd"] == pytest.approx(131_072 / 0.5e12)
    assert fp8.detail["router_gate.fwd"] == bf16.detail["router_gate.fwd"]
    assert (fp8.head_F, fp8.head_B, fp8.embed_F) == (bf16.head_F, bf16.head_B, bf16.embed_F)
    # the experts' two grouped GEMMs over 2 x 64 rows and the shared expert: all at the FP8 rate
    experts = 2 * 128 * 32 * 32 + 2 * 128 * 16 * 32 + 2 * 64 * 32 * 32 + 2 * 64 * 16 * 32
    forward = lambda c: c.mlp_F + c.shared_F  # noqa: E731 (the shared expert is a sub-stage of its own)
    assert forward(bf16) - forward(fp8) == pytest.approx(experts / 0.5e12 / 2)


def test_quantization_traffic_is_in_the_bytes() -> None:
    """Bandwidth-bound (FLOPs for free): o_proj [64, 32] x [32, 32] in bf16 moves 2 x (64x32 + 32x32 + 64x32) =
    10,240 bytes forward. In FP8 x is read and written as E4M3 with its scales, then read again (64 x 32 x
    (2 + 2 x 1.03125)), the weight likewise in 128x128 blocks (32 x 32 x (2 + 2 x (1 + 4/128^2))), the bf16 output
    written (64 x 32 x 2): 8,320 + 4,096.5 + 4,096 bytes."""
    op = next(o for o in fl.attention_ops(CFG, 64, 32, 2, fp8=True) if o.name == "o_proj")
    plain = next(o for o in fl.attention_ops(CFG, 64, 32, 2) if o.name == "o_proj")
    assert plain.fwd_bytes == 10_240 and op.fp8 and not plain.fp8
    assert op.fwd_bytes == pytest.approx(8_320 + 4_096.5 + 4_096)
    assert op.fwd_flops == plain.fwd_flops
    cluster = Cluster(_device(flops=1e30, hbm=1e9), 1, 1)
    work = Workload(seq_len=32, micro_batch=2, precision=FP8)
    costs = substage_costs(CFG, cluster, Parallelism(pp=1, dp=1, ep=1, schedule="1f1b"), work)
    assert costs.detail["o_proj.fwd"] == pytest.approx(op.fwd_bytes / 1e9)


def test_dispatch_direction_moves_fp8_and_its_scales() -> None:
    cluster = Cluster(GPUS["h800"], 4, 2)  # ep = 4 over two nodes: NVLink and IB bytes
    par = Parallelism(pp=1, dp=4, ep=4, schedule="1f1b")
    base = Workload(seq_len=32, micro_batch=2, comm_sms=0)
    bf16 = substage_costs(CFG, cluster, par, base)
    fp8 = substage_costs(CFG, cluster, par, dataclasses.replace(base, precision=FP8))
    assert bf16.dispatch > 0 and bf16.combine > 0  # at DeepEP's dispatch and combine rates, each its own
    assert fp8.dispatch / bf16.dispatch == pytest.approx(SCALED / 2) and fp8.combine == bf16.combine
    # fp8_dispatch on its own, and FP8 GEMMs with a bf16 dispatch
    alone = substage_costs(CFG, cluster, par, dataclasses.replace(base, precision=Precision(fp8_dispatch=True)))
    assert alone.dispatch == fp8.dispatch and alone.attn_F == bf16.attn_F
    off = substage_costs(
        CFG, cluster, par, dataclasses.replace(base, precision=Precision(fp8=True, fp8_dispatch=False))
    )
    assert off.dispatch == bf16.dispatch and off.attn_F == fp8.attn_F


def test_backward_all_to_alls_go_by_direction() -> None:
    """A lone backward: the combine's gradient (dispatch direction, 0.5 s) -> MLP dX (1) -> the dispatch's
    gradient (combine direction, 1.0 s) under MLP dW (0.8) -> attention dX and dW (1 + 1): 0.5 + 1 + max(1.0,
    0.8) + 2 = 4.5 s; with the directions the other way round it would be 1 + 1 + max(0.5, 0.8) + 2 = 4.8."""
    block = BlockTimes(attn_f=1, attn_dx=1, attn_dw=1, mlp_f=1, mlp_dx=1, mlp_dw=0.8, dispatch=0.5, combine=1.0)
    lone = chunk_times([block])
    backward, forward = lone.B, lone.F
    assert backward == pytest.approx(4.5)
    assert forward == pytest.approx(1 + 0.5 + 1 + 1.0)  # attention, dispatch, MLP, combine


# MLA with an MTP module (MLA's value head as wide as the query's, for the CPU's fused SDPA) and every width a
# multiple of 128; Qwen3 likewise, and Qwen3's tiny preset, whose expert rows [M, 32] and SwiGLU inputs [M, 32]
# fill a fraction of one 1x128 tile (a whole fp32 scale per row each).
ALIGNED = {
    "mla-mtp": PRESETS["deepseek-v3-tiny"].replace(
        hidden_size=128, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64,
        v_head_dim=128, num_heads=2, num_kv_heads=2, moe_intermediate_size=128, dense_intermediate_size=128,
        num_layers=2, mtp_layers=1,
    ),
    "qwen3": PRESETS["qwen3-moe-tiny"].replace(
        hidden_size=128, head_dim=128, num_heads=2, num_kv_heads=1, moe_intermediate_size=128,
        dense_intermediate_size=128, num_layers=1,
    ),
    "qwen3-partial-tiles": PRESETS["qwen3-moe-tiny"].replace(num_layers=1),
}  # fmt: skip


def _caching_saves(cfg: MoEConfig, block: int, t: int) -> int:
    """Bytes FP8 caching takes off one micro-batch of ``t`` bf16 tokens in ``block``, written out by hand: each
    kept tensor goes from 2 bytes an element to 1 (FP8) or 1.5 (E5M6) plus one fp32 scale per row and 1x128 tile.
    SDPA's output [T, H x W] to E5M6; the MLP's normed input [T, D] to FP8; an MoE block's expert rows [T K, D]
    and SwiGLU input [T K, 2F] to FP8; a SwiGLU MLP's (dense, or shared experts') SwiGLU input [T, 2F] to FP8 and
    its down projection's input [T, F] (2 bytes an element) gone, recomputed."""

    def tiles(width: int) -> int:
        return 4 * math.ceil(width / 128)

    def mlp(f: int) -> int:
        return t * (2 * f - tiles(2 * f)) + 2 * t * f

    c = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    hw = cfg.num_heads * (sdpa_head_dim(c, cfg.v_head_dim) if cfg.attention == "mla" else cfg.attn_head_dim)
    saved = t * (hw // 2 - tiles(hw)) + t * (cfg.hidden_size - tiles(cfg.hidden_size))
    if not cfg.is_moe_layer(block):
        return saved + mlp(cfg.dense_intermediate_size)
    d, f2, m = cfg.hidden_size, 2 * cfg.moe_intermediate_size, t * cfg.top_k
    saved += m * (d + f2) - m * (tiles(d) + tiles(f2))
    return saved + (mlp(cfg.num_shared_experts * cfg.moe_intermediate_size) if cfg.num_shared_experts else 0)


@pytest.mark.parametrize("name", sorted(ALIGNED))
def test_fp8_activations_against_the_tracker(name: str) -> None:
    """FP8 GEMMs in bf16, with and without fp8_activations: the saved bytes listed change by exactly what the
    tracker sees change, and that is, in every block (MTP's included, 64 tokens, top-2), what
    :func:`_caching_saves` writes out: SDPA's output in E5M6 (shared by SDPA's backward and o_proj), the MLP's
    normed input in FP8 (shared by the router's gate and the shared experts), the routed experts' two inputs and
    the SwiGLU MLPs' SwiGLU inputs in FP8, their down projections' inputs recomputed."""
    cfg = ALIGNED[name]
    layers = range(cfg.num_layers)
    blocks = [*layers, *range(cfg.num_layers, cfg.num_layers + cfg.mtp_layers)]
    measured, listed = {}, {}
    for save in (False, True):
        model = use_fp8(MoEModel(cfg, seed=0, piecewise=True).to(torch.bfloat16), FP8Recipe(save_fp8=save))
        measured[save] = tracked_peak_bytes(model, cfg, size=2, seq=32, mtp=bool(cfg.mtp_layers))
        total = module_activation_bytes(cfg, layers, 64, 32, 2, 1, first=True, last=True, recompute="none", fp8=save)
        leaves = sum(
            v for i in blocks for k, v in layer_activations(cfg, i, 64, 32, 2, fp8=save).items() if k in LEAVES
        )
        listed[save] = total - leaves
    assert listed[True] - listed[False] == measured[True] - measured[False]
    assert measured[False] - measured[True] == sum(_caching_saves(cfg, i, 64) for i in blocks) > 0


def test_fp8_activations_by_hand() -> None:
    """An MoE layer of 64 tokens, top-2: the experts' sorted rows [128, 32] and SwiGLU input [128, 2 x 16] are
    kept as 1 byte an element plus one fp32 scale per row (a row is one partial 1x128 tile): 128 x 32 x (1 + 4/32)
    each, instead of 2 bytes; SDPA's output [64, 4 x 8] in E5M6 (1.5 bytes + 4/32); the normed MLP input [64, 32]
    and the shared expert's SwiGLU input [64, 32] in FP8, its down projection's input [64, 16] gone. Nothing else
    changes, under selective recompute neither; the dense layer's SwiGLU MLP like the shared expert's."""
    plain = layer_activations(CFG, 1, 64, 32, 2)
    fp8 = layer_activations(CFG, 1, 64, 32, 2, fp8=True)
    assert fp8["mlp.experts_input_fp8"] == fp8["mlp.experts_gate_up_output_fp8"] == 128 * 32 * 1.125
    assert plain["mlp.experts_input"] == plain["mlp.experts_gate_up_output"] == 128 * 32 * 2
    assert fp8["attn.sdpa_out_e5m6"] == 64 * 32 * (1.5 + 4 / 32) and plain["attn.sdpa_out"] == 64 * 32 * 2
    assert fp8["attn.mlp_norm_output_fp8"] == fp8["mlp.shared_swiglu_input_fp8"] == 64 * 32 * 1.125
    assert plain["mlp.shared_down_input"] == 64 * 16 * 2 and "mlp.shared_down_input" not in fp8
    changed = {"attn.sdpa_out", "attn.mlp_norm_output", "mlp.shared_swiglu_input", "mlp.shared_down_input"}
    rest = {k: v for k, v in plain.items() if not k.startswith("mlp.experts_") and k not in changed}
    assert {k: v for k, v in fp8.items() if not k.startswith("mlp.experts_") and not k.endswith(("_fp8", "_e5m6"))} == (
        rest
    )
    by_hand = _caching_saves(CFG, 1, 64)
    assert sum(plain.values()) - sum(fp8.values()) == by_hand
    dense = {f: layer_activations(CFG, 0, 64, 32, 2, fp8=f) for f in (False, True)}
    assert sum(dense[False].values()) - sum(dense[True].values()) == _caching_saves(CFG, 0, 64)
    assert dense[True]["mlp.swiglu_input_fp8"] == 64 * 96 * (1 + 4 / 96) and "mlp.down_input" not in dense[True]
    sel = {f: sum(layer_activations(CFG, 1, 64, 32, 2, recompute="selective", fp8=f).values()) for f in (False, True)}
    assert sel[False] - sel[True] == by_hand
    # MLA with MTP, every width a multiple of 128: the dense block, layer 1's and MTP's MoE blocks, as written out
    mla = ALIGNED["mla-mtp"]
    kept = {
        f: module_activation_bytes(mla, range(2), 64, 32, 2, 1, first=True, last=True, recompute="none", fp8=f)
        for f in (False, True)
    }
    assert kept[False] - kept[True] == sum(_caching_saves(mla, i, 64) for i in range(3))
    # the footprint of a DeepSeek-V3 rank at the report's layout drops too; fp8_activations needs FP8 GEMMs
    v3, par = PRESETS["deepseek-v3"], Parallelism(pp=16, dp=128, ep=64, schedule="dualpipe")
    work = Workload(seq_len=4096, micro_batch=1, comm_sms=20, precision=FP8)
    cached = dataclasses.replace(work, fp8_activations=True)
    assert footprint(v3, par, cached, num_chunks=120).activations < footprint(v3, par, work, num_chunks=120).activations
    with pytest.raises(ValueError, match="fp8_activations needs fp8"):
        dataclasses.replace(work, precision=NO_FP8, fp8_activations=True)


def test_cli_flags_and_measured_gemms(capsys) -> None:
    argv = ["--model", "deepseek-v3-tiny", "--gpus", "8", "--gpu", "h100", "--seq-len", "64",
            "--global-batch-size", "16", "--schedules", "1f1b", "--recompute", "off"]  # fmt: skip
    with pytest.raises(SystemExit, match=r"^error: --fp8-activations needs --fp8"):
        main([*argv, "--fp8-activations"])
    assert main([*argv, "--fp8", "--no-fp8-dispatch", "--top", "1"]) == 0
    assert "precision: FP8 GEMMs (every linear but the head and the router's gate), dispatch and combine" in (
        capsys.readouterr().out
    )
    # a costs file's GEMMs ran in its own dtype: an FP8 plan refuses them rather than scale them
    measured = MeasuredCosts(config=CFG, seq_len=32, tokens=64, moe={"attn_F": 1e-3}, dense={"embed_F": 1e-4})
    cluster, par = Cluster(GPUS["h100"], 1, 1), Parallelism(pp=1, dp=1, ep=1, schedule="1f1b")
    work = Workload(seq_len=32, micro_batch=2, precision=FP8)
    with pytest.raises(ValueError, match=r"moe\.attn_F was measured with GEMMs in the file's dtype"):
        substage_costs(CFG, cluster, par, work, measured=measured)
    assert substage_costs(CFG, cluster, par, work, moe=False, measured=measured).embed_F > 0  # no GEMM: scaled


def test_deepseek_v3_comparison_runs_in_fp8() -> None:
    """The side-by-side times the report's layout with FP8 GEMMs and FP8 dispatch whatever the run asked for,
    and says so (a small model with 32 layers and 64 experts, so that PP16 x EP64 runs in seconds)."""
    cfg = MoEConfig(
        vocab_size=256, hidden_size=128, num_layers=32, num_heads=2, num_kv_heads=2, num_experts=64, top_k=2,
        n_group=8, topk_group=2, moe_intermediate_size=128, mtp_layers=0,
    )  # fmt: skip
    cluster, run = Cluster(GPUS["h800"], 2048, 8), RunShape(128, 128 * 32, 1)
    side = v3_side_by_side(cfg, cluster, run)
    assert side["precision"] == {"fp8_gemms": True, "fp8_dispatch": True}
    lay = side["layout"]
    cand = Candidate("dualpipe", 16, 128, 64, 32, 20, "selective", lay["pipeline_layout"])
    fp8 = evaluate(cfg, cluster, dataclasses.replace(run, precision=FP8), cand)
    bf16 = evaluate(cfg, cluster, run, cand)
    assert side["tokens_per_s_per_gpu"]["planner"] == pytest.approx(fp8.tokens_per_s_per_gpu)
    assert fp8.tokens_per_s_per_gpu > bf16.tokens_per_s_per_gpu
    text = v3_comparison(cfg, cluster, run, side=side)
    assert "precision (the report's, 3.3): FP8 GEMMs" in text and "(FP8 GEMMs, FP8 dispatch)" in text

"""FP8 training (DeepSeek-V3's recipe, kernels.fp8) against the bf16 run it replaces: the losses stay within 1%
(relative) of bf16's at every step after the fifth, in one process and at pp=2 x ep=2 under DualPipeV with
overlap (the report measures < 0.25% at scale; a tiny model with 128 tokens per micro-batch is noisier).

Measured: 0.70% in one process and 0.35% at pp=2 x ep=2 (32 tokens a sequence there), the worst step in both
a one-step blip the next step closes; bf16 itself differs from fp32 by 0.61% at that same step of the
one-process run (a routing decision that small rounding flips), so FP8 costs about what bf16 does here.
Re-measured on 2026-11-28 over 40 steps: 0.11% and 0.13% worst, 0.11% and 0.08% over steps 6-20, the loss
down 1.4 and 1.6 by step 20 (1.5 and 2.0 by step 40): 20 steps show both the closeness and the learning."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dualpipe.pieces import BlockRun, Compute
from kernels.fp8 import FP8Recipe
from moe.dispatch.local import LocalDispatcher
from moe.models.config import MoEConfig, preset
from moe.models.layers import Linear, use_fp8
from moe.models.model import MoEModel
from moe.models.stage import MoEStage
from tests.moe.helpers import SEED, assert_rel_close
from tests.moe.models.test_experts import DeliveringDispatcher
from tests.moe.train.test_trainer import train_each

STEPS = 20


def _close_to_bf16(bf16: dict[int, float], fp8: dict[int, float]) -> float:
    assert sorted(bf16) == sorted(fp8) == list(range(1, STEPS + 1))
    worst = max(abs(fp8[s] - bf16[s]) / bf16[s] for s in range(6, STEPS + 1))
    print(f"worst relative loss difference after step 5: {worst:.4f}")
    assert worst < 0.01, (worst, bf16, fp8)
    assert bf16 != fp8  # FP8 ran: it rounds differently
    assert fp8[STEPS] < fp8[1] - 0.5  # and it learns
    return worst


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "layout"),
    [
        (1, ["--seq-len", "64"]),  # 128 tokens a micro-batch
        (4, ["--pp", "2", "--dp", "2", "--ep", "2", "--schedule", "dualpipev", "--overlap", "--seq-len", "32"]),
    ],
    ids=["one-process", "pp2-ep2-dualpipev-overlap"],
)
def test_fp8_loss_tracks_bf16(tmp_path: Path, world: int, layout: list[str]) -> None:
    args = [*layout, "--steps", str(STEPS), "--dtype", "bfloat16"]
    got = train_each(world, tmp_path, {"bf16": args, "fp8": [*args, "--fp8", "--fp8-activations"]})  # one spawn
    _close_to_bf16(got["bf16"], got["fp8"])


def test_use_fp8_leaves_the_head_and_router_in_their_dtype() -> None:
    cfg = MoEConfig(num_layers=2, num_dense_layers=1, mtp_layers=1)
    model = use_fp8(MoEModel(cfg), FP8Recipe())
    kept = {name for name, m in model.named_modules() if isinstance(m, Linear) and m.fp8 is None}
    fp8 = {name for name, m in model.named_modules() if getattr(m, "fp8", None) is not None}
    assert kept == {"head", "blocks.1.router.gate", "blocks.2.router.gate"}, kept
    assert {"blocks.1.experts", "blocks.0.mlp.down", "blocks.1.shared.gate_up", "blocks.2.eh_proj"} <= fp8, fp8
    assert use_fp8(model, None) is model
    assert all(getattr(m, "fp8", None) is None for m in model.modules())


@pytest.mark.parametrize("name", ["deepseek-v3-tiny", "qwen3-moe-tiny"])
def test_published_architectures_run_their_projections_in_fp8(name: str) -> None:
    """MLA's low-rank projections and Qwen3's GQA projections go FP8; one step's gradients stay close to bf16's."""
    model = MoEModel(dataclasses.replace(preset(name), mtp_layers=0), seed=0).to(torch.bfloat16)
    ids = torch.randint(0, model.cfg.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    grads = {}
    for recipe in (None, FP8Recipe()):
        use_fp8(model, recipe)
        model.zero_grad()
        model(ids).float().logsumexp(-1).mean().backward()
        grads[recipe] = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    fp8_layers = {n for n, m in model.named_modules() if isinstance(m, Linear) and m.fp8 is not None}
    want = (
        {"q_a_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"}
        if name.startswith("deepseek")
        else {"q_proj", "o_proj"}
    )
    assert want <= {n.rsplit(".", 1)[-1] for n in fp8_layers}, fp8_layers
    bf16, fp8 = grads[None], grads[FP8Recipe()]
    assert bf16.keys() == fp8.keys()
    # The FP8 layers' weight gradients (measured 5-12% from bf16's; each E4M3 GEMM adds about 4%). The router's
    # are ill-conditioned (bf16 alone moves them 6-9% from fp32's) and are not compared.
    for n in (f"{layer}.weight" for layer in fp8_layers):
        err = ((fp8[n] - bf16[n]).norm() / bf16[n].norm()).item()
        assert 0 < err < 0.2, (n, err)


def test_fp8_activations_keep_what_the_report_keeps() -> None:
    """save_fp8 keeps, per MoE layer, the routed experts' up-projection input and SwiGLU input, the MLP's normed
    input (one copy for the router's gate and the shared expert) and the shared expert's SwiGLU input in FP8 (1
    byte + 4/128), and SDPA's output in E5M6 (1.5 bytes + 4/128; one copy for SDPA and o_proj), instead of bf16;
    the shared expert's down-projection input is recomputed. Exactly those bytes go; the gradients move by one
    rounding."""
    cfg = MoEConfig(num_layers=2, hidden_size=128, moe_intermediate_size=128)
    ids = torch.randint(0, cfg.vocab_size, (2, 128), generator=torch.Generator().manual_seed(0))
    out = {}
    for save in (False, True):
        model = use_fp8(MoEModel(cfg, seed=0).to(torch.bfloat16), FP8Recipe(save_fp8=save))
        saved: dict[int, tuple[torch.dtype, int]] = {}  # distinct storages

        def pack(t: torch.Tensor, saved: dict = saved) -> torch.Tensor:
            saved[t.untyped_storage().data_ptr()] = (t.dtype, t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = model(ids)
        logits.float().square().mean().backward()
        out[save] = (list(saved.values()), model.embed.weight.grad.float().clone())
    plain, kept = out[False][0], out[True][0]
    t, layers, rows = 2 * 128, cfg.num_layers, 2 * 128 * cfg.top_k
    assert cfg.num_dense_layers == 0 and cfg.num_shared_experts == 1 and cfg.num_heads * cfg.attn_head_dim == 128
    # per layer: experts' x [M, 128] and h [M, 256] (M = 256 tokens x top-2 = 512 rows), z [T, 128], the shared
    # expert's h [T, 256]; E5M6: SDPA's output [T, 128] as 1.5 bytes an element
    fp8 = layers * (rows * (128 + 256) + t * (128 + 256))
    e5m6 = layers * t * 128 * 3 // 2
    assert sum(n for dtype, n in kept if dtype == torch.float8_e4m3fn) == fp8
    assert sum(n for dtype, n in kept if dtype == torch.uint8) == e5m6
    scales = layers * 4 * (rows * (1 + 2) + t * (1 + 2 + 1))  # one fp32 per row and 1x128 tile
    bf16 = layers * 2 * (rows * (128 + 256) + t * (128 + 256 + 128 + 128))  # the shared expert's down input [T, 128]
    assert sum(n for _, n in plain) - sum(n for _, n in kept) == bf16 - fp8 - e5m6 - scales
    torch.testing.assert_close(out[True][1], out[False][1], rtol=0.1, atol=0.1 * out[False][1].abs().max().item())
    assert not torch.equal(out[True][1], out[False][1])


@pytest.mark.parametrize("dispatcher", ["local", "delivering"])
def test_fp8_caching_frees_the_mlp_input(dispatcher: str) -> None:
    """Under FP8 caching nothing of the backward reads the MLP's normed input z (its readers keep FP8 copies), so
    the overlap runtime's z, a piece output and input it holds, is freed once the MLP piece has run (at ep = 1
    the received rows are z itself; an all-to-all delivers a new buffer); without caching it stays. The backward
    then gives the same gradients as the block's one-graph forward."""
    cfg = MoEConfig(num_layers=2, num_dense_layers=1, hidden_size=128, moe_intermediate_size=128)
    x = torch.randn(2, 8, cfg.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    for save in (False, True):
        grads = []
        for piecewise in (True, False):
            disp = LocalDispatcher(cfg.num_experts) if dispatcher == "local" else DeliveringDispatcher(cfg.num_experts)
            stage = MoEStage(cfg, range(1, 2), first=False, last=False, dispatcher=disp)
            stage.reset_parameters(SEED)
            block = use_fp8(stage.to(torch.bfloat16), FP8Recipe(save_fp8=save)).blocks["1"]
            if not piecewise:
                out = block(x.clone().requires_grad_())
                out.backward((2 * out.detach().float()).bfloat16())
                grads.append({n: p.grad for n, p in block.named_parameters()})
                continue
            decl = block.pieces()
            run = BlockRun(decl)
            run.begin(x.clone().requires_grad_())
            for i, piece in enumerate(decl.pieces):
                run.compute(i) if isinstance(piece, Compute) else run.start(i)
            out = run.output()
            assert (run.values["z"].untyped_storage().nbytes() == 0) is save
            run.begin_backward((2 * out.float()).bfloat16())
            for i in reversed([i for i, p in enumerate(decl.pieces) if isinstance(p, Compute)]):
                run.compute_dx(i)
                run.compute_dw(i)
            grads.append({n: p.grad for n, p in block.named_parameters()})
        for name, grad in grads[1].items():
            assert_rel_close(grads[0][name].float(), grad.float(), 1e-2, name)

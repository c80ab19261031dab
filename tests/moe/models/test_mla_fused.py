"""MLA on a fused attention kernel: SDPA gets q, k and v at one head dim W = max(C, V) (the narrower side padded
with zeros, moe.models.mla), the output and every gradient equal the unpadded computation, and the planner's
listing of what the padded module keeps changes by exactly what moe.train.memory's tracker sees change.

Shapes: DeepSeek-V3's case V < C (C = 16 + 8, V = 16), the other way round (V = 32 > C, which pads q and k) and
V = C (nothing padded), at widths that make every activation O(1)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import moe.models.layers as layers
from dualpipe.weight_grad import WeightGradStore
from moe import MoEModel
from moe.models.config import PRESETS
from moe.models.layers import Linear, causal_attention, selective_recompute
from moe.models.mla import MLAttention
from moe.models.rope import RopeConfig
from moe.plan.footprint import LEAVES, layer_activations, module_activation_bytes
from moe.train.memory import SavedTensorTracker
from tests.moe.helpers import tracked_peak_bytes

B, S, HIDDEN, HEADS, NOPE, ROPE = 2, 24, 64, 4, 16, 8
C = NOPE + ROPE
V_DIMS = {"v-narrower": 16, "v-wider": 32, "v-equal": C}
YARN = RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, mscale=1.0, mscale_all_dim=1.0)


def _module(v_head_dim: int, dtype: torch.dtype = torch.float32) -> MLAttention:
    m = MLAttention(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=NOPE,
        qk_rope_head_dim=ROPE,
        v_head_dim=v_head_dim,
        rope=YARN,
    )
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # 1.5 / sqrt(fan_in): unit-scale activations, attention logits O(1..10)
        for _, p in sorted(m.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.5 * noise if p.dim() == 1 else noise * 1.5 / math.sqrt(p.shape[1]))
    return m.to(dtype)


def _input(dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(B, S, HIDDEN, generator=torch.Generator().manual_seed(1), dtype=dtype)


def _spy_sdpa(monkeypatch: pytest.MonkeyPatch) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The (q, k, v) of every F.scaled_dot_product_attention call from here on (the real one still runs)."""
    calls = []
    real = F.scaled_dot_product_attention

    def spy(q, k, v, *args, **kwargs):
        calls.append((q, k, v))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("case", V_DIMS)
def test_sdpa_runs_at_one_head_dim(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every SDPA call gets q, k and v of width max(C, V), for which the CPU picks its fused (flash) kernel; with
    the unpadded widths it would pick the math path. The output keeps the model's width."""
    v = V_DIMS[case]
    calls = _spy_sdpa(monkeypatch)
    out = _module(v)(_input(torch.float32))
    assert out.shape == (B, S, HIDDEN)
    assert len(calls) == 1
    q, k, val = calls[0]
    w = max(C, v)
    assert q.shape[-1] == k.shape[-1] == val.shape[-1] == w
    assert torch._fused_sdp_choice(q, k, val, is_causal=True) == SDPBackend.FLASH_ATTENTION.value
    unpadded = torch._fused_sdp_choice(q[..., :C], k[..., :C], val[..., :v], is_causal=True)
    assert unpadded == (SDPBackend.FLASH_ATTENTION.value if v == C else SDPBackend.MATH.value)
    # the padded columns are zeros
    assert not q[..., C:].any() and not k[..., C:].any() and not val[..., v:].any()


@pytest.mark.parametrize("selective", [False, True], ids=["kept", "selective-recompute"])
@pytest.mark.parametrize("case", ["v-narrower", "v-wider"])
def test_padded_equals_unpadded(case: str, selective: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """float64: the output and the gradients of the input and of every weight equal those of the same module
    whose attention runs on the unpadded q, k (C wide) and v (V wide) on SDPA's math path, to 1e-12. Selective
    recompute (the padded q, k, v freed after SDPA and refilled in backward) gives the same."""
    assert not WeightGradStore.enabled  # plain autograd: Linear accumulates its weight gradient at once
    v = V_DIMS[case]
    module = selective_recompute(_module(v, torch.float64), selective)
    grad_out = torch.randn(B, S, HIDDEN, generator=torch.Generator().manual_seed(2), dtype=torch.float64)

    def run() -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        module.zero_grad(set_to_none=True)
        x = _input(torch.float64).requires_grad_()
        out = module(x)
        (out * grad_out).sum().backward()
        return out.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}

    padded = run()

    def unpadded_attention(q, k, val, scale):
        with sdpa_kernel(SDPBackend.MATH):  # the math path takes V != C
            return causal_attention(q[..., :C], k[..., :C], val[..., :v], scale=scale)

    monkeypatch.setattr(layers, "causal_attention", unpadded_attention)  # what project_attention calls
    reference = run()
    for ours, ref in zip(padded[:2], reference[:2]):
        assert torch.allclose(ours, ref, rtol=0, atol=1e-12 * ref.abs().max().item())
    assert padded[2].keys() == reference[2].keys()
    for name, grad in padded[2].items():
        ref = reference[2][name]
        assert torch.allclose(grad, ref, rtol=0, atol=1e-12 * ref.abs().max().item()), name


def test_a_linear_over_a_strided_slice_keeps_the_view() -> None:
    """Linear over the last two dims of a slice ``[B, S, H, W][..., :V]`` (feature_dims=2): the same output, input
    gradient and weight gradient as over its contiguous copy ``[B, S, H * V]``, and what it keeps for backward is
    the sliced tensor's own storage, no copy."""
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(B, S, HEADS, C, generator=gen, dtype=torch.float64)
    linear = Linear(HEADS * 12, HIDDEN).double()
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen))
    grad_out = torch.randn(B, S, HIDDEN, generator=gen, dtype=torch.float64)
    results = []
    for flat in (False, True):
        linear.zero_grad(set_to_none=True)
        x = base.clone().requires_grad_()
        sliced = x[..., :12]
        tracker = SavedTensorTracker(exclude=[linear.weight])
        with tracker:
            out = linear(sliced.reshape(B, S, -1)) if flat else linear(sliced, feature_dims=2)
        (out * grad_out).sum().backward()
        results.append((out.detach(), x.grad, linear.weight.grad.clone(), tracker.peak_bytes))
    (out, dx, dw, kept), (ref_out, ref_dx, ref_dw, copy_kept) = results
    assert torch.allclose(out, ref_out) and torch.equal(dx, ref_dx) and torch.allclose(dw, ref_dw)
    assert kept == base.numel() * 8 and copy_kept == B * S * HEADS * 12 * 8


def _kept_bytes(cfg, dtype: torch.dtype, b: int) -> tuple[int, float]:
    """(the tracker's peak of saved-for-backward bytes over one micro-batch of 2 x 32 tokens, the planner's
    listing of the same, the runtime's piece inputs aside)."""
    measured = tracked_peak_bytes(MoEModel(cfg, seed=0, piecewise=True).to(dtype), cfg, size=2, seq=32)
    layers = range(cfg.num_layers)
    listed = module_activation_bytes(cfg, layers, 64, 32, b, 1, first=True, last=True, recompute="none")
    leaves = sum(v for i in layers for k, v in layer_activations(cfg, i, 64, 32, b).items() if k in LEAVES)
    return measured, listed - leaves


@pytest.mark.parametrize(("dtype", "b"), [(torch.float32, 4), (torch.bfloat16, 2)])
def test_listed_bytes_follow_the_padding(dtype: torch.dtype, b: int) -> None:
    """The DeepSeek-V3 tiny model (C = 16) with V = 12 (v padded), V = 24 (q and k padded) and V = 16: the
    planner's listing moves by exactly the bytes the tracker's peak moves (padded q/k/v copies instead of a view,
    SDPA's output W wide; o_proj keeps a view of its slice, no copy)."""
    base = PRESETS["deepseek-v3-tiny"].replace(mtp_layers=0)
    c = base.qk_nope_head_dim + base.qk_rope_head_dim
    measured_eq, listed_eq = _kept_bytes(base.replace(v_head_dim=c), dtype, b)
    for v in (12, 24):
        measured, listed = _kept_bytes(base.replace(v_head_dim=v), dtype, b)
        assert listed - listed_eq == measured - measured_eq != 0, v
        assert listed == pytest.approx(measured, rel=0.02)


@pytest.mark.gpu
def test_a_fused_kernel_runs_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3's head dims (C = 128 + 64, V = 128) in bf16 on CUDA: SDPA picks a fused kernel for the padded
    q, k, v (FlashAttention, or cuDNN's where torch prefers it: sm_90 with a recent cuDNN), and the profiler sees
    it run forward and backward; no memory-efficient (cutlass) kernel, which V != C would get otherwise. The
    kernels' names are in the assertion messages."""
    from torch.profiler import ProfilerActivity, profile

    module = MLAttention(
        hidden_size=1024,
        num_attention_heads=8,
        q_lora_rank=256,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        rope=YARN,
    )
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
            else:
                p.fill_(1.0)
    module = module.to("cuda", torch.bfloat16)
    x = torch.randn(2, 512, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    calls = _spy_sdpa(monkeypatch)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        module(x).float().square().mean().backward()
        torch.cuda.synchronize()
    (q, k, v), *_ = calls
    assert q.shape[-1] == k.shape[-1] == v.shape[-1] == 192
    # what each fused backend's kernels are named after (cuDNN's runtime-compiled ones: cudnn_generated_*_sdpa_*)
    fused = {SDPBackend.FLASH_ATTENTION.value: ("flash",), SDPBackend.CUDNN_ATTENTION.value: ("cudnn", "sdpa")}
    choice = torch._fused_sdp_choice(q, k, v, is_causal=True)
    assert choice in fused, choice
    kernels = sorted({e.name.lower() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA})
    attention = [name for name in kernels if any(word in name for word in fused[choice])]
    assert attention, kernels
    if choice == SDPBackend.FLASH_ATTENTION.value:  # FlashAttention names its passes
        assert any("fwd" in name for name in attention) and any("bwd" in name for name in attention), attention
    assert not any("fmha_cutlass" in name for name in kernels), kernels

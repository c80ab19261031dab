"""GPU tier: compiled Triton kernels in bf16 at moderate sizes (skipped without CUDA).

Tolerances follow the device METHOD: the reference runs in fp32 on the same bf16 inputs, and a bf16
result lands between 1e-3 and 1e-2 in relative-norm error. Outputs are checked to be finite after the
caching allocator was filled with NaN at the output's size, so an element the kernel never wrote shows.
"""

from __future__ import annotations

import pytest
import torch

from kernels import functional, ops, reference
from tests.kernels._util import assert_close, random_counts

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("force_triton")]

BF16 = torch.bfloat16


def _poison(numel: int, dtype: torch.dtype = BF16) -> None:
    """Leave a NaN-filled block of this size in the caching allocator for the next allocation to reuse."""
    block = torch.full((numel,), float("nan"), dtype=dtype, device="cuda")
    del block


def _fp32_ref(fn, *tensors, **kwargs):
    """The reference on fp32 copies of the inputs, cast to bf16 like the kernel's output."""
    out = fn(*(t.float() if t.is_floating_point() else t for t in tensors), **kwargs)
    return out.to(BF16)


@pytest.mark.parametrize("comm_sms", [0, 20])
def test_grouped_gemm_bf16(comm_sms):
    gen = torch.Generator().manual_seed(comm_sms)
    counts_E = random_counts(8, 3001, gen, empty=2).cuda()
    m, k, n = 3001, 1024, 768
    x_MK = torch.randn(m, k, generator=gen).to("cuda", BF16)
    w_EKN = (torch.randn(8, k, n, generator=gen) / k**0.5).to("cuda", BF16)
    dy_MN = torch.randn(m, n, generator=gen).to("cuda", BF16)
    _poison(m * n)
    y_MN = ops.grouped_gemm(x_MK, w_EKN, counts_E, comm_sms=comm_sms)
    assert_close(y_MN, _fp32_ref(reference.grouped_gemm, x_MK, w_EKN, counts_E))
    _poison(m * k)
    dx_MK = ops.grouped_gemm_dgrad(dy_MN, w_EKN, counts_E, comm_sms=comm_sms)
    assert_close(dx_MK, _fp32_ref(reference.grouped_gemm_dgrad, dy_MN, w_EKN, counts_E))
    _poison(8 * k * n)
    dw_EKN = ops.grouped_gemm_wgrad(x_MK, dy_MN, counts_E, comm_sms=comm_sms)
    assert_close(dw_EKN, _fp32_ref(reference.grouped_gemm_wgrad, x_MK, dy_MN, counts_E))


def test_permute_unpermute_bf16():
    gen = torch.Generator().manual_seed(0)
    num_tokens, top_k, num_experts, hidden = 2048, 8, 32, 1536
    idx_TK = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    idx_TK = idx_TK.masked_fill(torch.rand(num_tokens, top_k, generator=gen) < 0.1, -1).cuda()
    x_TD = torch.randn(num_tokens, hidden, generator=gen).to("cuda", BF16)
    w_TK = torch.rand(num_tokens, top_k, generator=gen).cuda()
    got = ops.permute(x_TD, idx_TK, num_experts)
    want = reference.permute(x_TD, idx_TK, num_experts)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    _poison(num_tokens * hidden)
    out_TD = ops.unpermute(got[0], got[1], w_TK)
    assert_close(out_TD, reference.unpermute(got[0], got[1], w_TK))

    x = x_TD.clone().requires_grad_()
    w = w_TK.clone().requires_grad_()
    x_sorted, row_id, _ = functional.permute_tokens(x, idx_TK, num_experts)
    functional.unpermute_tokens(x_sorted, row_id, w).float().square().sum().backward()
    x_ref = x_TD.float().requires_grad_()
    w_ref = w_TK.clone().requires_grad_()
    xs_ref, row_ref, _ = reference.permute(x_ref, idx_TK, num_experts)
    reference.unpermute(xs_ref, row_ref, w_ref).square().sum().backward()
    assert_close(x.grad, x_ref.grad.to(BF16))
    assert_close(w.grad, w_ref.grad, BF16)


@pytest.mark.parametrize(("n_group", "topk_group"), [(1, 1), (8, 4)])
def test_router_bf16_logits(n_group, topk_group):
    gen = torch.Generator().manual_seed(n_group)
    logits_TE = torch.randn(4096, 256, generator=gen).to("cuda", BF16)
    bias_E = (0.01 * torch.randn(256, generator=gen)).cuda()
    weights_TK, idx_TK, scores_TE = ops.router_topk(logits_TE, bias_E, 8, n_group, topk_group, 2.5)
    ref_w, ref_idx, ref_scores = reference.router_topk(logits_TE, bias_E, 8, n_group, topk_group, 2.5)
    # The GPU's exp may differ from torch's by an ulp, which could flip a near-exact tie; allow a few.
    assert (idx_TK != ref_idx).any(-1).float().mean() < 1e-3
    torch.testing.assert_close(scores_TE, ref_scores, rtol=1e-5, atol=1e-6)
    same = (idx_TK == ref_idx).all(-1)
    torch.testing.assert_close(weights_TK[same], ref_w[same], rtol=1e-5, atol=1e-6)


def test_swiglu_bf16():
    gen = torch.Generator().manual_seed(0)
    x_MF2 = torch.randn(4099, 2 * 2048, generator=gen).to("cuda", BF16)
    dy_MF = torch.randn(4099, 2048, generator=gen).to("cuda", BF16)
    _poison(4099 * 2048)
    assert_close(ops.swiglu(x_MF2), _fp32_ref(reference.swiglu, x_MF2))
    _poison(4099 * 4096)
    assert_close(ops.swiglu_backward(dy_MF, x_MF2), _fp32_ref(reference.swiglu_backward, dy_MF, x_MF2))
    scale_M = torch.rand(4099, generator=gen).cuda()
    _poison(4099 * 2048)
    assert_close(ops.swiglu(x_MF2, scale_M), _fp32_ref(reference.swiglu, x_MF2, scale_M))
    _poison(4099 * 4096)
    dx_MF2, dscale_M = ops.swiglu_scaled_backward(dy_MF, x_MF2, scale_M)
    ref_dx, ref_dscale = reference.swiglu_scaled_backward(dy_MF.float(), x_MF2.float(), scale_M)
    assert_close(dx_MF2, ref_dx.to(BF16))
    assert_close(dscale_M, ref_dscale, BF16)

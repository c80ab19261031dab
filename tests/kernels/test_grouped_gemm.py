"""Grouped GEMM (forward, input-grad, weight-grad) through the Triton backend against the reference."""

from __future__ import annotations

import pytest
import torch

from kernels import functional, ops, reference
from tests.kernels._util import assert_close, random_counts

pytestmark = pytest.mark.usefixtures("force_triton")

DTYPES = [torch.float32, torch.float16]


def _operands(device, dtype, counts_E, k, n, seed):
    gen = torch.Generator().manual_seed(seed)
    m = int(counts_E.sum())
    x_MK = torch.randn(m, k, generator=gen).to(device, dtype)
    w_EKN = (torch.randn(counts_E.numel(), k, n, generator=gen) / k**0.5).to(device, dtype)
    dy_MN = torch.randn(m, n, generator=gen).to(device, dtype)
    return x_MK, w_EKN, dy_MN, counts_E.to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_experts", "rows", "k", "n"), [(5, 37, 24, 40), (3, 50, 33, 17)])
def test_forward_dgrad_wgrad_match_reference(device, dtype, num_experts, rows, k, n):
    counts_E = random_counts(num_experts, rows, torch.Generator().manual_seed(rows), empty=1)
    assert (counts_E == 0).any()
    x_MK, w_EKN, dy_MN, counts_E = _operands(device, dtype, counts_E, k, n, seed=k * n)
    assert_close(ops.grouped_gemm(x_MK, w_EKN, counts_E), reference.grouped_gemm(x_MK, w_EKN, counts_E))
    assert_close(ops.grouped_gemm_dgrad(dy_MN, w_EKN, counts_E), reference.grouped_gemm_dgrad(dy_MN, w_EKN, counts_E))
    dw_EKN = ops.grouped_gemm_wgrad(x_MK, dy_MN, counts_E)
    assert_close(dw_EKN, reference.grouped_gemm_wgrad(x_MK, dy_MN, counts_E))
    assert torch.count_nonzero(dw_EKN[counts_E == 0]) == 0, "empty experts must get a zero gradient"


@pytest.mark.parametrize(
    "counts",
    [[0, 0, 19], [19, 0, 0], [0, 0, 0], [1, 1, 1, 1], [16, 0, 32], [75, 2]],
    ids=lambda c: "-".join(map(str, c)),
)
def test_edge_group_sizes(device, counts):
    """Leading/trailing empty groups, no rows at all, single rows, tile-aligned groups, and a group of
    5 row tiles (in the interpreter's 16-row tiles), which the tile swizzle splits 2 + 2 + 1."""
    counts_E = torch.tensor(counts, dtype=torch.int64)
    x_MK, w_EKN, dy_MN, counts_E = _operands(device, torch.float32, counts_E, 16, 20, seed=sum(counts))
    assert_close(ops.grouped_gemm(x_MK, w_EKN, counts_E), reference.grouped_gemm(x_MK, w_EKN, counts_E))
    assert_close(ops.grouped_gemm_wgrad(x_MK, dy_MN, counts_E), reference.grouped_gemm_wgrad(x_MK, dy_MN, counts_E))


@pytest.mark.parametrize("comm_sms", [0, 1, 3])
def test_comm_sms_changes_programs_not_results(device, comm_sms):
    """Fewer persistent programs walk more tiles each; int32 counts are accepted too."""
    counts_E = torch.tensor([9, 0, 23, 4], dtype=torch.int32)
    x_MK, w_EKN, dy_MN, counts_E = _operands(device, torch.float32, counts_E, 20, 36, seed=comm_sms)
    y_MN = ops.grouped_gemm(x_MK, w_EKN, counts_E, comm_sms=comm_sms)
    dw_EKN = ops.grouped_gemm_wgrad(x_MK, dy_MN, counts_E, comm_sms=comm_sms)
    assert_close(y_MN, reference.grouped_gemm(x_MK, w_EKN, counts_E))
    assert_close(dw_EKN, reference.grouped_gemm_wgrad(x_MK, dy_MN, counts_E))


def test_persistent_grid_respects_sm_budget(device):
    from kernels._launch import num_programs, sm_count

    sms = sm_count(device)
    assert num_programs(device, 0, 10**6) == sms
    assert num_programs(device, 1, 10**6) == sms - 1
    assert num_programs(device, 0, 2) == 2  # never more programs than work items
    with pytest.raises(ValueError, match="comm_sms"):
        num_programs(device, sms, 10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_through_functional_matches_reference_autograd(device, dtype):
    counts_E = torch.tensor([7, 0, 12, 2], dtype=torch.int64)
    x_MK, w_EKN, dy_MN, counts_E = _operands(device, dtype, counts_E, 24, 18, seed=7)
    x1, w1 = x_MK.clone().requires_grad_(), w_EKN.clone().requires_grad_()
    x2, w2 = x_MK.clone().requires_grad_(), w_EKN.clone().requires_grad_()
    y1 = functional.grouped_mm(x1, w1, counts_E)
    y2 = reference.grouped_gemm(x2, w2, counts_E)
    (y1 * dy_MN).sum().backward()
    (y2 * dy_MN).sum().backward()
    assert_close(y1.detach(), y2.detach())
    assert_close(x1.grad, x2.grad)
    assert_close(w1.grad, w2.grad)


def test_launcher_rejects_bad_arguments(device):
    from kernels import triton_grouped_gemm as tgg

    counts_E = torch.tensor([2, 2], device=device)
    x_MK = torch.randn(4, 16, device=device)
    w_EKN = torch.randn(2, 16, 8, device=device)
    with pytest.raises(ValueError, match="dtype"):
        tgg.grouped_gemm(x_MK, w_EKN.half(), counts_E)
    with pytest.raises(ValueError, match="contiguous"):
        tgg.grouped_gemm(torch.randn(16, 4, device=device).t(), w_EKN, counts_E)
    with pytest.raises(ValueError, match="do not agree"):
        tgg.grouped_gemm(x_MK, torch.randn(3, 16, 8, device=device), counts_E)
    with pytest.raises(ValueError, match="tokens_per_expert"):
        tgg.grouped_gemm(x_MK, w_EKN, counts_E.float())


def test_autotuned_launch_path(device, monkeypatch):
    """The CUDA launch path (triton.autotune, grid from the chosen config) run through the interpreter:
    with one candidate the autotuner only forwards, so the argument plumbing is checked on CPU."""
    from kernels import triton_grouped_gemm as tgg

    monkeypatch.setattr(tgg, "_use_autotune", lambda x: True)
    monkeypatch.setattr(tgg, "_CUDA_CONFIGS", (tgg._INTERPRETER_CONFIG,))
    monkeypatch.setattr(tgg, "_CUDA_WGRAD_CONFIGS", (tgg._INTERPRETER_CONFIG,))
    tgg._autotuned.cache_clear()
    try:
        counts_E = torch.tensor([10, 0, 21])
        x_MK, w_EKN, dy_MN, counts_E = _operands(device, torch.float16, counts_E, 16, 24, seed=3)
        assert_close(tgg.grouped_gemm(x_MK, w_EKN, counts_E), reference.grouped_gemm(x_MK, w_EKN, counts_E))
        assert_close(
            tgg.grouped_gemm_dgrad(dy_MN, w_EKN, counts_E), reference.grouped_gemm_dgrad(dy_MN, w_EKN, counts_E)
        )
        assert_close(tgg.grouped_gemm_wgrad(x_MK, dy_MN, counts_E), reference.grouped_gemm_wgrad(x_MK, dy_MN, counts_E))
        assert tgg._autotuned.cache_info().currsize == 2  # both autotuners were built and used
    finally:
        tgg._autotuned.cache_clear()  # the next caller builds its autotuner from the real configs


@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_rows_are_not_read(device, dtype):
    """Counts summing to fewer than M (a static row count with padding after the groups): the real rows
    match the reference and the unpadded call, whatever the padding holds (NaN here: a read would show)."""
    counts_E = torch.tensor([7, 0, 12, 3], dtype=torch.int64)
    x_MK, w_EKN, dy_MN, counts_E = _operands(device, dtype, counts_E, 24, 20, seed=4)
    m, pad = x_MK.shape[0], 9
    x_pad = torch.cat([x_MK, torch.full((pad, 24), float("nan"), dtype=dtype, device=device)])
    dy_pad = torch.cat([dy_MN, torch.full((pad, 20), float("nan"), dtype=dtype, device=device)])
    y_MN = ops.grouped_gemm(x_pad, w_EKN, counts_E)
    assert y_MN.shape == (m + pad, 20)
    assert torch.equal(y_MN[:m], ops.grouped_gemm(x_MK, w_EKN, counts_E))
    assert_close(y_MN[:m], reference.grouped_gemm(x_pad, w_EKN, counts_E)[:m])
    dx_MK = ops.grouped_gemm_dgrad(dy_pad, w_EKN, counts_E)
    assert torch.equal(dx_MK[:m], ops.grouped_gemm_dgrad(dy_MN, w_EKN, counts_E))
    assert_close(dx_MK[:m], reference.grouped_gemm_dgrad(dy_pad, w_EKN, counts_E)[:m])
    dw_EKN = ops.grouped_gemm_wgrad(x_pad, dy_pad, counts_E)
    assert torch.equal(dw_EKN, ops.grouped_gemm_wgrad(x_MK, dy_MN, counts_E))
    assert_close(dw_EKN, reference.grouped_gemm_wgrad(x_pad, dy_pad, counts_E))

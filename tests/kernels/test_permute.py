"""Token permute / unpermute and their backward through the Triton backend against the reference."""

from __future__ import annotations

import pytest
import torch

from kernels import functional, ops, reference
from tests.kernels._util import assert_close

pytestmark = pytest.mark.usefixtures("force_triton")

DTYPES = [torch.float32, torch.float16]


def _routing(num_tokens, top_k, num_experts, seed, *, drop=0.2, skip_expert=None):
    """Random distinct experts per token, a fraction of slots set to -1, optionally one expert unused."""
    gen = torch.Generator().manual_seed(seed)
    pool = num_experts if skip_expert is None else num_experts - 1
    idx_TK = torch.stack([torch.randperm(pool, generator=gen)[:top_k] for _ in range(num_tokens)])
    if skip_expert is not None:
        idx_TK = idx_TK + (idx_TK >= skip_expert).long()  # shift the unused expert out of the range
    dropped = torch.rand(num_tokens, top_k, generator=gen) < drop
    return idx_TK.masked_fill(dropped, -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "top_k", "num_experts", "hidden"), [(13, 3, 6, 20), (37, 2, 5, 33)])
def test_permute_and_unpermute_match_reference(device, dtype, num_tokens, top_k, num_experts, hidden):
    idx_TK = _routing(num_tokens, top_k, num_experts, seed=hidden, skip_expert=2).to(device)
    assert (idx_TK == -1).any()
    gen = torch.Generator().manual_seed(num_tokens)
    x_TD = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    weights_TK = torch.rand(num_tokens, top_k, generator=gen).to(device)

    x_sorted_MD, row_id_M, counts_E = ops.permute(x_TD, idx_TK, num_experts)
    ref_sorted_MD, ref_row_id_M, ref_counts_E = reference.permute(x_TD, idx_TK, num_experts)
    assert torch.equal(row_id_M, ref_row_id_M)  # the order is exact: expert, then flat slot
    assert torch.equal(counts_E, ref_counts_E) and counts_E[2] == 0
    assert torch.equal(x_sorted_MD, ref_sorted_MD)  # a pure copy

    out_TD = ops.unpermute(x_sorted_MD, row_id_M, weights_TK)
    assert_close(out_TD, reference.unpermute(x_sorted_MD, row_id_M, weights_TK))


@pytest.mark.parametrize(
    ("idx", "dtype"),
    [([[-1, -1], [-1, -1]], torch.int64), ([[3, 3], [3, 3]], torch.int64), ([[2, 0], [-1, 2]], torch.int32)],
    ids=["all-dropped", "one-expert", "int32-ids"],
)
def test_degenerate_routings(device, idx, dtype):
    idx_TK = torch.tensor(idx, device=device, dtype=dtype)
    x_TD = torch.randn(2, 16, device=device)
    weights_TK = torch.rand(2, 2, device=device)
    got = ops.permute(x_TD, idx_TK, 4)
    want = reference.permute(x_TD, idx_TK, 4)
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    assert_close(ops.unpermute(got[0], got[1], weights_TK), reference.unpermute(want[0], want[1], weights_TK))


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_through_functional_matches_reference_autograd(device, dtype):
    num_tokens, top_k, num_experts, hidden = 11, 3, 5, 24
    idx_TK = _routing(num_tokens, top_k, num_experts, seed=3).to(device)
    gen = torch.Generator().manual_seed(5)
    x_TD = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    w_TK = torch.rand(num_tokens, top_k, generator=gen).to(device)
    dout_TD = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    # A per-row scale between permute and unpermute makes dy (and so dx) differ from row to row.
    scale_M1 = torch.rand(int((idx_TK >= 0).sum()), 1, generator=gen).to(device, dtype)

    def run(permute, unpermute):
        x = x_TD.clone().requires_grad_()
        w = w_TK.clone().requires_grad_()
        x_sorted, row_id, _ = permute(x, idx_TK, num_experts)
        out = unpermute(x_sorted * scale_M1, row_id, w)
        (out.float() * dout_TD.float()).sum().backward()
        return out.detach(), x.grad, w.grad

    got = run(functional.permute_tokens, functional.unpermute_tokens)
    want = run(reference.permute, reference.unpermute)
    for g, w in zip(got, want):
        assert_close(g, w, dtype)
    assert torch.count_nonzero(got[2][idx_TK < 0]) == 0, "dropped slots get no weight gradient"


def test_explicit_backward_ops_match_reference(device):
    num_tokens, top_k, num_experts, hidden = 9, 2, 4, 40
    idx_TK = _routing(num_tokens, top_k, num_experts, seed=11).to(device)
    _, row_id_M, _ = reference.permute(torch.zeros(num_tokens, 1), idx_TK.cpu(), num_experts)
    row_id_M = row_id_M.to(device)
    gen = torch.Generator().manual_seed(1)
    y_MD = torch.randn(row_id_M.numel(), hidden, generator=gen).to(device)
    dout_TD = torch.randn(num_tokens, hidden, generator=gen).to(device)
    w_TK = torch.rand(num_tokens, top_k, generator=gen).to(device)
    assert_close(
        ops.permute_backward(y_MD, row_id_M, num_tokens, top_k),
        reference.permute_backward(y_MD, row_id_M, num_tokens, top_k),
    )
    for g, w in zip(
        ops.unpermute_backward(dout_TD, y_MD, row_id_M, w_TK),
        reference.unpermute_backward(dout_TD, y_MD, row_id_M, w_TK),
    ):
        assert_close(g, w)


def test_launchers_reject_bad_arguments(device):
    from kernels import triton_permute as tp

    x_TD = torch.randn(4, 16, device=device)
    with pytest.raises(ValueError, match="topk_idx"):
        tp.permute(x_TD, torch.zeros(4, 2, device=device), 3)
    with pytest.raises(ValueError, match=r"\[T=4, K\]"):
        tp.permute(x_TD, torch.zeros(5, 2, dtype=torch.long, device=device), 3)
    with pytest.raises(ValueError, match="row ids"):
        tp.unpermute(x_TD, torch.arange(3, device=device), torch.rand(2, 2, device=device))

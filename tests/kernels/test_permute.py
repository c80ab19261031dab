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
    # Without y (an unweighted combine's backward): the same dy, no weights' gradient.
    dy_MD, none = ops.unpermute_backward(dout_TD, None, row_id_M, w_TK)
    ref_dy_MD, ref_none = reference.unpermute_backward(dout_TD, None, row_id_M, w_TK)
    assert none is None and ref_none is None
    assert_close(dy_MD, ref_dy_MD)
    assert_close(dy_MD, reference.unpermute_backward(dout_TD, y_MD, row_id_M, w_TK)[0])


def test_launchers_reject_bad_arguments(device):
    from kernels import triton_permute as tp

    x_TD = torch.randn(4, 16, device=device)
    with pytest.raises(ValueError, match="topk_idx"):
        tp.permute(x_TD, torch.zeros(4, 2, device=device), 3)
    with pytest.raises(ValueError, match=r"\[T=4, K\]"):
        tp.permute(x_TD, torch.zeros(5, 2, dtype=torch.long, device=device), 3)
    with pytest.raises(ValueError, match="row ids"):
        tp.unpermute(x_TD, torch.arange(3, device=device), torch.rand(2, 2, device=device))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("extra", [0, 7, -3], ids=["exact", "padded", "truncated"])
def test_static_num_rows_match_reference(device, dtype, extra):
    """permute with a host-known row count: routed rows first, padding (row_id -1) after; too small a count
    keeps the first rows in sorted order. The combine ops and both backward passes skip the padding, whatever
    it holds (NaN here), and agree with the reference."""
    num_tokens, top_k, num_experts, hidden = 11, 3, 4, 20
    idx_TK = _routing(num_tokens, top_k, num_experts, seed=7).to(device)
    routed = int((idx_TK >= 0).sum())
    num_rows = routed + extra
    gen = torch.Generator().manual_seed(extra + 10)
    x_TD = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    w_TK = torch.rand(num_tokens, top_k, generator=gen).to(device)
    dout_TD = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)

    x_sorted_MD, row_id_M, counts_E = ops.permute(x_TD, idx_TK, num_experts, num_rows)
    ref_sorted_MD, ref_row_id_M, ref_counts_E = reference.permute(x_TD, idx_TK, num_experts, num_rows)
    _, full_row_id, full_counts = reference.permute(x_TD, idx_TK, num_experts)
    kept = min(routed, num_rows)
    assert row_id_M.shape == (num_rows,) and x_sorted_MD.shape == (num_rows, hidden)
    assert torch.equal(row_id_M, ref_row_id_M) and torch.equal(row_id_M[:kept], full_row_id[:kept])
    assert bool((row_id_M[kept:] == -1).all())
    assert torch.equal(counts_E, ref_counts_E) and int(counts_E.sum()) == kept
    if extra >= 0:
        assert torch.equal(counts_E, full_counts)
    assert torch.equal(x_sorted_MD[:kept], ref_sorted_MD[:kept])
    assert torch.count_nonzero(ref_sorted_MD[kept:]) == 0  # the reference zeroes its padding

    y_MD = (x_sorted_MD * 1.5).clone()
    y_MD[kept:] = float("nan")  # padding the kernels leave unwritten: it must never be read
    assert_close(ops.unpermute(y_MD, row_id_M, w_TK), reference.unpermute(y_MD, row_id_M, w_TK))
    assert_close(
        ops.permute_backward(y_MD, row_id_M, num_tokens, top_k),
        reference.permute_backward(y_MD, row_id_M, num_tokens, top_k),
    )
    dy_MD, dw_TK = ops.unpermute_backward(dout_TD, y_MD, row_id_M, w_TK)
    ref_dy_MD, ref_dw_TK = reference.unpermute_backward(dout_TD, y_MD, row_id_M, w_TK)
    assert_close(dy_MD[:kept], ref_dy_MD[:kept])
    assert_close(dw_TK, ref_dw_TK)


def test_static_num_rows_through_functional_equals_unpadded(device):
    """permute_tokens -> unpermute_tokens forward and backward with padded rows gives the unpadded results
    bit for bit (the padding changes sizes, not arithmetic)."""
    num_tokens, top_k, num_experts, hidden = 10, 2, 3, 16
    idx_TK = _routing(num_tokens, top_k, num_experts, seed=5).to(device)
    gen = torch.Generator().manual_seed(2)
    x_TD = torch.randn(num_tokens, hidden, generator=gen).to(device)
    w_TK = torch.rand(num_tokens, top_k, generator=gen).to(device)
    dout_TD = torch.randn(num_tokens, hidden, generator=gen).to(device)

    def run(num_rows):
        x, w = x_TD.clone().requires_grad_(), w_TK.clone().requires_grad_()
        x_sorted, row_id, counts = functional.permute_tokens(x, idx_TK, num_experts, num_rows)
        out = functional.unpermute_tokens(x_sorted * 2.0, row_id, w)
        (out * dout_TD).sum().backward()
        return out.detach(), x.grad, w.grad, counts

    for got, want in zip(run(num_tokens * top_k), run(None)):
        assert torch.equal(got, want)


def test_static_num_rows_rejected_when_negative(device):
    from kernels import triton_permute as tp

    with pytest.raises(ValueError, match="num_rows=-1"):
        tp.permute(torch.randn(2, 16, device=device), torch.zeros(2, 2, dtype=torch.long, device=device), 3, -1)

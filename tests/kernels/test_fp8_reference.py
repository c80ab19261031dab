"""The FP8 specification (kernels.reference_fp8) against oracles written another way: tile by tile loops for the
quantizers, and for the GEMMs the per-128 "promoted" accumulation a kernel does (each K slice's fp32 partial
product times its two scales), not the reference's dequantize-then-multiply."""

from __future__ import annotations

import pytest
import torch

from kernels import fp8, reference_fp8
from kernels.reference_fp8 import FP8_MAX, TILE

ops = reference_fp8


def _oracle_quantize(x: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    ni, nj = -(-rows // block[0]), -(-cols // block[1])
    q = torch.empty(rows, cols)
    scale = torch.empty(ni, nj)
    for i in range(ni):
        for j in range(nj):
            tile = x[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]].float()
            amax = tile.abs().max()  # float32, as the scale is computed in float32
            s = amax / FP8_MAX if amax > 0 else torch.tensor(1.0)
            scale[i, j] = s
            q[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = tile / s
    return q.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize(("shape", "block"), [((5, 300), (1, 128)), ((200, 130), (128, 128)), ((3, 7), (2, 4))])
def test_quantize_matches_a_tile_by_tile_oracle(shape, block):
    torch.manual_seed(0)
    x = torch.randn(shape) * torch.logspace(-3, 2, shape[1])  # tiles of very different ranges
    x[0, : min(shape[1], 128)] = 0  # an all-zero tile (or part of one)
    q, scale = ops.quantize_fp8(x, block)
    want_q, want_scale = _oracle_quantize(x, block)
    assert torch.equal(scale, want_scale)
    # Row tiles' scales are MN-major (the rows contiguous), as DeepGEMM and the GEMMs here read them.
    assert scale.stride(0) == (1 if block[0] == 1 else scale.shape[1])
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    # E4M3 keeps 3 mantissa bits: each value within 2^-4 of itself, or (subnormal) within 2^-10 of its scale.
    back = ops.dequantize_fp8(q, scale, block)
    bound = torch.maximum(x.abs() / 16, ops.dequantize_fp8(torch.full(q.shape, 2**-10), scale, block))
    assert ((back - x).abs() <= bound).all()


def test_a_tiles_amax_maps_to_448_and_leading_dims_keep_one_grid_per_matrix():
    w = torch.randn(3, 130, 260)
    q, scale = ops.quantize_fp8(w, (128, 128))
    assert scale.shape == (3, 2, 3)
    for e in range(3):
        assert torch.equal(scale[e], _oracle_quantize(w[e], (128, 128))[1])
    assert q.float().abs().amax() == FP8_MAX
    with pytest.raises(ValueError, match="expected"):
        ops.dequantize_fp8(q, scale[:, :1], (128, 128))


def test_a_transposed_weight_quantizes_into_the_transposed_blocks():
    # Why kernels.fp8 may quantize each phase's K-major copy of a weight from its own view: a 128x128 block and its
    # transpose have the same amax, so quantizing W^T is W's quantization transposed, bit for bit, written into
    # W^T's own (contiguous) storage.
    torch.manual_seed(6)
    w = torch.randn(2, 200, 130) * torch.logspace(-2, 2, 130)
    q, scale = ops.quantize_fp8(w, (128, 128))
    q_t, scale_t = ops.quantize_fp8(w.transpose(1, 2), (128, 128))
    assert q_t.is_contiguous() and q_t.shape == (2, 130, 200)
    assert torch.equal(q_t.view(torch.uint8), q.transpose(1, 2).view(torch.uint8))
    assert torch.equal(scale_t, scale.transpose(1, 2))


def _oracle_columns(x: torch.Tensor, counts: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each group's (q, scale) of 128x1 tiles, tiles restarting at the group's first row."""
    out_q, out_s, lo = [], [], 0
    for c in counts:
        q, s = _oracle_quantize(x[lo : lo + c].t().contiguous(), (1, TILE)) if c else (None, None)
        out_q.append(q)
        out_s.append(s)
        lo += c
    return out_q, out_s


def test_column_tiles_restart_at_every_group():
    torch.manual_seed(1)
    counts = [130, 0, 5, 129]
    x = torch.randn(sum(counts) + 3, 40)  # 3 padded rows past the groups
    q, scale = ops.quantize_fp8_columns(x, torch.tensor(counts))
    tiles = ops.column_tile_rows(x.shape[0], len(counts))
    assert scale.shape == (tiles, 40) and q.shape == (tiles * TILE, 40)
    # Stored [K, C]: the weight gradient's contraction (the rows) contiguous, K-major.
    assert q.stride() == (1, tiles * TILE)
    want_q, want_s = _oracle_columns(x, counts)
    tile = 0
    for c, wq, ws in zip(counts, want_q, want_s):
        if c:
            n = ws.shape[1]
            # The group's rows from its first tile's first row on, zeros to the end of its last tile.
            rows = q[tile * TILE : (tile + n) * TILE]
            assert torch.equal(rows[:c].t().float(), wq.float())
            assert not rows[c:].float().any()
            assert torch.equal(scale[tile : tile + n].t(), ws)
            tile += n
    assert ops.group_tiles(torch.tensor(counts), tiles) == [(0, 2), (2, 2), (2, 3), (3, 5)]
    one_q, one_s = ops.quantize_fp8_columns(x)
    assert one_s.shape == (-(-x.shape[0] // TILE), 40)
    assert torch.equal(one_q[: x.shape[0]].t().float(), _oracle_quantize(x.t().contiguous(), (1, TILE))[0].float())
    assert not one_q[x.shape[0] :].float().any()


def _promoted(qa, sa, qb, sb_rows):
    """sum over K slices of (qa_slice @ qb_slice^T) in fp32, times a's row scale and b's row scale of that slice."""
    acc = torch.zeros(qa.shape[0], qb.shape[0])
    for kb in range(sa.shape[1]):
        sl = slice(kb * TILE, (kb + 1) * TILE)
        acc += (qa[:, sl].float() @ qb[:, sl].float().t()) * sa[:, kb : kb + 1] * sb_rows[:, kb][None, :]
    return acc


def test_fp8_gemm_is_the_promoted_block_scaled_sum():
    torch.manual_seed(2)
    a, b = torch.randn(7, 300), torch.randn(200, 300)
    qa, sa = ops.quantize_fp8(a)
    qb, sb = ops.quantize_fp8(b, (128, 128))
    got = ops.fp8_gemm(qa, sa, qb, sb, out_dtype=torch.float32)
    want = _promoted(qa, sa, qb, sb.repeat_interleave(TILE, 0)[:200])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert ops.fp8_gemm(qa, sa, qb, sb).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="1x128"):
        ops.fp8_gemm(qa, sa[:, :1], qb, sb)


def test_grouped_gemm_is_the_dense_gemm_per_expert_and_zero_past_the_groups():
    torch.manual_seed(3)
    counts = torch.tensor([3, 0, 4])
    x, w = torch.randn(9, 140), torch.randn(3, 20, 140)  # w [E, N, K]: y = x @ w[e]^T, as fp8_gemm's b [N, K]
    qx, sx = ops.quantize_fp8(x)
    qw, sw = ops.quantize_fp8(w, (128, 128))
    y = ops.fp8_grouped_gemm(qx, sx, qw, sw, counts, out_dtype=torch.float32)
    for e, (lo, hi) in enumerate([(0, 3), (3, 3), (3, 7)]):
        if hi > lo:
            want = _promoted(qx[lo:hi], sx[lo:hi], qw[e], sw[e].repeat_interleave(TILE, 0)[:20])
            torch.testing.assert_close(y[lo:hi], want, rtol=1e-5, atol=1e-4)
    assert y[7:].abs().sum() == 0


def test_wgrad_is_the_promoted_sum_over_each_groups_row_tiles():
    torch.manual_seed(4)
    counts = [130, 0, 6]
    a, b = torch.randn(140, 12), torch.randn(140, 20)
    qa, sa = ops.quantize_fp8_columns(a, torch.tensor(counts))
    qb, sb = ops.quantize_fp8_columns(b, torch.tensor(counts))
    dw = ops.fp8_gemm_wgrad(qa, sa, qb, sb, torch.tensor(counts))
    assert dw.shape == (3, 12, 20) and dw.dtype == torch.float32
    assert dw[1].abs().sum() == 0
    want_qa, want_sa = _oracle_columns(a, counts)
    want_qb, want_sb = _oracle_columns(b, counts)
    for e in (0, 2):  # groups as matrices [features, rows]: the promoted sum runs over row tiles
        torch.testing.assert_close(
            dw[e], _promoted(want_qa[e], want_sa[e], want_qb[e], want_sb[e]), rtol=1e-5, atol=1e-4
        )


def test_linear_gemms_are_close_to_fp32_yet_quantized():
    torch.manual_seed(5)
    x, w, dy = torch.randn(2, 3, 256), torch.randn(64, 256), torch.randn(2, 3, 64)
    y = fp8.linear_forward(x, w)
    for got, want in [
        (y, x @ w.t()),
        (fp8.linear_dgrad(dy, w), dy @ w),
        (fp8.linear_wgrad(dy, x), dy.reshape(-1, 64).t() @ x.reshape(-1, 256)),
    ]:
        err = ((got - want).norm() / want.norm()).item()
        assert 1e-3 < err < 0.1  # E4M3: a few percent, never exact
    xq = fp8.quantize_rows(x)
    assert xq.q.dtype == torch.float8_e4m3fn and xq.scale.shape == (6, 2)

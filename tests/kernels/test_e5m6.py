"""kernels.e5m6: E5M6 codes, their packing into two uint8 planes, and the 1x128 power-of-2 scales."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.e5m6 import E5M6, E5M6_MAX, dequantize_e5m6, e5m6_elem_bytes, quantize_e5m6


def _all_codes() -> torch.Tensor:
    """The value of every 12-bit code (scale 1), NaN and inf included, from the bit layout written out here."""
    code = torch.arange(4096)
    sign = torch.where(code >> 11 == 1, -1.0, 1.0).double()
    exp, mant = (code >> 6) & 0x1F, (code & 0x3F).double()
    value = torch.where(exp == 0, mant / 64 * 2.0**-14, (1 + mant / 64) * torch.exp2(exp.double() - 15))
    value = torch.where(exp == 31, torch.where(mant == 0, math.inf, math.nan), value)
    return sign * value


def test_every_code_decodes_and_round_trips() -> None:
    """Packed by hand into the two planes, the 4096 codes decode to sign x (1 + m/64) x 2^(e-15) (subnormals
    m/64 x 2^-14); each finite one quantizes back to its own code (a row with E5M6's largest value: scale 1)."""
    code = torch.arange(4096)
    low = code & 0xF
    packed = E5M6((code >> 4).to(torch.uint8)[None], (low[0::2] | low[1::2] << 4).to(torch.uint8), torch.ones(1, 32))
    got = dequantize_e5m6(packed, torch.float32)[0].double()
    want = _all_codes()
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    assert want.abs().nan_to_num(posinf=0).max() == E5M6_MAX
    finite = code[want.isfinite()]
    rows = torch.stack([torch.full_like(want[finite], E5M6_MAX), want[finite]], dim=1).float()
    q = quantize_e5m6(rows)
    assert torch.equal(q.scale, torch.ones(len(finite), 1))
    assert torch.equal(q.high[:, 1].long() << 4 | (q.low >> 4).long(), finite)  # odd columns: the high nibbles


def test_rounds_to_the_nearest_code_with_power_of_two_scales() -> None:
    """Random rows (bf16 in, 300 wide: three tiles, the last partial) come back as the nearest multiple of their
    tile's scale times an E5M6 value; the scale is the power of 2 that maps the tile's amax into (max/2, max]."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, 300, generator=g) * torch.logspace(-6, 6, 300)).bfloat16()
    q = quantize_e5m6(x)
    assert q.high.shape == (6, 300) and q.low.shape == (900,) and q.scale.shape == (6, 3)
    amax = torch.nn.functional.pad(x.float().abs(), (0, 84)).view(6, 3, 128).amax(-1)
    assert torch.equal(q.scale, torch.exp2(torch.log2(q.scale).round()))
    assert bool(((amax / q.scale <= E5M6_MAX) & (amax / q.scale > E5M6_MAX / 2)).all())
    y = dequantize_e5m6(q, torch.float64)
    values = _all_codes()
    grid = values[values.isfinite()].sort().values
    scale = q.scale.double().repeat_interleave(128, dim=1)[:, :300]
    z = x.double() / scale
    nearest = (z[..., None] - grid).abs().min(-1).values
    assert torch.equal((y / scale - z).abs(), nearest)
    assert (y - x.double()).abs().max() <= (x.double().abs() * 2**-7).max()


def test_zeros_odd_counts_and_the_byte_count() -> None:
    q = quantize_e5m6(torch.zeros(3, 5))
    assert torch.equal(q.scale, torch.ones(3, 1)) and q.low.shape == (8,)  # 15 codes: the last byte half used
    assert torch.equal(dequantize_e5m6(q, torch.bfloat16), torch.zeros(3, 5, dtype=torch.bfloat16))
    x = torch.randn(4, 256)
    q = quantize_e5m6(x)
    nbytes = sum(t.numel() * t.element_size() for t in q)
    assert nbytes == x.numel() * e5m6_elem_bytes(256) == 4 * 256 * 1.5 + 4 * 2 * 4
    assert e5m6_elem_bytes(192) == pytest.approx(1.5 + 8 / 192)

"""The Triton FP8 kernels against their specification, kernels.reference_fp8.

Interpreter tier (no CUDA): tiny shapes under TRITON_INTERPRET=1, set by the root conftest. Triton 3.9's
interpreter loads, stores, upcasts and multiplies float8e4nv exactly (stored as uint8, decoded through fp16), but
its fp32 -> float8e4nv cast is wrong (it drops the carry of a rounded-up mantissa, 31.6 -> 16, and rounds ties
away from zero), so the quantization kernels round in integers there (their EMULATE path) and the hardware cast
(``cvt.rn.satfinite``) is checked by the GPU tests only. bf16 results are checked on the GPU only (the
interpreter rounds bf16 wrongly); bf16 inputs are fine.

Quantization is compared bit for bit (q's bytes and the scales, and their layouts), except the rows the spec
leaves unspecified; the GEMMs to float32 rounding (``dequantize @ dequantize`` summed in another order). The
layouts the GEMMs receive from kernels.fp8 (K-major operands, MN-major scales) are checked on the launchers'
arguments, and the grouped GEMM's padded rows on a poisoned output.
"""

from __future__ import annotations

import pytest
import torch

from kernels import fp8, ops, reference_fp8, registry, warmup
from kernels.reference_fp8 import FP8_DTYPE, TILE
from tests.kernels._util import REL_TOL, random_counts, rel_err
from tests.moe.helpers import tiny_config

pytestmark = pytest.mark.usefixtures("force_triton")

triton_quant = pytest.importorskip("kernels.triton_fp8_quant")
triton_gemm = pytest.importorskip("kernels.triton_fp8_gemm")


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8).cpu()


def _layout(t: torch.Tensor) -> tuple[int | None, ...]:
    """t's strides, None for dimensions of size 1 (whose stride means nothing)."""
    return tuple(stride if size > 1 else None for size, stride in zip(t.shape, t.stride(), strict=True))


def _assert_same_quantization(got: tuple, want: tuple) -> None:
    (q, scale), (ref_q, ref_scale) = got, want
    assert q.dtype == FP8_DTYPE and q.shape == ref_q.shape and scale.shape == ref_scale.shape
    assert (_layout(q), _layout(scale)) == (_layout(ref_q), _layout(ref_scale)), "layouts differ"
    assert torch.equal(scale.cpu(), ref_scale.cpu()), "scales differ"
    diff = (_bits(q) != _bits(ref_q)).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} fp8 values differ, first at {diff[0].tolist()}"


def _wide_range(*shape: int, gen: torch.Generator) -> torch.Tensor:
    """Normal values scaled per column over 9 decades, one all-zero 1x128 tile, and a lone outlier, so that
    scales differ per tile and some elements land in E4M3's subnormals."""
    x = torch.randn(*shape, generator=gen) * torch.logspace(-6, 3, shape[-1])
    x[..., 0, : min(TILE, shape[-1])] = 0.0
    x[..., -1, 1] = 3e4
    return x


def _recording(seen: set):
    """An interceptor (kernels.registry.intercept) adding every call's warm-up shape class to ``seen``."""

    def record(name, impl):
        def call(*args, **kwargs):
            seen.add(warmup.shape_class(name, *args, **kwargs))
            return impl(*args, **kwargs)

        return call

    return record


@pytest.mark.parametrize(
    ("shape", "block", "dtype", "transposed"),
    [
        ((13, 300), (1, TILE), torch.float32, False),  # partial last column tile, 3 scales a row
        ((2, 5, 200), (1, TILE), torch.bfloat16, False),  # leading dims fold into the rows
        ((2, 130, 260), (TILE, TILE), torch.float16, False),  # partial blocks on both edges, one grid per expert
        ((2, 130, 260), (TILE, TILE), torch.float32, True),  # a weight's K-major copy from its transposed view
        ((5, 250), (2, 200), torch.float32, False),  # a tile larger than a program's chunk: amax pass, then quantize
        ((3, 1100), (1, 1100), torch.float32, False),  # a row tile too wide for the row kernel: MN-major all the same
    ],
)
def test_quantize_is_the_reference_bit_for_bit(device, shape, block, dtype, transposed):
    gen = torch.Generator().manual_seed(sum(shape))
    x = _wide_range(*shape, gen=gen).to(device, dtype)
    x = x.transpose(-1, -2) if transposed else x
    _assert_same_quantization(ops.quantize_fp8(x, block), reference_fp8.quantize_fp8(x, block))


def test_rounding_is_to_nearest_even_at_every_tie(device):
    # One 1x128 tile per row whose amax is 448, so the scale is exactly 1 and x / scale = x: every midpoint between
    # two neighbouring E4M3 values (subnormals included) is a tie, and the values just around them must round
    # to the nearer side; 31.6 rounds up across a binade (its mantissa carries into the exponent).
    codes = torch.arange(0x7F, dtype=torch.uint8).view(FP8_DTYPE).float()  # +0 .. 448, NaN left out
    ties = (codes[1:] + codes[:-1]) / 2
    values = torch.cat([ties, ties.nextafter(torch.tensor(0.0)), ties.nextafter(torch.tensor(1e9)), codes])
    values = torch.cat([values, torch.tensor([31.6, 2.0**-10, 3 * 2.0**-10, 1e-30, -0.0])])
    rows = -(-values.numel() // (TILE - 1))
    x = torch.full((rows, TILE), 448.0)
    x[:, :-1] = torch.cat([values, torch.zeros(rows * (TILE - 1) - values.numel())]).view(rows, TILE - 1)
    x[1::2] *= -1  # both signs
    x = x.to(device)
    got, want = ops.quantize_fp8(x), reference_fp8.quantize_fp8(x)
    assert torch.equal(want[1].cpu(), torch.ones(rows, 1))
    _assert_same_quantization(got, want)


@pytest.mark.parametrize(("shape", "block"), [((3, 7, 300), (1, TILE)), ((2, 140, 130), (TILE, TILE))])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_dequantize_is_the_reference_bit_for_bit(device, shape, block, out_dtype):
    gen = torch.Generator().manual_seed(7)
    q, scale = reference_fp8.quantize_fp8(_wide_range(*shape, gen=gen), block)
    q, scale = q.to(device), scale.to(device)
    got = ops.dequantize_fp8(q, scale, block, out_dtype=out_dtype)
    assert torch.equal(got.cpu(), reference_fp8.dequantize_fp8(q, scale, block, out_dtype=out_dtype).cpu())
    with pytest.raises(ValueError, match="scale"):
        triton_quant.dequantize_fp8(q, scale[..., :-1, :], block)


@pytest.mark.parametrize(
    ("counts", "rows"),
    [
        (None, 300),  # one group: 3 tiles, the last partial
        ([130, 0, 5, 100], 260),  # a 2-tile group, an empty one, partial tiles, 25 padded rows
        ([0, 0], 17),  # no routed row at all
    ],
)
def test_quantize_columns_restart_per_group(device, counts, rows):
    gen = torch.Generator().manual_seed(rows)
    x = _wide_range(rows, 40, gen=gen).to(device)
    counts_E = None if counts is None else torch.tensor(counts, device=device)
    got_q, got_scale = ops.quantize_fp8_columns(x, counts_E)
    ref_q, ref_scale = reference_fp8.quantize_fp8_columns(x, counts_E)
    groups = [rows] if counts is None else counts
    used = sum(-(-c // TILE) for c in groups)  # the groups' tiles, zeros past each group's rows included
    assert got_scale.shape == ref_scale.shape
    _assert_same_quantization((got_q[: used * TILE], got_scale[:used]), (ref_q[: used * TILE], ref_scale[:used]))
    assert torch.equal(got_scale[used:].cpu(), torch.ones_like(got_scale[used:]).cpu())


def _assert_gemm_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Float32 rounding apart in the interpreter (its FP8 dot is exact in float32); on sm_90 the tensor cores
    sum each 128-element slice keeping about 14 bits (the DeepSeek-V3 report), hence 1e-3 there."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.shape, ref.dtype)
    assert torch.isfinite(out).all(), "non-finite values (an unwritten output?)"
    tol = max(REL_TOL[out.dtype], 1e-3 if out.is_cuda else 0.0)
    err = rel_err(out, ref)
    assert err <= tol, f"relative error {err:.3g} > {tol:.3g}"


def _quantized_rows(*shape: int, gen: torch.Generator, device: torch.device):
    return [t.to(device) for t in reference_fp8.quantize_fp8(torch.randn(*shape, generator=gen))]


def _quantized_weight(*shape: int, gen: torch.Generator, device: torch.device):
    w = torch.randn(*shape, generator=gen) / shape[-2] ** 0.5
    return [t.to(device) for t in reference_fp8.quantize_fp8(w, (TILE, TILE))]


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.float16])
def test_fp8_gemm_forward_and_transposed_weight(device, out_dtype):
    # K = 300: three promotion slices, the last partial; N = 150: two weight blocks, the last partial.
    gen = torch.Generator().manual_seed(1)
    m, k, n = 13, 300, 150
    x, x_scale = _quantized_rows(m, k, gen=gen, device=device)
    w, w_scale = _quantized_weight(n, k, gen=gen, device=device)
    y = triton_gemm.fp8_gemm(x, x_scale, w, w_scale, out_dtype=out_dtype)
    _assert_gemm_close(y, reference_fp8.fp8_gemm(x, x_scale, w, w_scale, out_dtype=out_dtype))
    # The input gradient's call: the weight and its scales as transposed views (strides, no copy).
    dy, dy_scale = _quantized_rows(m, n, gen=gen, device=device)
    dx = triton_gemm.fp8_gemm(dy, dy_scale, w.t(), w_scale.t(), out_dtype=out_dtype)
    _assert_gemm_close(dx, reference_fp8.fp8_gemm(dy, dy_scale, w.t(), w_scale.t(), out_dtype=out_dtype))
    with pytest.raises(ValueError, match="b_scale"):
        triton_gemm.fp8_gemm(x, x_scale, w, w_scale.t())


def test_fp8_grouped_gemm_empty_experts_and_unwritten_padding(device, monkeypatch):
    gen = torch.Generator().manual_seed(2)
    e, k, n, rows = 4, 260, 144, 40
    counts_E = torch.tensor([9, 0, 21, 3], dtype=torch.int32, device=device)  # 7 padded rows after the groups
    x, x_scale = _quantized_rows(rows, k, gen=gen, device=device)
    w, w_scale = _quantized_weight(e, n, k, gen=gen, device=device)  # [E, N, K], K-major
    # The output the launcher allocates, poisoned: the routed rows must be written, the padded ones left alone
    # (a zero fill of the padding is what the sync-free mode's 8x row bound made expensive).
    poisoned = torch.full((rows, n), float("nan"), device=device)
    monkeypatch.setattr(triton_gemm, "_grouped_out", lambda *args: poisoned)
    # comm_sms=1 leaves 3 of the interpreter's 4 pretend SMs: each persistent program walks several tiles.
    y = ops.fp8_grouped_gemm(x, x_scale, w, w_scale, counts_E, out_dtype=torch.float32, comm_sms=1)
    ref = reference_fp8.fp8_grouped_gemm(x, x_scale, w, w_scale, counts_E, out_dtype=torch.float32)
    assert y is poisoned
    _assert_gemm_close(y[:33], ref[:33])
    assert y[33:].isnan().all(), "a padded row past the groups was written"
    # Any strides give the same numbers (here w as a transposed view, the layout that pipelines worse).
    monkeypatch.undo()
    dy, dy_scale = _quantized_rows(rows, k, gen=gen, device=device)
    wt = w.transpose(1, 2).contiguous().transpose(1, 2)
    dx = triton_gemm.fp8_grouped_gemm(dy, dy_scale, wt, w_scale, counts_E, out_dtype=torch.float32)
    ref = reference_fp8.fp8_grouped_gemm(dy, dy_scale, w, w_scale, counts_E, out_dtype=torch.float32)
    _assert_gemm_close(dx[:33], ref[:33])


@pytest.mark.parametrize("counts", [None, [130, 0, 3, 5]])
def test_fp8_gemm_wgrad_per_group(device, counts):
    # Grouped: a group over two 128-row tiles, an empty group (a zero gradient) and 7 padded rows, never read.
    gen = torch.Generator().manual_seed(3)
    rows, n, k = 145, 40, 48
    counts_E = None if counts is None else torch.tensor(counts, device=device)
    a = reference_fp8.quantize_fp8_columns(torch.randn(rows, n, generator=gen).to(device), counts_E)
    b = reference_fp8.quantize_fp8_columns(torch.randn(rows, k, generator=gen).to(device), counts_E)
    dw = ops.fp8_gemm_wgrad(*a, *b, counts_E)
    _assert_gemm_close(dw, reference_fp8.fp8_gemm_wgrad(*a, *b, counts_E))
    if counts is not None:
        assert dw.shape == (4, n, k) and not dw[1].any()


def test_the_fp8_training_gemms_through_the_switch(device, monkeypatch):
    # kernels.fp8 composes the ops for training (weights quantized per call, dgrad on transposed views, wgrad in
    # 128x1 tiles restarting per expert): Triton and the reference agree end to end.
    gen = torch.Generator().manual_seed(4)
    rows, d, f, e = 24, 136, 144, 3
    counts_E = random_counts(e, rows - 4, gen, empty=1).to(device)
    x = torch.randn(rows, d, generator=gen).to(device)
    w = (torch.randn(e, d, f, generator=gen) / d**0.5).to(device)
    dy = torch.randn(rows, f, generator=gen).to(device)

    def run() -> list[torch.Tensor]:
        y = fp8.grouped_forward(x, w, counts_E)
        dx = fp8.grouped_dgrad(dy, w, counts_E)
        dw = fp8.grouped_wgrad(x, dy, counts_E)
        return [y[: rows - 4], dx[: rows - 4], dw]

    triton_out = run()
    monkeypatch.setenv(ops.ENV_VAR, "torch")
    for got, want in zip(triton_out, run(), strict=True):
        _assert_gemm_close(got, want)


# The NaN rows are the point: the interpreter's numpy warns about them (an all-NaN amax, SiLU's exp).
@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning")
def test_no_consumer_reads_the_unwritten_padded_rows(device, monkeypatch):
    # The FP8 expert MLP with a sync-free row bound (counts summing to less than M), forward and backward, every
    # grouped GEMM output poisoned (NaN) before the kernel writes it, and the padded input rows NaN as permute
    # leaves them: had a consumer (SwiGLU and its backward, the quantizers, the other GEMMs) carried a padded row
    # into a routed one or into a weight gradient, NaN would show there. Compared with the reference on the
    # routed rows.
    from kernels import functional

    gen = torch.Generator().manual_seed(7)
    rows, routed, d, f, e = 24, 19, 136, 72, 3
    counts_E = random_counts(e, routed, gen, empty=1).to(device)
    x = torch.randn(rows, d, generator=gen)
    x[routed:] = float("nan")
    scale = torch.rand(rows, generator=gen)
    scale[routed:] = 0.0  # row_weights' value for a padded row
    w1, w2 = torch.randn(e, d, 2 * f, generator=gen) / d**0.5, torch.randn(e, f, d, generator=gen) / f**0.5
    g = torch.randn(routed, d, generator=gen)
    recipe = fp8.FP8Recipe(save_fp8=True)
    monkeypatch.setattr(
        triton_gemm,
        "_grouped_out",
        lambda x_MK, w_ENK, out_dtype: torch.full((x_MK.shape[0], w_ENK.shape[1]), float("nan"), dtype=out_dtype,
                                                  device=x_MK.device),
    )  # fmt: skip

    def run() -> list[torch.Tensor]:
        leaves = [t.clone().to(device).requires_grad_() for t in (x, w1, w2)]
        y = functional.grouped_experts(*leaves, counts_E, scale_M=scale.to(device), fp8_recipe=recipe)
        (y[:routed] * g.to(device)).sum().backward()
        return [y, leaves[0].grad, leaves[1].grad, leaves[2].grad]

    y, dx, dw1, dw2 = run()
    assert y[routed:].isnan().all() and dx[routed:].isnan().all()  # poisoned, and left so
    triton_out = [y[:routed], dx[:routed], dw1, dw2]
    monkeypatch.setenv(ops.ENV_VAR, "torch")
    y, dx, dw1, dw2 = run()
    for got, want in zip(triton_out, [y[:routed], dx[:routed], dw1, dw2], strict=True):
        _assert_gemm_close(got.detach(), want.detach())


def test_meta_results_are_the_real_results_shapes():
    # The warm-up replays calls on meta tensors with each op's declared meta result; it must match what the op
    # returns (shapes, dtypes and layouts: the strides are part of a launch's class), here against the reference
    # on real tensors.
    gen = torch.Generator().manual_seed(5)
    counts_E = torch.tensor([5, 0, 9])
    x = torch.randn(17, 200, generator=gen)
    xq = reference_fp8.quantize_fp8(x)
    wq = reference_fp8.quantize_fp8(torch.randn(3, 136, 200, generator=gen), (TILE, TILE))
    cols = reference_fp8.quantize_fp8_columns(x, counts_E)
    calls = [
        ("quantize_fp8", (x, (TILE, TILE)), {}),
        ("quantize_fp8", (x,), {}),  # row tiles: MN-major scales
        ("dequantize_fp8", (*xq,), {"out_dtype": torch.float16}),
        ("quantize_fp8_columns", (x, counts_E), {}),
        ("fp8_gemm", (*xq, wq[0][0], wq[1][0]), {"out_dtype": torch.float32}),
        ("fp8_grouped_gemm", (*xq, *wq, counts_E), {"comm_sms": 0}),
        ("fp8_gemm_wgrad", (*cols, *cols, counts_E), {}),
    ]
    for name, args, kwargs in calls:
        want = registry.implementation(name, "torch")(*args, **kwargs)
        meta_args = [_on_meta(a) if isinstance(a, torch.Tensor) else a for a in args]
        got = registry.specialization(name).meta(0, *meta_args, **kwargs)
        for g, r in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, want)), strict=True):
            assert (g.shape, g.dtype, _layout(g)) == (r.shape, r.dtype, _layout(r)), name


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _spy_on_gemms(monkeypatch, seen: dict) -> None:
    """Replace the three Triton FP8 GEMM launchers by spies that record their tensor arguments and answer with
    the reference (the registry looks launchers up on their module at each call)."""
    for name in ("fp8_gemm", "fp8_grouped_gemm", "fp8_gemm_wgrad"):
        reference = registry.implementation(name, "torch")

        def spy(*args, _name=name, _reference=reference, **kwargs):
            seen.setdefault(_name, []).append([a for a in args if isinstance(a, torch.Tensor)])
            return _reference(*args, **kwargs)

        monkeypatch.setattr(triton_gemm, name, spy)


def test_every_fp8_gemm_receives_k_major_operands(device, monkeypatch):
    # sm_90's FP8 tensor cores take 8-bit operands K-major only (anything else is transposed through registers
    # and loses the copy pipelining): every phase of kernels.fp8 must hand its GEMM the contraction dimension
    # contiguous, the 1x128 scales MN-major, and the weight gradient's tokens in 128-row aligned storage.
    gen = torch.Generator().manual_seed(6)
    rows, d, f, e = 20, 136, 144, 3
    counts_E = random_counts(e, rows - 3, gen, empty=1).to(device)
    x, dy = torch.randn(rows, d, generator=gen).to(device), torch.randn(rows, f, generator=gen).to(device)
    w_EKN, w_NK = torch.randn(e, d, f, generator=gen).to(device), torch.randn(f, d, generator=gen).to(device)
    seen: dict = {}
    _spy_on_gemms(monkeypatch, seen)
    fp8.grouped_forward(x, w_EKN, counts_E)
    fp8.grouped_dgrad(dy, w_EKN, counts_E)
    fp8.grouped_wgrad(x, dy, counts_E)
    fp8.linear_forward(x, w_NK)
    fp8.linear_dgrad(dy, w_NK)
    fp8.linear_wgrad(dy, x)
    assert {k: len(v) for k, v in seen.items()} == {"fp8_grouped_gemm": 2, "fp8_gemm": 2, "fp8_gemm_wgrad": 2}
    for a, a_scale, b, _b_scale, *_ in seen["fp8_grouped_gemm"] + seen["fp8_gemm"]:
        assert a.stride(-1) == 1 and b.stride(-1) == 1, "an operand is not K-major"
        assert a_scale.stride(0) == 1, "the 1x128 scales are not MN-major"
    assert [b.shape[-2:] for _, _, b, *_ in seen["fp8_grouped_gemm"]] == [(f, d), (d, f)]
    for a, a_scale, b, b_scale, *_ in seen["fp8_gemm_wgrad"]:
        assert a.stride(0) == 1 and b.stride(0) == 1, "the weight gradient's operands are not tokens-contiguous"
        assert a.stride(1) % TILE == 0 and b.stride(1) % TILE == 0  # each tile's first token 128-aligned
        assert a_scale.stride(1) == 1 and b_scale.stride(1) == 1


def test_the_warm_up_covers_the_fp8_path():
    # shape_classes (a replay on meta tensors) against the classes of the same calls made for real on the
    # reference, seen through the registry's interceptor; every FP8 op appears, and row counts that differ
    # every step add no class to the FP8 kernels (they are never specialised on).
    cfg = tiny_config()
    shapes = warmup.KernelShapes.from_config(
        cfg, tokens=24, ep=2, dtype=torch.float32, fp8=fp8.FP8Recipe(save_fp8=True), fp8_linears=[(64, 96)]
    )
    classes = warmup.shape_classes(shapes)
    fp8_ops = {"quantize_fp8", "dequantize_fp8", "quantize_fp8_columns", "fp8_gemm", "fp8_grouped_gemm"}
    assert fp8_ops | {"fp8_gemm_wgrad"} <= {c.op for c in classes}
    runs = len(warmup._expert_runs(shapes))
    grouped = {c for c in classes if c.op == "fp8_grouped_gemm"}
    assert runs > 4 and len(grouped) <= 4, grouped  # one per GEMM layout (2 forward, 2 dgrad), whatever the rows
    # Two expert weight gradients and the linear's, whatever the rows (the stored row stride of the 128x1 operands
    # moves with them but is always a multiple of 128); the weights' 128x128 quantization as stored and transposed.
    assert len({c for c in classes if c.op == "fp8_gemm_wgrad"}) == 3
    blocks = {c.key for c in classes if c.op == "quantize_fp8" and c.key[0] == "_quantize_blocks_kernel"}
    assert len(blocks) == 2
    seen: set = set()
    with pytest.MonkeyPatch.context() as mp, registry.intercept(_recording(seen)):
        mp.setenv(ops.ENV_VAR, "torch")
        warmup._run_all(shapes, torch.device("cpu"), 0)
    assert seen == classes


def test_the_warm_up_covers_an_fp8_models_calls():
    # A tiny model in FP8 (its linears and experts, the router and head kept in precision), forward and backward
    # on the reference: every kernel call it makes has a class the warm-up compiles, given the model's linears.
    from moe import MoEModel, lm_loss
    from moe.models.layers import fp8_linears, use_fp8
    from tests.moe.helpers import batch

    cfg = tiny_config()
    model = use_fp8(MoEModel(cfg, seed=0), fp8.FP8Recipe(save_fp8=True))
    linears = fp8_linears(model)
    ids, labels = batch(cfg, size=2, seq=16)
    seen: set = set()
    with pytest.MonkeyPatch.context() as mp, registry.intercept(_recording(seen)):
        mp.setenv(ops.ENV_VAR, "torch")
        lm_loss(model(ids), labels).backward()
    assert {"fp8_gemm", "fp8_grouped_gemm", "fp8_gemm_wgrad", "quantize_fp8_columns"} <= {c.op for c in seen}
    shapes = warmup.KernelShapes.from_config(
        cfg, tokens=2 * 16, ep=1, dtype=torch.float32, fp8=fp8.FP8Recipe(save_fp8=True), fp8_linears=linears
    )
    missing = seen - warmup.shape_classes(shapes)
    assert not missing, f"the warm-up does not cover: {sorted(missing, key=repr)}"


def test_aot_lists_the_fp8_launches(capsys):
    from kernels import aot

    with pytest.raises(SystemExit):
        aot.main(["--help"])
    help_text = capsys.readouterr().out
    assert "triton_fp8_gemm: fp8_gemm, fp8_gemm_wgrad, fp8_grouped_gemm" in help_text
    assert "triton_fp8_quant: dequantize_fp8, quantize_fp8, quantize_fp8_columns" in help_text
    aot.main(["--list", "--only", "fp8"])
    names = capsys.readouterr().out.split("\n")
    for launch in ("fp8_gemm 7168->1536", "fp8_grouped_gemm", "fp8_gemm_wgrad", "quantize_fp8 128x128"):
        assert any(n.startswith(launch) for n in names), launch


# --- GPU tier: compiled kernels, the hardware's fp8 cast, bf16 outputs, real shapes (skipped without CUDA) ---


@pytest.mark.gpu
@pytest.mark.parametrize("block", [(1, TILE), (TILE, TILE)])
def test_gpu_quantize_is_the_reference_bit_for_bit(block):
    gen = torch.Generator().manual_seed(11)
    x = _wide_range(4, 1000, 7168 - 64, gen=gen).to("cuda", torch.bfloat16)
    _assert_same_quantization(ops.quantize_fp8(x, block), reference_fp8.quantize_fp8(x, block))
    counts_E = random_counts(8, 3000, gen, empty=2).cuda()
    x2 = x[0, :1000].repeat(4, 1)[:3500]
    got_q, got_s = ops.quantize_fp8_columns(x2, counts_E)
    ref_q, ref_s = reference_fp8.quantize_fp8_columns(x2, counts_E)
    tiles = int((-(-counts_E // TILE)).sum())
    _assert_same_quantization((got_q[: tiles * TILE], got_s[:tiles]), (ref_q[: tiles * TILE], ref_s[:tiles]))


@pytest.mark.gpu
def test_gpu_fp8_gemms_at_v3_like_shapes():
    gen = torch.Generator().manual_seed(12)
    m, k, n, e = 3001, 2048, 1536, 8
    counts_E = random_counts(e, m - 57, gen, empty=2).cuda()
    x, x_scale = _quantized_rows(m, k, gen=gen, device=torch.device("cuda"))
    w, w_scale = _quantized_weight(n, k, gen=gen, device=torch.device("cuda"))
    for out_dtype in (torch.bfloat16, torch.float32):
        y = ops.fp8_gemm(x, x_scale, w, w_scale, out_dtype=out_dtype)
        _assert_gemm_close(y, reference_fp8.fp8_gemm(x, x_scale, w, w_scale, out_dtype=out_dtype))
    we, we_scale = _quantized_weight(e, n, k, gen=gen, device=torch.device("cuda"))  # [E, N, K], K-major
    y = ops.fp8_grouped_gemm(x, x_scale, we, we_scale, counts_E, comm_sms=20)
    routed = m - 57  # the padded rows are left unwritten
    _assert_gemm_close(y[:routed], reference_fp8.fp8_grouped_gemm(x, x_scale, we, we_scale, counts_E)[:routed])
    a = reference_fp8.quantize_fp8_columns(torch.randn(m, k, generator=gen).cuda(), counts_E)
    b = reference_fp8.quantize_fp8_columns(torch.randn(m, n, generator=gen).cuda(), counts_E)
    _assert_gemm_close(ops.fp8_gemm_wgrad(*a, *b, counts_E), reference_fp8.fp8_gemm_wgrad(*a, *b, counts_E))


def test_the_switch_hands_strided_launchers_their_views(monkeypatch: pytest.MonkeyPatch) -> None:
    """The FP8 launchers take any strides: a view reaches the kernel as it is (the weight gradient's operands are
    views of tokens-contiguous storage, which a contiguous copy would undo); the others still get contiguous
    tensors."""
    import kernels.triton_fp8_gemm as module
    from kernels import ops, registry

    monkeypatch.setenv("DUALPIPE_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen = []
    monkeypatch.setattr(module, "fp8_gemm", lambda a, sa, b, sb, **kw: seen.append(b.is_contiguous()))
    w, scale = ops.quantize_fp8(torch.randn(256, 128), (128, 128))
    a, sa = ops.quantize_fp8(torch.randn(4, 256))
    ops.fp8_gemm(a, sa, w.t(), scale.t())
    assert seen == [False]
    assert registry.takes_strides("fp8_grouped_gemm") and not registry.takes_strides("grouped_gemm")

"""Triton FP8 GEMMs with block scales, DeepSeek-V3's recipe on sm_90: a linear's GEMM (:func:`fp8_gemm`), the
experts' grouped GEMM (:func:`fp8_grouped_gemm`) and the weight gradient over rows (:func:`fp8_gemm_wgrad`).

Legend for shape suffixes: M rows (tokens, sorted by expert for the grouped ops), K the contraction, N output
features, E groups (experts), J ``ceil(K / 128)``, T tiles of 128 rows, C their rows (128 T).

Every K loop steps 128 elements at a time, one scale tile: ``tl.dot`` multiplies the FP8 operands on the
tensor cores (``wgmma ... e4m3.e4m3`` on sm_90) into a fresh float32 tile, which is added to the float32
accumulator times the two scales of that slice. That is the report's promotion every 128 elements: Hopper's
FP8 tensor-core accumulation keeps about 14 bits (Triton's default on sm_90 does not promote by itself,
``max_num_imprecise_acc`` 2**30), so a long contraction is summed in full float32 one slice at a time. The
result equals :mod:`kernels.reference_fp8`'s ``dequantize @ dequantize`` up to the order of float32 additions.

The grouped GEMM and the weight gradient are persistent like :mod:`kernels.triton_grouped_gemm` (``num_sms -
comm_sms`` programs) and read the group sizes on the device only: no host sync, and the row counts may sum to
less than M. Padded rows past the groups are neither read nor written, as in the bf16 grouped GEMM (the
reference writes zeros there: compare the routed rows); at ep = 8 a sync-free batch pads to about 8x the
routed rows, all of which a zero fill would have written.

Layouts (:mod:`kernels.reference_fp8`, "Layouts"). Every operand is loaded K-major, the contraction dimension
contiguous: x ``[M, K]`` and w ``[N, K]`` / ``[E, N, K]``, and the weight gradient's ``[C, N]``, ``[C, K]``
views of tokens-contiguous storage. That is the only order in which sm_90's ``wgmma`` takes 8-bit operands from
shared memory; in any other Triton transposes the tile through registers and the loads lose their cp.async
pipelining (``python -m kernels.aot --only fp8``; numbers in ``kernels/NOTES.md``). The weight gradient's
groups start at 128-row tiles, so its loads along the tokens are aligned and unmasked. The 1x128 scales are
MN-major (one contiguous load per slice for a tile's rows). The launchers still take any strides, with the
same results.

On CUDA the tile shape is autotuned over :data:`_CUDA_CONFIGS` (the warm-up tunes each key up front); in
Triton's interpreter one small config runs (it multiplies FP8 exactly, decoding through fp16).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import triton
import triton.language as tl

from kernels._launch import BlockConfig, num_programs, validate_counts
from kernels.reference_fp8 import FP8_DTYPE, TILE, column_tile_rows
from kernels.registry import Specialization, launch_key, register, register_aot
from kernels.triton_grouped_gemm import _expert_tile, _expert_tiles, _swizzle

if TYPE_CHECKING:
    from kernels.warmup import KernelShapes

__all__ = ["fp8_gemm", "fp8_gemm_wgrad", "fp8_grouped_gemm"]

# block_k is the promotion interval and the scales' tile: always 128 (TILE), which the kernels take as a literal.
_INTERPRETER_CONFIG = BlockConfig(block_m=16, block_n=16, block_k=TILE, group_m=2, num_warps=4, num_stages=1)
# sm_90, 1-byte operands: a 128x128x128 stage is 32 KB of shared memory, so three stages fit with room; the
# slice's float32 product and the accumulator are two 128x128 fp32 tiles, 128 registers per thread at 8 warps.
_CUDA_CONFIGS = (
    BlockConfig(block_m=128, block_n=128, block_k=TILE, group_m=8, num_warps=8, num_stages=3),
    BlockConfig(block_m=64, block_n=128, block_k=TILE, group_m=8, num_warps=4, num_stages=4),
)
# Weight gradient: the output tile is block_n x block_k; the contraction steps 128 rows (one scale row), so
# block_m is always TILE.
_CUDA_WGRAD_CONFIGS = (
    BlockConfig(block_m=TILE, block_n=128, block_k=128, num_warps=8, num_stages=3),
    BlockConfig(block_m=TILE, block_n=64, block_k=128, num_warps=4, num_stages=4),
)
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Row counts change every step (routed rows): never specialised on, so they add no compile classes. The 1x128
# scales' stride between slices is the row count (MN-major); the weight gradient's T is its tile count.
_ROW_COUNTS = ("M", "T", "stride_asj", "stride_xsj")


@triton.jit
def _scaled_tile(
    a_ptr, b_ptr, as_ptr, bs_ptr, rows, cols, row_mask, col_mask, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_asm, stride_asj, stride_bsj, stride_bsn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """sum over 128-wide slices s of (a[rows, s] @ b[s, cols]) * a_scale[rows, s] * b_scale[s, cols // 128],
    float32 [BLOCK_M, BLOCK_N]; a in 1x128 tiles, b in 128x128 blocks (its scale indexed [k tile, n tile])."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    n_tile = cols // 128
    for kt in range(0, tl.cdiv(K, 128)):
        ks = kt * 128 + tl.arange(0, 128)
        k_mask = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        b = tl.load(b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)  # fmt: skip
        a_s = tl.load(as_ptr + rows * stride_asm + kt * stride_asj, mask=row_mask, other=0.0)
        b_s = tl.load(bs_ptr + kt * stride_bsj + n_tile * stride_bsn, mask=col_mask, other=0.0)
        acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
    return acc


@triton.jit(do_not_specialize=_ROW_COUNTS)
def _fp8_gemm_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, y_ptr, M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_asm, stride_asj, stride_bsi, stride_bsj,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
):  # fmt: skip
    """y = (a * a_scale) @ (b * b_scale)^T; a [M, K], b [N, K] (any strides), y [M, N] row-major."""
    m_tiles = tl.cdiv(M, BLOCK_M)
    m_tile, n_tile = _swizzle(tl.program_id(0), m_tiles, tl.cdiv(N, BLOCK_N), GROUP_M)
    rows = (m_tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask, col_mask = rows < M, cols < N
    acc = _scaled_tile(
        a_ptr, b_ptr, as_ptr, bs_ptr, rows, cols, row_mask, col_mask, K,
        stride_am, stride_ak, stride_bk, stride_bn, stride_asm, stride_asj, stride_bsj, stride_bsi, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    y = acc.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y, mask=row_mask[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=_ROW_COUNTS)
def _fp8_grouped_gemm_kernel(
    x_ptr, w_ptr, xs_ptr, ws_ptr, y_ptr, counts_ptr, N, K, E,
    stride_xm, stride_xk, stride_we, stride_wn, stride_wk, stride_xsm, stride_xsj, stride_wse, stride_wsi,
    stride_wsj,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """y[rows of e] = (x * x_scale)[rows of e] @ (w[e] * w_scale[e])^T; x [M, K], w [E, N, K], y [M, N] row-major.

    Work items are (group, m-tile, n-tile) as in the bf16 grouped GEMM: rows past the groups are no work item,
    so they are neither read nor written.
    """
    offs_e = tl.arange(0, BLOCK_E)
    counts_E = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0).to(tl.int32)
    row_end_E, n_tiles, m_tiles_E, tiles_E, tile_end_E, total_tiles = _expert_tiles(counts_E, N, BLOCK_M, BLOCK_N)

    tile = tl.program_id(0)
    while tile < total_tiles:
        e, row_lo, row_hi, m_tile, n_tile = _expert_tile(
            tile, offs_e, counts_E, row_end_E, n_tiles, m_tiles_E, tiles_E, tile_end_E, GROUP_M
        )
        rows = (row_lo + m_tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask, col_mask = rows < row_hi, cols < N
        e64 = e.to(tl.int64)
        acc = _scaled_tile(
            x_ptr, w_ptr + e64 * stride_we, xs_ptr, ws_ptr + e64 * stride_wse, rows, cols, row_mask, col_mask,
            K, stride_xm, stride_xk, stride_wk, stride_wn, stride_xsm, stride_xsj, stride_wsj, stride_wsi,
            BLOCK_M, BLOCK_N,
        )  # fmt: skip
        y = acc.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None] * N + cols[None, :], y, mask=row_mask[:, None] & col_mask[None, :])
        tile += tl.num_programs(0)


@triton.jit(do_not_specialize=_ROW_COUNTS)
def _fp8_wgrad_kernel(
    a_ptr, b_ptr, as_ptr, bs_ptr, dw_ptr, counts_ptr, T, N, K, E,
    stride_ac, stride_an, stride_bc, stride_bk, stride_ast, stride_asn, stride_bst, stride_bsk,
    GROUPED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """dw[e] = sum over group e's tiles t of (a[t]^T @ b[t]) * a_scale[t, n] * b_scale[t, k]; a [C, N] and b [C, K]
    in 128x1 tiles (tile t: rows 128 t .. 128 t + 127, group e's tiles t_e .. from the counts, zeros past its
    rows, so every tile is read whole), dw [E, N, K] float32 row-major (zeros for an empty group)."""
    k_tiles = tl.cdiv(K, BLOCK_K)
    n_tiles = tl.cdiv(N, BLOCK_N)
    if GROUPED:
        offs_e = tl.arange(0, BLOCK_E)
        counts_E = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0).to(tl.int32)
        tiles_E = tl.cdiv(counts_E, 128)
        tile_end_E = tl.cumsum(tiles_E, axis=0)
    for tile in range(tl.program_id(0), E * n_tiles * k_tiles, tl.num_programs(0)):
        e = tile // (n_tiles * k_tiles)
        local = tile % (n_tiles * k_tiles)
        ns = (local // k_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = (local % k_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
        n_mask, k_mask = ns < N, ks < K
        ns64, ks64 = ns.to(tl.int64), ks.to(tl.int64)  # a feature's stored row of C tokens: N * C passes 2**31
        if GROUPED:
            is_e = offs_e == e
            t_hi = tl.sum(tl.where(is_e, tile_end_E, 0), axis=0)
            t_lo = t_hi - tl.sum(tl.where(is_e, tiles_E, 0), axis=0)
        else:
            t_lo, t_hi = 0, T
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for t in range(t_lo, t_hi):
            # A tile starts at a multiple of 128 rows: with the rows contiguous (K-major) its loads are aligned
            # 16-byte vectors, which the pipeliner turns into cp.async.
            rows = t * 128 + tl.arange(0, 128)
            at = tl.load(a_ptr + ns64[:, None] * stride_an + rows[None, :] * stride_ac, mask=n_mask[:, None], other=0.0)
            b = tl.load(b_ptr + rows[:, None] * stride_bc + ks64[None, :] * stride_bk, mask=k_mask[None, :], other=0.0)
            a_s = tl.load(as_ptr + t * stride_ast + ns * stride_asn, mask=n_mask, other=0.0)
            b_s = tl.load(bs_ptr + t * stride_bst + ks * stride_bsk, mask=k_mask, other=0.0)
            acc += tl.dot(at, b) * (a_s[:, None] * b_s[None, :])
        out = dw_ptr + e.to(tl.int64) * N * K + ns[:, None] * K + ks[None, :]
        tl.store(out, acc, mask=n_mask[:, None] & k_mask[None, :])


class _Launch(NamedTuple):
    """One launch: the kernel, its arguments by name, its constexprs beyond the tile config, how many work items
    a tile config makes (the grid before the SM cap), and the argument names its CUDA autotuner keys on."""

    kernel: Any
    args: dict[str, Any]
    options: dict[str, Any]
    work: Callable[[dict], int]
    tune_key: tuple[str, ...]
    configs: tuple[BlockConfig, ...]


def _strides(prefix: str, dims: str, t: torch.Tensor) -> dict[str, int]:
    """t's strides as the kernel's arguments: ``_strides("stride_a", "mk", a)`` -> stride_am, stride_ak."""
    return {prefix + d: stride for d, stride in zip(dims, t.stride(), strict=True)}


def _gemm_launch(a_MK, a_scale_MJ, b_NK, b_scale, y_MN) -> _Launch:
    (m, k), n = a_MK.shape, b_NK.shape[0]
    args = {"a_ptr": a_MK, "b_ptr": b_NK, "as_ptr": a_scale_MJ, "bs_ptr": b_scale, "y_ptr": y_MN, "M": m, "N": n,
            "K": k, **_strides("stride_a", "mk", a_MK), **_strides("stride_b", "nk", b_NK),
            **_strides("stride_as", "mj", a_scale_MJ), **_strides("stride_bs", "ij", b_scale)}  # fmt: skip

    def work(meta: dict) -> int:
        return triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"])

    tune_key = ("N", "K", "stride_ak", "stride_bn", "stride_bk")
    return _Launch(_fp8_gemm_kernel, args, {}, work, tune_key, _CUDA_CONFIGS)


def _grouped_launch(x_MK, x_scale_MJ, w_ENK, w_scale_EIJ, counts_E, y_MN) -> _Launch:
    (m, k), (num_experts, n, _) = x_MK.shape, w_ENK.shape
    args = {"x_ptr": x_MK, "w_ptr": w_ENK, "xs_ptr": x_scale_MJ, "ws_ptr": w_scale_EIJ, "y_ptr": y_MN,
            "counts_ptr": counts_E, "N": n, "K": k, "E": num_experts, **_strides("stride_x", "mk", x_MK),
            **_strides("stride_w", "enk", w_ENK), **_strides("stride_xs", "mj", x_scale_MJ),
            **_strides("stride_ws", "eij", w_scale_EIJ)}  # fmt: skip

    def work(meta: dict) -> int:
        # sum over the E groups of ceil(rows / BM) <= ceil(M / BM) + E: a bound known without reading the counts
        # (the grid is capped at the SMs left to compute anyway; see the bf16 grouped GEMM).
        return (triton.cdiv(m, meta["BLOCK_M"]) + num_experts) * triton.cdiv(n, meta["BLOCK_N"])

    tune_key = ("N", "K", "stride_xk", "stride_wn", "stride_wk")
    options = {"BLOCK_E": triton.next_power_of_2(num_experts)}
    return _Launch(_fp8_grouped_gemm_kernel, args, options, work, tune_key, _CUDA_CONFIGS)


def _wgrad_launch(a_CN, a_scale_TN, b_CK, b_scale_TK, counts_E, dw_ENK) -> _Launch:
    (tiles, n), k = a_scale_TN.shape, b_CK.shape[1]
    num_groups = dw_ENK.shape[0]
    args = {"a_ptr": a_CN, "b_ptr": b_CK, "as_ptr": a_scale_TN, "bs_ptr": b_scale_TK, "dw_ptr": dw_ENK,
            "counts_ptr": counts_E, "T": tiles, "N": n, "K": k, "E": num_groups, **_strides("stride_a", "cn", a_CN),
            **_strides("stride_b", "ck", b_CK), **_strides("stride_as", "tn", a_scale_TN),
            **_strides("stride_bs", "tk", b_scale_TK)}  # fmt: skip

    def work(meta: dict) -> int:
        return num_groups * triton.cdiv(n, meta["BLOCK_N"]) * triton.cdiv(k, meta["BLOCK_K"])

    # The layout, not the storage's row stride (C = 128 T, which moves with the routed rows every step: an
    # autotune key holding it would tune again each step).
    tune_key = ("N", "K", "stride_ac", "stride_bc")
    options = {"GROUPED": counts_E is not None, "BLOCK_E": triton.next_power_of_2(num_groups)}
    return _Launch(_fp8_wgrad_kernel, args, options, work, tune_key, _CUDA_WGRAD_CONFIGS)


def _config(kernel: Any, cfg: BlockConfig):
    """``cfg`` as a triton.Config of the constexprs ``kernel`` takes (the weight gradient has neither GROUP_M nor
    BLOCK_M: its contraction steps one 128-row scale tile)."""
    meta = cfg.to_triton()
    kwargs = {name: value for name, value in meta.kwargs.items() if name in kernel.arg_names}
    return triton.Config(kwargs, num_warps=meta.num_warps, num_stages=meta.num_stages)


def _meta_kwargs(launch: _Launch, cfg: BlockConfig) -> dict:
    """The tile config as keyword arguments of a launch (constexprs, num_warps, num_stages)."""
    config = _config(launch.kernel, cfg)
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


@functools.cache
def _autotuned(kernel: Any, configs: tuple[BlockConfig, ...], key: tuple[str, ...]):
    """``kernel`` wrapped in triton.autotune over its CUDA configs (built on first CUDA use: the autotuner needs a
    driver). The keys are the sizes that fix the tile grid per row block and the operands' layouts; M (the
    routed rows, new every step) is left out, as in the bf16 grouped GEMM."""
    return triton.autotune([_config(kernel, c) for c in configs], key=list(key))(kernel)


def _run(launch: _Launch, device: torch.device, comm_sms: int | None) -> None:
    """Autotuned on CUDA; one fixed config elsewhere (the interpreter: autotuning needs a driver). comm_sms None:
    one program per work item; an int: persistent, capped at the SMs left after communication."""

    def grid(meta: dict) -> tuple[int]:
        work = launch.work(meta)
        return (work if comm_sms is None else num_programs(device, comm_sms, work),)

    if device.type == "cuda":
        _autotuned(launch.kernel, launch.configs, launch.tune_key)[grid](**launch.args, **launch.options)
    else:
        launch.kernel[grid](**launch.args, **launch.options, **_meta_kwargs(launch, _INTERPRETER_CONFIG))


def _check_fp8(name: str, **tensors: torch.Tensor) -> None:
    for arg, t in tensors.items():
        dims = 3 if arg == "w" else 2
        if t.dtype != FP8_DTYPE or t.dim() != dims:
            raise ValueError(f"{name}: {arg} must be a {dims}-D float8_e4m3fn, got {t.dtype} {tuple(t.shape)}")


def _check_scale(name: str, arg: str, scale: torch.Tensor, want: tuple[int, ...], device: torch.device) -> None:
    if tuple(scale.shape) != want or scale.dtype != torch.float32 or scale.device != device:
        raise ValueError(f"{name}: {arg} must be float32 {want} on {device}, got {scale.dtype} "
                         f"{tuple(scale.shape)} on {scale.device}")  # fmt: skip


def _check_out_dtype(name: str, out_dtype: torch.dtype) -> None:
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{name}: out_dtype {out_dtype} is not one of bf16, fp16, fp32")


def _check_counts(name: str, counts_E: torch.Tensor, device: torch.device) -> None:
    validate_counts(name, counts_E)
    if counts_E.device != device:
        raise ValueError(f"{name}: the group counts are on {counts_E.device}, the operands on {device}")


# --- what the warm-up and kernels.aot need of these ops (kernels.registry.Specialization, register_aot) ---


def _meta(t: torch.Tensor | None) -> torch.Tensor | None:
    """t on the meta device with its strides (the switch hands these launchers their tensors as they are, and the
    strides are part of a launch's class): a key never allocates or copies."""
    return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def _key(launch: _Launch) -> tuple:
    # The JIT's class of the launch plus the exact values the CUDA autotuner keys on.
    autotune = tuple(launch.args[name] for name in launch.tune_key)
    return (*launch_key(launch.kernel, launch.args, launch.options, unspecialized=_ROW_COUNTS), autotune)


def _gemm_out(a_MK, b_NK, out_dtype) -> torch.Tensor:
    return torch.empty(a_MK.shape[0], b_NK.shape[0], dtype=out_dtype, device=a_MK.device)


def _grouped_out(x_MK, w_ENK, out_dtype) -> torch.Tensor:
    """y [M, N], uninitialised: the kernel writes the groups' rows only."""
    return torch.empty(x_MK.shape[0], w_ENK.shape[1], dtype=out_dtype, device=x_MK.device)


def _wgrad_out(a_CN, b_CK, counts_E) -> torch.Tensor:
    num_groups = 1 if counts_E is None else counts_E.shape[0]
    dw_ENK = torch.empty(num_groups, a_CN.shape[1], b_CK.shape[1], dtype=torch.float32, device=a_CN.device)
    return dw_ENK if counts_E is not None else dw_ENK[0]


def _gemm_key(a_MK, a_scale_MJ, b_NK, b_scale, *, out_dtype=torch.bfloat16) -> tuple:
    a, b = _meta(a_MK), _meta(b_NK)
    return _key(_gemm_launch(a, _meta(a_scale_MJ), b, _meta(b_scale), _gemm_out(a, b, out_dtype)))


def _grouped_key(x_MK, x_scale_MJ, w_ENK, w_scale_EIJ, counts_E, *, out_dtype=torch.bfloat16, comm_sms=0) -> tuple:
    x, w = _meta(x_MK), _meta(w_ENK)
    y = _grouped_out(x, w, out_dtype)
    return _key(_grouped_launch(x, _meta(x_scale_MJ), w, _meta(w_scale_EIJ), _meta(counts_E), y))


def _wgrad_key(a_CN, a_scale_TN, b_CK, b_scale_TK, counts_E=None, *, comm_sms=0) -> tuple:
    a, b, counts = _meta(a_CN), _meta(b_CK), _meta(counts_E)
    dw = _wgrad_out(a, b, counts)
    return _key(_wgrad_launch(a, _meta(a_scale_TN), b, _meta(b_scale_TK), counts, dw.view(-1, *dw.shape[-2:])))


_GEMM = Specialization(
    key=_gemm_key, meta=lambda rows, a, a_s, b, b_s, *, out_dtype=torch.bfloat16: _gemm_out(a, b, out_dtype)
)
_GROUPED = Specialization(
    key=_grouped_key,
    meta=lambda rows, x, x_s, w, w_s, counts, *, out_dtype=torch.bfloat16, comm_sms=0: _grouped_out(x, w, out_dtype),
)
_WGRAD = Specialization(
    key=_wgrad_key, meta=lambda rows, a, a_s, b, b_s, counts=None, *, comm_sms=0: _wgrad_out(a, b, counts)
)


@register_aot
def _aot_specs(shapes: KernelShapes) -> list:
    """Every CUDA config of every phase, its operands in the layouts :mod:`kernels.fp8` hands them: the FP8
    linear's forward and input gradient at each of ``shapes.fp8_linears`` (T token rows), the experts' forward
    grouped GEMM (x [T x top-k, D] @ w1[e], w1 quantized into [E, 2F, D]), its input gradient (dh [T x top-k, 2F]
    @ w1[e]^T, w1 as stored, [E, D, 2F]) and their weight gradient (dw [E, D, 2F] from the routed rows in 128x1
    tiles, tokens-contiguous)."""
    from kernels.aot import launch_spec

    def meta(*shape: int, dtype: torch.dtype = FP8_DTYPE) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device="meta")

    def tiles_of(size: int) -> int:
        return triton.cdiv(size, TILE)

    def rows(m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[m, k] in 1x128 tiles, the scales MN-major."""
        return meta(m, k), meta(tiles_of(k), m, dtype=torch.float32).t()

    def weight(*lead: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., n, k] in 128x128 blocks (K-major)."""
        return meta(*lead, n, k), meta(*lead, tiles_of(n), tiles_of(k), dtype=torch.float32)

    def columns(c: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[c, k] in 128x1 tiles, a view of [k, c] storage."""
        return meta(k, c).t(), meta(c // TILE, k, dtype=torch.float32)

    t, m = shapes.tokens, shapes.tokens * shapes.top_k
    d, f2, e = shapes.hidden, 2 * shapes.expert_intermediate, shapes.num_local_experts
    launches = {}
    for k, n in shapes.fp8_linears:
        launches[f"fp8_gemm {k}->{n}"] = _gemm_launch(*rows(t, k), *weight(n=n, k=k), meta(t, n, dtype=shapes.dtype))
        launches[f"fp8_gemm dgrad {n}->{k}"] = _gemm_launch(
            *rows(t, n), *weight(n=k, k=n), meta(t, k, dtype=shapes.dtype)
        )
    counts = meta(e, dtype=torch.int64)
    launches["fp8_grouped_gemm"] = _grouped_launch(
        *rows(m, d), *weight(e, n=f2, k=d), counts, meta(m, f2, dtype=shapes.dtype)
    )
    launches["fp8_grouped_gemm dgrad"] = _grouped_launch(
        *rows(m, f2), *weight(e, n=d, k=f2), counts, meta(m, d, dtype=shapes.dtype)
    )
    c = column_tile_rows(m, e) * TILE
    dw = meta(e, d, f2, dtype=torch.float32)
    launches["fp8_gemm_wgrad"] = _wgrad_launch(*columns(c, d), *columns(c, f2), counts, dw)
    specs = []
    for name, launch in launches.items():
        for cfg in launch.configs:
            tag = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
            options = {**launch.options, **_meta_kwargs(launch, cfg)}
            specs.append(launch_spec(f"{name} {tag}", launch.kernel, launch.args, options))
    return specs


@register("triton", specialization=_GEMM, strided=True)
def fp8_gemm(
    a_MK: torch.Tensor,
    a_scale_MJ: torch.Tensor,
    b_NK: torch.Tensor,
    b_scale: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``y = dequantize(a) @ dequantize(b)^T`` -> ``[M, N]`` in out_dtype, float32 accumulation promoted every 128.

    a: ``[M, K]`` float8_e4m3fn in 1x128 tiles, a_scale ``[M, J]``; b: ``[N, K]`` float8_e4m3fn in 128x128
    blocks, b_scale ``[ceil(N/128), J]``: a linear's weight for the forward, ``W^T`` quantized into ``[K, N]``
    storage for the input gradient. Any strides; K-major operands and MN-major a_scale pipeline on sm_90.
    """
    _check_fp8("fp8_gemm", a=a_MK, b=b_NK)
    (m, k), n = a_MK.shape, b_NK.shape[0]
    if b_NK.shape[1] != k:
        raise ValueError(f"fp8_gemm: a {tuple(a_MK.shape)} and b {tuple(b_NK.shape)} differ in K")
    j = triton.cdiv(k, TILE)
    _check_scale("fp8_gemm", "a_scale", a_scale_MJ, (m, j), a_MK.device)
    _check_scale("fp8_gemm", "b_scale", b_scale, (triton.cdiv(n, TILE), j), a_MK.device)
    _check_out_dtype("fp8_gemm", out_dtype)
    y_MN = _gemm_out(a_MK, b_NK, out_dtype)
    if m == 0 or n == 0 or k == 0:
        return y_MN.zero_()
    _run(_gemm_launch(a_MK, a_scale_MJ, b_NK, b_scale, y_MN), a_MK.device, None)
    return y_MN


@register("triton", specialization=_GROUPED, strided=True)
def fp8_grouped_gemm(
    x_MK: torch.Tensor,
    x_scale_MJ: torch.Tensor,
    w_ENK: torch.Tensor,
    w_scale_EIJ: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    comm_sms: int = 0,
) -> torch.Tensor:
    """FP8 grouped GEMM: ``y[rows of e] = dequantize(x)[rows of e] @ dequantize(w[e])^T`` -> ``[M, N]`` in
    out_dtype; rows past the groups are left unwritten.

    x: ``[M, K]`` float8_e4m3fn in 1x128 tiles, x_scale ``[M, J]``; w: ``[E, N, K]`` float8_e4m3fn in 128x128
    blocks, w_scale ``[E, ceil(N/128), J]`` (any strides; K-major operands and MN-major x_scale pipeline on
    sm_90); tokens_per_expert ``[E]`` int32/int64 on the device, summing to at most M, never read on the host.
    comm_sms SMs are left to communication.
    """
    _check_fp8("fp8_grouped_gemm", x=x_MK, w=w_ENK)
    _check_counts("fp8_grouped_gemm", tokens_per_expert_E, x_MK.device)
    (m, k), (num_experts, n, w_k) = x_MK.shape, w_ENK.shape
    if w_k != k or tokens_per_expert_E.shape[0] != num_experts:
        raise ValueError(f"fp8_grouped_gemm: x {tuple(x_MK.shape)}, w {tuple(w_ENK.shape)} and tokens_per_expert "
                         f"{tuple(tokens_per_expert_E.shape)} do not agree on K or E")  # fmt: skip
    j = triton.cdiv(k, TILE)
    _check_scale("fp8_grouped_gemm", "x_scale", x_scale_MJ, (m, j), x_MK.device)
    _check_scale("fp8_grouped_gemm", "w_scale", w_scale_EIJ, (num_experts, triton.cdiv(n, TILE), j), x_MK.device)
    _check_out_dtype("fp8_grouped_gemm", out_dtype)
    y_MN = _grouped_out(x_MK, w_ENK, out_dtype)
    if m == 0 or n == 0:
        return y_MN
    if k == 0 or num_experts == 0:
        return y_MN.zero_()
    launch = _grouped_launch(x_MK, x_scale_MJ, w_ENK, w_scale_EIJ, tokens_per_expert_E, y_MN)
    _run(launch, x_MK.device, comm_sms)
    return y_MN


@register("triton", specialization=_WGRAD, strided=True)
def fp8_gemm_wgrad(
    a_CN: torch.Tensor,
    a_scale_TN: torch.Tensor,
    b_CK: torch.Tensor,
    b_scale_TK: torch.Tensor,
    tokens_per_group_E: torch.Tensor | None = None,
    *,
    comm_sms: int = 0,
) -> torch.Tensor:
    """The weight gradient's contraction over rows: ``dequantize(a)^T @ dequantize(b)`` over each group's tiles,
    float32.

    a ``[C, N]`` and b ``[C, K]`` float8_e4m3fn with their ``[T, N]`` / ``[T, K]`` scales (C = 128 T) as
    :func:`~kernels.triton_fp8_quant.quantize_fp8_columns` returns them for the same groups (128x1 tiles, each
    group's from a multiple of 128 rows, zeros past its rows; any strides, the rows contiguous pipeline on
    sm_90). tokens_per_group None -> ``[N, K]`` over all T tiles; ``[E]`` counts on the device (never read on
    the host) -> ``[E, N, K]``, zeros for an empty group. comm_sms SMs are left to communication.
    """
    _check_fp8("fp8_gemm_wgrad", a=a_CN, b=b_CK)
    if tokens_per_group_E is not None:
        _check_counts("fp8_gemm_wgrad", tokens_per_group_E, a_CN.device)
    (c, n), k = a_CN.shape, b_CK.shape[1]
    if b_CK.shape[0] != c or c % TILE:
        raise ValueError(f"fp8_gemm_wgrad: a {tuple(a_CN.shape)} and b {tuple(b_CK.shape)} must have the same "
                         f"rows, a multiple of {TILE}")  # fmt: skip
    _check_scale("fp8_gemm_wgrad", "a_scale", a_scale_TN, (c // TILE, n), a_CN.device)
    _check_scale("fp8_gemm_wgrad", "b_scale", b_scale_TK, (c // TILE, k), a_CN.device)
    dw = _wgrad_out(a_CN, b_CK, tokens_per_group_E)
    dw_ENK = dw.view(-1, n, k)
    if dw.numel() == 0 or c == 0:
        return dw.zero_()
    _run(_wgrad_launch(a_CN, a_scale_TN, b_CK, b_scale_TK, tokens_per_group_E, dw_ENK), a_CN.device, comm_sms)
    return dw

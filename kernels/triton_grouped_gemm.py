"""Triton grouped GEMM for experts over rows sorted by expert: forward, input-grad and weight-grad.

Legend for shape suffixes: M routed rows (sorted by expert), K input features, N output features,
E experts.

Both kernels are persistent: the launch has ``num_sms - comm_sms`` programs (or fewer when there is less
work) and each program walks the work items with a stride of the program count. On CUDA the tile shape is
autotuned for fp16/bf16 (``triton.autotune`` needs a driver); elsewhere one fixed config is used. Communication kernels
(DeepEP, NCCL) that run at the same time keep the SMs they reserved, instead of queueing behind a
grid of thousands of tiles.

Forward work items are (expert, m-tile, n-tile) triples. Their number depends on the group sizes, which
live on the device; to avoid a host synchronisation each program rebuilds the per-expert tile prefix sums
from ``tokens_per_expert`` itself (E is at most a few hundred, so this costs nothing next to one tile) and
loops while its tile index is below the device-side total. The host only needs an upper bound for the
grid: ``sum_e ceil(c_e / BM) <= ceil(M / BM) + E``. No launcher reads the counts on the host, so the
counts may sum to less than M: with a static M (padded rows, ``permute(..., num_rows=...)``) the rows past
the groups are neither read nor written, and the grid is sized from the static M.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kernels._launch import BlockConfig, num_programs, validate_counts
from kernels.registry import Specialization, dtype_name, int_class, register, register_aot

if TYPE_CHECKING:
    from kernels.warmup import KernelShapes

__all__ = ["grouped_gemm", "grouped_gemm_dgrad", "grouped_gemm_wgrad"]

# The interpreter (and anything that is not CUDA): one config, since autotuning needs a driver.
# tl.dot needs every dimension >= 16; group_m=2 makes the tile swizzle matter at test sizes.
_INTERPRETER_CONFIG = BlockConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)
# CUDA, fp16/bf16: autotuned over these per (N, K, layout of w). The first is the Hopper default: a
# 128x128 fp32 accumulator over 8 warps is 64 registers per thread, and three stages of 128x64 + 64x128
# bf16 tiles are 96 KB of shared memory. Every entry compiles for sm_90 with wgmma, pipelined loads and
# no spills (`python -m kernels.aot`; 128x256 and 128x128 at 4 warps spill and are left out).
_CUDA_CONFIGS = (
    BlockConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3),
    BlockConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4),
    BlockConfig(block_m=128, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4),
    BlockConfig(block_m=64, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=4),
)
# Weight-grad: the output tile is (block_k x block_n) and block_m is the reduction step over rows.
_CUDA_WGRAD_CONFIGS = (
    BlockConfig(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3),
    BlockConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),
    BlockConfig(block_m=64, block_n=256, block_k=128, num_warps=8, num_stages=3),
    BlockConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
)
# fp32 takes the exact (non-tf32) path on CUDA cores, which is not worth tuning; a small tile keeps its
# operands in registers (the bf16 default tile spills at 255 registers in fp32).
_CUDA_FP32_CONFIG = BlockConfig(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=3)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        # fp32 in, fp32 out: the reference is exact fp32, so no tf32 shortcut.
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _accumulate_tile(
    a_ptr, b_ptr, rows, cols, row_mask, col_mask, K,
    stride_am, stride_bk, stride_bn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """acc[BM, BN] = a[rows, :K] @ b[:K, cols] in fp32 (a row-major with row stride stride_am)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(
            a_ptr + rows[:, None] * stride_am + ks[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
            mask=k_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        acc = _dot(a, b, acc, IEEE)
    return acc


@triton.jit
def _swizzle(local, m_tiles, n_tiles, GROUP_M: tl.constexpr):
    """(m-tile, n-tile) of an expert's local tile index: GROUP_M m-tiles sweep each n-tile together.

    The programs running at once then share GROUP_M row blocks of x and a band of w's columns in L2,
    instead of one row block and all of w[e] (29 MB for a DeepSeek-V3 down projection).
    """
    per_group = GROUP_M * n_tiles
    first_m = (local // per_group) * GROUP_M
    group_rows = tl.minimum(m_tiles - first_m, GROUP_M)
    in_group = local % per_group
    return first_m + in_group % group_rows, in_group // group_rows


@triton.jit
def _expert_tiles(counts_E, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The persistent grid's work items for row groups of ``counts_E`` rows each: (group, m-tile, n-tile), group
    by group. Returns (row_end_E, n_tiles, m_tiles_E, tiles_E, tile_end_E, total_tiles) for :func:`_expert_tile`."""
    row_end_E = tl.cumsum(counts_E, axis=0)
    n_tiles = tl.cdiv(N, BLOCK_N)
    m_tiles_E = tl.cdiv(counts_E, BLOCK_M)
    tiles_E = m_tiles_E * n_tiles
    tile_end_E = tl.cumsum(tiles_E, axis=0)
    return row_end_E, n_tiles, m_tiles_E, tiles_E, tile_end_E, tl.sum(tiles_E, axis=0)


@triton.jit
def _expert_tile(tile, offs_e, counts_E, row_end_E, n_tiles, m_tiles_E, tiles_E, tile_end_E, GROUP_M: tl.constexpr):
    """(group, first row, end row, m-tile, n-tile) of work item ``tile`` (:func:`_expert_tiles`)."""
    # The group of this tile = number of groups whose tiles all come before it (empty ones included).
    e = tl.sum((tile_end_E <= tile).to(tl.int32), axis=0)
    is_e = offs_e == e
    local = tile - tl.sum(tl.where(is_e, tile_end_E - tiles_E, 0), axis=0)
    row_hi = tl.sum(tl.where(is_e, row_end_E, 0), axis=0)
    row_lo = row_hi - tl.sum(tl.where(is_e, counts_E, 0), axis=0)
    m_tile, n_tile = _swizzle(local, tl.sum(tl.where(is_e, m_tiles_E, 0), axis=0), n_tiles, GROUP_M)
    return e, row_lo, row_hi, m_tile, n_tile


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, w_ptr, y_ptr, counts_ptr, N, K, E,
    stride_we, stride_wk, stride_wn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_E: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """y[rows of e] = x[rows of e] @ w[e]; x [M, K] and y [M, N] row-major, w [E, K, N] any strides."""
    offs_e = tl.arange(0, BLOCK_E)
    counts_E = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0).to(tl.int32)
    row_end_E, n_tiles, m_tiles_E, tiles_E, tile_end_E, total_tiles = _expert_tiles(counts_E, N, BLOCK_M, BLOCK_N)

    tile = tl.program_id(0)
    while tile < total_tiles:
        e, row_lo, row_hi, m_tile, n_tile = _expert_tile(
            tile, offs_e, counts_E, row_end_E, n_tiles, m_tiles_E, tiles_E, tile_end_E, GROUP_M
        )
        rows = row_lo + m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        row_mask = rows < row_hi
        col_mask = cols < N
        rows64 = rows.to(tl.int64)  # row * K passes 2**31 beyond 299,593 rows of DeepSeek-V3's 7168
        acc = _accumulate_tile(
            x_ptr, w_ptr + e.to(tl.int64) * stride_we, rows64, cols, row_mask, col_mask, K,
            K, stride_wk, stride_wn, BLOCK_M, BLOCK_N, BLOCK_K, IEEE,
        )  # fmt: skip
        tl.store(
            y_ptr + rows64[:, None] * N + cols[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=row_mask[:, None] & col_mask[None, :],
        )
        tile += tl.num_programs(0)


@triton.jit
def _grouped_wgrad_kernel(
    x_ptr, dy_ptr, dw_ptr, counts_ptr, N, K, E,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """dw[e] = x[rows of e]^T @ dy[rows of e]; x [M, K], dy [M, N], dw [E, K, N], all row-major."""
    offs_e = tl.arange(0, BLOCK_E)
    counts_E = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0).to(tl.int32)
    row_end_E = tl.cumsum(counts_E, axis=0)
    k_tiles = tl.cdiv(K, BLOCK_K)
    n_tiles = tl.cdiv(N, BLOCK_N)
    # Work items do not depend on the group sizes here: every expert owns k_tiles * n_tiles outputs,
    # and an empty group still writes its zero tile.
    for tile in range(tl.program_id(0), E * k_tiles * n_tiles, tl.num_programs(0)):
        e = tile // (k_tiles * n_tiles)
        local = tile % (k_tiles * n_tiles)
        ks = (local // n_tiles) * BLOCK_K + tl.arange(0, BLOCK_K)
        cols = (local % n_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
        k_mask = ks < K
        col_mask = cols < N
        is_e = offs_e == e
        row_hi = tl.sum(tl.where(is_e, row_end_E, 0), axis=0)
        row_lo = row_hi - tl.sum(tl.where(is_e, counts_E, 0), axis=0)
        acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
        for m0 in range(row_lo, row_hi, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            row_mask = rows < row_hi
            rows64 = rows.to(tl.int64)
            # x^T tile [BK, BM]: read column-wise from row-major x, the layout tl.dot wants as lhs.
            xt = tl.load(
                x_ptr + rows64[None, :] * K + ks[:, None],
                mask=k_mask[:, None] & row_mask[None, :],
                other=0.0,
            )
            dy = tl.load(
                dy_ptr + rows64[:, None] * N + cols[None, :],
                mask=row_mask[:, None] & col_mask[None, :],
                other=0.0,
            )
            acc = _dot(xt, dy, acc, IEEE)
        out = dw_ptr + e.to(tl.int64) * K * N + ks[:, None] * N + cols[None, :]
        tl.store(out, acc.to(dw_ptr.dtype.element_ty), mask=k_mask[:, None] & col_mask[None, :])


def _use_autotune(x: torch.Tensor) -> bool:
    return x.device.type == "cuda" and x.dtype != torch.float32


@functools.cache
def _autotuned(kernel_name: str):
    """The kernel wrapped in triton.autotune over its CUDA configs (built on first CUDA use only: the
    autotuner needs a driver). Keyed on the sizes that set the tile count per row block and on w's
    layout; M changes with every batch's routing and is left out of the key."""
    if kernel_name == "wgrad":
        kernel, configs, key = _grouped_wgrad_kernel, _CUDA_WGRAD_CONFIGS, ["N", "K"]
    else:
        kernel, configs, key = _grouped_gemm_kernel, _CUDA_CONFIGS, ["N", "K", "stride_wk", "stride_wn"]
    with_group = kernel_name != "wgrad"
    return triton.autotune([c.to_triton(with_group=with_group) for c in configs], key=key)(kernel)


def _launch(kernel_name: str, args: tuple, x: torch.Tensor, work, comm_sms: int, **constexprs) -> None:
    """Persistent launch: autotuned on CUDA for fp16/bf16, one fixed config elsewhere.

    work(meta) -> upper bound of work items for the tile sizes in meta; the grid is that bound capped by
    the SMs left after communication.
    """

    def grid(meta: dict) -> tuple[int]:
        return (num_programs(x.device, comm_sms, work(meta)),)

    if _use_autotune(x):
        _autotuned(kernel_name)[grid](*args, **constexprs)
        return
    cfg = _CUDA_FP32_CONFIG if x.device.type == "cuda" else _INTERPRETER_CONFIG
    kernel = _grouped_wgrad_kernel if kernel_name == "wgrad" else _grouped_gemm_kernel
    meta = cfg.to_triton(with_group=kernel_name != "wgrad")
    kernel[grid](*args, **constexprs, **meta.kwargs, num_warps=meta.num_warps, num_stages=meta.num_stages)


def _check_operands(name: str, a: torch.Tensor, b: torch.Tensor, counts_E: torch.Tensor) -> None:
    if a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name}: dtype {a.dtype} is not one of fp32, fp16, bf16")
    if b.dtype != a.dtype:
        raise ValueError(f"{name}: operands have different dtypes {a.dtype} and {b.dtype}")
    if a.device != b.device or counts_E.device != a.device:
        raise ValueError(f"{name}: operands on different devices {a.device}, {b.device}, {counts_E.device}")
    if a.dim() != 2 or not a.is_contiguous():
        raise ValueError(f"{name}: the row operand must be a contiguous 2-D tensor, got {tuple(a.shape)}")
    validate_counts(name, counts_E)


# --- what the warm-up and kernels.aot need of these ops (kernels.registry.Specialization, register_aot) ---


def _gemm_key(x_MK: torch.Tensor, w_EKN: torch.Tensor, tokens_per_expert_E: torch.Tensor, **_) -> tuple:
    # The autotune key (N, K, stride_wk, stride_wn) plus what else the JIT specialises on: E (1 is folded) and
    # the tensors' dtypes (triton.autotune adds every tensor argument's dtype to its key). M is no argument.
    e, k, n = w_EKN.shape
    return (n, k, w_EKN.stride(1), w_EKN.stride(2), int_class(e), dtype_name(x_MK), dtype_name(tokens_per_expert_E))


def _wgrad_key(x_MK: torch.Tensor, dy_MN: torch.Tensor, tokens_per_expert_E: torch.Tensor, **_) -> tuple:
    counts = tokens_per_expert_E
    return (dy_MN.shape[1], x_MK.shape[1], int_class(counts.shape[0]), dtype_name(x_MK), dtype_name(counts))


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


_GEMM = Specialization(key=_gemm_key, meta=lambda rows, x, w, counts, **_: _meta(x.shape[0], w.shape[2], dtype=x.dtype))
_DGRAD = Specialization(
    key=lambda dy, w, counts, **_: _gemm_key(dy, w.transpose(1, 2), counts),
    meta=lambda rows, dy, w, counts, **_: _meta(dy.shape[0], w.shape[1], dtype=dy.dtype),
    kernel="grouped_gemm",  # the forward kernel on a transposed view of w
)
_WGRAD = Specialization(
    key=_wgrad_key, meta=lambda rows, x, dy, counts, **_: _meta(counts.shape[0], x.shape[1], dy.shape[1], dtype=x.dtype)
)


@register_aot
def _aot_specs(shapes: KernelShapes) -> list:
    """The grouped GEMMs with every config the CUDA autotuner may pick (forward D -> F, its input gradient on
    the transposed view, the weight gradient), and the fp32 fallback."""
    from kernels.aot import KernelSpec, pointer_type

    d, f, e = shapes.hidden, shapes.expert_intermediate, shapes.num_local_experts

    def launch(name, kernel, cfg, dtype, ints, ieee=False):
        meta = cfg.to_triton(with_group="GROUP_M" in kernel.arg_names)
        tag = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
        pointers = dict.fromkeys(kernel.arg_names[:3], dtype) | {"counts_ptr": "i64"}
        return KernelSpec(
            name=f"{name} {dtype} {tag}", kernel=kernel, pointers=pointers, ints={"E": e, **ints},
            constexprs={**meta.kwargs, "BLOCK_E": triton.next_power_of_2(e), "IEEE": ieee},
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    fwd = {"N": f, "K": d, "stride_we": d * f, "stride_wk": f, "stride_wn": 1}
    dgrad = {"N": d, "K": f, "stride_we": d * f, "stride_wk": 1, "stride_wn": f}  # w^T as a view
    wgrad = {"N": f, "K": d}
    dt = pointer_type(shapes.dtype)
    return (
        [launch("grouped_gemm", _grouped_gemm_kernel, cfg, dt, fwd) for cfg in _CUDA_CONFIGS]
        + [launch("grouped_gemm_dgrad", _grouped_gemm_kernel, cfg, dt, dgrad) for cfg in _CUDA_CONFIGS]
        + [launch("grouped_gemm_wgrad", _grouped_wgrad_kernel, cfg, dt, wgrad) for cfg in _CUDA_WGRAD_CONFIGS]
        + [
            launch("grouped_gemm", _grouped_gemm_kernel, _CUDA_FP32_CONFIG, "fp32", fwd, ieee=True),
            launch("grouped_gemm_wgrad", _grouped_wgrad_kernel, _CUDA_FP32_CONFIG, "fp32", wgrad, ieee=True),
        ]
    )


@register("triton", specialization=_GEMM)
def grouped_gemm(
    x_MK: torch.Tensor, w_EKN: torch.Tensor, tokens_per_expert_E: torch.Tensor, *, comm_sms: int = 0
) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e] -> [M, N] in x.dtype, fp32 accumulation.

    x: [M, K] contiguous; w: [E, K, N], any strides (the input-grad passes a transposed view);
    tokens_per_expert: [E] int32/int64 on x's device, summing to M or less (rows past the groups are
    padding: not read, y left unwritten there). comm_sms SMs are left free.
    """
    _check_operands("grouped_gemm", x_MK, w_EKN, tokens_per_expert_E)
    num_experts, k, n = w_EKN.shape
    if x_MK.shape[1] != k or tokens_per_expert_E.shape[0] != num_experts:
        raise ValueError(
            f"grouped_gemm: x {tuple(x_MK.shape)}, w {tuple(w_EKN.shape)} and tokens_per_expert "
            f"{tuple(tokens_per_expert_E.shape)} do not agree on K or E"
        )
    m = x_MK.shape[0]
    y_MN = torch.empty(m, n, dtype=x_MK.dtype, device=x_MK.device)
    if m == 0 or n == 0:
        return y_MN
    if k == 0:
        return y_MN.zero_()
    args = (x_MK, w_EKN, y_MN, tokens_per_expert_E, n, k, num_experts, *w_EKN.stride())

    def max_tiles(meta: dict) -> int:
        # sum_e ceil(c_e / BM) <= ceil(M / BM) + E: a bound known without reading the counts. With a padded
        # M the bound is the worst case, and what that costs is small: the grid is capped at the SMs left to
        # compute anyway (persistent programs), so a padded M only adds programs when the real tile count is
        # below the SM count; those programs load E counts, find their first tile past the device-side total
        # and exit (a few microseconds of launch, no GEMM work). Real work is what the counts say, however
        # large M is.
        return (triton.cdiv(m, meta["BLOCK_M"]) + num_experts) * triton.cdiv(n, meta["BLOCK_N"])

    _launch("forward", args, x_MK, max_tiles, comm_sms,
            BLOCK_E=triton.next_power_of_2(num_experts), IEEE=x_MK.dtype == torch.float32)  # fmt: skip
    return y_MN


@register("triton", specialization=_DGRAD)
def grouped_gemm_dgrad(
    dy_MN: torch.Tensor, w_EKN: torch.Tensor, tokens_per_expert_E: torch.Tensor, *, comm_sms: int = 0
) -> torch.Tensor:
    """Input gradient dx[rows of e] = dy[rows of e] @ w[e]^T -> [M, K]: the forward on a transposed view."""
    return grouped_gemm(dy_MN, w_EKN.transpose(1, 2), tokens_per_expert_E, comm_sms=comm_sms)


@register("triton", specialization=_WGRAD)
def grouped_gemm_wgrad(
    x_MK: torch.Tensor, dy_MN: torch.Tensor, tokens_per_expert_E: torch.Tensor, *, comm_sms: int = 0
) -> torch.Tensor:
    """Weight gradient dw[e] = x[rows of e]^T @ dy[rows of e] -> [E, K, N] in x.dtype (zeros if empty).

    x: [M, K] and dy: [M, N], both contiguous with the same dtype; tokens_per_expert: [E] summing to M or
    less (padded rows past the groups are not read). Work items are the E output tiles, whatever the counts.
    """
    _check_operands("grouped_gemm_wgrad", x_MK, dy_MN, tokens_per_expert_E)
    if not dy_MN.is_contiguous() or dy_MN.shape[0] != x_MK.shape[0]:
        raise ValueError(
            f"grouped_gemm_wgrad: dy {tuple(dy_MN.shape)} must be contiguous with x's {x_MK.shape[0]} rows"
        )
    num_experts = tokens_per_expert_E.shape[0]
    k, n = x_MK.shape[1], dy_MN.shape[1]
    dw_EKN = torch.empty(num_experts, k, n, dtype=x_MK.dtype, device=x_MK.device)
    if dw_EKN.numel() == 0:
        return dw_EKN
    args = (x_MK, dy_MN, dw_EKN, tokens_per_expert_E, n, k, num_experts)

    def output_tiles(meta: dict) -> int:
        return num_experts * triton.cdiv(k, meta["BLOCK_K"]) * triton.cdiv(n, meta["BLOCK_N"])

    _launch("wgrad", args, x_MK, output_tiles, comm_sms,
            BLOCK_E=triton.next_power_of_2(num_experts), IEEE=x_MK.dtype == torch.float32)  # fmt: skip
    return dw_EKN

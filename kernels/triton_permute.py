"""Triton token permute (rows into expert order) and unpermute (weighted combine), with backward.

Legend for shape suffixes: T tokens, D hidden size, E experts, K top-k, S = T*K flat top-k slots,
M routed rows (slots whose expert is not -1), B blocks of slots.

Permute is a stable counting sort of the S slots by expert, done without atomics so that the order is
deterministic and equal to the reference's (expert, then flat slot):

1. ``_block_histogram_kernel``: per block of slots, how many go to each expert -> counts [B, E].
2. a prefix sum over blocks and experts (tiny torch ops on [B, E]) -> where each block's rows of each
   expert start.
3. ``_rank_scatter_kernel``: a slot's rank among same-expert slots of its block is a cumulative sum of a
   one-hot [slots, E] tile; start + rank is its sorted row. It writes both maps: row_id [M] (row -> slot)
   and slot_row [S] (slot -> row, -1 when not routed).
4. ``_scatter_rows_kernel`` copies: each token row is read once and written to its K sorted rows. A
   gather (one program per sorted row) would read every token row K times: 2*M*D bytes against
   (T + M)*D here, 9/16 of the traffic at top-8 (the token rows of a real batch do not fit in L2).

Unpermute is the mirror image: each program reads the K rows of its tokens through slot_row, sums them
in fp32 registers and writes each token row once: (M + T)*D bytes, no atomics, deterministic. Its
backward scatters like step 4 and fuses the combine weights' gradient (a dot product per slot).

Host syncs: the routed row count M lives on the device, so sizing the outputs by it costs one sync per
call (``int(tokens_per_expert.sum())``). ``permute(..., num_rows=...)`` takes a static M known on the host
instead (an upper bound, e.g. a sync-free dispatcher's padded receive size R times min(K, E)): the routed
rows come first and the rest is padding, row_id -1 and x_sorted unwritten. Every op downstream (grouped
GEMM, unpermute, the backward passes) reads rows through row_id or the counts only, so padding is never
read, and none of them reads a device value on the host.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from kernels.registry import Specialization, dtype_name, int_class, register, register_aot

if TYPE_CHECKING:
    from kernels.warmup import KernelShapes

__all__ = ["permute", "permute_backward", "unpermute", "unpermute_backward"]

# One-hot tiles hold BLOCK_S x BLOCK_E int32; 8192 of them stay in registers at 4 warps (64 per thread).
_ONEHOT_ELEMS = 8192


@triton.jit
def _block_histogram_kernel(idx_ptr, counts_ptr, S, E, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr):
    """counts[b, e] = number of slots in block b routed to expert e (entries -1 count nowhere)."""
    block = tl.program_id(0)
    slots = block * BLOCK_S + tl.arange(0, BLOCK_S)
    experts = tl.arange(0, BLOCK_E)
    idx = tl.load(idx_ptr + slots, mask=slots < S, other=-1)
    onehot = (idx[:, None] == experts[None, :]).to(tl.int32)
    tl.store(counts_ptr + block * E + experts, tl.sum(onehot, axis=0), mask=experts < E)


@triton.jit
def _rank_scatter_kernel(
    idx_ptr, start_ptr, row_id_ptr, slot_row_ptr, S, E, M, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr
):
    """row = start[b, e] + rank of the slot among block b's slots of expert e; row_id[row] = slot and
    slot_row[slot] = row (-1 for slots that are not routed, or whose row is not below the M rows allocated)."""
    block = tl.program_id(0)
    slots = block * BLOCK_S + tl.arange(0, BLOCK_S)
    experts = tl.arange(0, BLOCK_E)
    idx = tl.load(idx_ptr + slots, mask=slots < S, other=-1)
    onehot = (idx[:, None] == experts[None, :]).to(tl.int32)
    rank_incl = tl.cumsum(onehot, axis=0)  # same-expert slots up to and including this one
    start_E = tl.load(start_ptr + block * E + experts, mask=experts < E, other=0)
    routed = (idx >= 0) & (idx < E)  # an id outside [0, E) would otherwise claim row 0; treat it as -1
    dest = tl.sum(onehot * (start_E[None, :] + rank_incl - 1), axis=1)
    routed = routed & (dest < M)  # more routed slots than a static row count: the excess is dropped
    tl.store(row_id_ptr + dest, slots.to(tl.int64), mask=(slots < S) & routed)
    tl.store(slot_row_ptr + slots, tl.where(routed, dest, -1).to(tl.int64), mask=slots < S)


@triton.jit
def _scatter_rows_kernel(
    src_ptr, slot_row_ptr, dst_ptr, scale_ptr, y_ptr, dscale_ptr, T, D,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
    SCALED: tl.constexpr, WITH_DSCALE: tl.constexpr,
):  # fmt: skip
    """For each routed slot (t, k) with row m = slot_row[t*K + k]: dst[m] = scale[t, k] * src[t].
    With WITH_DSCALE also dscale[t, k] = <src[t], y[m]> (0 for slots not routed): the combine
    weight's gradient when src is the combine's output gradient."""
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    kcols = tl.arange(0, BLOCK_K)
    tok_mask = tokens < T
    slot_mask = tok_mask[:, None] & (kcols < TOP_K)[None, :]
    slots_TK = tokens[:, None] * TOP_K + kcols[None, :]
    rows_TK = tl.load(slot_row_ptr + slots_TK, mask=slot_mask, other=-1)
    if SCALED:
        scale_TK = tl.load(scale_ptr + slots_TK, mask=slot_mask, other=0.0).to(tl.float32)
    dot_TK = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_mask = cols < D
        v = tl.load(
            src_ptr + tokens[:, None] * D + cols[None, :], mask=tok_mask[:, None] & col_mask[None, :], other=0.0
        )
        for k in tl.static_range(TOP_K):  # the row is in registers: write it to all of its K places
            pick = kcols[None, :] == k
            row = tl.sum(tl.where(pick, rows_TK, 0), axis=1)
            mask = (tl.sum(tl.where(pick & (rows_TK >= 0), 1, 0), axis=1) > 0)[:, None] & col_mask[None, :]
            out = v
            if SCALED:
                out = v.to(tl.float32) * tl.sum(tl.where(pick, scale_TK, 0.0), axis=1)[:, None]
            tl.store(dst_ptr + row[:, None] * D + cols[None, :], out.to(dst_ptr.dtype.element_ty), mask=mask)
            if WITH_DSCALE:
                y = tl.load(y_ptr + row[:, None] * D + cols[None, :], mask=mask, other=0.0)
                partial = tl.sum(v.to(tl.float32) * y.to(tl.float32), axis=1)
                dot_TK += tl.where(pick, partial[:, None], 0.0)
    if WITH_DSCALE:
        tl.store(dscale_ptr + slots_TK, dot_TK.to(dscale_ptr.dtype.element_ty), mask=slot_mask)


@triton.jit
def _invert_kernel(row_id_ptr, slot_row_ptr, M, BLOCK: tl.constexpr):
    """slot_row[row_id[m]] = m (slots never routed keep the -1 they were filled with; padded rows, whose
    row_id is -1, are skipped)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(row_id_ptr + rows, mask=rows < M, other=-1)
    tl.store(slot_row_ptr + slot, rows.to(tl.int64), mask=(rows < M) & (slot >= 0))


@triton.jit
def _combine_kernel(
    y_ptr, slot_row_ptr, w_ptr, out_ptr, T, D,
    TOP_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, WEIGHTED: tl.constexpr,
):  # fmt: skip
    """out[t] = sum_k w[t, k] * y[slot_row[t, k]] over routed slots, accumulated in fp32."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    tok_mask = tokens < T
    col_mask = cols < D
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    # Unrolled over the K slots (top_k is a model constant) so that all K row loads are in flight at once.
    for k in tl.static_range(TOP_K):
        slot = tokens.to(tl.int64) * TOP_K + k
        row = tl.load(slot_row_ptr + slot, mask=tok_mask, other=-1)
        routed = row >= 0
        v = tl.load(
            y_ptr + row[:, None] * D + cols[None, :],
            mask=routed[:, None] & col_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        if WEIGHTED:
            v *= tl.load(w_ptr + slot, mask=routed, other=0.0).to(tl.float32)[:, None]
        acc += v
    out = out_ptr + tokens.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=tok_mask[:, None] & col_mask[None, :])


def _row_blocks(device: torch.device, d: int) -> tuple[int, int]:
    """(tokens per program, columns per step) of the row-copy kernels."""
    if device.type != "cuda":
        return 4, 16  # the interpreter: small tiles so the D loop runs several steps in tests
    # 2 tokens x 1024 columns at 4 warps: 16 bf16 per thread per row, two 16-byte vectors, and the K
    # rows of an unrolled top-8 loop all in flight without spilling (54-156 registers at sm_90 per
    # `python -m kernels.aot`; 4 tokens spill in the combine). A 14 KB DeepSeek-V3 row takes 7 steps.
    return 2, min(1024, triton.next_power_of_2(d))


def _sort_blocks(num_experts: int) -> tuple[int, int]:
    """(slots per program, experts padded to a power of two) of the counting-sort kernels."""
    block_e = triton.next_power_of_2(max(num_experts, 1))
    return max(16, min(1024, _ONEHOT_ELEMS // block_e)), block_e


def _check_rows(name: str, x: torch.Tensor, index: torch.Tensor, index_name: str) -> None:
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"{name}: rows must be a contiguous 2-D tensor, got {tuple(x.shape)}")
    if index.dtype not in (torch.int32, torch.int64) or not index.is_contiguous():
        raise ValueError(f"{name}: {index_name} must be a contiguous int32/int64 tensor, got {index.dtype}")
    if index.device != x.device:
        raise ValueError(f"{name}: {index_name} is on {index.device}, rows on {x.device}")


def _sort_slots(topk_idx_TK: torch.Tensor, num_experts: int, num_rows: int | None) -> tuple[torch.Tensor, ...]:
    """Stable counting sort of the flat slots by expert.

    Returns (row_id [M] int64, slot_row [S] int64 with -1 for unrouted slots, tokens_per_expert [E] int64);
    M is num_rows when given (row_id -1 past the routed rows), else the routed count (one host sync).
    """
    idx_S = topk_idx_TK.reshape(-1)
    s = idx_S.numel()
    block_s, block_e = _sort_blocks(num_experts)
    n_blocks = max(1, triton.cdiv(s, block_s))
    counts_BE = torch.empty(n_blocks, num_experts, dtype=torch.int32, device=idx_S.device)
    _block_histogram_kernel[(n_blocks,)](idx_S, counts_BE, s, num_experts, BLOCK_S=block_s, BLOCK_E=block_e)
    tokens_per_expert_E = counts_BE.sum(0, dtype=torch.int64)
    expert_start_E = torch.cumsum(tokens_per_expert_E, 0) - tokens_per_expert_E
    start_BE = expert_start_E[None, :] + (torch.cumsum(counts_BE, 0, dtype=torch.int64) - counts_BE)
    if num_rows is None:
        # The only host synchronisation: the output has M rows, and M is known only on the device.
        m = int(tokens_per_expert_E.sum())
        row_id_M = torch.empty(m, dtype=torch.int64, device=idx_S.device)
    else:
        m = num_rows
        row_id_M = torch.full((m,), -1, dtype=torch.int64, device=idx_S.device)  # padding stays -1
        # Rows past num_rows are dropped by the kernel; the counts must then stop at num_rows too, or the
        # grouped GEMM would read past x_sorted. Tiny [E] ops, no sync.
        end_E = torch.cumsum(tokens_per_expert_E, 0).clamp_(max=m)
        tokens_per_expert_E = end_E - torch.cat([end_E.new_zeros(1), end_E[:-1]])
    slot_row_S = torch.empty(s, dtype=torch.int64, device=idx_S.device)
    if s > 0:
        _rank_scatter_kernel[(n_blocks,)](
            idx_S, start_BE, row_id_M, slot_row_S, s, num_experts, m, BLOCK_S=block_s, BLOCK_E=block_e
        )
    return row_id_M, slot_row_S, tokens_per_expert_E


def _slot_rows(row_id_M: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The inverse of row_id: slot_row [S] int64, -1 for slots that no row came from."""
    slot_row_S = torch.full((num_slots,), -1, dtype=torch.int64, device=row_id_M.device)
    m = row_id_M.numel()
    if m > 0:
        _invert_kernel[(triton.cdiv(m, 1024),)](row_id_M, slot_row_S, m, BLOCK=1024)
    return slot_row_S


def _scatter(src_TD, slot_row_S, m, top_k, out_dtype, *, scale_S=None, y_MD=None, dscale_S=None):
    """Launch :func:`_scatter_rows_kernel` -> [M, D]; the optional tensors switch on its variants."""
    num_tokens, d = src_TD.shape
    dst_MD = torch.empty(m, d, dtype=out_dtype, device=src_TD.device)
    if num_tokens == 0 or d == 0:
        if dscale_S is not None:
            dscale_S.zero_()
        return dst_MD
    block_t, block_d = _row_blocks(src_TD.device, d)
    _scatter_rows_kernel[(triton.cdiv(num_tokens, block_t),)](
        src_TD, slot_row_S, dst_MD, scale_S, y_MD, dscale_S, num_tokens, d,
        TOP_K=top_k, BLOCK_T=block_t, BLOCK_K=triton.next_power_of_2(top_k), BLOCK_D=block_d,
        SCALED=scale_S is not None, WITH_DSCALE=dscale_S is not None,
    )  # fmt: skip
    return dst_MD


def _combine(y_MD, row_id_M, num_tokens, top_k, weights_S=None):
    """Launch :func:`_combine_kernel` -> [T, D] in y.dtype."""
    d = y_MD.shape[1]
    out_TD = torch.empty(num_tokens, d, dtype=y_MD.dtype, device=y_MD.device)
    if out_TD.numel() == 0:
        return out_TD
    slot_row_S = _slot_rows(row_id_M, num_tokens * top_k)
    block_t, block_d = _row_blocks(y_MD.device, d)
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(d, block_d))
    _combine_kernel[grid](
        y_MD, slot_row_S, weights_S, out_TD, num_tokens, d,
        TOP_K=top_k, BLOCK_T=block_t, BLOCK_D=block_d, WEIGHTED=weights_S is not None,
    )  # fmt: skip
    return out_TD


# --- what the warm-up and kernels.aot need of these ops (kernels.registry.Specialization, register_aot) ---


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def _permute_key(x_TD, topk_idx_TK, num_experts, num_rows=None) -> tuple:
    r, k = topk_idx_TK.shape
    m = r * k if num_rows is None else num_rows  # the output rows: every slot, or the sync-free bound
    return (x_TD.shape[1], k, num_experts, dtype_name(x_TD), dtype_name(topk_idx_TK), int_class(r), int_class(m))


def _permute_meta(rows, x_TD, topk_idx_TK, num_experts, num_rows=None) -> tuple[torch.Tensor, ...]:
    m = rows if num_rows is None else num_rows  # without a static bound M is the routed slots' count
    return _meta(m, x_TD.shape[1], dtype=x_TD.dtype), _meta(m, dtype=torch.int64), _meta(num_experts, dtype=torch.int64)


def _combine_key(dx_sorted_MD, row_id_M, num_tokens, top_k) -> tuple:
    dx = dx_sorted_MD
    return (dx.shape[1], top_k, dtype_name(dx), int_class(dx.shape[0]), int_class(num_tokens))


def _unpermute_key(y_MD, row_id_M, topk_weights_TK) -> tuple:
    r, k = topk_weights_TK.shape
    return (y_MD.shape[1], k, dtype_name(y_MD), dtype_name(topk_weights_TK), int_class(y_MD.shape[0]), int_class(r))


def _unpermute_backward_key(dout_TD, y_MD, row_id_M, topk_weights_TK) -> tuple:
    r, k = topk_weights_TK.shape
    dweights = "dweights" if y_MD is not None else "no-dweights"  # a constexpr of the kernel
    m = row_id_M.shape[0]
    return (dout_TD.shape[1], k, dtype_name(dout_TD), dtype_name(topk_weights_TK), int_class(m), int_class(r), dweights)


def _unpermute_backward_meta(rows, dout_TD, y_MD, row_id_M, topk_weights_TK) -> tuple:
    dy = _meta(row_id_M.shape[0], dout_TD.shape[1], dtype=dout_TD.dtype if y_MD is None else y_MD.dtype)
    return dy, None if y_MD is None else _meta(*topk_weights_TK.shape, dtype=topk_weights_TK.dtype)


_PERMUTE = Specialization(key=_permute_key, meta=_permute_meta)
_PERMUTE_BACKWARD = Specialization(
    key=_combine_key, meta=lambda rows, dx, row_id, num_tokens, top_k: _meta(num_tokens, dx.shape[1], dtype=dx.dtype)
)
_UNPERMUTE = Specialization(
    key=_unpermute_key, meta=lambda rows, y, row_id, w: _meta(w.shape[0], y.shape[1], dtype=y.dtype)
)
_UNPERMUTE_BACKWARD = Specialization(key=_unpermute_backward_key, meta=_unpermute_backward_meta)


@register_aot
def _aot_specs(shapes: KernelShapes) -> list:
    """Permute and unpermute over T tokens of width D with top-k slots (M = T x top-k) to the local experts."""
    from kernels.aot import KernelSpec, pointer_type

    t, d, e, k = shapes.tokens, shapes.hidden, shapes.num_local_experts, shapes.top_k
    m, dt, i64 = t * k, pointer_type(shapes.dtype), "i64"
    cuda = torch.device("cuda")  # only its type is read: nothing touches a device
    block_s, block_e = _sort_blocks(e)
    sort = {"BLOCK_S": block_s, "BLOCK_E": block_e}
    block_t, block_d = _row_blocks(cuda, d)
    rows = {"T": t, "D": d}
    scatter = {"TOP_K": k, "BLOCK_T": block_t, "BLOCK_K": triton.next_power_of_2(k), "BLOCK_D": block_d}
    combine = {"TOP_K": k, "BLOCK_T": block_t, "BLOCK_D": block_d}
    no_dscale = {"scale_ptr": None, "y_ptr": None, "dscale_ptr": None}
    return [
        KernelSpec(name="permute histogram", kernel=_block_histogram_kernel,
                   pointers={"idx_ptr": i64, "counts_ptr": "i32"}, ints={"S": m, "E": e}, constexprs=sort),
        KernelSpec(name="permute rank+scatter", kernel=_rank_scatter_kernel,
                   pointers={"idx_ptr": i64, "start_ptr": i64, "row_id_ptr": i64, "slot_row_ptr": i64},
                   ints={"S": m, "E": e, "M": m}, constexprs=sort),
        KernelSpec(name="permute scatter rows", kernel=_scatter_rows_kernel,
                   pointers={"src_ptr": dt, "slot_row_ptr": i64, "dst_ptr": dt, **no_dscale}, ints=rows,
                   constexprs={**scatter, "SCALED": False, "WITH_DSCALE": False}),
        KernelSpec(name="unpermute_backward scatter", kernel=_scatter_rows_kernel,
                   pointers={"src_ptr": dt, "slot_row_ptr": i64, "dst_ptr": dt, "scale_ptr": "fp32",
                             "y_ptr": dt, "dscale_ptr": "fp32"}, ints=rows,
                   constexprs={**scatter, "SCALED": True, "WITH_DSCALE": True}),
        KernelSpec(name="combine_rows backward scatter", kernel=_scatter_rows_kernel,
                   pointers={"src_ptr": dt, "slot_row_ptr": i64, "dst_ptr": dt, "scale_ptr": "fp32",
                             "y_ptr": None, "dscale_ptr": None}, ints=rows,
                   constexprs={**scatter, "SCALED": True, "WITH_DSCALE": False}),
        KernelSpec(name="unpermute invert", kernel=_invert_kernel,
                   pointers={"row_id_ptr": i64, "slot_row_ptr": i64}, ints={"M": m}, constexprs={"BLOCK": 1024}),
        KernelSpec(name="unpermute combine", kernel=_combine_kernel,
                   pointers={"y_ptr": dt, "slot_row_ptr": i64, "w_ptr": "fp32", "out_ptr": dt}, ints=rows,
                   constexprs={**combine, "WEIGHTED": True}),
        KernelSpec(name="permute_backward combine", kernel=_combine_kernel,
                   pointers={"y_ptr": dt, "slot_row_ptr": i64, "w_ptr": None, "out_ptr": dt}, ints=rows,
                   constexprs={**combine, "WEIGHTED": False}),
    ]  # fmt: skip


@register("triton", specialization=_PERMUTE)
def permute(
    x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int, num_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows in expert order -> (x_sorted [M, D], row_id [M] int64, tokens_per_expert [E] int64).

    topk_idx: [T, K] int32/int64, entries in [0, num_experts) or -1 (skipped); same order as the reference.
    num_rows: a static M (no host sync); rows past the routed ones are padding, row_id -1, x_sorted unwritten.
    """
    _check_rows("permute", x_TD, topk_idx_TK, "topk_idx")
    if topk_idx_TK.dim() != 2 or topk_idx_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(f"permute: topk_idx {tuple(topk_idx_TK.shape)} must be [T={x_TD.shape[0]}, K]")
    if num_experts < 1:
        raise ValueError(f"permute: num_experts={num_experts} must be positive")
    if num_rows is not None and num_rows < 0:
        raise ValueError(f"permute: num_rows={num_rows} must be >= 0")
    row_id_M, slot_row_S, tokens_per_expert_E = _sort_slots(topk_idx_TK, num_experts, num_rows)
    x_sorted_MD = _scatter(x_TD, slot_row_S, row_id_M.numel(), topk_idx_TK.shape[1], x_TD.dtype)
    return x_sorted_MD, row_id_M, tokens_per_expert_E


@register("triton", specialization=_PERMUTE_BACKWARD)
def permute_backward(dx_sorted_MD: torch.Tensor, row_id_M: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """Gradient of :func:`permute` w.r.t. x: dx[t] = sum of the sorted rows that came from t -> [T, D]."""
    _check_rows("permute_backward", dx_sorted_MD, row_id_M, "row_id")
    return _combine(dx_sorted_MD, row_id_M, num_tokens, top_k)


@register("triton", specialization=_UNPERMUTE)
def unpermute(y_MD: torch.Tensor, row_id_M: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * y[row of (t, k)] -> [T, D] in y.dtype (fp32 accumulation)."""
    _check_rows("unpermute", y_MD, row_id_M, "row_id")
    if topk_weights_TK.dim() != 2 or not topk_weights_TK.is_contiguous():
        raise ValueError(f"unpermute: topk_weights must be a contiguous [T, K], got {tuple(topk_weights_TK.shape)}")
    if row_id_M.numel() != y_MD.shape[0]:
        raise ValueError(f"unpermute: {row_id_M.numel()} row ids for {y_MD.shape[0]} rows")
    num_tokens, top_k = topk_weights_TK.shape
    return _combine(y_MD, row_id_M, num_tokens, top_k, topk_weights_TK.reshape(-1))


@register("triton", specialization=_UNPERMUTE_BACKWARD)
def unpermute_backward(
    dout_TD: torch.Tensor, y_MD: torch.Tensor | None, row_id_M: torch.Tensor, topk_weights_TK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of :func:`unpermute` -> (dy [M, D] in y.dtype, dweights [T, K] in weights' dtype).

    y None: no dweights (None), dy in dout.dtype (an unweighted combine's backward, with unit weights)."""
    _check_rows("unpermute_backward", dout_TD, row_id_M, "row_id")
    if y_MD is not None and (not y_MD.is_contiguous() or y_MD.shape != (row_id_M.numel(), dout_TD.shape[1])):
        raise ValueError(f"unpermute_backward: y {tuple(y_MD.shape)} must be contiguous [M, D]")
    if not topk_weights_TK.is_contiguous() or topk_weights_TK.shape[0] != dout_TD.shape[0]:
        raise ValueError(f"unpermute_backward: topk_weights {tuple(topk_weights_TK.shape)} must be [T, K]")
    num_tokens, top_k = topk_weights_TK.shape
    weights_S = topk_weights_TK.reshape(-1)
    slot_row_S = _slot_rows(row_id_M, num_tokens * top_k)
    if y_MD is None:
        dy_MD = _scatter(dout_TD, slot_row_S, row_id_M.numel(), top_k, dout_TD.dtype, scale_S=weights_S)
        return dy_MD, None
    dweights_S = torch.empty_like(weights_S)  # every slot is written, unrouted ones with 0
    dy_MD = _scatter(
        dout_TD, slot_row_S, row_id_M.numel(), top_k, y_MD.dtype, scale_S=weights_S, y_MD=y_MD, dscale_S=dweights_S
    )
    return dy_MD, dweights_S.view_as(topk_weights_TK)

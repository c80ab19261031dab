"""Triton router: sigmoid scores, balancing bias, group-limited top-k and normalised weights in one pass.

Legend for shape suffixes: T tokens, E experts, K top-k, G expert groups.

One program owns a block of tokens and all E experts of each (E <= a few hundred fits in registers), so
the logits are read once and only the [T, E] scores and the [T, K] results are written. Every selection
is "largest value, lowest index among equals", done as a max followed by a min over the indices that
reach it: exactly the tie rule of the reference's stable descending sort, so given the same scores the
indices are the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.registry import Specialization, dtype_name, int_class, register, register_aot

if TYPE_CHECKING:
    from kernels.warmup import KernelShapes

__all__ = ["router_topk"]

# Token rows per program x experts (padded to a power of two) kept in registers at 4 warps.
_TILE_ELEMS = 4096


@triton.jit
def _sigmoid(x, PRECISE: tl.constexpr):
    """1 / (1 + exp(-x)) in fp32, on CUDA the way torch computes it (full-precision expf, IEEE divide).

    Triton's own exp and divide are approximate (a few ulp): a score one ulp off the reference's could
    flip a near-exact tie and pick a different expert. The interpreter has no libdevice; it uses numpy.
    """
    if PRECISE:
        denom = 1.0 + libdevice.exp(-x)
        return tl.math.div_rn(tl.full(denom.shape, 1.0, tl.float32), denom)
    else:
        return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _first_argmax(values, index, taken, SENTINEL: tl.constexpr):
    """Per row: the lowest index among the largest values not yet taken -> [rows] int32."""
    masked = tl.where(taken, float("-inf"), values)
    best = tl.max(masked, axis=1)
    hit = (masked == best[:, None]) & ~taken
    return tl.min(tl.where(hit, index[None, :], SENTINEL), axis=1)


@triton.jit
def _group_mask(
    choice, cols,
    N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """[rows, BLOCK_E] bool: the experts of the TOPK_GROUP groups with the best top-2 score sums."""
    group_of = cols // GROUP_SIZE
    gcols = tl.arange(0, BLOCK_G)
    no_cols = tl.broadcast_to((cols < 0)[None, :], (BLOCK_T, BLOCK_E))  # all False
    score_G = tl.full((BLOCK_T, BLOCK_G), float("-inf"), tl.float32)
    for g in tl.static_range(N_GROUP):
        vals = tl.where((group_of == g)[None, :], choice, float("-inf"))
        top = tl.max(vals, axis=1)
        if GROUP_SIZE > 1:
            # Second largest = largest after removing one occurrence of the first (a tie counts twice,
            # as in torch.topk(2).values).
            first = _first_argmax(vals, cols, no_cols, 1 << 30)
            top += tl.max(tl.where(cols[None, :] == first[:, None], float("-inf"), vals), axis=1)
        score_G = tl.where(gcols[None, :] == g, top[:, None], score_G)
    pad_G = tl.broadcast_to((gcols >= N_GROUP)[None, :], (BLOCK_T, BLOCK_G))
    keep_G = pad_G  # padding groups count as taken so they are never picked, and are dropped below
    for _ in tl.static_range(TOPK_GROUP):
        best = _first_argmax(score_G, gcols, keep_G, 1 << 30)
        keep_G = keep_G | (gcols[None, :] == best[:, None])
    keep_G = keep_G & ~pad_G
    eligible = no_cols
    for g in tl.static_range(N_GROUP):
        kept = tl.sum(tl.where(keep_G & (gcols[None, :] == g), 1, 0), axis=1) > 0
        eligible = eligible | ((group_of == g)[None, :] & kept[:, None])
    return eligible


@triton.jit
def _router_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, idx_ptr, scores_ptr, T, E, route_scale,
    TOP_K: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_G: tl.constexpr,
    PRECISE: tl.constexpr,
):  # fmt: skip
    """scores = sigmoid(logits); top-k of scores + bias within the kept groups; weights normalised."""
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    tok_mask = tokens < T
    col_mask = cols < E
    mask_TE = tok_mask[:, None] & col_mask[None, :]
    logits = tl.load(logits_ptr + tokens[:, None] * E + cols[None, :], mask=mask_TE, other=0.0)
    scores = _sigmoid(logits.to(tl.float32), PRECISE)
    tl.store(scores_ptr + tokens[:, None] * E + cols[None, :], scores, mask=mask_TE)

    bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    choice = scores + bias[None, :]
    if N_GROUP > 1:
        eligible = _group_mask(choice, cols, N_GROUP, TOPK_GROUP, GROUP_SIZE, BLOCK_T, BLOCK_E, BLOCK_G)
        choice = tl.where(eligible, choice, float("-inf"))

    kcols = tl.arange(0, BLOCK_K)
    idx_TK = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    w_TK = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    taken = tl.broadcast_to((cols >= E)[None, :], (BLOCK_T, BLOCK_E))  # padding is never chosen
    for i in tl.static_range(TOP_K):
        pick = _first_argmax(choice, cols, taken, BLOCK_E)
        hit = cols[None, :] == pick[:, None]
        taken = taken | hit
        w = tl.sum(tl.where(hit, scores, 0.0), axis=1)  # the unbiased score of the pick
        idx_TK = tl.where(kcols[None, :] == i, pick[:, None], idx_TK)
        w_TK = tl.where(kcols[None, :] == i, w[:, None], w_TK)
    if PRECISE:
        w_TK = tl.math.div_rn(w_TK, tl.sum(w_TK, axis=1)[:, None]) * route_scale
    else:
        w_TK = w_TK / tl.sum(w_TK, axis=1)[:, None] * route_scale
    mask_TK = tok_mask[:, None] & (kcols < TOP_K)[None, :]
    out = tokens[:, None] * TOP_K + kcols[None, :]
    tl.store(idx_ptr + out, idx_TK.to(tl.int64), mask=mask_TK)
    tl.store(weights_ptr + out, w_TK, mask=mask_TK)


def _blocks(device: torch.device, num_experts: int) -> tuple[int, int]:
    """(tokens per program, experts padded to a power of two)."""
    block_e = triton.next_power_of_2(num_experts)
    return max(1, min(64 if device.type == "cuda" else 8, _TILE_ELEMS // block_e)), block_e


def _check(logits_TE: torch.Tensor, bias_E: torch.Tensor, top_k: int, n_group: int, topk_group: int) -> None:
    if logits_TE.dim() != 2 or not logits_TE.is_contiguous() or not logits_TE.is_floating_point():
        raise ValueError(f"router_topk: logits must be a contiguous float [T, E], got {tuple(logits_TE.shape)}")
    num_experts = logits_TE.shape[1]
    if bias_E.shape != (num_experts,) or bias_E.device != logits_TE.device:
        raise ValueError(f"router_topk: bias {tuple(bias_E.shape)} must be [E={num_experts}] on {logits_TE.device}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"router_topk: top_k={top_k} must be in [1, {num_experts}]")
    if n_group < 1 or num_experts % n_group != 0 or not 1 <= topk_group <= n_group:
        raise ValueError(
            f"router_topk: {num_experts} experts, n_group={n_group}, topk_group={topk_group}: "
            "n_group must divide E and topk_group must be in [1, n_group]"
        )


# --- what the warm-up and kernels.aot need of this op (kernels.registry.Specialization, register_aot) ---


def _router_key(logits_TE, bias_E, top_k, n_group=1, topk_group=1, route_scale=1.0) -> tuple:
    t, e = logits_TE.shape
    return (e, top_k, n_group, topk_group, dtype_name(logits_TE), dtype_name(bias_E), int_class(t))


def _router_meta(rows, logits_TE, bias_E, top_k, *args, **kwargs) -> tuple[torch.Tensor, ...]:
    t = logits_TE.shape[0]
    return (
        torch.empty(t, top_k, dtype=torch.float32, device="meta"),
        torch.empty(t, top_k, dtype=torch.int64, device="meta"),
        torch.empty(*logits_TE.shape, dtype=torch.float32, device="meta"),
    )


@register_aot
def _aot_specs(shapes: KernelShapes) -> list:
    """The router over a micro-batch's T tokens and all routed experts, with group-limited routing."""
    from kernels.aot import KernelSpec, pointer_type

    e, k, groups = shapes.num_experts, shapes.top_k, shapes.n_group
    block_t, block_e = _blocks(torch.device("cuda"), e)  # only the device's type is read
    constexprs = {"TOP_K": k, "N_GROUP": groups, "TOPK_GROUP": shapes.topk_group, "GROUP_SIZE": e // groups,
                  "BLOCK_T": block_t, "BLOCK_E": block_e, "BLOCK_K": triton.next_power_of_2(k),
                  "BLOCK_G": triton.next_power_of_2(groups), "PRECISE": True}  # fmt: skip
    pointers = {"logits_ptr": pointer_type(shapes.dtype), "bias_ptr": "fp32", "weights_ptr": "fp32", "idx_ptr": "i64",
                "scores_ptr": "fp32"}  # fmt: skip
    return [KernelSpec(name=f"router_topk E{e} top-{k}", kernel=_router_topk_kernel, pointers=pointers,
                       ints={"T": shapes.tokens, "E": e}, floats=("route_scale",), constexprs=constexprs)]  # fmt: skip


@register("triton", specialization=Specialization(key=_router_key, meta=_router_meta))
def router_topk(
    logits_TE: torch.Tensor,
    bias_E: torch.Tensor,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    route_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing -> (weights [T, K] fp32, idx [T, K] int64, scores [T, E] fp32).

    logits: [T, E] contiguous fp32/fp16/bf16; bias: [E] (selection only). See the reference for semantics.
    """
    _check(logits_TE, bias_E, top_k, n_group, topk_group)
    num_tokens, num_experts = logits_TE.shape
    device = logits_TE.device
    weights_TK = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    idx_TK = torch.empty(num_tokens, top_k, dtype=torch.int64, device=device)
    scores_TE = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=device)
    if num_tokens == 0:
        return weights_TK, idx_TK, scores_TE
    block_t, block_e = _blocks(device, num_experts)
    _router_topk_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits_TE, bias_E.contiguous(), weights_TK, idx_TK, scores_TE, num_tokens, num_experts,
        float(route_scale), TOP_K=top_k, N_GROUP=n_group, TOPK_GROUP=topk_group,
        GROUP_SIZE=num_experts // n_group, BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), BLOCK_G=triton.next_power_of_2(n_group),
        PRECISE=device.type == "cuda",
    )  # fmt: skip
    return weights_TK, idx_TK, scores_TE

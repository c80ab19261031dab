"""Plain-torch references: the oracle for every Triton kernel, and the backend off CUDA.

Legend for shape suffixes: T tokens, D hidden size, E experts, K top-k, M routed rows (<= T*K),
N / F output and intermediate feature sizes, G expert groups.

Padded rows: with ``permute(..., num_rows=...)`` the expert path has a static row count, an upper bound on
the routed slots known on the host (a sync-free dispatcher's padded receive size), instead of the routed
count, which lives on the device. Rows past the routed ones are padding: their ``row_id`` is -1, the
grouped GEMMs' counts sum to fewer than M (rows past the groups are neither read nor, on Triton, written),
and the combine ops skip them. The references here write zeros into padded rows; the Triton kernels leave
them unwritten, so compare padded outputs on the routed rows only.

Each function here declares one op of :mod:`kernels.registry`: its name, signature and docstring are the
op's, and its Triton twin (same name, same signature) lives in a ``kernels/triton_*.py`` module. Tests and
benchmarks compare the two directly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.registry import register

__all__ = [
    "grouped_gemm",
    "grouped_gemm_dgrad",
    "grouped_gemm_wgrad",
    "permute",
    "permute_backward",
    "router_topk",
    "swiglu",
    "swiglu_backward",
    "swiglu_scaled_backward",
    "unpermute",
    "unpermute_backward",
]


def _offsets(tokens_per_expert_E: torch.Tensor) -> list[int]:
    counts = tokens_per_expert_E.tolist()
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + int(c))
    return offs


@register("torch")
def grouped_gemm(
    x_MK: torch.Tensor, w_EKN: torch.Tensor, tokens_per_expert_E: torch.Tensor, *, comm_sms: int = 0
) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e]; rows are sorted by expert, group e has tokens_per_expert[e] rows.

    x: [M, K], w: [E, K, N], tokens_per_expert: [E] int (sum <= M, zeros allowed) -> y: [M, N] in x.dtype
    (accumulated in fp32). Rows past the groups (padding, when the counts sum to less than M) are not read.

    comm_sms: SMs left to concurrent communication (the Triton kernel launches num_sms - comm_sms
    persistent programs; the reference ignores it, as do the other two grouped GEMMs here).
    """
    offs = _offsets(tokens_per_expert_E)
    y_MN = x_MK.new_zeros(x_MK.shape[0], w_EKN.shape[2])
    for e in range(w_EKN.shape[0]):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            y_MN[lo:hi] = (x_MK[lo:hi].float() @ w_EKN[e].float()).to(x_MK.dtype)
    return y_MN


@register("torch")
def grouped_gemm_dgrad(
    dy_MN: torch.Tensor, w_EKN: torch.Tensor, tokens_per_expert_E: torch.Tensor, *, comm_sms: int = 0
) -> torch.Tensor:
    """Input gradient of :func:`grouped_gemm`: dx[rows of e] = dy[rows of e] @ w[e]^T -> [M, K] in dy.dtype."""
    return grouped_gemm(dy_MN, w_EKN.transpose(1, 2), tokens_per_expert_E)


@register("torch")
def grouped_gemm_wgrad(
    x_MK: torch.Tensor, dy_MN: torch.Tensor, tokens_per_expert_E: torch.Tensor, *, comm_sms: int = 0
) -> torch.Tensor:
    """Weight gradient of :func:`grouped_gemm`: dw[e] = x[rows of e]^T @ dy[rows of e] -> [E, K, N].

    Experts with no rows get a zero gradient. Result in x.dtype, accumulated in fp32.
    """
    offs = _offsets(tokens_per_expert_E)
    num_experts = tokens_per_expert_E.shape[0]
    dw_EKN = x_MK.new_zeros(num_experts, x_MK.shape[1], dy_MN.shape[1])
    for e in range(num_experts):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            dw_EKN[e] = (x_MK[lo:hi].float().t() @ dy_MN[lo:hi].float()).to(x_MK.dtype)
    return dw_EKN


@register("torch")
def permute(
    x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int, num_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather token rows into expert order.

    topk_idx: [T, K] int, entries in [0, num_experts) or -1 (not routed here; skipped).
    Returns (x_sorted [M, D], row_id_M, tokens_per_expert [E] int64) where M is the number of routed
    entries, rows are ordered by expert and, within an expert, by flat position t*K + k (stable), and
    row_id[m] = t*K + k is the flat top-k slot that sorted row m came from (token = row_id // K).

    num_rows: None, or a static M known on the host (an upper bound on the routed entries, e.g.
    R * min(K, E) for R rows whose K experts are distinct), so that no output size depends on a device
    value. Then the outputs have num_rows rows: the routed rows first, padding after (row_id -1, x zero);
    should more entries be routed than num_rows, only the first num_rows in sorted order are kept (and
    counted in tokens_per_expert).
    """
    flat_S = topk_idx_TK.reshape(-1)
    k = topk_idx_TK.shape[1]
    valid_S = (flat_S >= 0) & (flat_S < num_experts)
    keys_S = torch.where(valid_S, flat_S, torch.full_like(flat_S, num_experts)).long()
    order_S = torch.sort(keys_S, stable=True).indices
    # index_add_ rather than bincount: same counts, and no output length to read on the host.
    counts_E = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat_S.device)
    counts_E.index_add_(0, keys_S, torch.ones_like(keys_S))
    tokens_per_expert_E = counts_E[:num_experts]
    if num_rows is None:
        row_id_M = order_S[: int(valid_S.sum())]
        return x_TD.index_select(0, row_id_M // k), row_id_M, tokens_per_expert_E
    if num_rows < 0:
        raise ValueError(f"permute: num_rows={num_rows} must be >= 0")
    routed = valid_S.sum()
    row_id_M = torch.full((num_rows,), -1, dtype=torch.int64, device=flat_S.device)
    kept = min(num_rows, order_S.numel())
    row_id_M[:kept] = torch.where(torch.arange(kept, device=flat_S.device) < routed, order_S[:kept], -1)
    end_E = torch.cumsum(tokens_per_expert_E, 0).clamp(max=num_rows)
    tokens_per_expert_E = end_E - torch.cat([end_E.new_zeros(1), end_E[:-1]])
    padded_M = row_id_M < 0
    x_sorted_MD = x_TD.index_select(0, row_id_M.clamp(min=0) // k).masked_fill(padded_M[:, None], 0)
    return x_sorted_MD, row_id_M, tokens_per_expert_E


def _routed_rows(row_id_M: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(routed mask [M], slot [M], token [M]) of row ids where padding (-1) points at slot 0, masked out."""
    routed_M = row_id_M >= 0
    slot_M = row_id_M.clamp(min=0)
    return routed_M, slot_M, slot_M // top_k


@register("torch")
def unpermute(y_MD: torch.Tensor, row_id_M: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
    """Weighted scatter-add back to token order: out[t] = sum_k w[t, k] * y[row of (t, k)].

    Slots that were not routed, and padded rows (row_id -1), contribute nothing. Accumulates in fp32, returns
    y.dtype, shape [T, D].
    """
    num_tokens, k = topk_weights_TK.shape
    routed_M, slot_M, token_M = _routed_rows(row_id_M, k)
    w_M = topk_weights_TK.reshape(-1).float().index_select(0, slot_M)
    # where, not a product with the mask: padded rows may hold anything, NaN included.
    rows_MD = torch.where(routed_M[:, None], y_MD.float() * w_M[:, None], 0.0)
    out_TD = torch.zeros(num_tokens, y_MD.shape[1], dtype=torch.float32, device=y_MD.device)
    out_TD.index_add_(0, token_M, rows_MD)
    return out_TD.to(y_MD.dtype)


@register("torch")
def permute_backward(dx_sorted_MD: torch.Tensor, row_id_M: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """Gradient of :func:`permute` w.r.t. x: dx[t] = sum of the sorted rows that came from token t.

    dx_sorted: [M, D], row_id: [M] from :func:`permute` (padded rows, -1, are skipped) -> [T, D] in
    dx_sorted.dtype (fp32 accumulation).
    """
    routed_M, _, token_M = _routed_rows(row_id_M, top_k)
    dx_TD = torch.zeros(num_tokens, dx_sorted_MD.shape[1], dtype=torch.float32, device=dx_sorted_MD.device)
    dx_TD.index_add_(0, token_M, torch.where(routed_M[:, None], dx_sorted_MD.float(), 0.0))
    return dx_TD.to(dx_sorted_MD.dtype)


@register("torch")
def unpermute_backward(
    dout_TD: torch.Tensor, y_MD: torch.Tensor | None, row_id_M: torch.Tensor, topk_weights_TK: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gradients of :func:`unpermute` -> (dy [M, D] in y.dtype, dweights [T, K] in topk_weights.dtype).

    dy[m] = w[slot m] * dout[token of m]; dweights[t, k] = <dout[t], y[row of (t, k)]>, zero where the
    slot was not routed. Padded rows (row_id -1) get dy = 0. Computed in fp32.

    y: None when the weights' gradient is not wanted (an unweighted combine's backward passes unit weights):
    dweights is then None and dy is in dout.dtype.
    """
    num_tokens, k = topk_weights_TK.shape
    routed_M, slot_M, token_M = _routed_rows(row_id_M, k)
    dout_MD = torch.where(routed_M[:, None], dout_TD.float().index_select(0, token_M), 0.0)
    w_M = topk_weights_TK.reshape(-1).float().index_select(0, slot_M)
    dy_MD = (dout_MD * w_M[:, None]).to(dout_TD.dtype if y_MD is None else y_MD.dtype)
    if y_MD is None:
        return dy_MD, None
    dot_M = torch.where(routed_M, (dout_MD * y_MD.float()).sum(-1), 0.0)
    # Padded rows add their 0 to slot 0; routed rows own their slot alone.
    dweights_S = torch.zeros(num_tokens * k, dtype=torch.float32, device=y_MD.device)
    dweights_S.index_add_(0, slot_M, dot_M)
    return dy_MD, dweights_S.view(num_tokens, k).to(topk_weights_TK.dtype)


@register("torch")
def router_topk(
    logits_TE: torch.Tensor,
    bias_E: torch.Tensor,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    route_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 routing: sigmoid scores, bias for selection only, group-limited top-k.

    scores = sigmoid(logits) in fp32. Selection uses scores + bias. With n_group > 1 the experts are split
    into n_group contiguous groups, each group is scored by the sum of its top-2 biased scores, and only the
    best topk_group groups stay eligible (this caps the nodes a token is sent to). Ties break toward the
    lower index. Weights are the *unbiased* scores of the chosen experts, normalised to sum to 1, times
    route_scale.

    Returns (topk_weights [T, K] fp32, topk_idx [T, K] int64 in descending biased-score order,
    scores [T, E] fp32).
    """
    num_tokens, num_experts = logits_TE.shape
    if num_experts % n_group != 0:
        raise ValueError(f"{num_experts} experts do not split into n_group={n_group} groups")
    scores_TE = torch.sigmoid(logits_TE.float())
    choice_TE = scores_TE + bias_E.float()
    if n_group > 1:
        grouped = choice_TE.view(num_tokens, n_group, num_experts // n_group)
        group_score_TG = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)
        keep_TG = _topk_indices(group_score_TG, topk_group)
        mask_TG = torch.zeros_like(group_score_TG, dtype=torch.bool).scatter_(1, keep_TG, True)
        mask_TE = mask_TG.repeat_interleave(num_experts // n_group, dim=1)
        choice_TE = choice_TE.masked_fill(~mask_TE, float("-inf"))
    topk_idx_TK = _topk_indices(choice_TE, top_k)
    weights_TK = scores_TE.gather(1, topk_idx_TK)
    weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True) * route_scale
    return weights_TK, topk_idx_TK, scores_TE


def _topk_indices(values: torch.Tensor, k: int) -> torch.Tensor:
    # A stable descending sort makes ties pick the lower index, which the Triton kernel reproduces.
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


@register("torch")
def swiglu(x_MF2: torch.Tensor, scale_M: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate) * up with x = [gate | up] along the last dim: [M, 2F] -> [M, F] (computed in fp32).

    scale: None, or [M] per-row factors multiplied in before the one rounding to x.dtype (an expert's routing
    weight, applied to the SwiGLU output so that the combine needs no weights: :func:`swiglu_scaled_backward`).
    """
    gate, up = x_MF2.float().chunk(2, dim=-1)
    y_MF = F.silu(gate) * up
    if scale_M is not None:
        y_MF = y_MF * scale_M.float()[:, None]
    return y_MF.to(x_MF2.dtype)


@register("torch")
def swiglu_backward(dy_MF: torch.Tensor, x_MF2: torch.Tensor) -> torch.Tensor:
    """Gradient of :func:`swiglu` (no scale) with respect to its input: [M, F], [M, 2F] -> [M, 2F]."""
    gate, up = x_MF2.float().chunk(2, dim=-1)
    dy = dy_MF.float()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    dgate = dy * up * sig * (1 + gate * (1 - sig))
    dup = dy * silu
    return torch.cat([dgate, dup], dim=-1).to(x_MF2.dtype)


@register("torch")
def swiglu_scaled_backward(
    dy_MF: torch.Tensor, x_MF2: torch.Tensor, scale_M: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``swiglu(x, scale)`` -> (dx [M, 2F] in x.dtype, dscale [M] in scale.dtype), in fp32.

    dx = swiglu_backward(scale * dy, x) and dscale[m] = <dy[m], silu(gate[m]) * up[m]>: the routing weight's
    gradient, from the unscaled SwiGLU output recomputed here rather than kept.
    """
    gate, up = x_MF2.float().chunk(2, dim=-1)
    dy = dy_MF.float()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    dscale_M = (dy * silu * up).sum(-1)
    da = dy * scale_M.float()[:, None]
    dgate = da * up * sig * (1 + gate * (1 - sig))
    dup = da * silu
    return torch.cat([dgate, dup], dim=-1).to(x_MF2.dtype), dscale_M.to(scale_M.dtype)

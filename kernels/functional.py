"""Differentiable kernel ops: autograd Functions over :mod:`kernels.ops` (the backend switch).

Legend for shape suffixes: T tokens, D hidden size, E experts, K top-k (or input features of the
GEMM), M routed rows, N output features, F intermediate size.

Backward passes call the raw ops too, so forward and backward always take the same backend.
``router_topk`` has no Function: its indices are not differentiable. Callers that train the router
recompute the weights from the indices with torch ops on differentiable scores, e.g.
``w = torch.sigmoid(logits).gather(1, idx); w = w / w.sum(-1, keepdim=True) * route_scale``.

:func:`grouped_experts` is the expert MLP, E SwiGLU MLPs over expert-sorted rows, with its three parts
(:func:`experts_forward`, :func:`experts_input_grad`, :func:`experts_weight_grads`) exposed so a schedule
can run the weight gradient apart from the input gradient.

An MoE layer runs ``permute_tokens -> row_weights -> grouped_experts(scale_M=...) -> combine_rows``: each
row's routing weight multiplies its SwiGLU output before the down projection (the projection is linear, so
the result is the weighted combine's), and the combine is a plain sum. The weight's gradient is then a dot
product with the down projection's input gradient and the SwiGLU output recomputed from the gate/up
activations the experts keep anyway, so no [M, D] expert output is kept for backward (the weighted
:func:`unpermute_tokens` keeps it: it needs it for the same gradient).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch

from kernels import fp8, ops

__all__ = [
    "WeightGradHook",
    "accumulate_grad",
    "combine_rows",
    "experts_forward",
    "experts_input_grad",
    "experts_weight_grads",
    "grouped_experts",
    "grouped_mm",
    "permute_tokens",
    "row_weights",
    "swiglu",
    "unpermute_tokens",
]

WeightGradHook = Callable[[Callable[[], None]], None]
"""Receives a closure that computes weight gradients and adds them to the weights' ``.grad``, to run it
whenever it chooses (now, after a communication has started, in a later pipeline slot)."""


class _GroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_MK, w_EKN, tokens_per_expert_E, comm_sms: int):
        ctx.save_for_backward(x_MK, w_EKN, tokens_per_expert_E)
        ctx.comm_sms = comm_sms
        return ops.grouped_gemm(x_MK, w_EKN, tokens_per_expert_E, comm_sms=comm_sms)

    @staticmethod
    def backward(ctx: Any, dy_MN):
        x_MK, w_EKN, tokens_per_expert_E = ctx.saved_tensors
        dy_MN = dy_MN.contiguous()
        dx_MK = dw_EKN = None
        if ctx.needs_input_grad[0]:
            dx_MK = ops.grouped_gemm_dgrad(dy_MN, w_EKN, tokens_per_expert_E, comm_sms=ctx.comm_sms)
        if ctx.needs_input_grad[1]:
            dw_EKN = ops.grouped_gemm_wgrad(x_MK, dy_MN, tokens_per_expert_E, comm_sms=ctx.comm_sms)
        return dx_MK, dw_EKN, None, None


def grouped_mm(
    x_MK: torch.Tensor, w_EKN: torch.Tensor, tokens_per_expert_E: torch.Tensor, comm_sms: int = 0
) -> torch.Tensor:
    """Differentiable grouped GEMM: x [M, K] (rows sorted by expert) @ w [E, K, N] per group -> [M, N].

    Gradients flow to x and w. A zero-bubble schedule that defers the weight-grad calls
    :func:`kernels.ops.grouped_gemm_wgrad` itself instead (with the saved x and dy).
    """
    return _GroupedMM.apply(x_MK.contiguous(), w_EKN, tokens_per_expert_E, comm_sms)


class _PermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_TD, topk_idx_TK, num_experts: int, num_rows: int | None):
        x_sorted_MD, row_id_M, tokens_per_expert_E = ops.permute(x_TD, topk_idx_TK, num_experts, num_rows)
        ctx.save_for_backward(row_id_M)
        ctx.num_tokens, ctx.top_k = topk_idx_TK.shape
        ctx.mark_non_differentiable(row_id_M, tokens_per_expert_E)
        return x_sorted_MD, row_id_M, tokens_per_expert_E

    @staticmethod
    def backward(ctx: Any, dx_sorted_MD, _drow_id, _dcounts):
        (row_id_M,) = ctx.saved_tensors
        dx_TD = ops.permute_backward(dx_sorted_MD.contiguous(), row_id_M, ctx.num_tokens, ctx.top_k)
        return dx_TD, None, None, None


def permute_tokens(
    x_TD: torch.Tensor, topk_idx_TK: torch.Tensor, num_experts: int, num_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Differentiable (w.r.t. x) permute -> (x_sorted [M, D], row_id [M] int64, tokens_per_expert [E]).

    num_rows: a static M known on the host (an upper bound on the routed slots): the outputs are padded to it
    and no op of the expert path reads a device value on the host. None: M is the routed count (one sync).
    """
    return _PermuteTokens.apply(x_TD.contiguous(), topk_idx_TK.contiguous(), num_experts, num_rows)


class _UnpermuteTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y_MD, row_id_M, topk_weights_TK):
        ctx.save_for_backward(y_MD, row_id_M, topk_weights_TK)
        return ops.unpermute(y_MD, row_id_M, topk_weights_TK)

    @staticmethod
    def backward(ctx: Any, dout_TD):
        y_MD, row_id_M, topk_weights_TK = ctx.saved_tensors
        dy_MD, dweights_TK = ops.unpermute_backward(dout_TD.contiguous(), y_MD, row_id_M, topk_weights_TK)
        return dy_MD, None, dweights_TK


def unpermute_tokens(y_MD: torch.Tensor, row_id_M: torch.Tensor, topk_weights_TK: torch.Tensor) -> torch.Tensor:
    """Differentiable (w.r.t. y and topk_weights) weighted combine: [M, D] -> [T, D] in y.dtype."""
    return _UnpermuteTokens.apply(y_MD.contiguous(), row_id_M, topk_weights_TK.contiguous())


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y_MD, row_id_M, num_tokens: int, top_k: int):
        ctx.save_for_backward(row_id_M)
        ctx.top_k = top_k
        # The unweighted combine is permute's backward: every token sums the rows that came from it.
        return ops.permute_backward(y_MD, row_id_M, num_tokens, top_k)

    @staticmethod
    def backward(ctx: Any, dout_TD):
        (row_id_M,) = ctx.saved_tensors
        ones_TK = dout_TD.new_ones(dout_TD.shape[0], ctx.top_k, dtype=torch.float32)
        dy_MD, _ = ops.unpermute_backward(dout_TD.contiguous(), None, row_id_M, ones_TK)
        return dy_MD, None, None, None


def combine_rows(y_MD: torch.Tensor, row_id_M: torch.Tensor, num_tokens: int, top_k: int) -> torch.Tensor:
    """Differentiable (w.r.t. y) unweighted combine: out[t] = sum of the rows of t's slots, [M, D] -> [T, D] in
    y.dtype (fp32 accumulation; padded rows, row_id -1, add nothing). Saves the row ids only."""
    return _CombineRows.apply(y_MD.contiguous(), row_id_M, num_tokens, top_k)


class _RowWeights(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, topk_weights_TK, row_id_M):
        ctx.save_for_backward(row_id_M)
        ctx.shape = topk_weights_TK.shape
        routed_M = row_id_M >= 0
        w_M = topk_weights_TK.reshape(-1).index_select(0, row_id_M.clamp(min=0))
        return torch.where(routed_M, w_M, 0.0)

    @staticmethod
    def backward(ctx: Any, dw_M):
        (row_id_M,) = ctx.saved_tensors
        num_slots = ctx.shape.numel()
        # Padded rows scatter into one spare slot past the end, dropped: the routed rows own their slots, so
        # the result is a copy, exact and in any order (no accumulation).
        slot_M = torch.where(row_id_M >= 0, row_id_M, num_slots)
        dweights_S = dw_M.new_zeros(num_slots + 1).scatter_(0, slot_M, dw_M)
        return dweights_S[:num_slots].view(ctx.shape), None


def row_weights(topk_weights_TK: torch.Tensor, row_id_M: torch.Tensor) -> torch.Tensor:
    """Differentiable (w.r.t. the weights) gather of each sorted row's routing weight: w[m] = weights[slot of m],
    [T, K] -> [M] in the weights' dtype, 0 for padded rows (row_id -1). Saves the row ids only."""
    return _RowWeights.apply(topk_weights_TK, row_id_M)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_MF2):
        ctx.save_for_backward(x_MF2)
        return ops.swiglu(x_MF2)

    @staticmethod
    def backward(ctx: Any, dy_MF):
        (x_MF2,) = ctx.saved_tensors
        return ops.swiglu_backward(dy_MF.contiguous(), x_MF2)


def swiglu(x_MF2: torch.Tensor) -> torch.Tensor:
    """Differentiable silu(gate) * up with x = [gate | up]: [..., 2F] -> [..., F].

    Leading dimensions are flattened into rows for the op (the Triton launcher takes a 2-D [M, 2F]; a
    dense MLP passes [B, S, 2F]) and restored on the result.
    """
    lead = x_MF2.shape[:-1]
    y_MF = _SwiGLU.apply(x_MF2.contiguous().reshape(-1, x_MF2.shape[-1]))
    return y_MF.reshape(*lead, y_MF.shape[-1])


def accumulate_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad += grad`` the way autograd's AccumulateGrad would (first write takes the tensor).

    A parameter with a ``main_grad`` attribute (a gradient buffer an optimizer allocated, e.g. fp32 for a
    bf16 weight) gets ``main_grad += grad`` instead, in the buffer's dtype: micro-batches and deferred
    weight gradients then accumulate at the buffer's precision, not the weight's.
    """
    main_grad = getattr(param, "main_grad", None)
    if main_grad is not None:
        main_grad.add_(grad)
        return
    if param.grad is None:
        param.grad = grad.to(param.dtype)
    else:
        param.grad += grad


class _Gemms(NamedTuple):
    """The three grouped GEMMs of the expert MLP in one precision (signatures of the bf16 ops)."""

    forward: Callable[..., torch.Tensor]
    dgrad: Callable[..., torch.Tensor]
    wgrad: Callable[..., torch.Tensor]


def _gemms(recipe: fp8.FP8Recipe | None) -> _Gemms:
    # Looked up per call: a spy or wrapper that replaces a kernels.ops attribute replaces what runs.
    if recipe is None:
        return _Gemms(ops.grouped_gemm, ops.grouped_gemm_dgrad, ops.grouped_gemm_wgrad)
    return _Gemms(fp8.grouped_forward, fp8.grouped_dgrad, fp8.grouped_wgrad)


def experts_forward(
    x_MD: torch.Tensor,
    w_gate_up_EDF2: torch.Tensor,
    w_down_EFD: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    *,
    scale_M: torch.Tensor | None = None,
    comm_sms: int = 0,
    fp8_recipe: fp8.FP8Recipe | None = None,
    x_fp8: fp8.Quantized | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """For the rows of expert e: y = (silu(x @ W_gate[e]) * (x @ W_up[e]) [* scale]) @ W_down[e].

    x: [M, D] sorted by expert, tokens_per_expert: [E] summing to M, w_gate_up: [E, D, 2F] (gate | up fused,
    so the first GEMM reads x once), w_down: [E, F, D]; scale: None or [M] per-row factors (the routing
    weights, :func:`row_weights`) applied to the SwiGLU output. Returns (y [M, D] in x.dtype, h [M, 2F]),
    where h, the gate | up activations, is what the backward parts take. fp8_recipe: run both GEMMs (and, in
    the backward parts, all four) in FP8 (:mod:`kernels.fp8`); None: in x's dtype. x_fp8: x already quantized
    in 1x128 tiles, for the FP8 up-projection (a caller that keeps it for backward).
    """
    gemm = _gemms(fp8_recipe).forward
    if x_fp8 is None:
        h_MF2 = gemm(x_MD, w_gate_up_EDF2, tokens_per_expert_E, comm_sms=comm_sms)
    else:
        h_MF2 = fp8.grouped_forward(x_MD, w_gate_up_EDF2, tokens_per_expert_E, comm_sms=comm_sms, x_fp8=x_fp8)
    y_MD = gemm(ops.swiglu(h_MF2, scale_M), w_down_EFD, tokens_per_expert_E, comm_sms=comm_sms)
    return y_MD, h_MF2


def experts_input_grad(
    dy_MD: torch.Tensor,
    h_MF2: torch.Tensor,
    w_gate_up_EDF2: torch.Tensor,
    w_down_EFD: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    *,
    scale_M: torch.Tensor | None = None,
    comm_sms: int = 0,
    fp8_recipe: fp8.FP8Recipe | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Input gradients of :func:`experts_forward` -> (dx [M, D], dh [M, 2F], dscale [M] or None without a
    scale); dh goes on to the weight grads. dscale[m] = <dz[m], swiglu(h[m])> with dz the down projection's
    input gradient before the scale."""
    dgrad = _gemms(fp8_recipe).dgrad
    dz_MF = dgrad(dy_MD, w_down_EFD, tokens_per_expert_E, comm_sms=comm_sms)
    dscale_M = None
    if scale_M is None:
        dh_MF2 = ops.swiglu_backward(dz_MF, h_MF2)
    else:
        dh_MF2, dscale_M = ops.swiglu_scaled_backward(dz_MF, h_MF2, scale_M)
    dx_MD = dgrad(dh_MF2, w_gate_up_EDF2, tokens_per_expert_E, comm_sms=comm_sms)
    return dx_MD, dh_MF2, dscale_M


def experts_weight_grads(
    x_MD: torch.Tensor,
    h_MF2: torch.Tensor,
    dy_MD: torch.Tensor,
    dh_MF2: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    *,
    scale_M: torch.Tensor | None = None,
    comm_sms: int = 0,
    fp8_recipe: fp8.FP8Recipe | None = None,
) -> Iterator[torch.Tensor]:
    """Weight gradients of :func:`experts_forward`: dw_down [E, F, D], then dw_gate_up [E, D, 2F].

    Each is computed when the iterator reaches it, so a caller that adds one to ``.grad`` before asking for
    the next holds one weight-sized temporary, not two. The (scaled) SwiGLU output is recomputed from h:
    cheaper than keeping a second [M, F] activation alive until the weight gradient runs.
    """
    wgrad = _gemms(fp8_recipe).wgrad
    a_MF = ops.swiglu(h_MF2, scale_M)
    yield wgrad(a_MF, dy_MD, tokens_per_expert_E, comm_sms=comm_sms)
    del a_MF
    yield wgrad(x_MD, dh_MF2, tokens_per_expert_E, comm_sms=comm_sms)


class _GroupedExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x_MD, w_gate_up_EDF2, w_down_EFD, tokens_per_expert_E, scale_M, comm_sms, defer, recipe):
        save_fp8 = recipe is not None and recipe.save_fp8
        x_fp8 = fp8.quantize_rows(x_MD) if save_fp8 else None
        y_MD, h_MF2 = experts_forward(
            x_MD,
            w_gate_up_EDF2,
            w_down_EFD,
            tokens_per_expert_E,
            scale_M=scale_M,
            comm_sms=comm_sms,
            fp8_recipe=recipe,
            x_fp8=x_fp8,
        )
        # With save_fp8 the up-projection's input (read by the weight gradient only) waits in the FP8 its GEMM
        # used, and the SwiGLU input in FP8 too, as DeepSeek-V3 keeps them.
        kept = (*x_fp8, *fp8.quantize_rows(h_MF2)) if x_fp8 is not None else (x_MD, h_MF2)
        # Weights on ctx, not saved: the deferred closure accumulates into their ``.grad``, which needs the
        # parameter objects themselves (a saved tensor comes back as an alias under saved-tensors hooks).
        ctx.save_for_backward(tokens_per_expert_E, scale_M, *kept)
        ctx.weights = (w_gate_up_EDF2, w_down_EFD)
        ctx.comm_sms, ctx.defer, ctx.recipe, ctx.x_dtype = comm_sms, defer, recipe, x_MD.dtype
        return y_MD

    @staticmethod
    def backward(ctx: Any, dy_MD):
        tokens_per_expert_E, scale_M, *kept = ctx.saved_tensors
        if len(kept) == 4:  # FP8: x and h with their scales
            x_MD, h_MF2 = fp8.Quantized(*kept[:2]), fp8.Quantized(*kept[2:]).dequantize(ctx.x_dtype)
        else:
            x_MD, h_MF2 = kept
        w_gate_up_EDF2, w_down_EFD = ctx.weights
        dy_MD, sms, recipe = dy_MD.contiguous(), ctx.comm_sms, ctx.recipe
        dx_MD, dh_MF2, dscale_M = experts_input_grad(
            dy_MD,
            h_MF2,
            w_gate_up_EDF2,
            w_down_EFD,
            tokens_per_expert_E,
            scale_M=scale_M,
            comm_sms=sms,
            fp8_recipe=recipe,
        )
        if not ctx.needs_input_grad[4]:
            dscale_M = None
        if not (ctx.needs_input_grad[1] or ctx.needs_input_grad[2]):
            return dx_MD, None, None, None, dscale_M, None, None, None

        def weight_grads() -> Iterator[torch.Tensor]:
            x = x_MD.dequantize(ctx.x_dtype) if isinstance(x_MD, fp8.Quantized) else x_MD
            return experts_weight_grads(
                x, h_MF2, dy_MD, dh_MF2, tokens_per_expert_E, scale_M=scale_M, comm_sms=sms, fp8_recipe=recipe
            )

        if ctx.defer is None:
            dw_down_EFD, dw_gate_up_EDF2 = weight_grads()
            return dx_MD, dw_gate_up_EDF2, dw_down_EFD, None, dscale_M, None, None, None

        def accumulate_weight_grads() -> None:
            # It may run later with grad mode on: the saved tensors may require grad, the sums must not.
            with torch.no_grad():
                for w, dw in zip((w_down_EFD, w_gate_up_EDF2), weight_grads()):
                    accumulate_grad(w, dw)

        ctx.defer(accumulate_weight_grads)
        return dx_MD, None, None, None, dscale_M, None, None, None


def grouped_experts(
    x_MD: torch.Tensor,
    w_gate_up_EDF2: torch.Tensor,
    w_down_EFD: torch.Tensor,
    tokens_per_expert_E: torch.Tensor,
    *,
    scale_M: torch.Tensor | None = None,
    comm_sms: int = 0,
    defer_weight_grad: WeightGradHook | None = None,
    fp8_recipe: fp8.FP8Recipe | None = None,
) -> torch.Tensor:
    """Differentiable expert MLP (:func:`experts_forward`): [M, D] rows sorted by expert -> [M, D].

    scale: None, or [M] per-row routing weights (:func:`row_weights`) multiplied into the SwiGLU output;
    differentiable, its gradient computed in the input-gradient step. It saves x, the gate/up output h and
    the scale (no output, no SwiGLU output).
    comm_sms: SMs the grouped GEMMs leave to concurrent all-to-all kernels (0 = use all).
    defer_weight_grad: None, and the weights get their gradients from autograd like any input. Otherwise
    backward returns the input gradients only and hands this hook a closure that, when called, adds the
    weight gradients to ``w_gate_up.grad`` and ``w_down.grad`` (leaf weights) under ``torch.no_grad``.
    fp8_recipe: None, or the FP8 recipe its four GEMMs follow (:mod:`kernels.fp8`); its ``save_fp8`` keeps x
    in FP8 until the weight gradient.
    """
    if scale_M is not None and scale_M.shape != (x_MD.shape[0],):
        raise ValueError(f"grouped_experts: scale {tuple(scale_M.shape)} must be [M={x_MD.shape[0]}]")
    scale_M = None if scale_M is None else scale_M.contiguous()
    return _GroupedExperts.apply(
        x_MD, w_gate_up_EDF2, w_down_EFD, tokens_per_expert_E, scale_M, comm_sms, defer_weight_grad, fp8_recipe
    )

"""Dense building blocks: linear with a deferrable weight gradient, RMSNorm, rotary attention, SwiGLU MLP,
and selective activation recompute.

Legend for shape suffixes: B batch, S sequence, D hidden, H query heads, G key/value heads, C head dim,
F intermediate width, T tokens (B*S).

Every matrix multiply goes through :class:`Linear`, whose backward computes the input gradient at once and
hands the weight gradient to ``WeightGradStore`` when it is enabled (:func:`defer_wgrad`, DualPipe's
protocol). That is what lets a compute piece's backward run as "dX now, dW later" (:mod:`dualpipe.pieces`).

Selective recompute (the DeepSeek-V3 report, section 3.2.3: "we recompute all RMSNorm operations and MLA
up-projections during back-propagation, thereby eliminating the need to persistently store their output
activations"): :func:`recompute` runs a small function keeping only its inputs, and :func:`release` frees its
outputs too once the ops that read them have saved them, refilling them by running the function again when
the backward reaches those ops. :func:`selective_recompute` turns it on for a model's norms and attention
up-projections; ``ParallelConfig.recompute = "selective"`` does that for a training job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dualpipe.weight_grad import WeightGradStore
from kernels import fp8 as kernel_fp8
from kernels import functional
from kernels.fp8 import FP8Recipe
from kernels.functional import accumulate_grad

__all__ = [
    "RECOMPUTE",
    "Attention",
    "DenseMLP",
    "Linear",
    "RMSNorm",
    "accumulate_grad",
    "causal_attention",
    "defer_wgrad",
    "fp8_linears",
    "recompute",
    "recompute_granularity",
    "release",
    "selective_recompute",
    "use_fp8",
]


def _without_grad(fn: Callable[[], None]) -> Callable[[], None]:
    # A deferred closure runs later, maybe with grad mode on: its saved activations may be leaves that
    # require grad, and the product must not grow a graph.
    def run() -> None:
        with torch.no_grad():
            fn()

    return run


def defer_wgrad(fn: Callable[[], None]) -> None:
    """DualPipe's protocol for a weight gradient: hand the closure to ``WeightGradStore`` when it is enabled
    (the piece runtime's dW, or a zero-bubble ``W`` slot), else compute it now."""
    if WeightGradStore.enabled:
        WeightGradStore.put(_without_grad(fn))
    else:
        _without_grad(fn)()


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, fp8: FP8Recipe | None, feature_dims: int) -> torch.Tensor:
        # The weight is kept on ctx, not saved: its backward accumulates into ``weight.grad``, which needs the
        # parameter object itself, and a saved tensor comes back as a new alias under saved-tensors hooks
        # (activation checkpointing, offloading, moe.train.memory's tracker).
        ctx.weight, ctx.fp8, ctx.feature_dims = weight, fp8, feature_dims
        # x itself is saved, a strided view included: the GEMM's contiguous operand is a temporary, made again
        # for the weight gradient, so that a view of a kept tensor costs no memory between forward and backward.
        ctx.save_for_backward(x)
        x = _features(x, feature_dims)
        return F.linear(x, weight) if fp8 is None else kernel_fp8.linear_forward(x, weight)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None]:
        weight, fp8, feature_dims = ctx.weight, ctx.fp8, ctx.feature_dims
        (x,) = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dy @ weight if fp8 is None else kernel_fp8.linear_dgrad(dy, weight)
            dx = dx.view(x.shape)
        if ctx.needs_input_grad[1]:
            # The weight never gets an autograd gradient: the closure accumulates into .grad directly, so a
            # deferred closure and an immediate one leave the same result.
            def wgrad() -> None:
                x_TK = _features(x, feature_dims).reshape(-1, weight.shape[1])
                if fp8 is None:
                    accumulate_grad(weight, dy.reshape(-1, dy.shape[-1]).t() @ x_TK)
                else:
                    accumulate_grad(weight, kernel_fp8.linear_wgrad(dy, x_TK))

            defer_wgrad(wgrad)
        return dx, None, None, None


def _features(x: torch.Tensor, feature_dims: int) -> torch.Tensor:
    """``x [..., *F]`` with its last ``feature_dims`` dims as one, ``[..., prod(F)]`` (a copy where no view can be)."""
    return x if feature_dims == 1 else x.flatten(-feature_dims)


class Linear(nn.Module):
    """``y = x @ W^T`` (no bias) whose weight gradient can be deferred; W is ``[out, in]``.

    ``fp8``: None, or the recipe its three GEMMs follow in FP8 (:func:`use_fp8` sets it model-wide).
    ``keep_precision``: a layer DeepSeek-V3 keeps out of FP8 (the output head, the router's gate):
    :func:`use_fp8` leaves it alone.
    """

    def __init__(self, in_features: int, out_features: int, *, keep_precision: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.keep_precision = keep_precision
        self.fp8: FP8Recipe | None = None

    def forward(self, x: torch.Tensor, *, feature_dims: int = 1) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]``. ``feature_dims``: how many trailing dims of ``x`` hold the input
        features (``[..., H, V]`` with ``in = H * V``: attention heads straight from SDPA's output); a strided ``x``
        (a slice) is then saved as the view it is, its contiguous copy made only for the GEMMs."""
        return _LinearFn.apply(x, self.weight, self.fp8, feature_dims)

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return f"in_features={inp}, out_features={out}" + (", fp8" if self.fp8 is not None else "")


def fp8_linears(*modules: nn.Module) -> tuple[tuple[int, int], ...]:
    """The distinct ``(in_features, out_features)`` of the FP8 :class:`Linear` layers in ``modules`` (what the
    kernel warm-up compiles the FP8 GEMMs for: :class:`kernels.warmup.KernelShapes`)."""
    linears = (m for module in modules for m in module.modules() if isinstance(m, Linear) and m.fp8 is not None)
    return tuple(sorted({(m.weight.shape[1], m.weight.shape[0]) for m in linears}))


def use_fp8(model: nn.Module, recipe: FP8Recipe | None) -> nn.Module:
    """Run the GEMMs of every layer of ``model`` that takes an ``fp8`` recipe (each :class:`Linear`, the routed
    experts) in FP8 with ``recipe`` (None: back to the model's dtype), except the layers marked
    ``keep_precision``. The DeepSeek-V3 report keeps the embedding, output head, router, norms and attention
    core in higher precision: the first and the last two have no GEMM here, the head and router are marked."""
    for module in model.modules():
        if hasattr(module, "fp8") and not getattr(module, "keep_precision", False):
            module.fp8 = recipe
    return model


class _Replay:
    """One call of a recomputed function: the function, the outputs whose storage :func:`release` freed, and the
    graph rebuilt in backward (built once, for the refill and the backward alike)."""

    __slots__ = ("fn", "freed", "graph")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.freed: list[tuple[int, torch.Tensor]] = []  # (output index, an alias of the freed output)
        self.graph: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None

    def rebuild(self, saved: Sequence[Any], needs_grad: Sequence[bool]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        """(leaves, outputs) of the function run again under autograd on detached copies of its inputs."""
        if self.graph is None:
            leaves = tuple(
                t.detach().requires_grad_(need) if isinstance(t, torch.Tensor) else t
                for t, need in zip(saved, needs_grad)
            )
            with torch.enable_grad():
                outs = self.fn(*leaves)
            self.graph = (leaves, outs if isinstance(outs, tuple) else (outs,))
        return self.graph


class _Recompute(torch.autograd.Function):
    """``fn(*inputs)`` run without a graph; backward runs it again under autograd and back-propagates through
    that (a nested backward, as reentrant checkpointing does: weight gradients inside reach ``.grad`` or
    ``WeightGradStore`` exactly as in a plain backward)."""

    @staticmethod
    def forward(ctx, replay: _Replay, *inputs: Any) -> Any:
        ctx.replay = replay
        ctx.save_for_backward(*inputs)
        outs = replay.fn(*inputs)  # autograd functions run forward with grad mode off
        kept = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
        for out in outs if isinstance(outs, tuple) else (outs,):
            if out.untyped_storage().data_ptr() in kept:  # release() would free an input
                raise ValueError("a recomputed function must return new tensors, not its inputs or views of them")
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        replay: _Replay = ctx.replay
        leaves, outs = replay.rebuild(ctx.saved_tensors, ctx.needs_input_grad[1:])
        replay.graph = None
        roots = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        if roots:
            torch.autograd.backward([o for o, _ in roots], [g for _, g in roots])
        return (None, *(t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in leaves))


def recompute(fn: Callable[..., Any], *inputs: torch.Tensor) -> Any:
    """``fn(*inputs)`` (a tensor or a tuple of tensors) keeping only ``inputs`` for backward: nothing ``fn``
    computes inside is saved, and the backward runs ``fn`` again. ``fn`` must be deterministic and return new
    tensors. Pass the outputs to :func:`release` to drop them as well once their readers have run.

    Plain ``fn(*inputs)`` when no graph is being built (grad mode off, as in a piece's full recompute forward,
    or no input requiring grad)."""
    if not torch.is_grad_enabled() or not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs):
        return fn(*inputs)
    return _Recompute.apply(_Replay(fn), *inputs)


def release(outputs: torch.Tensor | Sequence[torch.Tensor], after: torch.Tensor) -> None:
    """Free the storage of ``outputs`` of one :func:`recompute` call, now that the ops reading them have run,
    and refill it (by running the function again) when the backward reaches ``after``.

    ``after`` is a tensor every reader of ``outputs`` feeds (the attention's output, for its q/k/v): its
    gradient comes before any reader's backward, which then finds what it saved in place. The refilled tensors
    are the same storages with the same bytes (the function is replayed), so the readers' saved tensors need no
    change; the freed storages are not ``release``'s to count, an allocator is (a saved-tensors tracker that
    counts bytes when they are saved still counts them). No-op for tensors :func:`recompute` did not make
    (selective recompute off, or no graph)."""
    outs = (outputs,) if isinstance(outputs, torch.Tensor) else tuple(outputs)
    node = outs[0].grad_fn
    replay = getattr(node, "replay", None)
    if not isinstance(replay, _Replay) or not after.requires_grad:
        return
    if any(o.grad_fn is not node for o in outs):
        raise ValueError("release() takes outputs of one recompute() call")
    seen: set[int] = set()
    for out in outs:
        storage = out.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        replay.freed.append((out.output_nr, out.detach()))
        storage.resize_(0)
    after.register_hook(lambda grad: _refill(node))


def _refill(node: Any) -> None:
    replay: _Replay = node.replay
    if not replay.freed:
        return
    _, fresh = replay.rebuild(node.saved_tensors, node.needs_input_grad[1:])
    for index, kept in replay.freed:
        new = fresh[index]
        if new.shape != kept.shape or new.stride() != kept.stride() or new.storage_offset() != kept.storage_offset():
            raise RuntimeError("a released output came back with another layout: the recomputed function changed")
        storage = kept.untyped_storage()
        storage.resize_(new.untyped_storage().nbytes())
        storage.copy_(new.untyped_storage())
    replay.freed = []


RECOMPUTE = ("none", "selective", "full")
"""Activation-recompute granularities (``ParallelConfig.recompute``), from keeping everything to keeping least."""


def recompute_granularity(value: bool | str) -> str:
    """A granularity of :data:`RECOMPUTE`; True and False (the switch of earlier releases) are full and none."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if value not in RECOMPUTE:
        raise ValueError(f"recompute = {value!r}: choose one of {', '.join(RECOMPUTE)} (true: full, false: none)")
    return value


def selective_recompute(module: nn.Module, enabled: bool = True) -> nn.Module:
    """Selective recompute on (or off) for every part of ``module`` that has it: each :class:`RMSNorm` keeps only
    its input, and MLA (:class:`moe.models.mla.MLAttention`) recomputes its up-projections (the per-head q, k, v
    built from the latents) instead of keeping them. A block frees its attention norm's output as well
    (:func:`release`). Returns ``module``."""
    for m in module.modules():
        if hasattr(type(m), "selective_recompute"):
            m.selective_recompute = enabled
    return module


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in fp32."""

    selective_recompute: bool = False
    """Keep only the input for backward, not the fp32 intermediates (:func:`selective_recompute`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.selective_recompute:
            return recompute(self.normalize, x)
        return self.normalize(x)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """The norm itself (what :meth:`forward` computes, recomputed or not)."""
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def _rotate(x_BSHC: torch.Tensor, cos_SC: torch.Tensor, sin_SC: torch.Tensor) -> torch.Tensor:
    # Rotate pairs (first half, second half) of each head by the position angle.
    x1, x2 = x_BSHC.float().chunk(2, dim=-1)
    cos, sin = cos_SC[None, :, None, :], sin_SC[None, :, None, :]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x_BSHC.dtype)


def causal_attention(
    q_BSHC: torch.Tensor, k_BSGC: torch.Tensor, v_BSGV: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Causal softmax attention of every attention variant (SDPA: FlashAttention's kernel where it applies):
    ``[B, S, H, C]`` queries over ``G`` key/value heads (``H % G == 0``, grouped-query when ``G < H``), value
    width ``V`` -> ``[B, S, H, V]``. ``scale``: the softmax scale (None: ``C ** -0.5``). ``V`` may differ from
    ``C``, but then no FlashAttention kernel runs (CUDA's and the CPU's fused kernels take one head dim for q, k
    and v): MLA pads to one width before calling this (:mod:`moe.models.mla`)."""
    o_BHSV = F.scaled_dot_product_attention(
        q_BSHC.transpose(1, 2),
        k_BSGC.transpose(1, 2),
        v_BSGV.transpose(1, 2),
        is_causal=True,
        scale=scale,
        enable_gqa=k_BSGC.shape[2] != q_BSHC.shape[2],
    )
    return o_BHSV.transpose(1, 2)


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary positions (SDPA does the softmax)."""

    def __init__(self, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, rope_theta: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.wq = Linear(hidden, num_heads * head_dim)
        self.wk = Linear(hidden, num_kv_heads * head_dim)
        self.wv = Linear(hidden, num_kv_heads * head_dim)
        self.wo = Linear(num_heads * head_dim, hidden)
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        b, s, _ = x_BSD.shape
        q_BSHC = self.wq(x_BSD).view(b, s, self.num_heads, self.head_dim)
        k_BSGC = self.wk(x_BSD).view(b, s, self.num_kv_heads, self.head_dim)
        v_BSGC = self.wv(x_BSD).view(b, s, self.num_kv_heads, self.head_dim)
        angles_SC = torch.arange(s, device=x_BSD.device, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        cos_SC, sin_SC = angles_SC.cos(), angles_SC.sin()
        q_BSHC, k_BSGC = _rotate(q_BSHC, cos_SC, sin_SC), _rotate(k_BSGC, cos_SC, sin_SC)
        return self.wo(causal_attention(q_BSHC, k_BSGC, v_BSGC).reshape(b, s, -1))


class DenseMLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))`` with gate and up fused into one matrix."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up = Linear(hidden, 2 * intermediate)
        self.down = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., D] -> [..., D]`` (``functional.swiglu`` flattens the leading dims for the kernel)."""
        return self.down(functional.swiglu(self.gate_up(x)))

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
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dualpipe.weight_grad import WeightGradStore
from kernels import e5m6, functional, ops
from kernels import fp8 as kernel_fp8
from kernels.fp8 import FP8Recipe
from kernels.functional import accumulate_grad

__all__ = [
    "RECOMPUTE",
    "Attention",
    "DenseMLP",
    "Kept",
    "Linear",
    "RMSNorm",
    "accumulate_grad",
    "caches_fp8",
    "causal_attention",
    "defer_wgrad",
    "fp8_linears",
    "keep_e5m6",
    "keep_fp8",
    "project_attention",
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


@dataclass(frozen=True, slots=True)
class Kept:
    """A tensor kept for backward in a smaller form (FP8 caching), shared by every op that reads it: each saves
    ``parts`` (the same storages, counted once) and gets the tensor back as ``restore(*parts)`` (its shape, in
    its dtype; ``restore`` holds no tensor, so that what an op saves goes through its ``save_for_backward``)."""

    parts: tuple[torch.Tensor, ...]
    restore: Callable[..., torch.Tensor]

    def view(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Kept:
        """The same parts restoring ``fn(tensor)`` (a view of it: a slice, a reshape)."""
        restore = self.restore
        return Kept(self.parts, lambda *parts: fn(restore(*parts)))


def keep_fp8(x: torch.Tensor) -> Kept:
    """``x`` kept in FP8 (E4M3) with one fp32 scale per 1x128 tile of its last dim, as the routed experts keep
    their inputs under ``FP8Recipe.save_fp8`` (:func:`kernels.fp8.quantize_rows`)."""
    shape, dtype = x.shape, x.dtype
    return Kept(
        tuple(kernel_fp8.quantize_rows(x.detach())),
        lambda q, s: kernel_fp8.Quantized(q, s).dequantize(dtype).view(shape),
    )


def keep_e5m6(x: torch.Tensor) -> Kept:
    """``x`` kept in E5M6 with a power-of-2 scale per 1x128 tile of its last dim (:mod:`kernels.e5m6`)."""
    shape, dtype = x.shape, x.dtype
    return Kept(
        tuple(e5m6.quantize_e5m6(x.detach())), lambda *parts: e5m6.dequantize_e5m6(e5m6.E5M6(*parts), dtype).view(shape)
    )


def caches_fp8(*layers: nn.Module) -> bool:
    """Whether ``layers`` all run in FP8 with ``save_fp8`` (the trainer's ``training.fp8_activations``) and a graph
    is being built: then they keep their inputs in FP8 (E5M6 for the attention output projection's)."""
    return torch.is_grad_enabled() and all(getattr(m, "fp8", None) is not None and m.fp8.save_fp8 for m in layers)


class _LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, weight: torch.Tensor, fp8: FP8Recipe | None, feature_dims: int, kept: Kept | None
    ) -> torch.Tensor:
        # The weight is kept on ctx, not saved: its backward accumulates into ``weight.grad``, which needs the
        # parameter object itself, and a saved tensor comes back as a new alias under saved-tensors hooks
        # (activation checkpointing, offloading, moe.train.memory's tracker).
        ctx.weight, ctx.fp8, ctx.feature_dims = weight, fp8, feature_dims
        # x itself is saved, a strided view included: the GEMM's contiguous operand is a temporary, made again
        # for the weight gradient, so that a view of a kept tensor costs no memory between forward and backward.
        # With ``kept``, x's smaller copy is saved instead (shared with the other ops that read x).
        ctx.restore, ctx.x_shape = (None, x.shape) if kept is None else (kept.restore, x.shape)
        ctx.save_for_backward(*((x,) if kept is None else kept.parts))
        x = _features(x, feature_dims)
        return F.linear(x, weight) if fp8 is None else kernel_fp8.linear_forward(x, weight)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        weight, fp8, feature_dims, restore = ctx.weight, ctx.fp8, ctx.feature_dims, ctx.restore
        saved = ctx.saved_tensors
        dx = None
        if ctx.needs_input_grad[0]:
            dx = dy @ weight if fp8 is None else kernel_fp8.linear_dgrad(dy, weight)
            dx = dx.view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            # The weight never gets an autograd gradient: the closure accumulates into .grad directly, so a
            # deferred closure and an immediate one leave the same result.
            def wgrad() -> None:
                x = saved[0] if restore is None else restore(*saved)
                x_TK = _features(x, feature_dims).reshape(-1, weight.shape[1])
                if fp8 is None:
                    accumulate_grad(weight, dy.reshape(-1, dy.shape[-1]).t() @ x_TK)
                else:
                    accumulate_grad(weight, kernel_fp8.linear_wgrad(dy, x_TK))

            defer_wgrad(wgrad)
        return dx, None, None, None, None


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

    def forward(self, x: torch.Tensor, *, feature_dims: int = 1, kept: Kept | None = None) -> torch.Tensor:
        """``x [..., in]`` -> ``[..., out]``. ``feature_dims``: how many trailing dims of ``x`` hold the input
        features (``[..., H, V]`` with ``in = H * V``: attention heads straight from SDPA's output); a strided ``x``
        (a slice) is then saved as the view it is, its contiguous copy made only for the GEMMs. ``kept``: x as
        another op keeps it for backward (FP8 caching, :class:`Kept`): saved instead of x, for the weight
        gradient."""
        return _LinearFn.apply(x, self.weight, self.fp8, feature_dims, kept)

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


class _SavedByOp:
    """What a saved-tensors pack hook returns inside :class:`_SDPAKeptOutput`: a tensor SDPA saved, or, for its
    output, where the output's E5M6 copy goes and the view of the output SDPA saved."""

    __slots__ = ("kept", "parts", "tensor", "view")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor
        self.kept: Kept | None = None
        self.parts: tuple[torch.Tensor, ...] = ()
        self.view: tuple[Any, ...] = ()

    def unpack(self) -> torch.Tensor:
        if self.kept is None:
            assert self.tensor is not None
            return self.tensor
        # the output again, restored from E5M6 into a storage laid out as the original, viewed as SDPA saved it
        base_shape, base_stride, base_offset, nbytes, shape, stride, offset = self.view
        full = self.kept.restore(*self.parts)
        storage = torch.empty(nbytes // full.element_size(), dtype=full.dtype, device=full.device)
        storage.as_strided(base_shape, base_stride, base_offset).copy_(full)
        return storage.as_strided(shape, stride, offset)


class _SDPAKeptOutput(torch.autograd.Function):
    """:func:`causal_attention` whose output is saved once, in E5M6: SDPA runs as usual (any backend) on
    detached inputs, with a pack hook that swaps its saved output for the E5M6 copy made once it returns; the
    backward restores it and back-propagates through that graph. ``box`` receives the copy (a :class:`Kept`)
    for the output projection, which saves the same parts."""

    @staticmethod
    def forward(ctx, box: list[Kept], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None):
        leaves = tuple(t.detach().requires_grad_(need) for t, need in zip((q, k, v), ctx.needs_input_grad[1:4]))
        saved: list[_SavedByOp] = []

        def pack(t: torch.Tensor) -> _SavedByOp:
            saved.append(_SavedByOp(t))
            return saved[-1]

        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _SavedByOp.unpack):
            o = causal_attention(*leaves, scale=scale)  # [B, S, H, W], laid out so in memory
        kept = keep_e5m6(o.flatten(-2) if o.is_contiguous() else o.contiguous().flatten(-2)).view(
            lambda t: t.view(o.shape)
        )
        ptr = o.untyped_storage().data_ptr()
        for entry in saved:
            t = entry.tensor
            if t is not None and t.untyped_storage().data_ptr() == ptr:  # the output, as SDPA saved it
                nbytes = t.untyped_storage().nbytes()
                entry.view = (o.shape, o.stride(), o.storage_offset(), nbytes, t.shape, t.stride(), t.storage_offset())
                entry.kept, entry.parts, entry.tensor = kept, kept.parts, None
        # What SDPA keeps, saved here too (the same storages): the tensors a saved-tensors tracker outside counts.
        ctx.save_for_backward(*(e.tensor for e in saved if e.tensor is not None), *kept.parts)
        ctx.graph = (leaves, o)
        box.append(kept)
        return o.detach()

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        leaves, o = ctx.graph
        del ctx.graph
        wanted = [t for t in leaves if t.requires_grad]
        grads = iter(torch.autograd.grad(o, wanted, do) if wanted else ())
        return None, *(next(grads) if t.requires_grad else None for t in leaves), None


def project_attention(
    o_proj: Linear,
    q_BSHC: torch.Tensor,
    k_BSGC: torch.Tensor,
    v_BSGW: torch.Tensor,
    scale: float | None = None,
    width: int | None = None,
) -> torch.Tensor:
    """``o_proj`` of :func:`causal_attention`'s output ``[B, S, H, W]`` (its first ``width`` columns of each head,
    a view: MLA pads V to W) -> ``[B, S, D]``.

    With FP8 caching (:func:`caches_fp8` of ``o_proj``), SDPA's output is kept once, in E5M6, as the DeepSeek-V3
    report keeps the input of the linear after the attention: SDPA's backward and the projection's weight
    gradient both read that copy (:class:`_SDPAKeptOutput`), and the bf16 output is freed once projected."""
    width = v_BSGW.shape[-1] if width is None else width
    wanted = any(t.requires_grad for t in (q_BSHC, k_BSGC, v_BSGW))
    if not (wanted and caches_fp8(o_proj)):
        o_BSHW = causal_attention(q_BSHC, k_BSGC, v_BSGW, scale)
        return o_proj(o_BSHW[..., :width], feature_dims=2)
    box: list[Kept] = []
    o_BSHW = _SDPAKeptOutput.apply(box, q_BSHC, k_BSGC, v_BSGW, scale)
    out = o_proj(o_BSHW[..., :width], feature_dims=2, kept=box[0].view(lambda t: t[..., :width]))
    o_BSHW.untyped_storage().resize_(0)  # nothing reads the bf16 output again: the E5M6 copy serves backward
    return out


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
        return project_attention(self.wo, q_BSHC, k_BSGC, v_BSGC)


class _KeptMLP(torch.autograd.Function):
    """:class:`DenseMLP` in FP8 keeping, for backward, its input as a :class:`Kept` (FP8, maybe shared with the
    router) and the SwiGLU input in FP8; the SwiGLU output, the down projection's input, is recomputed for that
    projection's weight gradient, as the routed experts do (:func:`kernels.functional.grouped_experts`)."""

    @staticmethod
    def forward(ctx, x_TD: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, kept: Kept):
        h_TF2 = kernel_fp8.linear_forward(x_TD.reshape(-1, x_TD.shape[-1]), w_gate_up)
        y_TD = kernel_fp8.linear_forward(ops.swiglu(h_TF2), w_down)
        ctx.weights, ctx.restore, ctx.x_shape = (w_gate_up, w_down), kept.restore, x_TD.shape
        ctx.save_for_backward(*kept.parts, *kernel_fp8.quantize_rows(h_TF2))
        return y_TD.view(*x_TD.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (w_gate_up, w_down), restore = ctx.weights, ctx.restore
        *parts, hq, h_scale = ctx.saved_tensors
        dy_TD = dy.reshape(-1, dy.shape[-1])
        h_TF2 = kernel_fp8.Quantized(hq, h_scale).dequantize(dy.dtype)
        dh_TF2 = ops.swiglu_backward(kernel_fp8.linear_dgrad(dy_TD, w_down), h_TF2)
        dx = kernel_fp8.linear_dgrad(dh_TF2, w_gate_up).view(ctx.x_shape)

        def wgrad() -> None:
            accumulate_grad(w_down, kernel_fp8.linear_wgrad(dy_TD, ops.swiglu(h_TF2)))
            x_TD = restore(*parts)
            accumulate_grad(w_gate_up, kernel_fp8.linear_wgrad(dh_TF2, x_TD.reshape(-1, x_TD.shape[-1])))

        defer_wgrad(wgrad)
        return dx, None, None, None


class DenseMLP(nn.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))`` with gate and up fused into one matrix."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up = Linear(hidden, 2 * intermediate)
        self.down = Linear(intermediate, hidden)

    def forward(self, x: torch.Tensor, kept: Kept | None = None) -> torch.Tensor:
        """``[..., D] -> [..., D]`` (``functional.swiglu`` flattens the leading dims for the kernel).

        With FP8 caching (:func:`caches_fp8`) it keeps its input in FP8 (``kept``: that copy, made by the caller
        and shared with another reader, the router) and the SwiGLU input in FP8, and recomputes the SwiGLU
        output (:class:`_KeptMLP`), where it would keep x, the SwiGLU input and output in the activation dtype."""
        if caches_fp8(self.gate_up, self.down):
            return _KeptMLP.apply(x, self.gate_up.weight, self.down.weight, keep_fp8(x) if kept is None else kept)
        return self.down(functional.swiglu(self.gate_up(x)))

"""Compile and autotune every Triton kernel at a model's real shapes before the first training step.

Legend for shape suffixes: T tokens of one micro-batch on this rank, R rows a rank receives after
dispatch, M routed rows (R's slots that hit a local expert), D hidden, F intermediate width, E local
experts (``E_all`` routed experts in the router), K top-k.

Why a warm-up, and not fixed configs. Two things happen on the first Triton call with new arguments, and
both must stay out of ``pipe.step``, where NCCL/DeepEP work of other ranks is in flight:

* the grouped GEMM's ``triton.autotune`` benchmarks every config (``do_bench``: device syncs and
  reruns, tens of milliseconds per key). Ranks tuning at different moments drift apart inside the
  overlapped pair, and a rank blocked in ``do_bench`` behind a DeepEP kernel that waits for a peer can
  hang. Fixed configs per shape class would avoid tuning but not compilation, and would freeze one GPU's
  choice (H100, H800 and H200 differ in bandwidth per SM) into the code;
* every ``@triton.jit`` kernel compiles once per *specialisation*: Triton specialises each integer
  argument on ``== 1`` (folded into a constant) and ``% 16 == 0`` (a divisibility hint), and types it
  i32 or i64 by range (``specialize_impl`` in ``python/triton/runtime/jit.py``; native code from
  Triton 3.5). A compile costs 0.2-2 s of host time, and the row counts after dispatch (R, M) change
  every step, so a kernel that takes them as arguments meets a new class on some later step unless all
  were compiled up front.

So :func:`warm_up` runs the expert path (permute, grouped GEMMs, SwiGLU, the combine, and their
backwards), the dense/shared SwiGLU and the router once per shape class on this rank, then synchronises.
How the keys handle the moving M: the autotune key of the grouped GEMM is (N, K, w's strides) plus the
tensor dtypes, and M is deliberately absent (it is not even a kernel argument: each program reads the
per-expert counts on the device), so one tuning per key serves every routing. The warm-up tunes each key
at the balanced-load M (T x K rows, the average a rank receives) first, because the autotuner keeps the
config of the first call of a key; the later runs only add the compile classes of R and M. The kernels
that do take R or M as arguments (the permute family, SwiGLU on expert rows) get one run per reachable
class combination, enumerated by :func:`shape_classes`.

With ``KernelShapes.fp8`` the expert path runs its GEMMs in FP8 (:mod:`kernels.fp8`: the 1x128, 128x128 and
128x1 quantizations, the FP8 grouped GEMM and weight gradient) and each of ``fp8_linears`` runs a linear's
three FP8 GEMMs on the T token rows, every operand in the K-major layout its phase reads (the 128x128
quantization runs on a weight as stored and on its transposed view: two classes). The FP8 kernels never
specialise on a row count (``do_not_specialize``, which covers the MN-major scales' strides too; the 128x1
operands' stored row stride, 128 x their tile count, is always a multiple of 16), so the row classes above add
no compiles there.

What a call's class is, and what its result looks like on meta tensors, each Triton module declares next to
its launcher (:class:`kernels.registry.Specialization`); this module keeps no list of kernels, and sees the
calls through :func:`kernels.registry.intercept`, without replacing anything in :mod:`kernels.ops`.

Off CUDA (the torch reference, the Triton interpreter) there is nothing to tune or compile ahead:
:func:`warm_up` returns an empty tuple and touches no kernel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kernels import fp8, functional, ops, registry
from kernels.fp8 import FP8Recipe
from kernels.registry import int_class

__all__ = ["KernelShapes", "ShapeClass", "int_class", "shape_class", "shape_classes", "warm_up"]

# Row counts tried for R and M besides the balanced ones: small, so a class costs a compile, not a GEMM.
_SMALL_ROWS = 32


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelShapes:
    """The sizes the model's Triton calls take on one rank."""

    tokens: int
    """T: tokens of one micro-batch on this rank (micro-batch size x sequence length)."""
    hidden: int
    """D: model width."""
    expert_intermediate: int
    """F: intermediate width of one routed expert."""
    num_experts: int
    """Routed experts of the router (all ranks together)."""
    num_local_experts: int
    """Experts this rank holds (num_experts / ep)."""
    top_k: int
    """K: routed experts per token."""
    n_group: int = 1
    """Expert groups of group-limited routing."""
    topk_group: int = 1
    """Groups a token may pick from."""
    route_scale: float = 1.0
    """Multiplier on the routing weights (does not change any class; passed so the router runs as in training)."""
    dense_intermediates: tuple[int, ...] = ()
    """Widths of the SwiGLU MLPs run on the T token rows: the dense layers' MLP and the fused shared experts."""
    dtype: torch.dtype = torch.bfloat16
    """Activation and weight dtype of the model."""
    fp8: FP8Recipe | None = None
    """The FP8 recipe of the model's GEMMs (:mod:`kernels.fp8`), None where they run in ``dtype``."""
    fp8_linears: tuple[tuple[int, int], ...] = ()
    """(in_features, out_features) of each distinct FP8 linear layer run on the T token rows (the attention
    projections, dense and shared-expert MLPs); only with ``fp8``."""

    def __post_init__(self) -> None:
        sizes = {
            "tokens": self.tokens,
            "hidden": self.hidden,
            "expert_intermediate": self.expert_intermediate,
            "num_experts": self.num_experts,
            "num_local_experts": self.num_local_experts,
            "top_k": self.top_k,
            "n_group": self.n_group,
            "topk_group": self.topk_group,
        }
        for name, value in sizes.items():
            if value < 1:
                raise ValueError(f"KernelShapes.{name} must be positive, got {value}")
        if self.num_local_experts > self.num_experts or self.top_k > self.num_experts:
            raise ValueError(
                f"KernelShapes: num_local_experts={self.num_local_experts} and top_k={self.top_k} must not "
                f"exceed num_experts={self.num_experts}"
            )
        if any(f < 1 for f in self.dense_intermediates):
            raise ValueError(f"KernelShapes.dense_intermediates must be positive, got {self.dense_intermediates}")
        if any(len(pair) != 2 or min(pair) < 1 for pair in self.fp8_linears):
            raise ValueError(f"KernelShapes.fp8_linears must be positive (in, out) pairs, got {self.fp8_linears}")
        if self.fp8_linears and self.fp8 is None:
            raise ValueError("KernelShapes.fp8_linears needs an fp8 recipe (fp8=FP8Recipe(...))")

    @classmethod
    def from_config(
        cls,
        cfg: Any,
        *,
        tokens: int,
        ep: int,
        dtype: torch.dtype = torch.bfloat16,
        fp8: FP8Recipe | None = None,
        fp8_linears: Iterable[tuple[int, int]] = (),
    ) -> KernelShapes:
        """The shapes of a model config on one rank of an ``ep``-way expert-parallel group.

        cfg: any object with ``moe.MoEConfig``'s fields (hidden_size, moe_intermediate_size, num_experts,
        top_k, n_group, topk_group, route_scale, num_shared_experts, dense_intermediate_size, num_layers and
        ``is_moe_layer(i)``); read by name so that this package stays free of ``moe``.
        tokens: micro-batch size x sequence length. fp8, fp8_linears: as the fields (the model knows its FP8
        linears: e.g. the (in, out) features of every module ``moe.models.layers.use_fp8`` gave the recipe).
        """
        if ep < 1 or cfg.num_experts % ep:
            raise ValueError(f"ep={ep} must be positive and divide num_experts={cfg.num_experts}")
        dense = []
        moe_layers = [cfg.is_moe_layer(i) for i in range(cfg.num_layers)]
        if not all(moe_layers):
            dense.append(cfg.dense_intermediate_size)
        if cfg.num_shared_experts > 0 and any(moe_layers):
            dense.append(cfg.num_shared_experts * cfg.moe_intermediate_size)
        return cls(
            tokens=tokens,
            hidden=cfg.hidden_size,
            expert_intermediate=cfg.moe_intermediate_size,
            num_experts=cfg.num_experts,
            num_local_experts=cfg.num_experts // ep,
            top_k=cfg.top_k,
            n_group=cfg.n_group,
            topk_group=cfg.topk_group,
            route_scale=cfg.route_scale,
            dense_intermediates=tuple(dict.fromkeys(dense)),
            dtype=dtype,
            fp8=fp8,
            fp8_linears=tuple(dict.fromkeys((int(k), int(n)) for k, n in fp8_linears)),
        )


class ShapeClass(NamedTuple):
    """One op call class: calls with equal classes hit the same compiled kernels and autotune entries."""

    op: str
    """The Triton-level op (``grouped_gemm_dgrad`` is the forward GEMM on a transposed view: "grouped_gemm")."""
    key: tuple
    """The op's :attr:`kernels.registry.Specialization.key`: fixed sizes, dtypes, and the :func:`int_class` of
    every row count that varies per step."""


def shape_class(op: str, *args: Any, **kwargs: Any) -> ShapeClass:
    """The class of one call ``kernels.ops.<op>(*args, **kwargs)`` (any device, meta tensors included), as the
    op's Triton module declares it (:class:`kernels.registry.Specialization`)."""
    try:
        spec = registry.specialization(op)
    except ValueError:
        raise ValueError(f"shape_class: unknown op {op!r} (known: {', '.join(ops._OPS)})") from None
    return ShapeClass(spec.kernel or op, spec.key(*args, **kwargs))


def _class_representatives(candidates: list, cls) -> list:
    """The first candidate of each distinct cls(candidate), in order."""
    seen: dict = {}
    for c in candidates:
        seen.setdefault(cls(c), c)
    return list(seen.values())


def _expert_runs(shapes: KernelShapes) -> list[tuple[int, int]]:
    """(R, M) pairs for the expert path: the balanced pair first (it is where each GEMM key is tuned),
    then one pair per reachable combination of R's and M's classes (R: itself and R*K, which the permute
    kernels take; M: 0 to R*K routed slots, where M=0 still launches the combine kernels on R rows)."""
    k = shapes.top_k
    balanced = (shapes.tokens, shapes.tokens * k)
    rows = _class_representatives(
        [1, *range(_SMALL_ROWS, _SMALL_ROWS + 16)], lambda r: (int_class(r), int_class(r * k))
    )
    runs = [balanced]
    for r in rows:
        routed = _class_representatives(list(range(min(r * k, 64) + 1)), int_class)
        runs += [(r, m) for m in routed if (r, m) != balanced]
    return runs


def _routing(r: int, m: int, shapes: KernelShapes, device: torch.device) -> torch.Tensor:
    """local_idx [R, K]: m of the R*K slots routed, the rest -1 (slots served by other ranks).

    Routed slot s sits at token s % R, top-k position s // R: the routed slots spread over all tokens
    before any token gets a second one, as after a real dispatch. Its expert is (token + position) % E:
    distinct within a token (as top-k picks are) and balanced over the local experts.
    """
    k, e = shapes.top_k, shapes.num_local_experts
    slots = torch.arange(m, device=device)
    token, position = slots % r, slots // r
    flat = torch.full((r * k,), -1, dtype=torch.int64, device=device)
    flat[token * k + position] = (token + position) % e
    return flat.view(r, k)


def _randn(*shape: int, dtype: torch.dtype, device: torch.device, requires_grad: bool = False) -> torch.Tensor:
    # Random data, not zeros: a kernel that skips work on zeros would be tuned on the wrong timings.
    t = torch.randn(*shape, device=device, dtype=torch.float32).mul_(0.05).to(dtype)
    return t.requires_grad_(requires_grad)


def _run_expert_path(r: int, m: int, shapes: KernelShapes, device: torch.device, comm_sms: int) -> None:
    """permute -> grouped experts (routing weights on the SwiGLU output) -> combine, forward and backward, as
    the model's MoE layer (moe.models.experts.GroupedExperts) runs them."""
    d, f, e, k, dt = shapes.hidden, shapes.expert_intermediate, shapes.num_local_experts, shapes.top_k, shapes.dtype
    x_RD = _randn(r, d, dtype=dt, device=device, requires_grad=True)
    w1_EDF2 = _randn(e, d, 2 * f, dtype=dt, device=device, requires_grad=True)
    w2_EFD = _randn(e, f, d, dtype=dt, device=device, requires_grad=True)
    weights_RK = torch.rand(r, k, device=device, dtype=torch.float32, requires_grad=True)
    x_MD, row_id_M, counts_E = functional.permute_tokens(x_RD, _routing(r, m, shapes, device), e)
    scale_M = functional.row_weights(weights_RK, row_id_M)
    y_MD = functional.grouped_experts(
        x_MD, w1_EDF2, w2_EFD, counts_E, scale_M=scale_M, comm_sms=comm_sms, fp8_recipe=shapes.fp8
    )
    out_RD = functional.combine_rows(y_MD, row_id_M, r, k)
    out_RD.backward(_randn(r, d, dtype=dt, device=device))


def _run_fp8_linear(in_features: int, out_features: int, shapes: KernelShapes, device: torch.device) -> None:
    """A linear layer's three FP8 GEMMs on the T token rows, as moe.models.layers.Linear runs them."""
    t, dt = shapes.tokens, shapes.dtype
    x_TK = _randn(t, in_features, dtype=dt, device=device)
    w_NK = _randn(out_features, in_features, dtype=dt, device=device)
    dy_TN = _randn(t, out_features, dtype=dt, device=device)
    fp8.linear_forward(x_TK, w_NK)
    fp8.linear_dgrad(dy_TN, w_NK)
    fp8.linear_wgrad(dy_TN, x_TK)


def _run_dense(rows: int, width: int, shapes: KernelShapes, device: torch.device) -> None:
    h_MF2 = _randn(rows, 2 * width, dtype=shapes.dtype, device=device, requires_grad=True)
    functional.swiglu(h_MF2).backward(_randn(rows, width, dtype=shapes.dtype, device=device))


def _run_fp8_cache(shapes: KernelShapes, device: torch.device) -> None:
    """The FP8 copies an FP8 model keeps for backward on the T token rows (``FP8Recipe.save_fp8``): the MLP's
    normed input (width D) and each SwiGLU MLP's input (twice its width), quantized and read back."""
    for width in (shapes.hidden, *(2 * f for f in shapes.dense_intermediates)):
        x_TW = _randn(shapes.tokens, width, dtype=shapes.dtype, device=device)
        fp8.Quantized(*fp8.quantize_rows(x_TW)).dequantize(shapes.dtype)


def _run_router(shapes: KernelShapes, device: torch.device) -> None:
    logits_TE = _randn(shapes.tokens, shapes.num_experts, dtype=shapes.dtype, device=device)
    bias_E = torch.zeros(shapes.num_experts, device=device, dtype=torch.float32)
    ops.router_topk(logits_TE, bias_E, shapes.top_k, shapes.n_group, shapes.topk_group, shapes.route_scale)


def _run_all(shapes: KernelShapes, device: torch.device, comm_sms: int, on_expert_run=None) -> None:
    """Every call of the warm-up, on whatever backend the switch picks for ``device``.

    on_expert_run(r, m) is told each expert-path run's sizes before it starts (the recording run needs M,
    which meta tensors cannot compute).
    """
    for r, m in _expert_runs(shapes):
        if on_expert_run is not None:
            on_expert_run(r, m)
        _run_expert_path(r, m, shapes, device, comm_sms)
    for width in shapes.dense_intermediates:
        _run_dense(shapes.tokens, width, shapes, device)
    for in_features, out_features in shapes.fp8_linears:
        _run_fp8_linear(in_features, out_features, shapes, device)
    if shapes.fp8 is not None and shapes.fp8.save_fp8:
        _run_fp8_cache(shapes, device)
    _run_router(shapes, device)


def _recording(seen: set[ShapeClass], run: Callable[[str, Callable, tuple, dict], Any]):
    """An interceptor (:func:`kernels.registry.intercept`) that adds each call's class to ``seen`` and then
    returns ``run(name, impl, args, kwargs)``."""

    def wrap(name: str, impl: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            seen.add(shape_class(name, *args, **kwargs))
            return run(name, impl, args, kwargs)

        return call

    return wrap


def shape_classes(shapes: KernelShapes) -> frozenset[ShapeClass]:
    """Every class :func:`warm_up` covers for ``shapes``: the classes of the calls it makes.

    Computed by making the warm-up's own calls on meta tensors (no data, no kernel), each call of the backend
    switch intercepted (:func:`kernels.registry.intercept`) to record its class and return the op's meta
    result (:attr:`kernels.registry.Specialization.meta`), so this set and what :func:`warm_up` runs cannot
    drift apart. Meta tensors take the switch's torch route, so ``DUALPIPE_KERNELS=triton`` needs
    ``TRITON_INTERPRET=1`` here (the switch refuses Triton for a non-CUDA tensor otherwise).
    """
    seen: set[ShapeClass] = set()
    rows = {"m": 0}

    def meta_result(name: str, impl: Callable, args: tuple, kwargs: dict) -> Any:
        return registry.specialization(name).meta(rows["m"], *args, **kwargs)

    with registry.intercept(_recording(seen, meta_result)):
        _run_all(shapes, torch.device("meta"), 0, on_expert_run=lambda r, m: rows.update(m=m))
    return frozenset(seen)


def warm_up(shapes: KernelShapes, device: torch.device | str, *, comm_sms: int = 0) -> tuple[ShapeClass, ...]:
    """Compile and autotune every Triton kernel the model will call on this rank, then synchronise.

    Call once per rank after the model is built and before the first ``pipe.step``, with the same
    ``comm_sms`` the model's grouped GEMMs get (it sets their grid). Collective-free: ranks may finish at
    different times, and the first step's communication lines them up again. Returns the classes warmed,
    in no particular order; an empty tuple (and no kernel call at all) when ``device`` is not CUDA or the
    backend switch (``DUALPIPE_KERNELS``) does not pick Triton for it. The classes are recorded from the calls
    themselves, so they are :func:`shape_classes` ``(shapes)``.
    """
    device = torch.device(device)
    if device.type != "cuda" or ops.backend_for(torch.empty(0, device=device)) != "triton":
        return ()
    # The warm-up's random inputs must not move the caller's generator (the model's init, data order).
    # enable_grad: the backward kernels are warmed through autograd, also when the caller is in no_grad.
    seen: set[ShapeClass] = set()
    recording = _recording(seen, lambda name, impl, args, kwargs: impl(*args, **kwargs))
    with torch.random.fork_rng(devices=[device]), torch.enable_grad(), registry.intercept(recording):
        torch.manual_seed(0)
        _run_all(shapes, device, comm_sms)
    torch.cuda.synchronize(device)
    # The balanced run held one MoE layer's expert weights, their gradients and T x K rows of activations
    # (about 6 GB at DeepSeek-V3's per-rank shapes): hand the blocks back rather than leave them cached in
    # sizes the training step may never reuse.
    torch.cuda.empty_cache()
    return tuple(sorted(seen, key=repr))  # keys of different kernels hold different types: no plain sort

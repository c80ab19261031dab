"""Kernel benchmark: every op behind the backend switch, checked against its torch reference, then timed.

Legend for shape suffixes: T tokens, D hidden size, E experts, K top-k, M = T*K routed rows, F expert
intermediate size.

    python -m bench.kernels --shapes v3 --out bench/results               # on a GPU (Triton backend)
    python -m bench.kernels --shapes v3 --only fp8_grouped_wgrad          # one op (names: --only help)
    python -m bench.kernels --shapes v3 --costs-out costs.json            # also a costs file for moe.plan
    TRITON_INTERPRET=1 DUALPIPE_KERNELS=triton python -m bench.kernels --repeats 0   # CPU: check in the interpreter

Which kernels run: the backend the switch picks (``DUALPIPE_KERNELS``, :mod:`kernels.ops`): Triton on CUDA;
on CPU the torch reference unless forced to Triton, which then runs in the interpreter (fp32, small shapes).

Checks. Before an op is timed, its output on the benchmarked backend is compared with the same call on the
torch reference backend at the same shape (:func:`bench.harness.check_close`): integer outputs exactly, floating
ones in relative norm and in largest element error, per output dtype (:data:`TOLERANCE`, :func:`fp8_tolerance`).
A mismatch, or an exception, is a failed row (untimed, the reason printed under the table); the other rows still
run, and the command exits non-zero at the end (``--repeats 0`` checks every op and times none). When the switch
picks the reference itself nothing is compared (the rows' check is '-', and a note says so). torch's own peers
(``torch._grouped_mm``, ``torch._scaled_mm``) are checked the same way and, when they disagree or do not run
here, left out with a note.

Cold inputs: every timed call's arguments rotate over copies (:func:`bench.harness.rotation`), enough that the
L2 cache (``L2_cache_size`` of the device, 50 MB on H100/H200) holds none of them when a call starts; at most
``2 * inputs + L2`` is held per op. Baseline rows time the same way.

Rows per shape (ops[B] is the benchmarked backend; ``--only NAME`` keeps one op, repeatable):

* baselines, timed when an op needs them: ``dense_matmul`` (one bf16 matmul with the grouped GEMM's M, K, N)
  and ``d2d_copy`` (a device-to-device copy of the permuted rows);
* ``grouped_gemm``, ``grouped_gemm_dgrad``, ``grouped_gemm_wgrad``: ops[B] and ``torch._grouped_mm`` (where it
  runs here), plus ``grouped_gemm`` with ``--comm-sms`` SMs left to communication on Triton;
* ``permute``, ``unpermute``, ``swiglu``, ``swiglu_backward``, ``router_topk``: ops[B], against the copy;
* FP8 (``--no-fp8`` leaves them out): ``fp8_grouped_forward``, ``fp8_grouped_dgrad``, ``fp8_grouped_wgrad``
  (:func:`kernels.fp8.grouped_forward` and its two gradients) and ``fp8_linear_forward``, ``_dgrad``,
  ``_wgrad`` (:mod:`kernels.fp8`'s linear GEMMs, a ``[F, D]`` weight over the M routed rows), each timed as
  training runs it: activation and weight quantization included; and ``fp8_gemm``, the forward GEMM alone on
  operands quantized before the clock, against ``torch._scaled_mm`` in each scaling recipe this torch runs
  (blockwise 1x128 x 128x128 is the same recipe; rowwise and tensorwise are coarser; each checked within 10%
  of the unquantized product).

Targets on an H100 (from the issue): grouped GEMM at least as fast as ``torch._grouped_mm`` and at least 60% of
the dense rate; permute and unpermute at least 70% of the copy bandwidth (:func:`check_targets`).

Shapes. ``v3`` is DeepSeek-V3's expert layer (D 7168, F 2048, top-8 of 256 routed experts in 8 groups) on a rank
holding 32 experts (ep 8), at 4096 and 16384 tokens (1024 and 4096 rows per expert). One expert count only: a
second one (E 8) would compile every grouped kernel again for its block of experts, and the whole run must stay
within two minutes on an H200, Triton's autotuning and compilation included (it is one step of the one-GPU
check). ``small`` is sized for the Triton interpreter (seconds, fp32). ``--budget-s`` stops starting new ops
once the run is that old (a note lists what was left out); the results are saved either way.

``--costs-out FILE`` also writes the planner's costs file (:mod:`moe.plan.measured`, its ``ops`` section)
for one shape of the set (``--costs-shape``), from the rows of the path this run benchmarks (``ops[triton]``
on a GPU with Triton, ``ops[torch]`` elsewhere). Planner ops it covers (:data:`PLANNER_OPS`): the routed
experts' grouped GEMMs ``experts_gate_up`` and ``experts_down`` (fwd, dx, dw), ``experts_swiglu.fwd``,
``permute.fwd``, ``unpermute.fwd`` and ``router_topk.fwd``; the planner keeps its roofline for every other
op (attention, the router's gate GEMM, the shared experts, every backward of the memory-bound ops).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import importlib.metadata
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.harness import Bench, Check, Row, Tolerance, check_close, tensor_bytes
from kernels import fp8, ops, reference, reference_fp8
from kernels.reference_fp8 import TILE
from moe.dispatch import DEFAULT_COMM_SMS
from moe.models.config import MoEConfig
from moe.plan.measured import MeasuredCosts, measured_ops, save_costs, work_ratio


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEShape:
    """One MoE layer configuration as one rank sees it."""

    num_experts: int
    """Local experts (the grouped GEMM's groups)."""
    num_tokens: int
    top_k: int
    hidden: int
    inter: int
    """Expert intermediate size: the GEMM maps hidden -> inter."""
    router_experts: int
    """Routed experts of the whole model (the router's E)."""
    n_group: int
    topk_group: int

    @property
    def rows(self) -> int:
        return self.num_tokens * self.top_k

    @property
    def label(self) -> str:
        return f"E{self.num_experts} T{self.num_tokens} K{self.top_k} D{self.hidden} F{self.inter}"


# DeepSeek-V3: hidden 7168, expert intermediate 2048, 256 routed experts in 8 groups, top-8 from 4 groups.
_V3 = {"hidden": 7168, "inter": 2048, "router_experts": 256, "n_group": 8, "topk_group": 4, "top_k": 8}
SHAPES = {
    # The interpreter runs a kernel ~4000x slower than torch: 32 routed rows over 4 experts, one 128-wide FP8
    # scale tile of D and a partial one of F.
    "small": [
        MoEShape(num_experts=4, num_tokens=16, top_k=2, hidden=128, inter=32,
                 router_experts=16, n_group=4, topk_group=2),
    ],
    "v3": [
        MoEShape(num_experts=32, num_tokens=4096, **_V3),
        MoEShape(num_experts=32, num_tokens=16384, **_V3),
    ],
}  # fmt: skip

# Tolerances by output dtype. A correct kernel differs from the reference by the order of its float32 sums and
# then by at most one rounding of each output element: 2**-8 of it in bf16, 2**-11 in fp16; the largest element
# error is bounded at 4 such roundings of the largest element. A wrong tile or row, an unwritten output, a
# swapped operand are errors of the output's own size.
TOLERANCE = {
    torch.bfloat16: Tolerance(norm=1e-2, peak=2**-6),
    torch.float16: Tolerance(norm=2e-3, peak=2**-9),
    torch.float32: Tolerance(norm=1e-5, peak=1e-4),
}
EXACT = Tolerance(norm=0.0, peak=0.0)
"""For ops that only move values (permute): the same bits."""
_FP8_ACCUMULATION = Tolerance(norm=1e-3, peak=2**-8)
"""sm_90's FP8 tensor cores sum each 128-element slice keeping about 14 bits (the DeepSeek-V3 report) before the
kernel promotes it to float32; the reference sums in float32 throughout."""
_SCALED_MM = Tolerance(norm=0.1, peak=0.5)
"""torch._scaled_mm against the unquantized product: E4M3 rounding gives a few percent in any recipe; a scale
layout read differently gives errors of the product's own size."""


def dtype_tolerance(dtype: torch.dtype) -> Tolerance:
    """The bound for a floating output of ``dtype`` (:data:`TOLERANCE`)."""
    return TOLERANCE[dtype]


def fp8_tolerance(dtype: torch.dtype) -> Tolerance:
    """The bound for an FP8 GEMM's output of ``dtype``: its rounding or the tensor cores' accumulation, the larger."""
    own = TOLERANCE[dtype]
    return Tolerance(norm=max(own.norm, _FP8_ACCUMULATION.norm), peak=max(own.peak, _FP8_ACCUMULATION.peak))


@dataclass(frozen=True, kw_only=True, slots=True)
class Peer:
    """A torch implementation timed beside an op once its output passes its check."""

    impl: str
    fn: Callable[..., object]
    args: tuple
    ratio: str
    """The op's row's ratio to this one, e.g. 'speedup_vs_grouped_mm'."""
    want: object = None
    """What its output is compared with; None: the op's reference output."""
    tolerance: Callable[[torch.dtype], Tolerance] | None = None
    """None: the op's own."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Case:
    """One op at one shape: ``fn(*args)``, run on the benchmarked backend and on the reference, then timed."""

    op: str
    fn: Callable[..., object]
    """The op through the backend switch (:mod:`kernels.ops` or :mod:`kernels.fp8`)."""
    args: tuple
    tolerance: Callable[[torch.dtype], Tolerance] = dtype_tolerance
    flops: float | None = None
    """Floating-point operations of one call (None for the memory-bound ops)."""
    variant: str = ""
    """Appended to the impl name of a second configuration of the same op (``comm_sms=20``)."""
    peers: tuple[Peer, ...] = ()
    """Several peers with one impl name are alternatives: the first whose output passes is timed."""
    against: tuple[tuple[str, str, str], ...] = ()
    """(row, ratio, metric): ratios to a baseline ('dense_matmul', 'd2d_copy') or to another op's ops[...] row at
    the same shape; metric as :meth:`bench.harness.Bench.compare` takes it. Baselines apply to the peers too."""


def _routing(shape: MoEShape, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """[T, K] distinct local experts per token with uneven popularity (so group sizes differ)."""
    popularity = torch.rand(shape.num_experts, generator=gen) * 2
    logits = torch.randn(shape.num_tokens, shape.num_experts, generator=gen) + popularity
    return logits.topk(min(shape.top_k, shape.num_experts), dim=-1).indices.to(device)


class Inputs:
    """The tensors of one shape, made on the device on first use (``--only`` makes only what its op reads)."""

    def __init__(self, shape: MoEShape, dtype: torch.dtype, device: torch.device) -> None:
        self.shape, self.dtype, self.device = shape, dtype, device
        self._gen = torch.Generator(device).manual_seed(0)

    def randn(self, *size: int, scale: float = 1.0) -> torch.Tensor:
        """Normal values times ``scale`` in the compute dtype."""
        return (torch.randn(*size, generator=self._gen, device=self.device) * scale).to(self.dtype)

    def rand(self, *size: int) -> torch.Tensor:
        """Uniform [0, 1) float32 values (routing weights)."""
        return torch.rand(*size, generator=self._gen, device=self.device)

    @functools.cached_property
    def routing(self) -> torch.Tensor:
        """[T, K] local expert ids."""
        return _routing(self.shape, self.device, torch.Generator().manual_seed(0))

    @functools.cached_property
    def counts(self) -> torch.Tensor:
        """[E] routed rows per local expert (summing to M)."""
        return torch.bincount(self.routing.flatten(), minlength=self.shape.num_experts)

    @functools.cached_property
    def gemm(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x [M, D], w [E, D, F], dy [M, F]): the grouped GEMM's operands, w scaled to keep y near unit size."""
        s = self.shape
        m = self.routing.numel()
        return self.randn(m, s.hidden), self.randn(s.num_experts, s.hidden, s.inter, scale=s.hidden**-0.5), \
            self.randn(m, s.inter)  # fmt: skip

    @functools.cached_property
    def w_linear(self) -> torch.Tensor:
        """[F, D]: a linear layer's weight over the routed rows (the FP8 linear GEMMs)."""
        return self.randn(self.shape.inter, self.shape.hidden, scale=self.shape.hidden**-0.5)

    @functools.cached_property
    def x_tokens(self) -> torch.Tensor:
        """[T, D] token rows."""
        return self.randn(self.shape.num_tokens, self.shape.hidden)


def _gemm_flops(shape: MoEShape) -> float:
    """FLOPs of every GEMM here: M routed rows, D -> F (or its gradients, the same products)."""
    return 2.0 * shape.rows * shape.hidden * shape.inter


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


def grouped_gemm_cases(op: str) -> Callable[[Inputs, int, str], list[Case]]:
    """The bf16 (compute-dtype) grouped GEMM phase ``op`` of :mod:`kernels.ops`, against ``torch._grouped_mm``."""

    def build(inp: Inputs, comm_sms: int, backend: str) -> list[Case]:
        x, w, dy = inp.gemm
        counts = inp.counts
        operands = {"grouped_gemm": (x, w), "grouped_gemm_dgrad": (dy, w), "grouped_gemm_wgrad": (x, dy)}[op]
        peer_operands = {"grouped_gemm": (x, w), "grouped_gemm_dgrad": (dy, w.transpose(1, 2)),
                         "grouped_gemm_wgrad": (x.t(), dy)}[op]  # fmt: skip
        peers = ()
        if hasattr(torch, "_grouped_mm"):
            offs = torch.cumsum(counts, 0).to(torch.int32)  # end row of each group, as _grouped_mm wants
            peers = (Peer(impl="torch._grouped_mm", fn=_grouped_mm, args=(*peer_operands, offs),
                          ratio="speedup_vs_grouped_mm"),)  # fmt: skip
        against = (("dense_matmul", "vs_dense_rate", "tflops"),)
        fn = getattr(ops, op)
        case = Case(op=op, fn=fn, args=(*operands, counts), flops=_gemm_flops(inp.shape), peers=peers, against=against)
        cases = [case]
        # The interpreter has 4 pretend SMs and no communication to leave any to.
        if op == "grouped_gemm" and backend == "triton" and comm_sms > 0 and inp.device.type == "cuda":
            cases.append(dataclasses.replace(case, fn=functools.partial(fn, comm_sms=comm_sms),
                                             variant=f"comm_sms={comm_sms}", peers=()))  # fmt: skip
        return cases

    return build


def _memory_bound(op: str, args: Callable[[Inputs], tuple], **kw):
    """Builder of a memory-bound op of :mod:`kernels.ops`, rated against the device-to-device copy."""

    def build(inp: Inputs, comm_sms: int, backend: str) -> list[Case]:
        return [Case(op=op, fn=getattr(ops, op), args=args(inp), against=(("d2d_copy", "vs_copy_bw", "gbps"),), **kw)]

    return build


def _unpermute_args(inp: Inputs) -> tuple:
    x_sorted_MD, row_id_M, _ = reference.permute(inp.x_tokens, inp.routing, inp.shape.num_experts)
    weights_TK = inp.rand(*inp.routing.shape)
    return x_sorted_MD, row_id_M, weights_TK


def _router_args(inp: Inputs) -> tuple:
    s = inp.shape
    # Zero bias: the check wants the same experts, and bf16 logits tie often; ties break toward the lower index by
    # rule in both implementations, while a random bias would leave near-ties that one ulp of sigmoid can flip.
    bias_E = torch.zeros(s.router_experts, device=inp.device)
    return inp.randn(s.num_tokens, s.router_experts), bias_E, s.top_k, s.n_group, s.topk_group


def _fp8_cases(op: str, fn: Callable, operands: Callable[[Inputs], tuple], bf16: str | None):
    """Builder of one FP8 training GEMM of :mod:`kernels.fp8` (quantization included), rated against the dense
    bf16 matmul and, for the grouped phases, the bf16 grouped GEMM of the same phase (``bf16``)."""

    def build(inp: Inputs, comm_sms: int, backend: str) -> list[Case]:
        against = [("dense_matmul", "vs_dense_rate", "tflops")]
        if bf16 is not None:
            against.append((bf16, "speedup_vs_bf16", "time"))
        return [Case(op=op, fn=fn, args=operands(inp), tolerance=fp8_tolerance, flops=_gemm_flops(inp.shape),
                     against=tuple(against))]  # fmt: skip

    return build


def _scaled_mm_peers(x_MK: torch.Tensor, w_NK: torch.Tensor, dtype: torch.dtype) -> tuple[Peer, ...]:
    """``torch._scaled_mm`` on x @ w^T in each scaling recipe, each with the scale layouts cuBLAS may read (the
    first that passes its check against the unquantized product is timed). Scales are decoding scales
    (``amax / 448``) in the recipe's tiles, from :func:`kernels.reference_fp8.quantize_fp8`."""
    if not hasattr(torch, "_scaled_mm"):
        return ()
    m, k = x_MK.shape
    n = w_NK.shape[0]
    want = x_MK @ w_NK.t()
    # 1x128 activation scales outer-dim-major (M contiguous), as cuBLAS's block scaling reads them.
    blockwise = [lambda xs, ws: (xs.t().contiguous().t(), ws.t()), lambda xs, ws: (xs, ws.t().contiguous())]
    recipes = {
        "blockwise": ((1, TILE), (TILE, TILE), blockwise),
        "rowwise": ((1, k), (1, k), [lambda xs, ws: (xs, ws.t().contiguous())]),
        "tensorwise": ((m, k), (n, k), [lambda xs, ws: (xs.reshape(()), ws.reshape(()))]),
    }
    peers = []
    for recipe, (x_block, w_block, layouts) in recipes.items():
        xq, x_scale = reference_fp8.quantize_fp8(x_MK, x_block)
        wq, w_scale = reference_fp8.quantize_fp8(w_NK, w_block)
        for layout in layouts:
            scale_a, scale_b = layout(x_scale, w_scale)
            peers.append(Peer(impl=f"torch._scaled_mm {recipe}", fn=functools.partial(_scaled_mm, out_dtype=dtype),
                              args=(xq, wq.t(), scale_a, scale_b), ratio=f"speedup_vs_scaled_mm_{recipe}",
                              want=want, tolerance=lambda _: _SCALED_MM))  # fmt: skip
    return tuple(peers)


def _scaled_mm(a, b, scale_a, scale_b, *, out_dtype):
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def _fp8_gemm_cases(inp: Inputs, comm_sms: int, backend: str) -> list[Case]:
    """The linear forward's FP8 GEMM alone (x [M, D] in 1x128 tiles, w [F, D] in 128x128 blocks, quantized before
    the clock) against ``torch._scaled_mm`` and the bf16 matmul."""
    x = inp.gemm[0]
    xq, x_scale = reference_fp8.quantize_fp8(x)
    wq, w_scale = reference_fp8.quantize_fp8(inp.w_linear, (TILE, TILE))
    fn = functools.partial(ops.fp8_gemm, out_dtype=inp.dtype)
    return [Case(op="fp8_gemm", fn=fn, args=(xq, x_scale, wq, w_scale), tolerance=fp8_tolerance,
                 flops=_gemm_flops(inp.shape), peers=_scaled_mm_peers(x, inp.w_linear, inp.dtype),
                 against=(("dense_matmul", "speedup_vs_bf16", "time"),))]  # fmt: skip


OPS: dict[str, Callable[[Inputs, int, str], list[Case]]] = {
    **{op: grouped_gemm_cases(op) for op in ("grouped_gemm", "grouped_gemm_dgrad", "grouped_gemm_wgrad")},
    "permute": _memory_bound("permute", lambda i: (i.x_tokens, i.routing, i.shape.num_experts),
                             tolerance=lambda _: EXACT),
    "unpermute": _memory_bound("unpermute", _unpermute_args),
    "swiglu": _memory_bound("swiglu", lambda i: (i.randn(i.shape.rows, 2 * i.shape.inter),)),
    "swiglu_backward": _memory_bound("swiglu_backward", lambda i: (i.randn(i.shape.rows, i.shape.inter),
                                                                   i.randn(i.shape.rows, 2 * i.shape.inter))),
    "router_topk": _memory_bound("router_topk", _router_args),
    "fp8_grouped_forward": _fp8_cases("fp8_grouped_forward", fp8.grouped_forward,
                                      lambda i: (i.gemm[0], i.gemm[1], i.counts), "grouped_gemm"),
    "fp8_grouped_dgrad": _fp8_cases("fp8_grouped_dgrad", fp8.grouped_dgrad,
                                    lambda i: (i.gemm[2], i.gemm[1], i.counts), "grouped_gemm_dgrad"),
    "fp8_grouped_wgrad": _fp8_cases("fp8_grouped_wgrad", fp8.grouped_wgrad,
                                    lambda i: (i.gemm[0], i.gemm[2], i.counts), "grouped_gemm_wgrad"),
    "fp8_linear_forward": _fp8_cases("fp8_linear_forward", fp8.linear_forward,
                                     lambda i: (i.gemm[0], i.w_linear), None),
    "fp8_linear_dgrad": _fp8_cases("fp8_linear_dgrad", fp8.linear_dgrad, lambda i: (i.gemm[2], i.w_linear), None),
    "fp8_linear_wgrad": _fp8_cases("fp8_linear_wgrad", fp8.linear_wgrad, lambda i: (i.gemm[2], i.gemm[0]), None),
    "fp8_gemm": _fp8_gemm_cases,
}  # fmt: skip
"""Benchmarked op -> builder ``(inputs, comm_sms, backend) -> cases``, in the order they run (``--only`` names)."""


def _dense_matmul(inp: Inputs) -> tuple[str, Callable, tuple, dict]:
    """One matmul with the grouped GEMMs' M, K and N (expert 0's weight for every row): the rate they can reach."""
    m, k, n = inp.shape.rows, inp.shape.hidden, inp.shape.inter
    x, w, _ = inp.gemm
    work = {"flops": _gemm_flops(inp.shape), "bytes": (m * k + k * n + m * n) * inp.dtype.itemsize}
    return "torch.matmul", torch.matmul, (x, w[0]), work


def _d2d_copy(inp: Inputs) -> tuple[str, Callable, tuple, dict]:
    """A device-to-device copy of the permuted rows' size [M, D]: the bandwidth the memory-bound ops can reach."""
    src = inp.x_tokens.repeat(inp.shape.top_k, 1)
    return "Tensor.copy_", torch.Tensor.copy_, (torch.empty_like(src), src), {"bytes": 2 * tensor_bytes(src)}


BASELINES = {"dense_matmul": _dense_matmul, "d2d_copy": _d2d_copy}
"""Baseline row -> ``(inputs) -> (impl, fn, args, Bench.measure's flops and bytes)``."""


@contextlib.contextmanager
def forced_backend(backend: str) -> Iterator[None]:
    """Every :mod:`kernels.ops` call inside takes ``backend`` (the switch reads ``DUALPIPE_KERNELS`` per call)."""
    before = os.environ.get(ops.ENV_VAR)
    os.environ[ops.ENV_VAR] = backend
    try:
        yield
    finally:
        if before is None:
            del os.environ[ops.ENV_VAR]
        else:
            os.environ[ops.ENV_VAR] = before


def _failure(exc: Exception, where: str) -> Check:
    first = (str(exc).strip().splitlines() or [""])[0][:200]
    return Check(passed=False, detail=f"{where} raised {type(exc).__name__}: {first}")


class KernelBench:
    """Checks and times the cases of one run on one backend; baselines are timed once per shape, on demand."""

    def __init__(self, bench: Bench, backend: str) -> None:
        self.bench, self.backend = bench, backend
        self.failed: list[Row] = []
        self._baselines: dict[tuple[str, str], Row | None] = {}

    def run(self, case: Case, inp: Inputs) -> None:
        """Check ``case`` against the reference, then time it and its peers (failures become rows and notes; with
        no repeats the checked rows are recorded untimed)."""
        label, impl = inp.shape.label, f"ops[{self.backend}]" + (f" {case.variant}" if case.variant else "")
        try:
            with forced_backend("torch"):
                want = case.fn(*case.args)
        except Exception as exc:  # the row's failure; the run goes on
            self.failed.append(self.bench.untimed(case.op, impl, label, _failure(exc, "the reference")))
            return
        check = None
        if self.backend != "torch":  # else the benchmarked call is the reference itself
            try:
                check = check_close(case.fn(*case.args), want, case.tolerance)
            except Exception as exc:  # a kernel that raises fails its check
                check = _failure(exc, impl)
            if not check.passed:
                self.failed.append(self.bench.untimed(case.op, impl, label, check))
                return
        peers = self._passing_peers(case, want, label)
        # Fewest bytes a call moves: its arguments read once and its results written once. For every op here that
        # is also the least its work allows (permute reads each token row once, and writes each of its K copies).
        nbytes = tensor_bytes(case.args) + tensor_bytes(want)
        del want
        if self.bench.repeats == 0:
            for name, row_check in [(impl, check), *((peer.impl, peer_check) for peer, peer_check in peers)]:
                self.bench.untimed(case.op, name, label, row_check)
            return
        measure = functools.partial(self.bench.measure, case.op, shape=label, flops=case.flops, bytes=nbytes)
        try:
            row = measure(impl, fn=case.fn, args=case.args, check=check)
        except Exception as exc:  # out of memory for the rotated copies, a launch that fails when repeated
            self.failed.append(self.bench.untimed(case.op, impl, label, _failure(exc, f"{impl} timed")))
            return
        peer_rows = []
        for peer, peer_check in peers:
            try:
                peer_rows.append(measure(peer.impl, fn=peer.fn, args=peer.args, check=peer_check))
            except Exception as exc:  # torch's, not ours: a note
                self.bench.notes.append(f"{peer.impl} {case.op} {label}: left out ({_failure(exc, 'timed').detail})")
                continue
            self.bench.compare(row, peer_rows[-1], peer.ratio)
        for name, ratio, metric in case.against:
            other = self._row(name, inp)
            if other is not None:
                self.bench.compare(row, other, ratio, metric)
                if other.baseline:
                    for peer_row in peer_rows:
                        self.bench.compare(peer_row, other, ratio, metric)

    def _passing_peers(self, case: Case, want: object, label: str) -> list[tuple[Peer, Check]]:
        """Each peer impl's first alternative whose output passes its check; a note for the impls none passes."""
        passed, failures = {}, {}
        for peer in case.peers:
            if peer.impl in passed:
                continue
            try:
                check = check_close(peer.fn(*peer.args), want if peer.want is None else peer.want,
                                    peer.tolerance or case.tolerance)  # fmt: skip
            except Exception as exc:  # not run by this torch on this device: a note, not a failure
                check = _failure(exc, peer.impl)
            if check.passed:
                passed[peer.impl] = (peer, check)
                failures.pop(peer.impl, None)
            else:
                failures[peer.impl] = check.detail
        self.bench.notes.extend(f"{impl} {case.op} {label}: left out ({why})" for impl, why in failures.items())
        return list(passed.values())

    def _row(self, name: str, inp: Inputs) -> Row | None:
        """The baseline ``name`` at this shape (timed on first use), or op ``name``'s timed ops[...] row."""
        if name in BASELINES:
            key = (inp.shape.label, name)
            if key not in self._baselines:
                try:
                    impl, fn, args, work = BASELINES[name](inp)
                    row = self.bench.measure(name, impl, inp.shape.label, fn, args=args, baseline=True, **work)
                except Exception as exc:  # the ops keep their own rows; only their ratios to it are lost
                    self.bench.notes.append(f"{name} {inp.shape.label}: left out ({_failure(exc, 'timed').detail})")
                    row = None
                self._baselines[key] = row
            return self._baselines[key]
        rows = [r for r in self.bench.rows if r.op == name and r.shape == inp.shape.label and is_ours(r)]
        return rows[0] if rows else None


def is_ours(row: Row) -> bool:
    """A timed row of the benchmarked backend's op (not a baseline, a peer, or the comm_sms variant)."""
    return row.impl.startswith("ops[") and " " not in row.impl and row.ms is not None


def check_targets(rows: list[Row]) -> list[dict]:
    """The issue's H100 targets, evaluated on the ops rows of this run (all three grouped GEMMs)."""
    wanted = {"vs_dense_rate": 0.6, "speedup_vs_grouped_mm": 1.0, "vs_copy_bw": 0.7}
    checks = []
    for r in rows:
        if not is_ours(r):
            continue
        if not (r.op.startswith("grouped_gemm") or r.op in ("permute", "unpermute")):
            continue
        for ratio, target in wanted.items():
            if ratio in r.ratios:
                value = r.ratios[ratio]
                checks.append({"check": f"{r.op} {r.shape} {ratio}", "value": value, "target": target,
                               "met": value >= target})  # fmt: skip
    return checks


PLANNER_OPS = {
    "experts_gate_up.fwd": "grouped_gemm",
    "experts_gate_up.dx": "grouped_gemm_dgrad",
    "experts_gate_up.dw": "grouped_gemm_wgrad",
    "experts_down.fwd": "grouped_gemm",
    "experts_down.dx": "grouped_gemm_dgrad",
    "experts_down.dw": "grouped_gemm_wgrad",
    "experts_swiglu.fwd": "swiglu",
    "permute.fwd": "permute",
    "unpermute.fwd": "unpermute",
    "router_topk.fwd": "router_topk",
}
"""Planner op and phase (:mod:`moe.plan.flops`) -> the benchmarked op whose time stands for it. The kernel
maps hidden -> inter; the planner's gate/up GEMM maps D -> 2F and its down GEMM F -> D: each takes the
kernel's time times its FLOP ratio to the kernel (2 and 1), that is the kernel's achieved rate."""


def planner_config(shape: MoEShape) -> MoEConfig:
    """The MoE layer of ``shape`` as :class:`MoEConfig` fields (the router's experts are the model's; no
    shared expert, which is not measured). Attention, vocabulary and dense widths keep their defaults: the
    costs file holds no op they shape."""
    return MoEConfig(
        hidden_size=shape.hidden, moe_intermediate_size=shape.inter, num_experts=shape.router_experts,
        top_k=shape.top_k, n_group=shape.n_group, topk_group=shape.topk_group, num_shared_experts=0,
    )  # fmt: skip


def costs_file(rows: list[Row], shape: MoEShape, dtype: torch.dtype, device: torch.device) -> MeasuredCosts:
    """The planner's costs file for ``shape`` from this run's timed ``ops[...]`` rows: one micro-batch of
    ``num_tokens`` tokens (one sequence) on one rank of an ep group of ``router_experts / num_experts``.
    Each planner op's seconds are its kernel's median times the op's work over the kernel's (FLOPs, or
    bytes for a kernel without FLOPs), so the file describes the planner's op at the file's shape."""
    if shape.router_experts % shape.num_experts:
        raise ValueError(f"{shape.label}: {shape.router_experts} router experts do not split into ep groups")
    ours = {r.op: r for r in rows if r.shape == shape.label and is_ours(r)}
    missing = set(PLANNER_OPS.values()) - set(ours)
    if missing:
        raise ValueError(f"{shape.label}: no timed ops[...] rows for {sorted(missing)}: was the shape benchmarked?")
    impl = ours["grouped_gemm"].impl
    costs = MeasuredCosts(
        config=planner_config(shape), seq_len=shape.num_tokens, tokens=shape.num_tokens, moe={},
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        source=f"bench.kernels {impl} {dtype} {shape.label}", date=datetime.date.today().isoformat(),
        act_bytes=dtype.itemsize, ep=shape.router_experts // shape.num_experts, comm_sms=0,
    )  # fmt: skip
    planner = measured_ops(costs)
    seconds = {}
    for key, bench_op in PLANNER_OPS.items():
        name, phase = key.split(".")
        row, op = ours[bench_op], planner[name]
        work = (getattr(op, f"{phase}_flops"), getattr(op, f"{phase}_bytes"))
        seconds[key] = row.ms * 1e-3 * work_ratio(work, (row.flops or 0.0, row.bytes or 0.0), key)
    return dataclasses.replace(costs, ops=seconds)


def _triton_version() -> str | None:
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", choices=sorted(SHAPES), default="small")
    p.add_argument("--only", action="append", default=None, metavar="NAME",
                   help=f"benchmark only this op (repeatable): {', '.join(OPS)}")  # fmt: skip
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="default: bf16 on CUDA, fp32 elsewhere (the interpreter rounds bf16 wrongly)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=30, help="0: check every op, time none")
    p.add_argument("--comm-sms", type=int, default=DEFAULT_COMM_SMS,
                   help="extra grouped-GEMM row with this many SMs left to communication (Triton only)")  # fmt: skip
    p.add_argument("--no-fp8", dest="fp8", action="store_false", help="leave out the FP8 GEMM rows")
    p.add_argument("--budget-s", type=float, default=None, metavar="S",
                   help="start no new op once the run is S seconds old (the rows so far are saved)")  # fmt: skip
    p.add_argument("--out", default="bench/results")
    p.add_argument("--costs-out", default=None, metavar="FILE",
                   help="also write the planner's costs file (python -m moe.plan --costs FILE)")  # fmt: skip
    p.add_argument("--costs-shape", type=int, default=0, metavar="N",
                   help="which shape of the set the costs file describes (index, default the first)")  # fmt: skip
    return p


def _selected(args: argparse.Namespace) -> list[str]:
    """The ops this run benchmarks, in :data:`OPS` order; SystemExit naming the valid ones for an unknown name."""
    unknown = sorted(set(args.only or ()) - set(OPS))
    if unknown:
        raise SystemExit(f"--only {', '.join(unknown)}: not a benchmarked op; one of {', '.join(OPS)}")
    names = [op for op in OPS if args.only is None or op in args.only]
    return [op for op in names if args.fp8 or not op.startswith("fp8_")]


def main(argv: list[str] | None = None) -> Path:
    """Run the benchmark, print and save it; SystemExit (non-zero) after saving when an op failed its check."""
    args = build_parser().parse_args(argv)
    if args.costs_out and not 0 <= args.costs_shape < len(SHAPES[args.shapes]):
        raise SystemExit(f"--costs-shape {args.costs_shape}: the {args.shapes} set has {len(SHAPES[args.shapes])}")
    selected = _selected(args)
    device = torch.device(args.device)
    default = "bf16" if device.type == "cuda" else "fp32"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype or default]
    try:
        backend = ops.backend_for(torch.empty(0, device=device))
    except (RuntimeError, ValueError) as exc:
        raise SystemExit(str(exc)) from None
    bench = Bench("kernels", device, warmup=args.warmup, repeats=args.repeats)
    runner = KernelBench(bench, backend)
    started, skipped = time.monotonic(), []
    with forced_backend(backend):
        for shape in SHAPES[args.shapes]:
            inp = Inputs(shape, dtype, device)
            for op in selected:
                elapsed = time.monotonic() - started
                if args.budget_s is not None and elapsed > args.budget_s:
                    skipped.append(f"{op} {shape.label}")
                    continue
                # Where the time goes, as it goes: a run killed by an outer timeout still shows how far it got.
                print(f"[{elapsed:6.1f} s] {op} {shape.label}", flush=True)
                for case in OPS[op](inp, args.comm_sms, backend):
                    runner.run(case, inp)
            del inp
            if device.type == "cuda":
                torch.cuda.empty_cache()
    if skipped:
        bench.notes.append(f"--budget-s {args.budget_s:g} spent: not run {', '.join(skipped)}")
    if backend == "torch":
        bench.notes.append(f"the switch ({ops.ENV_VAR}) picks the torch reference here: its rows are the reference's, "
                           "so nothing was checked; the Triton kernels on CPU: TRITON_INTERPRET=1 "
                           f"{ops.ENV_VAR}=triton")  # fmt: skip
    targets = check_targets(bench.rows) if device.type == "cuda" else []
    print(bench.table())
    for c in targets:
        print(f"target {'met ' if c['met'] else 'MISS'}  {c['check']}: {c['value']:.2f} (>= {c['target']})")
    context = {"shapes": args.shapes, "dtype": str(dtype), "backend": backend, "triton": _triton_version(),
               "targets": targets, "failed": [f"{r.op} {r.impl} {r.shape}" for r in runner.failed]}  # fmt: skip
    path = bench.save(args.out, extra=context)
    print(f"saved {path}")
    problems = (
        [f"{len(runner.failed)} kernel check(s) failed: " + ", ".join(context["failed"])] if runner.failed else []
    )
    if args.costs_out:
        try:
            save_costs(args.costs_out, costs_file(bench.rows, SHAPES[args.shapes][args.costs_shape], dtype, device))
            print(f"saved {args.costs_out}")
        except ValueError as exc:  # a failed or skipped op: the file would describe what was not measured
            problems.append(f"no costs file: {exc}")
    if problems:
        raise SystemExit("; ".join(problems))
    return path


if __name__ == "__main__":
    main()

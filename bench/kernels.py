"""Kernel benchmark: the ops behind the backend switch against their baselines, measured in one run.

Legend for shape suffixes: T tokens, D hidden size, E experts, K top-k, M = T*K routed rows, F expert
intermediate size.

    python -m bench.kernels --shapes v3 --out bench/results          # on a GPU
    python -m bench.kernels --shapes small --warmup 1 --repeats 3     # anywhere (reference backend on CPU)
    python -m bench.kernels --shapes v3 --costs-out costs.json        # also a costs file for moe.plan

Rows per shape: baselines (one dense matmul with the grouped GEMM's M, K, N; a device-to-device copy of
the permuted tensor), then each op through :mod:`kernels.ops`, the plain reference (a per-expert loop for
the GEMMs) and ``torch._grouped_mm`` where torch has it. Targets on an H100 (from the issue): grouped
GEMM at least as fast as ``torch._grouped_mm`` and at least 60% of the dense rate; permute and unpermute
at least 70% of the copy bandwidth.

FP8 rows (CUDA only; on CPU a note says why they are missing): ``fp8_gemm`` (1x128 activations, 128x128 weight
blocks, :mod:`kernels.triton_fp8_gemm`) against ``torch._scaled_mm`` in each scaling recipe this torch runs
(blockwise 1x128 x 128x128 is the same recipe; rowwise and tensorwise are coarser) and against the bf16 matmul
of the same size; ``fp8_grouped_gemm`` against the bf16 grouped GEMM. Operands are quantized before the clock
starts: the rows time the GEMMs alone.

``--costs-out FILE`` also writes the planner's costs file (:mod:`moe.plan.measured`, its ``ops`` section)
for one shape of the set (``--costs-shape``), from the rows of the path this run benchmarks (``ops[triton]``
on a GPU with Triton, ``ops[torch]`` elsewhere). Planner ops it covers (:data:`PLANNER_OPS`): the routed
experts' grouped GEMMs ``experts_gate_up`` and ``experts_down`` (fwd, dx, dw), ``experts_swiglu.fwd``,
``permute.fwd``, ``unpermute.fwd`` and ``router_topk.fwd``; the planner keeps its roofline for every other
op (attention, the router's gate GEMM, the shared experts, every backward of the memory-bound ops).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.harness import Bench, Row
from kernels import ops, reference
from kernels.reference_fp8 import TILE
from moe.config import MoEConfig
from moe.dispatch import DEFAULT_COMM_SMS
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
    "small": [
        MoEShape(num_experts=8, num_tokens=256, top_k=4, hidden=256, inter=128,
                 router_experts=32, n_group=4, topk_group=2),
    ],
    "v3": [
        MoEShape(num_experts=8, num_tokens=4096, **_V3),
        MoEShape(num_experts=32, num_tokens=4096, **_V3),
        MoEShape(num_experts=32, num_tokens=16384, **_V3),
    ],
}  # fmt: skip


def _routing(shape: MoEShape, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """[T, K] distinct local experts per token with uneven popularity (so group sizes differ)."""
    popularity = torch.rand(shape.num_experts, generator=gen) * 2
    logits = torch.randn(shape.num_tokens, shape.num_experts, generator=gen) + popularity
    return logits.topk(min(shape.top_k, shape.num_experts), dim=-1).indices.to(device)


def _grouped_mm_fns(x_MK, w_EKN, dy_MN, counts_E) -> dict[str, Callable[[], object]]:
    """torch._grouped_mm versions of forward, dgrad and wgrad, each kept only if torch runs it here."""
    if not hasattr(torch, "_grouped_mm"):
        return {}
    offs = torch.cumsum(counts_E, 0).to(torch.int32)  # end row of each group, as _grouped_mm wants
    candidates = {
        "grouped_gemm": lambda: torch._grouped_mm(x_MK, w_EKN, offs=offs),
        "grouped_gemm_dgrad": lambda: torch._grouped_mm(dy_MN, w_EKN.transpose(1, 2), offs=offs),
        "grouped_gemm_wgrad": lambda: torch._grouped_mm(x_MK.t(), dy_MN, offs=offs),
    }
    fns = {}
    for op, fn in candidates.items():
        try:
            fn()
        except (RuntimeError, NotImplementedError):  # dtype, layout or architecture not supported
            continue
        fns[op] = fn
    return fns


def bench_grouped_gemm(bench: Bench, shape: MoEShape, dtype: torch.dtype, comm_sms: int) -> None:
    """Forward, dgrad and wgrad over the permuted rows; the dense matmul of the same size is the ceiling."""
    dev, gen = bench.device, torch.Generator().manual_seed(0)
    idx_TK = _routing(shape, torch.device("cpu"), gen)
    counts_E = torch.bincount(idx_TK.flatten(), minlength=shape.num_experts).to(dev)
    m, k, n = idx_TK.numel(), shape.hidden, shape.inter
    x_MK = torch.randn(m, k, generator=gen).to(dev, dtype)
    w_EKN = (torch.randn(shape.num_experts, k, n, generator=gen) / k**0.5).to(dev, dtype)
    dy_MN = torch.randn(m, n, generator=gen).to(dev, dtype)
    size = dtype.itemsize
    flops = 2.0 * m * k * n
    dense = bench.measure(
        "dense_matmul", "torch.matmul", shape.label, lambda: x_MK @ w_EKN[0],
        flops=flops, bytes=(m * k + k * n + m * n) * size, baseline=True,
    )  # fmt: skip
    grouped_mm = _grouped_mm_fns(x_MK, w_EKN, dy_MN, counts_E)
    if len(grouped_mm) < 3:
        bench.notes.append(f"torch._grouped_mm runs only {sorted(grouped_mm)} for {dtype} on {dev}")
    backend = ops.backend_for(x_MK)
    cases = {
        "grouped_gemm": (x_MK, w_EKN, (m * k + k * n * shape.num_experts + m * n) * size),
        "grouped_gemm_dgrad": (dy_MN, w_EKN, (m * n + k * n * shape.num_experts + m * k) * size),
        "grouped_gemm_wgrad": (x_MK, dy_MN, (m * k + m * n + k * n * shape.num_experts) * size),
    }
    for op, (a, b, nbytes) in cases.items():
        run = {
            f"ops[{backend}]": lambda op=op, a=a, b=b: getattr(ops, op)(a, b, counts_E),
            "reference": lambda op=op, a=a, b=b: getattr(reference, op)(a, b, counts_E),
        }
        if op in grouped_mm:
            run["torch._grouped_mm"] = grouped_mm[op]
        rows = {impl: bench.measure(op, impl, shape.label, fn, flops=flops, bytes=nbytes) for impl, fn in run.items()}
        ours = rows[f"ops[{backend}]"]
        bench.compare(ours, dense, "vs_dense_rate", "tflops")
        bench.compare(ours, rows["reference"], "speedup_vs_reference")
        if op in grouped_mm:
            bench.compare(ours, rows["torch._grouped_mm"], "speedup_vs_grouped_mm")
            bench.compare(rows["torch._grouped_mm"], dense, "vs_dense_rate", "tflops")
    if backend == "triton" and comm_sms > 0:
        fn = lambda: ops.grouped_gemm(x_MK, w_EKN, counts_E, comm_sms=comm_sms)  # noqa: E731
        row = bench.measure("grouped_gemm", f"ops[triton] comm_sms={comm_sms}", shape.label, fn, flops=flops)
        bench.compare(row, dense, "vs_dense_rate", "tflops")


def bench_memory_bound(bench: Bench, shape: MoEShape, dtype: torch.dtype) -> None:
    """Permute, unpermute, router and SwiGLU against a device-to-device copy of the permuted rows."""
    dev, gen = bench.device, torch.Generator().manual_seed(1)
    idx_TK = _routing(shape, dev, gen)
    t, k = idx_TK.shape
    m, d, f, size = idx_TK.numel(), shape.hidden, shape.inter, dtype.itemsize
    x_TD = torch.randn(t, d, generator=gen).to(dev, dtype)
    src, dst = torch.empty(m, d, dtype=dtype, device=dev), torch.empty(m, d, dtype=dtype, device=dev)
    src.copy_(x_TD.repeat(k, 1))
    copy = bench.measure("d2d_copy", "Tensor.copy_", shape.label, lambda: dst.copy_(src),
                         bytes=2.0 * m * d * size, baseline=True)  # fmt: skip
    x_sorted_MD, row_id_M, _ = reference.permute(x_TD, idx_TK, shape.num_experts)
    weights_TK = torch.rand(t, k, generator=gen).to(dev)
    logits_TE = torch.randn(t, shape.router_experts, generator=gen).to(dev, dtype)
    bias_E = torch.zeros(shape.router_experts, device=dev)
    route = (shape.top_k, shape.n_group, shape.topk_group)
    x_MF2 = torch.randn(m, 2 * f, generator=gen).to(dev, dtype)
    cases: dict[str, tuple[tuple, float]] = {
        # Fewest bytes: each token row read once and each of its K copies written once (a gather that
        # reads the token row K times moves 2*M*D instead), plus the int64 expert ids and row ids.
        "permute": ((x_TD, idx_TK, shape.num_experts), (t + m) * d * size + 16.0 * m),
        "unpermute": ((x_sorted_MD, row_id_M, weights_TK), (m + t) * d * size + 12.0 * m),
        "router_topk": ((logits_TE, bias_E, *route), t * shape.router_experts * (size + 4) + 12.0 * t * k),
        "swiglu": ((x_MF2,), 3.0 * m * f * size),
    }
    backend = ops.backend_for(x_TD)
    for op, (args, nbytes) in cases.items():
        ours = bench.measure(
            op, f"ops[{backend}]", shape.label, lambda op=op, a=args: getattr(ops, op)(*a), bytes=nbytes
        )
        ref = bench.measure(
            op, "reference", shape.label, lambda op=op, a=args: getattr(reference, op)(*a), bytes=nbytes
        )
        bench.compare(ours, copy, "vs_copy_bw", "gbps")
        bench.compare(ours, ref, "speedup_vs_reference")


def _relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _scaled_mm_fns(x_MK: torch.Tensor, w_NK: torch.Tensor, ref_MN: torch.Tensor) -> tuple[dict, list[str]]:
    """``torch._scaled_mm`` on x @ w^T in each scaling recipe this torch runs here -> ({recipe: fn}, notes).

    Scales are decoding scales (``amax / 448``) from :func:`kernels.ops.quantize_fp8` in the recipe's tiles.
    A recipe is kept only if it runs and lands within 10% (relative norm) of the bf16 product, so that a scale
    layout torch reads differently is not timed as if it were right.
    """
    m, k = x_MK.shape
    n = w_NK.shape[0]
    # 1x128 activation scales outer-dim-major (M contiguous), as cuBLAS's block scaling reads them.
    blockwise = [
        lambda xs, ws: (xs.t().contiguous().t(), ws.t()),
        lambda xs, ws: (xs, ws.t().contiguous()),
    ]
    recipes = {
        "blockwise": ((1, TILE), (TILE, TILE), blockwise),
        "rowwise": ((1, k), (1, k), [lambda xs, ws: (xs, ws.t().contiguous())]),
        "tensorwise": ((m, k), (n, k), [lambda xs, ws: (xs.reshape(()), ws.reshape(()))]),
    }
    fns, notes = {}, []
    for recipe, (x_block, w_block, layouts) in recipes.items():
        xq, x_scale = ops.quantize_fp8(x_MK, x_block)
        wq, w_scale = ops.quantize_fp8(w_NK, w_block)
        error = "no scale layout ran"
        for layout in layouts:
            scale_a, scale_b = layout(x_scale, w_scale)

            def fn(xq=xq, wq=wq, scale_a=scale_a, scale_b=scale_b):
                return torch._scaled_mm(xq, wq.t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)

            try:
                err = _relative_error(fn(), ref_MN)
            except (RuntimeError, ValueError, NotImplementedError) as exc:
                error = str(exc).splitlines()[0][:120]
                continue
            if err < 0.1:
                fns[recipe] = fn
                break
            error = f"relative error {err:.2f} against bf16 (a scale layout read differently)"
        if recipe not in fns:
            notes.append(f"torch._scaled_mm {recipe}: not timed ({error})")
    return fns, notes


def bench_fp8(bench: Bench, shape: MoEShape, comm_sms: int) -> None:
    """The FP8 GEMMs against their peers, CUDA only: fp8_gemm (M = routed rows, hidden -> inter, like the dense
    baseline) vs ``torch._scaled_mm`` and the bf16 matmul; fp8_grouped_gemm vs the bf16 grouped GEMM."""
    dev, gen = bench.device, torch.Generator().manual_seed(2)
    if dev.type != "cuda":
        bench.notes.append("fp8 rows skipped: no CUDA device (the FP8 GEMMs are sm_90 Triton kernels)")
        return
    idx_TK = _routing(shape, torch.device("cpu"), gen)
    counts_E = torch.bincount(idx_TK.flatten(), minlength=shape.num_experts).to(dev)
    m, k, n, e = idx_TK.numel(), shape.hidden, shape.inter, shape.num_experts
    bf16 = torch.bfloat16
    x_MK = torch.randn(m, k, generator=gen).to(dev, bf16)
    w_NK = (torch.randn(n, k, generator=gen) / k**0.5).to(dev, bf16)
    w_EKN = (torch.randn(e, k, n, generator=gen) / k**0.5).to(dev, bf16)
    flops = 2.0 * m * k * n
    # One byte per FP8 operand element, bf16 out, float32 scales (1x128 for x, 128x128 per weight matrix).
    x_scales, w_scales = 4.0 * m * _scale_tiles(k), 4.0 * _scale_tiles(n) * _scale_tiles(k)
    fp8_bytes = m * k + n * k + 2.0 * m * n + x_scales + w_scales
    dense = bench.measure("fp8_gemm", "torch.matmul bf16", shape.label, lambda: x_MK @ w_NK.t(), flops=flops,
                          bytes=2.0 * (m * k + n * k + m * n), baseline=True)  # fmt: skip
    xq, x_scale = ops.quantize_fp8(x_MK)
    wq, w_scale = ops.quantize_fp8(w_NK, (TILE, TILE))
    ours_fn = lambda: ops.fp8_gemm(xq, x_scale, wq, w_scale)  # noqa: E731
    impl = f"ops[{ops.backend_for(xq)}]"
    ours = bench.measure("fp8_gemm", impl, shape.label, ours_fn, flops=flops, bytes=fp8_bytes)
    bench.compare(ours, dense, "speedup_vs_bf16")
    dense_ref = x_MK @ w_NK.t()
    peers, notes = _scaled_mm_fns(x_MK, w_NK, dense_ref)
    bench.notes.extend(notes)
    ours.ratios["rel_err_vs_bf16"] = _relative_error(ours_fn(), dense_ref)
    for recipe, fn in peers.items():
        row = bench.measure("fp8_gemm", f"torch._scaled_mm {recipe}", shape.label, fn, flops=flops, bytes=fp8_bytes)
        bench.compare(ours, row, f"speedup_vs_scaled_mm_{recipe}")
        bench.compare(row, dense, "speedup_vs_bf16")

    bf16_grouped = bench.measure(
        "fp8_grouped_gemm", f"{impl} bf16 grouped_gemm", shape.label,
        lambda: ops.grouped_gemm(x_MK, w_EKN, counts_E, comm_sms=comm_sms),
        flops=flops, bytes=2.0 * (m * k + e * k * n + m * n), baseline=True,
    )  # fmt: skip
    wq_E, w_scale_E = ops.quantize_fp8(w_EKN, (TILE, TILE))
    grouped = bench.measure(
        "fp8_grouped_gemm", impl, shape.label,
        lambda: ops.fp8_grouped_gemm(xq, x_scale, wq_E, w_scale_E, counts_E, comm_sms=comm_sms),
        flops=flops, bytes=m * k + e * k * n + 2.0 * m * n + x_scales + e * w_scales,
    )  # fmt: skip
    bench.compare(grouped, bf16_grouped, "speedup_vs_bf16")


def _scale_tiles(size: int) -> int:
    """128-wide scale tiles along a dimension of ``size``."""
    return -(-size // TILE)


def check_targets(rows: list[Row]) -> list[dict]:
    """The issue's H100 targets, evaluated on the ops rows of this run (all three grouped GEMMs)."""
    wanted = {"vs_dense_rate": 0.6, "speedup_vs_grouped_mm": 1.0, "vs_copy_bw": 0.7}
    checks = []
    for r in rows:
        if not r.impl.startswith("ops[") or " " in r.impl:  # skip baselines and the comm_sms variant
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
    """The planner's costs file for ``shape`` from this run's ``ops[...]`` rows: one micro-batch of
    ``num_tokens`` tokens (one sequence) on one rank of an ep group of ``router_experts / num_experts``.
    Each planner op's seconds are its kernel's median times the op's work over the kernel's (FLOPs, or
    bytes for a kernel without FLOPs), so the file describes the planner's op at the file's shape."""
    if shape.router_experts % shape.num_experts:
        raise ValueError(f"{shape.label}: {shape.router_experts} router experts do not split into ep groups")
    ours = {r.op: r for r in rows if r.shape == shape.label and r.impl.startswith("ops[") and " " not in r.impl}
    missing = set(PLANNER_OPS.values()) - set(ours)
    if missing:
        raise ValueError(f"{shape.label}: no ops[...] rows for {sorted(missing)}: was the shape benchmarked?")
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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", choices=sorted(SHAPES), default="small")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                   help="default: bf16 on CUDA, fp32 elsewhere (CPU bf16 matmuls are not representative)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--comm-sms", type=int, default=DEFAULT_COMM_SMS,
                   help="extra grouped-GEMM row with this many SMs left to communication (Triton only)")  # fmt: skip
    p.add_argument("--no-fp8", dest="fp8", action="store_false",
                   help="leave out the FP8 GEMM rows (CUDA only; skipped with a note elsewhere)")  # fmt: skip
    p.add_argument("--out", default="bench/results")
    p.add_argument("--costs-out", default=None, metavar="FILE",
                   help="also write the planner's costs file (python -m moe.plan --costs FILE)")  # fmt: skip
    p.add_argument("--costs-shape", type=int, default=0, metavar="N",
                   help="which shape of the set the costs file describes (index, default the first)")  # fmt: skip
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    args = parse_args(argv)
    if args.costs_out and not 0 <= args.costs_shape < len(SHAPES[args.shapes]):
        raise SystemExit(f"--costs-shape {args.costs_shape}: the {args.shapes} set has {len(SHAPES[args.shapes])}")
    device = torch.device(args.device)
    default = "bf16" if device.type == "cuda" else "fp32"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype or default]
    bench = Bench("kernels", device, warmup=args.warmup, repeats=args.repeats)
    for shape in SHAPES[args.shapes]:
        bench_grouped_gemm(bench, shape, dtype, args.comm_sms)
        bench_memory_bound(bench, shape, dtype)
        if args.fp8:
            bench_fp8(bench, shape, args.comm_sms)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    targets = check_targets(bench.rows) if device.type == "cuda" else []
    if device.type != "cuda":
        bench.notes.append("no GPU: ops ran the torch reference; the H100 targets were not evaluated")
    print(bench.table())
    for c in targets:
        print(f"target {'met ' if c['met'] else 'MISS'}  {c['check']}: {c['value']:.2f} (>= {c['target']})")
    context = {"shapes": args.shapes, "dtype": str(dtype), "triton": _triton_version(), "targets": targets}
    path = bench.save(args.out, extra=context)
    print(f"saved {path}")
    if args.costs_out:
        save_costs(args.costs_out, costs_file(bench.rows, SHAPES[args.shapes][args.costs_shape], dtype, device))
        print(f"saved {args.costs_out}")
    return path


if __name__ == "__main__":
    main()

"""Compile every Triton kernel of the package for a GPU without a GPU, and report what the compiler made.

    python -m kernels.aot              # sm_90 (H100/H800), the DeepSeek-V3 bf16 launches
    python -m kernels.aot --arch 100

Triton ships its own ``ptxas`` and ``cuobjdump``, so the whole pipeline (TTIR -> TTGIR -> LLVM -> PTX ->
cubin) runs on a CPU-only machine. Each kernel is compiled with the argument specialisation the JIT would
give a representative launch (16-byte aligned pointers, integers that are multiples of 16 marked so, ones
folded into constants) and the tile configuration its launcher picks on CUDA. The report answers, before
any device time is spent, what the method asks of a GPU kernel: does it compile, does it spill (stack
bytes), how much shared memory, are the Hopper matrix instructions (``wgmma``) and asynchronous copies
there. Needs ``TRITON_INTERPRET`` unset (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

import torch

__all__ = ["CompileReport", "KernelSpec", "compile_spec", "kernel_specs"]

# DeepSeek-V3 on one rank: hidden 7168, expert intermediate 2048, 32 local experts, 16384 tokens, top-8
# from 256 routed experts in 8 groups (4 kept); 132 SMs (H100 SXM / H800).
_D, _F, _E, _T, _K, _SMS = 7168, 2048, 32, 16384, 8, 132
_M = _T * _K


@dataclass(frozen=True, kw_only=True, slots=True)
class KernelSpec:
    """One representative launch of one kernel."""

    name: str
    kernel: object
    """The ``@triton.jit`` function."""
    pointers: dict[str, str]
    """Pointer arguments and their element types ('bf16', 'fp32', 'i64', ...); None for absent ones."""
    ints: dict[str, int] = field(default_factory=dict)
    """Integer arguments and their values in the launch (they decide the JIT's specialisation)."""
    floats: tuple[str, ...] = ()
    constexprs: dict[str, object] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True, kw_only=True, slots=True)
class CompileReport:
    name: str
    registers: int
    stack_bytes: int
    """Per-thread stack frame: non-zero means registers spilled to local memory."""
    shared_bytes: int
    wgmma: int
    """Hopper warpgroup matrix instructions in the PTX."""
    async_copies: int
    """Asynchronous global->shared copies in the TTGIR (software pipelining happened)."""


def _source(spec: KernelSpec):
    from triton.compiler import ASTSource

    signature, constexprs, aligned = {}, dict(spec.constexprs), []
    for name in spec.kernel.arg_names:
        if name in spec.constexprs:
            signature[name] = "constexpr"
        elif name in spec.pointers:
            dtype = spec.pointers[name]
            if dtype is None:  # the JIT turns a None argument into a constant
                signature[name], constexprs[name] = "constexpr", None
            else:
                signature[name] = f"*{dtype}"
                aligned.append(name)  # torch allocations are 256-byte aligned
        elif name in spec.floats:
            signature[name] = "fp32"
        elif spec.ints.get(name) == 1:  # the JIT folds ints equal to 1 into the kernel
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if spec.ints[name] % 16 == 0:
                aligned.append(name)
    attrs = {(spec.kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    return ASTSource(spec.kernel, signature, constexprs, attrs)


def compile_spec(spec: KernelSpec, arch: int = 90) -> CompileReport:
    """Compile one launch for sm_<arch> and read its resource usage off the cubin."""
    import triton
    from triton.backends.compiler import GPUTarget

    compiled = triton.compile(
        _source(spec),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": spec.num_warps, "num_stages": spec.num_stages},
    )
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [cuobjdump, "--dump-resource-usage", cubin.name], capture_output=True, text=True, check=True
        ).stdout
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    return CompileReport(
        name=spec.name,
        registers=regs,
        stack_bytes=stack,
        shared_bytes=compiled.metadata.shared,
        wgmma=compiled.asm["ptx"].count("wgmma.mma_async"),
        async_copies=compiled.asm["ttgir"].count("async_copy_global_to_local"),
    )


def _gemm_specs() -> list[KernelSpec]:
    """The grouped GEMMs with every config the CUDA autotuner may pick, and the fp32 fallback."""
    from kernels import triton_grouped_gemm as gg

    def launch(name, kernel, cfg, dtype, ints, ieee=False):
        meta = cfg.to_triton(with_group="GROUP_M" in kernel.arg_names)
        tag = f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages}"
        pointers = dict.fromkeys(kernel.arg_names[:3], dtype) | {"counts_ptr": "i64"}
        return KernelSpec(
            name=f"{name} {tag}", kernel=kernel, pointers=pointers, ints={"E": _E, **ints},
            constexprs={**meta.kwargs, "BLOCK_E": _E, "IEEE": ieee},
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    fwd = {"N": _F, "K": _D, "stride_we": _D * _F, "stride_wk": _F, "stride_wn": 1}
    dgrad = {"N": _D, "K": _F, "stride_we": _D * _F, "stride_wk": 1, "stride_wn": _F}  # w^T as a view
    wgrad = {"N": _F, "K": _D}
    fwd_kernel, wgrad_kernel = gg._grouped_gemm_kernel, gg._grouped_wgrad_kernel
    return (
        [launch("grouped_gemm bf16", fwd_kernel, cfg, "bf16", fwd) for cfg in gg._CUDA_CONFIGS]
        + [launch("grouped_gemm_dgrad bf16", fwd_kernel, cfg, "bf16", dgrad) for cfg in gg._CUDA_CONFIGS]
        + [launch("grouped_gemm_wgrad bf16", wgrad_kernel, cfg, "bf16", wgrad) for cfg in gg._CUDA_WGRAD_CONFIGS]
        + [
            launch("grouped_gemm fp32", fwd_kernel, gg._CUDA_FP32_CONFIG, "fp32", fwd, ieee=True),
            launch("grouped_gemm_wgrad fp32", wgrad_kernel, gg._CUDA_FP32_CONFIG, "fp32", wgrad, ieee=True),
        ]
    )


def _memory_bound_specs() -> list[KernelSpec]:
    from kernels import triton_permute as tp
    from kernels import triton_router as tr
    from kernels import triton_swiglu as ts

    cuda = torch.device("cuda")  # only its type is read: nothing touches a device
    block_s, block_e = tp._sort_blocks(_E)
    sort = {"BLOCK_S": block_s, "BLOCK_E": block_e}
    block_t, block_d = tp._row_blocks(cuda, _D)
    rows = {"T": _T, "D": _D}
    scatter = {"TOP_K": _K, "BLOCK_T": block_t, "BLOCK_K": _K, "BLOCK_D": block_d}
    no_dscale = {"scale_ptr": None, "y_ptr": None, "dscale_ptr": None}
    router_t, router_e = tr._blocks(cuda, 256)
    block_m, block_f = ts._blocks(cuda, _F)
    swiglu = {"BLOCK_M": block_m, "BLOCK_F": block_f}
    i64 = "i64"
    return [
        KernelSpec(name="permute histogram", kernel=tp._block_histogram_kernel,
                   pointers={"idx_ptr": i64, "counts_ptr": "i32"}, ints={"S": _M, "E": _E}, constexprs=sort),
        KernelSpec(name="permute rank+scatter", kernel=tp._rank_scatter_kernel,
                   pointers={"idx_ptr": i64, "start_ptr": i64, "row_id_ptr": i64, "slot_row_ptr": i64},
                   ints={"S": _M, "E": _E, "M": _M}, constexprs=sort),
        KernelSpec(name="permute scatter rows", kernel=tp._scatter_rows_kernel,
                   pointers={"src_ptr": "bf16", "slot_row_ptr": i64, "dst_ptr": "bf16", **no_dscale}, ints=rows,
                   constexprs={**scatter, "SCALED": False, "WITH_DSCALE": False}),
        KernelSpec(name="unpermute_backward scatter", kernel=tp._scatter_rows_kernel,
                   pointers={"src_ptr": "bf16", "slot_row_ptr": i64, "dst_ptr": "bf16", "scale_ptr": "fp32",
                             "y_ptr": "bf16", "dscale_ptr": "fp32"}, ints=rows,
                   constexprs={**scatter, "SCALED": True, "WITH_DSCALE": True}),
        KernelSpec(name="combine_rows backward scatter", kernel=tp._scatter_rows_kernel,
                   pointers={"src_ptr": "bf16", "slot_row_ptr": i64, "dst_ptr": "bf16", "scale_ptr": "fp32",
                             "y_ptr": None, "dscale_ptr": None}, ints=rows,
                   constexprs={**scatter, "SCALED": True, "WITH_DSCALE": False}),
        KernelSpec(name="unpermute invert", kernel=tp._invert_kernel,
                   pointers={"row_id_ptr": i64, "slot_row_ptr": i64}, ints={"M": _M}, constexprs={"BLOCK": 1024}),
        KernelSpec(name="unpermute combine", kernel=tp._combine_kernel,
                   pointers={"y_ptr": "bf16", "slot_row_ptr": i64, "w_ptr": "fp32", "out_ptr": "bf16"}, ints=rows,
                   constexprs={"TOP_K": _K, "BLOCK_T": block_t, "BLOCK_D": block_d, "WEIGHTED": True}),
        KernelSpec(name="permute_backward combine", kernel=tp._combine_kernel,
                   pointers={"y_ptr": "bf16", "slot_row_ptr": i64, "w_ptr": None, "out_ptr": "bf16"}, ints=rows,
                   constexprs={"TOP_K": _K, "BLOCK_T": block_t, "BLOCK_D": block_d, "WEIGHTED": False}),
        KernelSpec(name="router_topk V3", kernel=tr._router_topk_kernel,
                   pointers={"logits_ptr": "bf16", "bias_ptr": "fp32", "weights_ptr": "fp32", "idx_ptr": i64,
                             "scores_ptr": "fp32"}, ints={"T": _T, "E": 256}, floats=("route_scale",),
                   constexprs={"TOP_K": _K, "N_GROUP": 8, "TOPK_GROUP": 4, "GROUP_SIZE": 32, "BLOCK_T": router_t,
                               "BLOCK_E": router_e, "BLOCK_K": _K, "BLOCK_G": 8, "PRECISE": True}),
        KernelSpec(name="swiglu forward", kernel=ts._swiglu_fwd_kernel,
                   pointers={"x_ptr": "bf16", "y_ptr": "bf16", "scale_ptr": None}, ints={"M": _M, "F": _F},
                   constexprs={**swiglu, "SCALED": False}),
        KernelSpec(name="swiglu forward, routing weights", kernel=ts._swiglu_fwd_kernel,
                   pointers={"x_ptr": "bf16", "y_ptr": "bf16", "scale_ptr": "fp32"}, ints={"M": _M, "F": _F},
                   constexprs={**swiglu, "SCALED": True}),
        KernelSpec(name="swiglu backward", kernel=ts._swiglu_bwd_kernel,
                   pointers={"dy_ptr": "bf16", "x_ptr": "bf16", "dx_ptr": "bf16"}, ints={"M": _M, "F": _F},
                   constexprs=swiglu),
        KernelSpec(name="swiglu backward, routing weights", kernel=ts._swiglu_scaled_bwd_kernel,
                   pointers={"dy_ptr": "bf16", "x_ptr": "bf16", "scale_ptr": "fp32", "dx_ptr": "bf16",
                             "dscale_ptr": "fp32"}, ints={"M": _M, "F": _F}, constexprs=swiglu),
    ]  # fmt: skip


def kernel_specs() -> list[KernelSpec]:
    """Every kernel of the package at a DeepSeek-V3 bf16 launch, with its launcher's CUDA configuration."""
    from triton import knobs

    if knobs.runtime.interpret:
        raise RuntimeError("kernels.aot compiles kernels: run it with TRITON_INTERPRET unset")
    return _gemm_specs() + _memory_bound_specs()


def main(argv: list[str] | None = None) -> list[CompileReport]:
    parser = argparse.ArgumentParser(prog="python -m kernels.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H800)")
    args = parser.parse_args(argv)
    reports = []
    print(f"{'kernel':<46} {'regs':>5} {'stack':>6} {'smem':>7} {'wgmma':>6} {'async':>6}")
    for spec in kernel_specs():
        r = compile_spec(spec, args.arch)
        reports.append(r)
        print(f"{r.name:<46} {r.registers:5d} {r.stack_bytes:6d} {r.shared_bytes:7d} {r.wgmma:6d} {r.async_copies:6d}")
    return reports


if __name__ == "__main__":
    main()

"""Compile every Triton kernel of the package for a GPU without a GPU, and report what the compiler made.

    python -m kernels.aot              # sm_90 (H100/H800), the DeepSeek-V3 launches (bf16 and FP8)
    python -m kernels.aot --arch 100
    python -m kernels.aot --list       # the launches, without compiling
    python -m kernels.aot --only fp8   # the launches whose name contains "fp8"

Triton ships its own ``ptxas`` and ``cuobjdump``, so the whole pipeline (TTIR -> TTGIR -> LLVM -> PTX ->
cubin) runs on a CPU-only machine. Each kernel is compiled with the argument specialisation the JIT would
give a representative launch (16-byte aligned pointers, integers that are multiples of 16 marked so, ones
folded into constants, neither for the kernel's ``do_not_specialize`` arguments) and the tile configuration
its launcher picks on CUDA. The report answers, before any device time is spent, what the method asks of a
GPU kernel: does it compile, does it spill (stack bytes), how much shared memory, are the Hopper matrix
instructions (``wgmma``) and asynchronous copies there. Needs ``TRITON_INTERPRET`` unset (interpreted kernels
cannot be compiled).

Which launches: every Triton module declares its own next to its launchers (a function marked
:func:`kernels.registry.register_aot`, called with :data:`V3_RANK`); this module keeps no list of kernels.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field
from typing import Any

import torch

from kernels import registry
from kernels.fp8 import FP8Recipe
from kernels.warmup import KernelShapes

__all__ = ["V3_RANK", "CompileReport", "KernelSpec", "compile_spec", "kernel_specs", "launch_spec", "pointer_type"]

V3_RANK = KernelShapes(
    tokens=16384, hidden=7168, expert_intermediate=2048, num_experts=256, num_local_experts=32, top_k=8,
    n_group=8, topk_group=4, dtype=torch.bfloat16, fp8=FP8Recipe(), fp8_linears=((7168, 1536),),
)  # fmt: skip
"""DeepSeek-V3 on one rank: hidden 7168, expert intermediate 2048, 32 local experts, 16384 tokens, top-8 from
256 routed experts in 8 groups (4 kept), bf16, the FP8 recipe; MLA's query down-projection (7168 -> 1536)
stands for the FP8 linears."""

_POINTER_TYPES = {
    torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4nv",
    torch.int64: "i64", torch.int32: "i32",
}  # fmt: skip


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
    unspecialized = {p.name for p in getattr(spec.kernel, "params", ()) if getattr(p, "do_not_specialize", False)}
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
        elif name in unspecialized:  # typed by value only
            signature[name] = "i64" if spec.ints[name] >= 2**31 else "i32"
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
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    if knobs.runtime.interpret:
        raise RuntimeError("kernels.aot compiles kernels: run it with TRITON_INTERPRET unset")

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


def pointer_type(dtype: torch.dtype) -> str:
    """Triton's pointer element type for a torch dtype ("bf16", "fp8e4nv", "i64", ...)."""
    return _POINTER_TYPES[dtype]


def launch_spec(name: str, kernel: Any, args: dict[str, Any], options: dict[str, Any]) -> KernelSpec:
    """A :class:`KernelSpec` from a launch ``kernel[grid](**args, **options)`` (tensors may be meta tensors):
    tensors become pointers of their dtype, ints and floats stay, options are constexprs and launch options."""
    options = dict(options)
    warps, stages = options.pop("num_warps", 4), options.pop("num_stages", 3)
    pointers = {k: None if v is None else pointer_type(v.dtype) for k, v in args.items()
                if v is None or isinstance(v, torch.Tensor)}  # fmt: skip
    ints = {k: v for k, v in args.items() if isinstance(v, int) and not isinstance(v, bool)}
    floats = tuple(k for k, v in args.items() if isinstance(v, float))
    return KernelSpec(name=name, kernel=kernel, pointers=pointers, ints=ints, floats=floats, constexprs=options,
                      num_warps=warps, num_stages=stages)  # fmt: skip


def kernel_specs(shapes: KernelShapes = V3_RANK) -> list[KernelSpec]:
    """Every kernel of the package at ``shapes``, with its launchers' CUDA configurations: the launches each
    Triton module declares (:func:`kernels.registry.register_aot`), modules in name order. Listing works under
    ``TRITON_INTERPRET`` too; compiling (:func:`compile_spec`) does not."""
    return [spec for build in registry.aot_spec_builders() for spec in build(shapes)]


def main(argv: list[str] | None = None) -> list[CompileReport]:
    parser = argparse.ArgumentParser(
        prog="python -m kernels.aot",
        description=__doc__.split("\n\n")[0],
        epilog=_modules_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H800)")
    parser.add_argument("--list", action="store_true", help="print the launches' names and exit (no compiling)")
    parser.add_argument("--only", default="", metavar="TEXT", help="compile the launches whose name contains TEXT")
    args = parser.parse_args(argv)
    specs = [s for s in kernel_specs() if args.only in s.name]
    if args.list:
        print("\n".join(s.name for s in specs))
        return []
    reports = []
    print(f"{'kernel':<46} {'regs':>5} {'stack':>6} {'smem':>7} {'wgmma':>6} {'async':>6}")
    for spec in specs:
        r = compile_spec(spec, args.arch)
        reports.append(r)
        print(f"{r.name:<46} {r.registers:5d} {r.stack_bytes:6d} {r.shared_bytes:7d} {r.wgmma:6d} {r.async_copies:6d}")
    return reports


def _modules_epilog() -> str:
    """The Triton modules and their ops, for --help (read off the registry; a module without Triton installed
    cannot be listed)."""
    try:
        builders = registry.aot_spec_builders()
    except ImportError as exc:
        return f"kernels: unavailable ({exc})"
    lines = ["kernels (each module declares its launches):"]
    for build in builders:
        module = build.__module__
        ops = [n for n in registry.op_names("triton") if registry.implementation(n, "triton").__module__ == module]
        lines.append(f"  {module.removeprefix('kernels.')}: {', '.join(ops)}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

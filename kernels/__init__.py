"""HOW FAST: Triton kernels for the MoE layer, each with a plain-torch reference and one backend switch.

Layers: :mod:`kernels.registry` (the op table), :mod:`kernels.reference` (the oracle, and the backend off
CUDA), ``kernels.triton_*`` (Triton kernels and their launchers, imported lazily), :mod:`kernels.ops` (the
switch, raw ops), :mod:`kernels.functional` (autograd Functions, among them the expert MLP
:func:`~kernels.functional.grouped_experts`), :mod:`kernels.aot` (compiles every kernel for sm_90
without a GPU and reports registers, spills and shared memory), and :mod:`kernels.warmup` (compiles and
autotunes every kernel at a model's shapes once per rank, before the first training step). A new kernel is
a ``triton_*.py`` module plus its reference, each function marked with :func:`kernels.registry.register`.
Importing this package has no side effects and does not import Triton.
"""

from kernels import functional, ops, reference, registry
from kernels.functional import grouped_experts, grouped_mm, permute_tokens, swiglu, unpermute_tokens
from kernels.ops import ENV_VAR, backend_for, router_topk

__all__ = [
    "ENV_VAR",
    "backend_for",
    "functional",
    "grouped_experts",
    "grouped_mm",
    "ops",
    "permute_tokens",
    "reference",
    "registry",
    "router_topk",
    "swiglu",
    "unpermute_tokens",
]

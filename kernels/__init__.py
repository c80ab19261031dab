"""HOW FAST: Triton kernels for the MoE layer, each with a plain-torch reference and one backend switch.

Layers: :mod:`kernels.reference` (the oracle, and the backend off CUDA), ``kernels.triton_*`` (Triton
kernels and their launchers, imported lazily), :mod:`kernels.ops` (the switch, raw ops),
:mod:`kernels.functional` (autograd Functions), :mod:`kernels.nn` (modules), and :mod:`kernels.aot`
(compiles every kernel for sm_90 without a GPU and reports registers, spills and shared memory).
Importing this package has no side effects and does not import Triton.
"""

from kernels import functional, ops, reference
from kernels.functional import grouped_mm, permute_tokens, swiglu, unpermute_tokens
from kernels.nn import GroupedExperts
from kernels.ops import ENV_VAR, backend_for, router_topk

__all__ = [
    "ENV_VAR",
    "GroupedExperts",
    "backend_for",
    "functional",
    "grouped_mm",
    "ops",
    "permute_tokens",
    "reference",
    "router_topk",
    "swiglu",
    "unpermute_tokens",
]

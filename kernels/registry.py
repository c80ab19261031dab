"""The op table: which function implements each kernel op on each backend.

An op is a pair of functions with one name and one signature: the plain-torch reference in
:mod:`kernels.reference` (whose docstring gives the shapes and dtypes, and which :mod:`kernels.ops` copies
into its dispatcher) and the Triton launcher in one ``kernels/triton_*.py`` module. Each marks itself with
``@register("torch")`` or ``@register("triton")``; the op's name is the function's name. A new kernel is
therefore its Triton file plus its reference, and nothing else.

Triton modules register when they are imported, which happens on the first Triton lookup (all of them at
once: the table only learns which module holds an op's launcher by running it), never on ``import kernels``.

Beside its launcher, a Triton module declares what ahead-of-time work needs to know of it, so that neither
:mod:`kernels.warmup` nor :mod:`kernels.aot` keeps a list of kernels:

* ``@register("triton", specialization=Specialization(key=..., meta=...))``: which compiled (and autotuned)
  kernels a call runs, and its result's shapes (the warm-up's classes, replayed on meta tensors);
* ``@register_aot`` on a function ``(shapes) -> [kernels.aot.KernelSpec]``: representative launches of the
  module's kernels at a model's shapes (:class:`kernels.warmup.KernelShapes`), compiled by :mod:`kernels.aot`.

:func:`intercept` lets the warm-up see every call the backend switch makes (recording classes, or replacing
the kernels with their meta results) without replacing anything in :mod:`kernels.ops`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import pkgutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar

__all__ = [
    "BACKENDS",
    "Backend",
    "Specialization",
    "aot_spec_builders",
    "dtype_name",
    "implementation",
    "int_class",
    "intercept",
    "launch_key",
    "op_names",
    "register",
    "register_aot",
    "specialization",
    "takes_strides",
]

Backend = Literal["torch", "triton"]
BACKENDS: tuple[Backend, ...] = ("torch", "triton")
_TRITON_PREFIX = "triton_"

_Fn = TypeVar("_Fn", bound=Callable)

# op name -> backend -> (module, attribute). Implementations are looked up on their module at call time,
# so replacing the module attribute (a test's spy, a debugging wrapper) replaces what the switch calls.
_TABLE: dict[str, dict[Backend, tuple[str, str]]] = {}


@dataclass(frozen=True, kw_only=True, slots=True)
class Specialization:
    """How the calls of one Triton op map onto compiled kernels: what the warm-up needs of the op."""

    key: Callable[..., tuple]
    """``key(*args, **kwargs)`` of a call (the op's own arguments, meta tensors included) -> a tuple that is
    equal for two calls exactly when they run the same compiled and autotuned kernels: the sizes and strides
    the autotuner keys on, the tensors' dtypes, the constexprs, and :func:`int_class` of every integer
    argument the JIT specialises on."""
    meta: Callable[..., Any]
    """``meta(rows, *args, **kwargs)`` -> the call's result as ``device="meta"`` tensors (shapes and dtypes).
    rows: the routed rows of the warm-up's current expert run, the one size a meta tensor cannot compute
    (a permute's output without a static ``num_rows``); other ops ignore it."""
    kernel: str | None = None
    """The op whose kernels this one runs, when not its own (an input gradient that calls the forward on a
    transposed view): calls of both then share classes."""


# op name -> its Specialization (Triton ops only); module, attribute of each @register_aot function.
_SPECIALIZATIONS: dict[str, Specialization] = {}
_AOT: set[tuple[str, str]] = set()
# Triton ops whose launchers take any strides.
_STRIDED: set[str] = set()
# Wrappers installed by intercept(), innermost last. Process-wide on purpose: autograd runs the backward
# functions of CUDA tensors on its own device threads, which a context variable would not reach.
_INTERCEPTORS: list[Callable[[str, Callable], Callable]] = []


def register(
    backend: Backend, *, specialization: Specialization | None = None, strided: bool = False
) -> Callable[[_Fn], _Fn]:
    """Decorator: ``fn`` is ``backend``'s implementation of the op named ``fn.__name__``.

    specialization (Triton implementations only): how its calls map onto compiled kernels, for the warm-up.
    strided (Triton implementations only): the launcher takes its tensors with any strides, so the backend
    switch passes them as they are (a transposed weight view stays a view, in the layout the kernel reads best)
    instead of making them contiguous.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if (specialization is not None or strided) and backend != "triton":
        raise ValueError(f"a specialization or strides describe a Triton launcher, not a {backend} implementation")

    def mark(fn: _Fn) -> _Fn:
        where = (fn.__module__, fn.__name__)
        entries = _TABLE.setdefault(fn.__name__, {})
        if entries.get(backend, where) != where:
            module = entries[backend][0]
            raise ValueError(f"op {fn.__name__!r} has two {backend} implementations: in {module} and {where[0]}")
        entries[backend] = where
        if specialization is not None:
            _SPECIALIZATIONS[fn.__name__] = specialization
        if strided:
            _STRIDED.add(fn.__name__)
        return fn

    return mark


def takes_strides(name: str) -> bool:
    """Whether op ``name``'s Triton launcher takes its tensors with any strides (``register(strided=True)``)."""
    _import_triton_modules()
    return name in _STRIDED


def register_aot(fn: _Fn) -> _Fn:
    """Decorator for a Triton module's ``fn(shapes: kernels.warmup.KernelShapes) -> list[kernels.aot.KernelSpec]``:
    one launch per kernel and configuration the module's launchers pick on CUDA at those shapes."""
    _AOT.add((fn.__module__, fn.__name__))
    return fn


def aot_spec_builders() -> list[Callable]:
    """Every :func:`register_aot` function, by module name (importing the Triton modules)."""
    _import_triton_modules()
    return [getattr(sys.modules[module], attribute) for module, attribute in sorted(_AOT)]


def specialization(name: str) -> Specialization:
    """The :class:`Specialization` of Triton op ``name`` (importing the Triton modules)."""
    _import_triton_modules()
    spec = _SPECIALIZATIONS.get(name)
    if spec is None:
        known = ", ".join(sorted(_SPECIALIZATIONS))
        raise ValueError(f"op {name!r} declares no specialization with its Triton launcher (known: {known})")
    return spec


def int_class(value: int, *, specialized: bool = True) -> str:
    """Triton's specialisation class of an integer kernel argument: "1", "16" (divisible by 16, zero
    included), "n" (anything else), with "64" appended from 2**31 on (the argument becomes i64).

    specialized=False: an argument in the kernel's ``do_not_specialize``, whose class is its type only
    ("i32" or "i64").
    """
    if not specialized:
        return "i64" if value >= 2**31 else "i32"
    cls = "1" if value == 1 else "16" if value % 16 == 0 else "n"
    return cls + "64" if value >= 2**31 else cls


def dtype_name(tensor: Any) -> str:
    """A tensor's dtype as a short name ("bfloat16", "int64"), for class keys."""
    return str(tensor.dtype).removeprefix("torch.")


def launch_key(kernel: Any, args: dict[str, Any], options: dict[str, Any], *, unspecialized=()) -> tuple:
    """The compile class of one launch ``kernel[grid](**args, **options)``, as a :class:`Specialization` key:
    the kernel's name, each tensor argument's dtype (None for an absent one), :func:`int_class` of each integer
    argument (``unspecialized``: the names in the kernel's ``do_not_specialize``), the options sorted."""
    parts: list[Any] = [kernel.fn.__name__]
    for name, value in args.items():
        if value is None or isinstance(value, bool):
            parts.append(value)
        elif isinstance(value, float):
            parts.append("fp32")  # the JIT does not specialise on a float's value
        elif isinstance(value, int):
            parts.append(int_class(value, specialized=name not in unspecialized))
        else:
            parts.append(dtype_name(value))
    return (*parts, *sorted(options.items()))


@contextlib.contextmanager
def intercept(wrap: Callable[[str, Callable], Callable]) -> Iterator[None]:
    """While open, :func:`implementation` returns ``wrap(name, impl)`` instead of ``impl``: every call through
    :mod:`kernels.ops` (and :mod:`kernels.functional`, which calls it) goes through ``wrap``'s function. The
    warm-up records classes so, or replaces the kernels by their meta results. Nests (the innermost wraps
    last); process-wide while open."""
    _INTERCEPTORS.append(wrap)
    try:
        yield
    finally:
        _INTERCEPTORS.remove(wrap)


def op_names(backend: Backend = "torch") -> list[str]:
    """The ops registered so far for ``backend``, sorted (for "torch": every op :mod:`kernels.reference` declares)."""
    if backend == "triton":
        _import_triton_modules()
    return sorted(name for name, entries in _TABLE.items() if backend in entries)


def implementation(name: str, backend: Backend) -> Callable:
    """The function implementing op ``name`` on ``backend`` (importing the Triton modules if needed)."""
    if backend == "triton":
        _import_triton_modules()
    where = _TABLE.get(name, {}).get(backend)
    if where is None:
        raise NotImplementedError(f"op {name!r} has no {backend} implementation (registered: {sorted(_TABLE)})")
    module, attribute = where
    fn = getattr(sys.modules[module], attribute)
    for wrap in _INTERCEPTORS:
        fn = wrap(name, fn)
    return fn


@functools.cache
def _import_triton_modules() -> None:
    """Import every ``kernels/triton_*.py`` once, so that their ``@register("triton")`` entries exist."""
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name.startswith(_TRITON_PREFIX):
            importlib.import_module(f"{__package__}.{info.name}")

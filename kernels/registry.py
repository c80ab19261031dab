"""The op table: which function implements each kernel op on each backend.

An op is a pair of functions with one name and one signature: the plain-torch reference in
:mod:`kernels.reference` (whose docstring gives the shapes and dtypes, and which :mod:`kernels.ops` copies
into its dispatcher) and the Triton launcher in one ``kernels/triton_*.py`` module. Each marks itself with
``@register("torch")`` or ``@register("triton")``; the op's name is the function's name. A new kernel is
therefore its Triton file plus its reference, and nothing else.

Triton modules register when they are imported, which happens on the first Triton lookup (all of them at
once: the table only learns which module holds an op's launcher by running it), never on ``import kernels``.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypeVar

__all__ = ["BACKENDS", "Backend", "implementation", "op_names", "register"]

Backend = Literal["torch", "triton"]
BACKENDS: tuple[Backend, ...] = ("torch", "triton")
_TRITON_PREFIX = "triton_"

_Fn = TypeVar("_Fn", bound=Callable)

# op name -> backend -> (module, attribute). Implementations are looked up on their module at call time,
# so replacing the module attribute (a test's spy, a debugging wrapper) replaces what the switch calls.
_TABLE: dict[str, dict[Backend, tuple[str, str]]] = {}


def register(backend: Backend) -> Callable[[_Fn], _Fn]:
    """Decorator: ``fn`` is ``backend``'s implementation of the op named ``fn.__name__``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: expected one of {', '.join(BACKENDS)}")

    def mark(fn: _Fn) -> _Fn:
        where = (fn.__module__, fn.__name__)
        entries = _TABLE.setdefault(fn.__name__, {})
        if entries.get(backend, where) != where:
            module = entries[backend][0]
            raise ValueError(f"op {fn.__name__!r} has two {backend} implementations: in {module} and {where[0]}")
        entries[backend] = where
        return fn

    return mark


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
    return getattr(sys.modules[module], attribute)


@functools.cache
def _import_triton_modules() -> None:
    """Import every ``kernels/triton_*.py`` once, so that their ``@register("triton")`` entries exist."""
    for info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if info.name.startswith(_TRITON_PREFIX):
            importlib.import_module(f"{__package__}.{info.name}")

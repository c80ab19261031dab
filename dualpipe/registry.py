"""One small registry type for every kind of named, pluggable thing (schedules here, token dispatchers in
:mod:`moe.dispatch`): specs with a ``name``, registered once, read everywhere through a live mapping."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol, TypeVar

__all__ = ["Registry"]


class _Named(Protocol):
    @property
    def name(self) -> str: ...


_Spec = TypeVar("_Spec", bound=_Named)


class Registry(Mapping[str, _Spec]):
    """Specs of one ``kind`` by name, in registration order.

    A read-only mapping for its readers (``name in SCHEDULES``, iteration for ``--help`` choices); it prints
    as the tuple of names, so messages read ``choose one of ('dualpipe', ...)``. A name is registered once:
    a clash is a bug, not an override.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._specs: dict[str, _Spec] = {}

    def register(self, spec: _Spec) -> _Spec:
        if spec.name in self._specs:
            raise ValueError(f"{self.kind} {spec.name!r} is already registered")
        self._specs[spec.name] = spec
        return spec

    def unregister(self, name: str) -> _Spec:
        """Remove ``name`` (tests that register their own) and return its spec."""
        self.lookup(name)
        return self._specs.pop(name)

    def lookup(self, name: str) -> _Spec:
        """The spec of ``name``; an unknown name is a ``ValueError`` listing the registered ones."""
        spec = self._specs.get(name)
        if spec is None:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {self}")
        return spec

    def __getitem__(self, name: str) -> _Spec:
        return self._specs[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __str__(self) -> str:
        return str(tuple(self._specs))

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self._specs)})"

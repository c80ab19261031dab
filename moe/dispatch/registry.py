"""The token-dispatcher registry: every backend file registers one :class:`DispatcherSpec` when imported.

Adding a backend is one new file in this package that ends with ``register_dispatcher(DispatcherSpec(...))``
plus one import line in ``moe/dispatch/__init__.py``. :data:`DISPATCHERS` is a live, read-only view of the
registered backends, so ``ParallelConfig`` and ``examples/train.py --dispatcher`` accept every one of them
without a list of their own.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from dualpipe.registry import Registry
from moe.dispatch.base import DEFAULT_COMM_SMS, TokenDispatcher

__all__ = [
    "DISPATCHERS",
    "DispatchOptions",
    "DispatcherFactory",
    "DispatcherSpec",
    "Launch",
    "make_dispatcher",
    "register_dispatcher",
    "unregister_dispatcher",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class DispatchOptions:
    """How to build a dispatcher beyond its kind, expert count and group: what :func:`make_dispatcher` checks and
    every factory takes (a backend reads the fields it uses). Built once by the caller, from its configuration."""

    hidden_size: int = 0
    """Width of the rows sent (DeepEP sizes its buffers from it; 0: not known, its rules unchecked)."""
    dtype: torch.dtype = torch.bfloat16
    """Dtype of the rows sent."""
    comm_sms: int = DEFAULT_COMM_SMS
    """SM budget of the communication kernels (each backend states its own limits on it)."""
    sync_free: bool = False
    """The backend's sync-free mode (:attr:`DispatcherSpec.sync_free` says which have one): worst-case receive
    buffers, no host sync in a layer."""
    deterministic: bool = False
    """Received rows in source order (rank, then token), so runs repeat bit for bit, from a backend whose order
    otherwise follows arrival (:attr:`DispatcherSpec.deterministic`); the others give that order always."""
    fp8: bool = False
    """Send the dispatch direction (dispatch, and the gradient of combine) as FP8 rows with 1x128 scales,
    dequantized on arrival (:mod:`moe.dispatch.fp8`); ``local`` applies the same round trip, so one process
    computes what the expert-parallel run does."""
    local_world_size: int | None = None
    """Ranks per node (None: torchrun's ``LOCAL_WORLD_SIZE``, else every rank on one node); the factories get it
    resolved where there is a group."""
    counts_group: dist.ProcessGroup | None = None
    """A duplicate of the expert group for the row-count exchange of a backend that has one
    (:attr:`DispatcherSpec.exchanges_counts`; the others get None)."""

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"DispatchOptions.dtype must be a torch.dtype, got {self.dtype!r}")
        if self.hidden_size < 0:
            raise ValueError(f"DispatchOptions.hidden_size must be >= 0, got {self.hidden_size}")
        if self.local_world_size is not None and self.local_world_size < 1:
            raise ValueError(f"DispatchOptions.local_world_size must be >= 1, got {self.local_world_size}")


class DispatcherFactory(Protocol):
    """Builds a dispatcher over the expert-parallel ``group``; a backend ignores the options it does not use."""

    def __call__(
        self, num_experts: int, group: dist.ProcessGroup | None, options: DispatchOptions
    ) -> TokenDispatcher: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class Launch:
    """What a dispatcher would be built for; None: not known (that rule is not checked)."""

    dtype: torch.dtype | None = None
    """Dtype of the rows sent."""
    hidden_size: int | None = None
    """Width of the rows sent."""
    comm_sms: int | None = None
    """SM budget of the communication kernels."""
    ep_ranks: tuple[int, ...] | None = None
    """Global ranks of the expert-parallel group, in group-rank order."""
    ep_size: int | None = None
    """The expert-parallel group's size, where its ranks are not known yet (a configuration's check); with
    ``ep_ranks`` their count."""

    @property
    def group_size(self) -> int | None:
        """Ranks of the expert-parallel group (None: not known)."""
        return len(self.ep_ranks) if self.ep_ranks is not None else self.ep_size

    local_world_size: int | None = None
    """Ranks per node (torchrun's ``LOCAL_WORLD_SIZE``); node ``n`` holds global ranks ``n*L .. n*L+L-1``."""
    fp8: bool | None = None
    """FP8 dispatch: the dispatch-direction rows travel as FP8 values with 1x128 scales (:mod:`moe.dispatch.fp8`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DispatcherSpec:
    """One backend: its name, how to build it, and what it needs.

    :func:`make_dispatcher` enforces ``needs_group``, ``dtypes`` and ``rules`` before the backend builds
    anything. CUDA and ``package`` are recorded, not enforced there, because the tests run such backends over
    CPU emulations; a caller that wants those refused early too (a launcher) asks :meth:`check`.
    """

    name: str
    """The ``ParallelConfig.dispatcher`` / ``--dispatcher`` value."""
    factory: DispatcherFactory
    needs_group: bool = False
    """``make_dispatcher`` refuses ``group=None`` (otherwise None means the default group, or no group)."""
    needs_cuda: bool = False
    """The real kernels run on CUDA devices only."""
    dtypes: tuple[torch.dtype, ...] | None = None
    """Row dtypes the backend takes; None: any."""
    package: str | None = None
    """Module the backend imports lazily when it is built; None: nothing beyond torch."""
    install_hint: str = ""
    """How to get ``package`` (the backend raises it as an ImportError when the import fails)."""
    rules: Callable[[Launch], list[str]] | None = None
    """The backend's own limits on a launch (SM count, row width, topology): what breaks them, in words."""
    sync_free: bool = False
    """The backend has a sync-free mode (:attr:`DispatchOptions.sync_free`): receive buffers of a worst-case
    size, so a layer issues no host sync at all."""
    deterministic: bool = False
    """The backend returns received rows in arrival order unless asked for source order (rank, then token)
    with :attr:`DispatchOptions.deterministic`; the other backends always return them in source order (their
    factories get ``deterministic=False``)."""
    fp8: bool = False
    """The backend can send the dispatch direction in FP8 (:attr:`DispatchOptions.fp8`): :mod:`moe.dispatch.fp8`."""
    exchanges_counts: bool = False
    """Outside its sync-free mode the backend exchanges row counts in a collective of their own before each
    dispatch, and its factory takes :attr:`DispatchOptions.counts_group`, a duplicate of the expert group for them
    (its own communicator and stream, so the counts do not queue behind the other micro-batch's all-to-all)."""

    @property
    def requirements(self) -> tuple[str, ...]:
        """What the backend needs, in words (empty: nothing beyond torch)."""
        needs = []
        if self.needs_group:
            needs.append("an expert-parallel process group")
        if self.needs_cuda:
            needs.append("CUDA")
        if self.dtypes is not None:
            needs.append(_rows_in(self.dtypes))
        if self.package is not None:
            needs.append(f"the module {self.package!r}")
        return tuple(needs)

    def check(self, *, device: torch.device | str | None = None, launch: Launch | None = None) -> list[str]:
        """The needs a dispatcher on ``device`` for ``launch`` would miss (None: not checked).

        The group is not checked here: :func:`make_dispatcher` refuses a missing one itself.
        """
        missing = []
        if self.needs_cuda and device is not None and torch.device(device).type != "cuda":
            missing.append(f"CUDA (got {device})")
        if launch is not None:
            missing.extend(self.violations(launch))
        if self.package is not None and not _importable(self.package):
            missing.append(self.install_hint or f"the module {self.package!r}")
        return missing

    def violations(self, launch: Launch) -> list[str]:
        """What in ``launch`` the backend cannot run: the row dtype, then its own ``rules``."""
        found = []
        if self.dtypes is not None and launch.dtype is not None and launch.dtype not in self.dtypes:
            found.append(f"{_rows_in(self.dtypes)} (got {launch.dtype})")
        if launch.fp8 and not self.fp8:
            found.append("rows in the model dtype (it has no FP8 dispatch; got fp8 on)")
        if self.rules is not None:
            found.extend(self.rules(launch))
        return found


def _rows_in(dtypes: tuple[torch.dtype, ...]) -> str:
    return f"rows in {' or '.join(map(str, dtypes))}"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a missing parent package, or a module without a spec
        return False


DISPATCHERS: Registry[DispatcherSpec] = Registry("dispatcher")
"""Registered backends by name; ``name in DISPATCHERS`` tells whether ``make_dispatcher(name, ...)`` knows it."""


def register_dispatcher(spec: DispatcherSpec) -> DispatcherSpec:
    """Make ``spec.name`` selectable; a name is registered once (a clash is a bug, not an override)."""
    return DISPATCHERS.register(spec)


def unregister_dispatcher(name: str) -> DispatcherSpec:
    """Remove a backend registered with :func:`register_dispatcher` and return its spec."""
    return DISPATCHERS.unregister(name)


def make_dispatcher(
    kind: str, num_experts: int, group: dist.ProcessGroup | None = None, options: DispatchOptions | None = None
) -> TokenDispatcher:
    """Build the registered dispatcher ``kind`` over the expert-parallel ``group`` (``local`` ignores it), as
    ``options`` say (None: the defaults).

    A mode the backend lacks, a missing group or a launch the backend cannot run (its dtype, FP8, its ``rules``)
    raises ValueError, in one line, before the backend builds anything.
    """
    options = options or DispatchOptions()
    spec = DISPATCHERS.lookup(kind)
    if options.sync_free and not spec.sync_free:
        have = sorted(name for name in DISPATCHERS if DISPATCHERS.lookup(name).sync_free)
        raise ValueError(f"the {kind!r} dispatcher has no sync-free mode (dispatchers with one: {', '.join(have)})")
    if spec.needs_group and group is None:
        raise ValueError(f"the {kind!r} dispatcher needs an expert-parallel process group")
    if group is not None:
        ep_ranks = tuple(dist.get_process_group_ranks(group))
        local_world_size = options.local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    else:
        ep_ranks = local_world_size = None
    launch = Launch(
        dtype=options.dtype,
        hidden_size=options.hidden_size,
        comm_sms=options.comm_sms,
        ep_ranks=ep_ranks,
        local_world_size=local_world_size,
        fp8=options.fp8,
    )
    if problems := spec.violations(launch):
        raise ValueError(f"the {kind!r} dispatcher cannot run this launch: {'; '.join(problems)}")
    options = dataclasses.replace(
        options,
        local_world_size=local_world_size,
        deterministic=options.deterministic and spec.deterministic,
        counts_group=options.counts_group if spec.exchanges_counts else None,
    )
    return spec.factory(num_experts, group, options)

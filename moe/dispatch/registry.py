"""The token-dispatcher registry: every backend file registers one :class:`DispatcherSpec` when imported.

Adding a backend is one new file in this package that ends with ``register_dispatcher(DispatcherSpec(...))``
plus one import line in ``moe/dispatch/__init__.py``. :data:`DISPATCHERS` is a live, read-only view of the
registered backends, so ``ParallelConfig`` and ``examples/train.py --dispatcher`` accept every one of them
without a list of their own.
"""

from __future__ import annotations

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
    "DispatcherFactory",
    "DispatcherSpec",
    "Launch",
    "make_dispatcher",
    "register_dispatcher",
    "unregister_dispatcher",
]


class DispatcherFactory(Protocol):
    """Builds a dispatcher over the expert-parallel ``group``; a backend ignores the arguments it does not use."""

    def __call__(
        self,
        num_experts: int,
        group: dist.ProcessGroup | None,
        *,
        hidden_size: int,
        dtype: torch.dtype,
        comm_sms: int,
        sync_free: bool = False,
        deterministic: bool = False,
        fp8: bool = False,
        counts_group: dist.ProcessGroup | None = None,
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
    """The backend has a sync-free mode (``make_dispatcher(..., sync_free=True)``): receive buffers of a
    worst-case size, so a layer issues no host sync at all; the factory takes ``sync_free``."""
    deterministic: bool = False
    """The backend returns received rows in arrival order unless asked for source order (rank, then token)
    with ``make_dispatcher(..., deterministic=True)``, which its factory takes; the other backends always
    return them in source order."""
    fp8: bool = False
    """The backend can send the dispatch direction in FP8 (``make_dispatcher(..., fp8=True)``, which its factory
    takes): :mod:`moe.dispatch.fp8`."""
    exchanges_counts: bool = False
    """Outside its sync-free mode the backend exchanges row counts in a collective of their own before each
    dispatch, and its factory takes ``counts_group``, a duplicate of the expert group for them (its own
    communicator and stream, so the counts do not queue behind the other micro-batch's all-to-all)."""

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
    kind: str,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    *,
    hidden_size: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    comm_sms: int = DEFAULT_COMM_SMS,
    local_world_size: int | None = None,
    sync_free: bool = False,
    deterministic: bool = False,
    fp8: bool = False,
    counts_group: dist.ProcessGroup | None = None,
) -> TokenDispatcher:
    """Build the registered dispatcher ``kind`` over the expert-parallel ``group`` (``local`` ignores it).

    ``hidden_size`` and ``dtype`` describe the rows sent (DeepEP sizes its buffers from them); ``comm_sms`` is
    the SM budget of the communication kernels; ``local_world_size`` the ranks per node (None: torchrun's
    ``LOCAL_WORLD_SIZE``, else every rank on one node). ``sync_free`` asks for the backend's sync-free mode
    (worst-case receive buffers, no host sync in a layer; :attr:`DispatcherSpec.sync_free` says which have
    one). ``deterministic`` asks for received rows in source order (rank, then token), so runs repeat bit for
    bit, from a backend whose order otherwise follows arrival (:attr:`DispatcherSpec.deterministic`); the
    others give that order always. ``fp8`` sends the dispatch direction (dispatch, and the gradient of combine)
    as FP8 rows with 1x128 scales, dequantized on arrival (:mod:`moe.dispatch.fp8`); ``local`` applies the same
    round trip, so one process computes what the expert-parallel run does. ``counts_group``: a duplicate of
    ``group`` for the row-count exchange of a backend that has one (:attr:`DispatcherSpec.exchanges_counts`;
    the others ignore it). A launch the backend cannot run raises ValueError before the backend builds anything.
    """
    spec = DISPATCHERS.lookup(kind)
    if sync_free and not spec.sync_free:
        have = sorted(name for name in DISPATCHERS if DISPATCHERS.lookup(name).sync_free)
        raise ValueError(f"the {kind!r} dispatcher has no sync-free mode (dispatchers with one: {', '.join(have)})")
    if spec.needs_group and group is None:
        raise ValueError(f"the {kind!r} dispatcher needs an expert-parallel process group")
    if group is not None:
        ep_ranks = tuple(dist.get_process_group_ranks(group))
        local_world_size = local_world_size or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    else:
        ep_ranks = local_world_size = None
    launch = Launch(
        dtype=dtype,
        hidden_size=hidden_size,
        comm_sms=comm_sms,
        ep_ranks=ep_ranks,
        local_world_size=local_world_size,
        fp8=fp8,
    )
    if problems := spec.violations(launch):
        raise ValueError(f"the {kind!r} dispatcher cannot run this launch: {'; '.join(problems)}")
    modes = {"sync_free": True} if sync_free else {}  # asked only of backends that take them
    if deterministic and spec.deterministic:
        modes["deterministic"] = True
    if fp8:
        modes["fp8"] = True  # spec.fp8: the violations above refused a backend without it
    if counts_group is not None and spec.exchanges_counts:
        modes["counts_group"] = counts_group
    return spec.factory(num_experts, group, hidden_size=hidden_size, dtype=dtype, comm_sms=comm_sms, **modes)

"""Process groups that wait as long as the default group.

``torch.distributed.new_group`` (and ``DeviceMesh``, which creates its groups through it) gives a new group its
backend's default timeout, NCCL 10 minutes and gloo 30, not the default group's: a job started with
``--timeout 60`` still hung for 10 minutes on a stalled expert all-to-all. Every group the layout creates goes
through :func:`new_groups`, with the timeout passed explicitly.

The timeout of an existing group is read from its backend's options (``Backend.options._timeout``, the field
``init_process_group`` and ``new_group`` write; torch has no public getter): :func:`group_timeout`.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["group_timeout", "new_groups", "with_timeout"]


def group_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta:
    """How long a collective of ``group`` (None: the default group) waits before it fails."""
    pg = group if group is not None else dist.group.WORLD
    device = torch.device("cuda" if "nccl" in str(dist.get_backend(pg)) else "cpu")
    return pg._get_backend(device).options._timeout


def with_timeout(options: object | None, timeout: datetime.timedelta | None) -> object | None:
    """``options`` (``ProcessGroupNCCL.Options`` or None) carrying ``timeout`` (None: left as they are): c10d
    overwrites the options' timeout with ``new_group``'s ``timeout`` argument and warns when the two differ."""
    if options is not None and timeout is not None:
        options._timeout = timeout  # type: ignore[attr-defined]
    return options


def new_groups(
    rank_lists: Sequence[Sequence[int]], *, timeout: datetime.timedelta, options: object | None = None
) -> dist.ProcessGroup | None:
    """Create one group per list of global ranks in ``rank_lists`` (disjoint), each waiting at most ``timeout``
    and built with the backend ``options``; return the one this rank is in (None: none).

    Collective: every rank of the default group calls it with the same lists, in the same order.
    """
    rank, mine = dist.get_rank(), None
    options = with_timeout(options, timeout)
    for ranks in rank_lists:
        group = dist.new_group(list(ranks), timeout=timeout, pg_options=options)
        if rank in ranks:
            mine = group
    return mine

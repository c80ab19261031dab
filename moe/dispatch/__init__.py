"""Token dispatchers: ``local`` (no EP), ``alltoall`` (torch.distributed), ``deepep`` (DeepEP V1 Buffer)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe.dispatch.alltoall import AllToAllDispatcher
from moe.dispatch.base import Dispatched, Pending, Route, TokenDispatcher
from moe.dispatch.deepep import DEEPEP_INSTALL_HINT, DeepEPDispatcher
from moe.dispatch.local import LocalDispatcher

__all__ = [
    "DEEPEP_INSTALL_HINT",
    "DISPATCHERS",
    "AllToAllDispatcher",
    "DeepEPDispatcher",
    "Dispatched",
    "LocalDispatcher",
    "Pending",
    "Route",
    "TokenDispatcher",
    "make_dispatcher",
]

DISPATCHERS = ("local", "alltoall", "deepep")


def make_dispatcher(
    kind: str,
    num_experts: int,
    group: dist.ProcessGroup | None = None,
    *,
    hidden_size: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    comm_sms: int = 20,
) -> TokenDispatcher:
    """Build dispatcher ``kind`` over the expert-parallel ``group`` (``local`` ignores the group)."""
    if kind == "local":
        return LocalDispatcher(num_experts)
    if kind == "alltoall":
        return AllToAllDispatcher(num_experts, group)
    if kind == "deepep":
        if group is None:
            raise ValueError("the 'deepep' dispatcher needs an expert-parallel process group")
        hidden_bytes = hidden_size * torch.empty((), dtype=dtype).element_size()
        return DeepEPDispatcher(num_experts, group, hidden_bytes=hidden_bytes, comm_sms=comm_sms)
    raise ValueError(f"unknown dispatcher {kind!r}; choose one of {DISPATCHERS}")

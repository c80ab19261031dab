"""Token dispatchers: ``local`` (no EP), ``alltoall`` (torch.distributed), ``deepep`` (DeepEP V1 Buffer),
``deepep-v2`` (DeepEP V2 ElasticBuffer), ``emulated`` (one device, each transfer timed as a link of given bandwidth).

Each backend registers itself in its own file (see :mod:`moe.dispatch.registry`); importing it here is what
makes it selectable by name.
"""

from __future__ import annotations

from moe.dispatch.alltoall import AllToAllDispatcher
from moe.dispatch.base import DEFAULT_COMM_SMS, Dispatched, Pending, Route, TokenDispatcher
from moe.dispatch.deepep import DEEPEP_INSTALL_HINT, DeepEPDispatcher
from moe.dispatch.deepep_v2 import DEEPEP_V2_INSTALL_HINT, DeepEPV2Dispatcher
from moe.dispatch.emulated import EmulatedDispatcher
from moe.dispatch.local import LocalDispatcher
from moe.dispatch.registry import (
    DISPATCHERS,
    DispatcherSpec,
    DispatchOptions,
    Launch,
    make_dispatcher,
    register_dispatcher,
    unregister_dispatcher,
)
from moe.dispatch.traffic import Traffic

__all__ = [
    "DEEPEP_INSTALL_HINT",
    "DEEPEP_V2_INSTALL_HINT",
    "DEFAULT_COMM_SMS",
    "DISPATCHERS",
    "AllToAllDispatcher",
    "DeepEPDispatcher",
    "DeepEPV2Dispatcher",
    "DispatchOptions",
    "Dispatched",
    "DispatcherSpec",
    "EmulatedDispatcher",
    "Launch",
    "LocalDispatcher",
    "Pending",
    "Route",
    "TokenDispatcher",
    "Traffic",
    "make_dispatcher",
    "register_dispatcher",
    "unregister_dispatcher",
]

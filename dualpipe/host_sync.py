"""Find the ops that make the host wait for the GPU, on any device (CPU tests included).

An op that needs a device value on the host (a data-dependent output size, a Python scalar) blocks the CPU
thread until the GPU has finished everything queued before it: the host can no longer run ahead and keep
the communication and compute streams fed. On CPU nothing waits, so such code looks free in tests;
:class:`HostSyncDetector` flags these ops wherever they run, by name, so a CPU test can count them::

    from dualpipe.host_sync import HostSyncDetector

    with HostSyncDetector() as syncs:
        loss = step()
    assert not syncs.flagged, syncs.summary()

:data:`HOST_SYNC_OPS` is the table of what is flagged and why. A copy from a non-CPU tensor to the CPU is
flagged too unless it is ``non_blocking`` (into pinned memory, read after an event: see
:func:`dualpipe.collectives.counts_to_host`). The detector is a ``TorchDispatchMode`` (aten ops, also those run
by autograd's backward on this thread) plus a ``TorchFunctionMode`` for ``Tensor.tolist``, which on a CPU
tensor reads memory without dispatching any op. Ops run by other threads (gloo's workers) are not seen.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HOST_SYNC_OPS", "FlaggedOp", "HostSyncDetector"]

_aten = torch.ops.aten

HOST_SYNC_OPS: dict[str, str] = {
    "aten._local_scalar_dense": "a Python scalar from a tensor (item(), int(t), float(t), bool(t)): the host reads it",
    "aten.nonzero": "the output length is the number of nonzeros, known only after the kernel ran",
    "aten.bincount": "the output length is max(input) + 1 (a device reduction read on the host first)",
    "aten.masked_select": "the output length is the number of selected elements",
    "aten._unique": "the output length is the number of distinct values",
    "aten._unique2": "the output length is the number of distinct values",
    "aten.unique_dim": "the output length is the number of distinct slices",
    "aten.unique_consecutive": "the output length is the number of runs",
    "aten.unique_dim_consecutive": "the output length is the number of runs",
    "aten.repeat_interleave.Tensor": "without output_size, the output length is sum(repeats), read on the host",
    "aten.index.Tensor": "with a boolean mask the index is the mask's nonzero() (data-dependent length)",
    "aten.index_put": "with a boolean mask the index is the mask's nonzero() (data-dependent length)",
    "aten.index_put_": "with a boolean mask the index is the mask's nonzero() (data-dependent length)",
    "aten.equal": "returns a Python bool computed on the device",
    "aten.is_nonzero": "returns a Python bool computed on the device",
    "aten._to_copy": "a blocking copy from the device to the CPU waits for the device",
    "aten.copy_": "a blocking copy from the device to the CPU waits for the device",
    "Tensor.tolist": "Python numbers from a tensor: a device-to-host copy the host waits for",
}
"""Op name -> why it synchronises the host on CUDA. Ops listed with a condition (mask indexing, copies,
``repeat_interleave``) are flagged only when the condition holds."""


@dataclass(frozen=True, slots=True)
class FlaggedOp:
    """One op that would synchronise the host on CUDA."""

    op: str
    """Its name, a key of :data:`HOST_SYNC_OPS`."""
    why: str
    where: str
    """The innermost project frame that issued it (``file:line in function``), or ``?``."""


def _op_name(func: Any) -> str:
    # aten.index.Tensor keeps its overload (aten.index has others); the rest are flagged for any overload.
    full = f"aten.{func.__name__}"
    if full in HOST_SYNC_OPS:
        return full
    packet = f"aten.{func._overloadpacket.__name__}"
    return packet


def _has_bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _flag_reason(func: Any, args: tuple, kwargs: dict) -> str | None:
    """The table key for this call when it would synchronise the host, else None."""
    name = _op_name(func)
    if name not in HOST_SYNC_OPS:
        return None
    if name in ("aten.index.Tensor", "aten.index_put", "aten.index_put_"):
        return name if _has_bool_index(args[1]) else None
    if name == "aten.repeat_interleave.Tensor":
        return None if kwargs.get("output_size") is not None else name
    if name == "aten._to_copy":
        src, device = args[0], kwargs.get("device")
        to_cpu = device is not None and torch.device(device).type == "cpu"
        return name if to_cpu and src.device.type != "cpu" and not kwargs.get("non_blocking", False) else None
    if name == "aten.copy_":
        dst, src = args[0], args[1]
        blocking = not (args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
        return name if dst.device.type == "cpu" and src.device.type != "cpu" and blocking else None
    return name


def _where() -> str:
    for frame in reversed(traceback.extract_stack()):
        if "/torch/" not in frame.filename and frame.filename != __file__:
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "?"


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: HostSyncDetector) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (name := _flag_reason(func, args, kwargs)) is not None:
            self.owner._flag(name)
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, owner: HostSyncDetector) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.tolist:
            self.owner._flag("Tensor.tolist")
        return func(*args, **(kwargs or {}))


class HostSyncDetector:
    """A context manager recording every op of :data:`HOST_SYNC_OPS` run on this thread inside it."""

    def __init__(self) -> None:
        self.flagged: list[FlaggedOp] = []
        self._modes = (_Function(self), _Dispatch(self))

    def _flag(self, name: str) -> None:
        self.flagged.append(FlaggedOp(name, HOST_SYNC_OPS[name], _where()))

    def __enter__(self) -> HostSyncDetector:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def counts(self) -> dict[str, int]:
        """Flagged ops by name."""
        out: dict[str, int] = {}
        for f in self.flagged:
            out[f.op] = out.get(f.op, 0) + 1
        return out

    def summary(self) -> str:
        """One line per flagged op: name, where, why."""
        return "\n".join(f"{f.op} at {f.where}: {f.why}" for f in self.flagged) or "no host syncs"

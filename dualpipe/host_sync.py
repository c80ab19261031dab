"""Find the ops that make the host wait for the GPU, on any device (CPU tests included).

An op that needs a device value on the host (a data-dependent output size, a Python scalar) blocks the CPU
thread until the GPU has finished everything queued before it: the host can no longer run ahead and keep
the communication and compute streams fed. On CPU nothing waits, so such code looks free in tests;
:class:`HostSyncDetector` flags these ops wherever they run, by name, so a CPU test can count them::

    from dualpipe.host_sync import HostSyncDetector

    with HostSyncDetector() as syncs:
        loss = step()
    assert not syncs.flagged, syncs.summary()

:data:`HOST_SYNC_OPS` is the table of what is flagged and why. Copies between the host and a device are
flagged in both directions when they block: torch runs a blocking copy as the transfer followed by a sync of
the current stream, so the host waits for everything queued before it, a device-to-host copy and a
host-to-device one alike. Sync-free forms: a download ``non_blocking`` into pinned memory, read after an event
(:func:`dualpipe.collectives.exchange_counts_to_host`); an upload ``non_blocking`` from pinned memory
(:func:`to_device`), or no upload at all (``torch.full`` fills on the device). Where this process has no pinned
memory (CPU-only builds) an upload counts as sync-free once it is ``non_blocking``. A tensor built from Python
data on a device (``torch.tensor(data, device=...)``, ``torch.as_tensor``, ``Tensor.new_tensor``) is an upload
from pageable memory that torch runs blocking: flagged. Mask assignment ``t[mask] = scalar`` is flagged only where
torch runs it as ``nonzero`` plus a scatter: with one boolean mask, a one-element host value and no
accumulation, ``index_put_`` runs ``masked_fill_``, which does not sync (``canDispatchToMaskedFill`` in ATen).

Any device that is not the CPU is a device here, so a CPU test can stand ``meta`` in for CUDA and see the
uploads and downloads its code would make (on CPU, ``t.to(device)`` with ``device`` the CPU is no copy at all,
and nothing is seen). The detector is a ``TorchDispatchMode`` (aten ops, also those run by autograd's backward
on this thread) plus a ``TorchFunctionMode`` for ``Tensor.tolist``, which on a CPU tensor reads memory without
dispatching any op, and for tensors built from Python data, whose copy to the device runs below the dispatcher.
Ops run by other threads (gloo's workers) are not seen.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HOST_SYNC_OPS", "FlaggedOp", "HostSyncDetector", "to_device"]

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
    "aten.index_put": "with a boolean mask (and not a masked_fill: one mask, a one-element host value, no "
    "accumulation) the index is the mask's nonzero() (data-dependent length)",
    "aten.index_put_": "with a boolean mask (and not a masked_fill: one mask, a one-element host value, no "
    "accumulation) the index is the mask's nonzero() (data-dependent length)",
    "aten.equal": "returns a Python bool computed on the device",
    "aten.is_nonzero": "returns a Python bool computed on the device",
    "aten._to_copy": "a blocking copy between the host and the device (either way; an upload from pageable memory "
    "too) syncs the current stream: the host waits for the device",
    "aten.copy_": "a blocking copy between the host and the device (either way; an upload from pageable memory "
    "too) syncs the current stream: the host waits for the device",
    "Tensor.tolist": "Python numbers from a tensor: a device-to-host copy the host waits for",
    "torch.tensor": "a tensor built on the device from Python data (torch.tensor, torch.as_tensor, new_tensor): a "
    "blocking upload from pageable memory",
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


_MASKS = (torch.bool, torch.uint8)


def _has_bool_index(indices: Any) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in _MASKS for i in indices or ())


def _is_masked_fill(args: tuple, kwargs: dict) -> bool:
    """Whether ``index_put(_)(self, indices, values, accumulate)`` runs as ``masked_fill_``: ATen's
    ``canDispatchToMaskedFill`` (one boolean mask on self's device, a one-element value on the CPU, no
    accumulation). ``t[mask] = 0.0`` on CUDA is that: Python keeps the scalar value on the CPU."""
    self_t, indices, values = args[0], args[1], args[2]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if accumulate or values.numel() != 1 or values.device.type != "cpu":
        return False
    masks = [i for i in indices if isinstance(i, torch.Tensor)]
    return len(masks) == 1 and masks[0].dtype in _MASKS and masks[0].device == self_t.device


def _pinned_memory_exists() -> bool:
    """Whether this process can pin host memory (an accelerator is present)."""
    accelerator = getattr(torch, "accelerator", None)
    return accelerator.is_available() if accelerator is not None else torch.cuda.is_available()


def _blocking_transfer(src: torch.Tensor, dst: torch.device, non_blocking: bool, pinning: bool) -> bool:
    """Whether copying ``src`` to ``dst`` makes the host wait: a copy between the host and a device that is not
    ``non_blocking``, or an upload from pageable memory where pinned memory exists (the driver stages it and may
    sync the stream)."""
    if (src.device.type == "cpu") == (dst.type == "cpu"):
        return False  # on the host, or between devices: no host wait
    if not non_blocking:
        return True
    return src.device.type == "cpu" and pinning and not src.is_pinned()


def _flag_reason(func: Any, args: tuple, kwargs: dict, pinning: bool = False) -> str | None:
    """The table key for this call when it would synchronise the host, else None. ``pinning``: whether this
    process has pinned memory (then a non-blocking upload must come from it)."""
    name = _op_name(func)
    if name not in HOST_SYNC_OPS:
        return None
    if name == "aten.index.Tensor":
        return name if _has_bool_index(args[1]) else None
    if name in ("aten.index_put", "aten.index_put_"):
        return name if _has_bool_index(args[1]) and not _is_masked_fill(args, kwargs) else None
    if name == "aten.repeat_interleave.Tensor":
        return None if kwargs.get("output_size") is not None else name
    if name == "aten._to_copy":
        src, device = args[0], kwargs.get("device")
        if device is None:
            return None  # a dtype or layout change on the same device
        return (
            name if _blocking_transfer(src, torch.device(device), kwargs.get("non_blocking", False), pinning) else None
        )
    if name == "aten.copy_":
        dst, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return name if _blocking_transfer(src, dst.device, non_blocking, pinning) else None
    return name


_BUILDERS = (torch.tensor, torch.as_tensor, torch.Tensor.new_tensor)


def _builds_on_device(func: Any, args: tuple, kwargs: dict) -> bool:
    """``torch.tensor(data, device=...)`` and friends with Python ``data`` and a device that is not the CPU
    (tensor ``data`` is copied through ``aten._to_copy``, which the dispatch mode sees)."""
    if func is torch.Tensor.new_tensor:
        data, device = args[1], kwargs.get("device", args[0].device)
    else:
        data, device = args[0], kwargs.get("device")
    if isinstance(data, torch.Tensor):
        return False
    device = torch.device(device) if device is not None else torch.get_default_device()
    return device.type != "cpu"


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` on ``device`` without making the host wait: the sync-free form of ``host.to(device)``.

    On the CPU it is ``host`` itself. Elsewhere the tensor is copied into pinned memory (a host-side copy, from
    torch's caching host allocator, which keeps the block until the transfer has used it) and uploaded
    ``non_blocking`` on the current stream, so readers queued after it on that stream see the data; without
    pinned memory in this process (a CPU-only build standing in a fake device) the upload is only non-blocking.
    """
    device = torch.device(device)
    if device.type == "cpu":
        return host.to(device)
    if _pinned_memory_exists() and not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


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
        if (name := _flag_reason(func, args, kwargs, self.owner.pinning)) is not None:
            self.owner._flag(name)
        return func(*args, **kwargs)


class _Function(TorchFunctionMode):
    def __init__(self, owner: HostSyncDetector) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist:
            self.owner._flag("Tensor.tolist")
        elif func in _BUILDERS and _builds_on_device(func, args, kwargs):
            self.owner._flag("torch.tensor")
        return func(*args, **kwargs)


class HostSyncDetector:
    """A context manager recording every op of :data:`HOST_SYNC_OPS` run on this thread inside it."""

    def __init__(self) -> None:
        self.flagged: list[FlaggedOp] = []
        self.pinning = _pinned_memory_exists()
        """Whether this process has pinned memory: then a non-blocking upload must come from it."""
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

"""Count the bytes autograd keeps for backward: the activation memory of a step, on any device.

:class:`SavedTensorTracker` hooks every tensor saved for backward (``torch.autograd.graph.saved_tensors_hooks``)
and keeps a running sum over distinct storages, with its peak. On CPU, where no allocator reports a peak,
it is the activation figure; tests use it to check the executor holds what the simulator predicts
(:mod:`dualpipe.simulate`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["SavedTensorTracker", "storage_key"]


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identity of the storage behind ``t`` (device, address): views and aliases share it."""
    return (str(t.device), t.untyped_storage().data_ptr())


class _Packed:
    """What a saved-tensors pack hook returns: holds the tensor, and tells the tracker when autograd drops it."""

    __slots__ = ("key", "tensor", "tracker")

    def __init__(self, tracker: SavedTensorTracker, tensor: torch.Tensor, key: tuple[str, int] | None) -> None:
        self.tracker, self.tensor, self.key = tracker, tensor, key

    def __del__(self) -> None:
        if self.key is not None:
            self.tracker._release(self.key)


class SavedTensorTracker:
    """Counts the bytes of tensors autograd keeps for backward while active (``saved_tensors_hooks``).

    ``live_bytes`` is the sum over distinct storages currently saved by some live graph; ``peak_bytes`` its
    maximum since :meth:`reset_peak`. Storages in ``exclude`` (parameters, buffers) are not counted. Works
    on every device; activation recomputation shows as a lower peak, since a recomputed piece saves its
    tensors only during its own backward.

    Under saved-tensors hooks a saved tensor comes back from ``ctx.saved_tensors`` as a new alias, never as
    the object that was saved: a backward that writes ``weight.grad`` on a saved weight would lose it. Keep
    such weights on ``ctx`` instead (as ``moe.models.layers.Linear`` does).
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._exclude = {storage_key(t) for t in exclude}
        self._refs: dict[tuple[str, int], tuple[int, int]] = {}  # storage -> (saved references, bytes)
        self.live_bytes = 0
        self.peak_bytes = 0
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    def _pack(self, t: torch.Tensor) -> _Packed:
        if t.device.type == "meta" or t.untyped_storage().data_ptr() == 0:
            return _Packed(self, t, None)
        key = storage_key(t)
        if key in self._exclude:
            return _Packed(self, t, None)
        # Hold an alias, not ``t`` itself: a pipeline frees a sent output by swapping its ``.data``, which
        # must not empty what backward reads (autograd's own saved output is such an alias too).
        t = t.detach()
        count, nbytes = self._refs.get(key, (0, t.untyped_storage().nbytes()))
        if count == 0:
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._refs[key] = (count + 1, nbytes)
        return _Packed(self, t, key)

    @staticmethod
    def _unpack(packed: _Packed) -> torch.Tensor:
        return packed.tensor

    def _release(self, key: tuple[str, int]) -> None:
        count, nbytes = self._refs[key]
        if count == 1:
            del self._refs[key]
            self.live_bytes -= nbytes
        else:
            self._refs[key] = (count - 1, nbytes)

    @property
    def live_storages(self) -> int:
        """Distinct storages currently saved for backward (and counted)."""
        return len(self._refs)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def __enter__(self) -> SavedTensorTracker:
        if self._hooks is not None:
            raise RuntimeError("SavedTensorTracker is already active")
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.__exit__(*exc)

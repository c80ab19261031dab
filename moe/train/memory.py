"""Per-rank memory figures of a training step: parameters, gradients, optimizer state, peak activations.

    meter = MemoryMeter(stages, optimizer)
    meter.start_step()
    ...  # forward/backward (a pipeline step), optimizer step
    record.update(meter.stop_step())

Parameter, gradient and optimizer-state bytes are counted from the tensors themselves (each storage once),
on any device. Peak activation bytes come from :class:`SavedTensorTracker` on the CPU: the largest sum, over
the step, of the bytes of distinct storages that autograd holds for backward (tensors saved by forward ops,
custom functions included), parameters and buffers excluded. On CUDA the allocator's figures are what the
step reports: ``cuda_peak_allocated_bytes`` (``torch.cuda.max_memory_allocated`` over the step) and
``cuda_peak_step_bytes``, that peak less what was allocated when the step started (activations, gradients
and every temporary of the step), which is also ``peak_activation_bytes`` there. The tracker's hooks run
in Python for every saved tensor, host time a GPU step cannot spare: ``track_saved=True`` turns it on
there too (then ``peak_activation_bytes`` is its figure).

With activation offloading (:meth:`MemoryMeter.watch_offload`) a moved storage leaves the tracker's count when its
copy to the host starts and comes back when its reload does, so ``peak_activation_bytes`` is what stays on the
device; the host side is reported apart: ``offloaded_bytes`` (moved during the step) and ``offload_host_bytes``
(the host pool's peak over the step).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from dualpipe.memory import SavedTensorTracker, storage_key
from dualpipe.offload import Offloader

__all__ = ["MemoryMeter", "SavedTensorTracker", "gradient_bytes", "optimizer_state_bytes", "parameter_bytes"]


def _unique_params(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    seen: set[int] = set()
    out = []
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and aliases counted once)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if t.device.type == "meta":
            continue
        key = storage_key(t)
        nbytes = t.untyped_storage().nbytes()
        if key[1] == 0:  # empty storages share the null pointer
            continue
        seen[key] = max(seen.get(key, 0), nbytes)
    return sum(seen.values())


def parameter_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of every parameter of ``modules`` (shared ones once)."""
    return _tensor_bytes(_unique_params(modules))


def gradient_bytes(modules: Iterable[nn.Module]) -> int:
    """Bytes of the gradients: ``p.main_grad`` (an fp32 accumulation buffer) where a parameter has one, and
    ``p.grad`` too when it is a separate tensor."""
    grads = []
    for p in _unique_params(modules):
        main = getattr(p, "main_grad", None)
        if isinstance(main, torch.Tensor):
            grads.append(main)
        if p.grad is not None:
            grads.append(p.grad)
    return _tensor_bytes(grads)


def optimizer_state_bytes(optimizer: Any) -> int:
    """The optimizer's own ``state_bytes()`` when it has one (a sharded optimizer knows its shard), else the
    bytes of every tensor in a ``torch.optim.Optimizer``'s ``state``."""
    if optimizer is None:
        return 0
    if callable(getattr(optimizer, "state_bytes", None)):
        return int(optimizer.state_bytes())
    tensors = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return _tensor_bytes(tensors)


class MemoryMeter:
    """Memory figures of one rank per training step.

    Args:
        modules: this rank's stage modules (a pipeline's ``module`` list; shared parameters counted once).
        optimizer: the rank's optimizer (``state_bytes()`` is used when it has one), or None.

    :meth:`stop_step` returns ``param_bytes``, ``grad_bytes``, ``optimizer_state_bytes`` (after the step's
    optimizer step, so the states exist), ``peak_activation_bytes`` (saved-for-backward bytes, the peak
    over the step) and, on CUDA, ``cuda_peak_allocated_bytes`` and ``cuda_peak_step_bytes``. All ints.
    Call :meth:`stop_step` after the optimizer step and before ``zero_grad`` so the gradients are there.
    """

    def __init__(
        self, modules: nn.Module | Sequence[nn.Module], optimizer: Any = None, *, track_saved: bool | None = None
    ) -> None:
        self.modules = [modules] if isinstance(modules, nn.Module) else list(modules)
        self.optimizer = optimizer
        params = _unique_params(self.modules)
        buffers = [b for m in self.modules for b in m.buffers()]
        self.tracker = SavedTensorTracker(exclude=[*params, *buffers])
        devices = {p.device for p in params}
        self.device = devices.pop() if len(devices) == 1 else torch.device("cpu")
        self._cuda_start = 0
        self.track_saved = not self._cuda if track_saved is None else track_saved
        self._offload: tuple[Offloader | None] | None = None
        self._offload_start = 0

    def watch_offload(self, offloader: Offloader | None) -> None:
        """Report the host side of activation offloading (``offloaded_bytes``, ``offload_host_bytes``; zeros on
        a rank that offloads nothing, ``offloader`` None, so every rank reports the same figures)."""
        self._offload = (offloader,)

    @property
    def _cuda(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_available()

    def start_step(self) -> None:
        """Begin counting: every autograd graph built from here on is tracked until :meth:`stop_step`."""
        if self._cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_start = torch.cuda.memory_allocated(self.device)
        if self.track_saved:
            self.tracker.reset_peak()
            self.tracker.__enter__()
        offloader = self._offload[0] if self._offload else None
        if offloader is not None:
            self._offload_start = offloader.offloaded_bytes
            if offloader.pool is not None:
                offloader.pool.reset_peak()

    def stop_step(self) -> dict[str, int]:
        """Stop counting; the step's figures (see the class docstring)."""
        if self.track_saved:
            self.tracker.__exit__(None, None, None)
        out = {
            "param_bytes": parameter_bytes(self.modules),
            "grad_bytes": gradient_bytes(self.modules),
            "optimizer_state_bytes": optimizer_state_bytes(self.optimizer),
            "peak_activation_bytes": self.tracker.peak_bytes if self.track_saved else 0,
        }
        if self._offload is not None:
            offloader = self._offload[0]
            pool = None if offloader is None else offloader.pool
            moved = 0 if offloader is None else offloader.offloaded_bytes - self._offload_start
            out["offloaded_bytes"] = moved
            out["offload_host_bytes"] = 0 if pool is None else pool.peak_bytes
        if self._cuda:
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
            out["cuda_peak_allocated_bytes"] = peak
            out["cuda_peak_step_bytes"] = peak - self._cuda_start
            if not self.track_saved:
                out["peak_activation_bytes"] = out["cuda_peak_step_bytes"]
        return out

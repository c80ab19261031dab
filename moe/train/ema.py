"""An exponential moving average of the weights in host memory, updated off the training step's path.

    ema = HostEMA(optimizer, decay=0.999)    # fp32 host copy of this rank's rows of the weights
    optimizer.step()
    ema.update()                             # queues the copy and the average, returns at once
    ...
    ema.wait(); ema.state_for(p)             # read it (checkpoints, export)

The DeepSeek-V3 report (3.2.3) keeps such an average "in CPU memory and updated asynchronously after each
training step", to judge the model early without GPU memory. After each optimizer step, with ``w`` the weights
it produced::

    ema = decay * ema + (1 - decay) * w          # fp32, on the host

What a rank holds: the rows of each parameter whose optimizer state it holds
(:meth:`moe.train.optimizer.DistributedOptimizer.shard_of`): every row without ZeRO-1, its rows of every
tensor with it (dense over the dp group, experts over their replicas), so the average is sharded as the
optimizer state is and checkpoints store it the same way. It averages the fp32 masters the optimizer steps (a
bf16 run's, not their bf16 roundings). It starts as the weights the run's first step starts from (the initial
or loaded weights; a run resumed from a checkpoint without an average: the checkpoint's weights).

Timing: :meth:`update` records an event after the optimizer step on the current stream; a side stream waits for
it and copies every master into one pinned fp32 buffer (no GPU memory: the buffer is on the host); a worker
thread waits for that copy and applies the formula on the host. Nothing blocks the host thread that queues the
next step. The next optimizer step must not overwrite a master before the copy has read it: :meth:`before_step`
makes the current stream wait for the copy's event (a wait on the device, not on the host). On a CPU rank the
copy is a plain copy on the calling thread and the worker does the rest: the same path, so tests run it.

Host memory: :data:`moe.optim_state.EMA_HOST_BYTES` per element held, the average and the staging buffer
(:meth:`HostEMA.host_bytes`; the planner's footprint counts the same, as host bytes beside the GPU's).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch
from torch import nn

from moe.optim_state import EMA_HOST_BYTES
from moe.train.optimizer import DistributedOptimizer

__all__ = ["HostEMA", "ema_reference"]


def ema_reference(trajectory: list[torch.Tensor], decay: float) -> torch.Tensor:
    """The plain-torch oracle: the average of ``trajectory`` (the weights before the first step, then after each
    step), in fp32, by the formula as written."""
    ema = trajectory[0].float().clone()
    for w in trajectory[1:]:
        ema = decay * ema + (1 - decay) * w.float()
    return ema


def _average_(ema: torch.Tensor, staged: torch.Tensor, decay: float) -> None:
    """``ema = decay * ema + (1 - decay) * staged`` in place, rounding as :func:`ema_reference` does (three
    fp32 operations; ``staged`` is scratch)."""
    ema.mul_(decay)
    staged.mul_(1 - decay)
    ema.add_(staged)


class HostEMA:
    """This rank's fp32 moving average of the weights ``optimizer`` steps, in host memory (module docstring).

    Construction copies the current weights (the average's start) and waits for that copy. Not collective;
    :meth:`applied` is (ZeRO-1's all-gather)."""

    def __init__(self, optimizer: DistributedOptimizer, decay: float) -> None:
        if not 0 < decay < 1:
            raise ValueError(f"decay must lie in (0, 1), got {decay}")
        self.optimizer = optimizer
        self.decay = decay
        self.params = list(optimizer.params())
        masters = [optimizer.master_for(p) for p in self.params]
        self.device = masters[0].device if masters else torch.device("cpu")
        cuda = self.device.type == "cuda"
        total = sum(m.numel() for m in masters)
        self._ema = torch.zeros(total, dtype=torch.float32)
        # pinned: the device copies into it without a staging copy of its own, asynchronously
        self._staged = torch.zeros(total, dtype=torch.float32, pin_memory=cuda)
        self._views: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        offset = 0
        for p, m in zip(self.params, masters):
            n = m.numel()
            self._views[id(p)] = (
                self._ema[offset : offset + n].view(m.shape),
                self._staged[offset : offset + n].view(m.shape),
            )
            offset += n
        self._stream = torch.cuda.Stream(self.device) if cuda else None
        self._copied: torch.cuda.Event | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-ema")
        self._pending: Future | None = None
        self.reset()

    def state_for(self, p: nn.Parameter) -> torch.Tensor:
        """The average of this rank's rows of ``p`` (the shape of :meth:`DistributedOptimizer.master_for`), fp32
        on the host: the live tensor (a checkpoint loader fills it in place). :meth:`wait` before reading it."""
        return self._views[id(p)][0]

    def host_bytes(self) -> int:
        """Host bytes this rank holds for the average: the average and the staging buffer."""
        return self._ema.numel() * EMA_HOST_BYTES

    @torch.no_grad()
    def reset(self) -> None:
        """Start the average over from the current weights (a run's first step, or a resume from a checkpoint
        without an average); waits for the copy."""
        self.wait()
        for p in self.params:
            self._views[id(p)][0].copy_(self.optimizer.master_for(p))

    def before_step(self) -> None:
        """Call before each optimizer step: the step waits (on the device) until the last copy has read the
        masters it overwrites. Nothing to wait for on a CPU rank (the copy ran on the calling thread)."""
        if self._copied is not None:
            torch.cuda.current_stream(self.device).wait_event(self._copied)

    @torch.no_grad()
    def update(self) -> None:
        """Call after each optimizer step: queue the copy of the new weights and the average over them."""
        self.wait()  # the last average has read the staging buffer (long done, one step later)
        pairs = [(self._views[id(p)][1], self.optimizer.master_for(p)) for p in self.params]
        if self._stream is None:
            for staged, master in pairs:
                staged.copy_(master)
            copied = None
        else:
            stepped = torch.cuda.current_stream(self.device).record_event()
            self._stream.wait_event(stepped)
            with torch.cuda.stream(self._stream):
                for staged, master in pairs:
                    staged.copy_(master, non_blocking=True)
            copied = self._stream.record_event()
            self._copied = copied
        self._pending = self._worker.submit(self._average, copied)

    def _average(self, copied: torch.cuda.Event | None) -> None:
        if copied is not None:
            copied.synchronize()  # this worker thread waits, not the training loop
        _average_(self._ema, self._staged, self.decay)

    def wait(self) -> None:
        """Block until the queued average is done (and raise what it raised)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    @contextmanager
    def applied(self) -> Iterator[None]:
        """Collective: for the block's duration the parameters hold the average (each rank's rows written into
        its rows, in the parameters' dtype, then ZeRO-1's all-gathers give every rank all of it); their own values
        come back after, from a host copy."""
        self.wait()
        saved = [p.detach().to("cpu", copy=True) for p in self.params]
        with torch.no_grad():
            for p in self.params:
                self._rows(p).copy_(self.state_for(p))
            self.optimizer.gather_params()
            try:
                yield
            finally:
                for p, value in zip(self.params, saved):
                    p.copy_(value)

    def _rows(self, p: nn.Parameter) -> torch.Tensor:
        """This rank's rows of ``p`` (a view; ``p`` itself when they are all of it)."""
        shard = self.optimizer.shard_of(p)
        if (shard.start, shard.stop) == (0, shard.rows):
            return p.detach()
        return p.detach().narrow(shard.dim, shard.start, shard.stop - shard.start)

    def close(self) -> None:
        """Finish the queued average and stop the worker thread."""
        self.wait()
        self._worker.shutdown()

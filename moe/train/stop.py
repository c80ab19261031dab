"""SIGINT and SIGTERM as a request to stop at a step boundary, the same one on every rank.

A user's Ctrl-C reaches torchrun alone (its workers run in sessions of their own), a scheduler's SIGTERM reaches
it first; torchrun sends the same signal to each worker's process group, waits ``--shutdown-timeout`` seconds (30
unless set, or ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) and SIGKILLs the workers still running, then exits with status 1
and a ``SignalException`` traceback of its own (torch.distributed.elastic: ``LocalElasticAgent._shutdown``,
``SubprocessContext._close``). So the workers get the signal at different moments, and the stop must fit in that
grace. The handler only notes the signal; each rank's vote rides on an all-reduce the step already does
(:meth:`moe.train.trainer.Trainer._global_mean_losses`), so every rank reads the same sum after the same step and
they stop together. The first signal leaves the default disposition in place: a second one ends the process at
once, even while it waits inside a collective.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from types import FrameType
from typing import Any

__all__ = ["STOP_SIGNALS", "StopSignals"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals that stop a run cleanly, in the order of :meth:`StopSignals.votes`."""


class StopSignals:
    """Inside ``with``, :data:`STOP_SIGNALS` set :attr:`received` instead of ending the process (on the main
    thread; elsewhere Python lets no handler be set, and nothing changes). On exit the previous handlers are back.
    """

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        """The signal this process got."""
        self.agreed: signal.Signals | None = None
        """The signal the world stops on, once an all-reduce of :meth:`votes` has shown one (:meth:`agree`)."""
        self._previous: dict[signal.Signals, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._note) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, handler in self._previous.items():
            # None: a handler set outside Python; the default is the closest we can put back
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        self._previous = {}

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received = signal.Signals(signum)
        for s in STOP_SIGNALS:  # a second signal ends the process at once, not at the next step
            signal.signal(s, signal.SIG_DFL)

    def votes(self) -> list[float]:
        """This rank's vote, one number per signal of :data:`STOP_SIGNALS`: 1 for the one it got, else 0."""
        return [float(s == self.received) for s in STOP_SIGNALS]

    def agree(self, counts: Sequence[float]) -> None:
        """Read the votes summed over the world: any rank's signal stops all (SIGTERM over SIGINT if both came)."""
        got = [s for s, n in zip(STOP_SIGNALS, counts, strict=True) if n > 0]
        if got:
            self.agreed = got[-1]

"""SIGINT and SIGTERM during training, in this process: the handler notes the signal, the votes agree, a second
signal meets the default disposition, the previous handlers come back. (The whole stop, at a step boundary with
its checkpoint: test_jobs.py for one process under Ctrl-C, tests/examples/test_launch.py for SIGTERM to torchrun.)"""

from __future__ import annotations

import os
import signal

from moe.train.stop import STOP_SIGNALS, StopSignals


def test_a_signal_is_noted_and_a_second_one_would_end_the_process() -> None:
    seen: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        outer = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        with StopSignals() as signals:
            assert signals.votes() == [0.0, 0.0]
            os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode
            assert signals.received == signal.SIGTERM and signals.votes() == [0.0, 1.0]
            # the process goes on, and the next SIGINT or SIGTERM gets the default disposition: an immediate end
            assert all(signal.getsignal(s) == signal.SIG_DFL for s in STOP_SIGNALS)
        assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == outer  # the previous handlers are back
        assert seen == []  # the outer handler never saw the signal the run took
    finally:
        signal.signal(signal.SIGTERM, before)


def test_any_ranks_signal_stops_all() -> None:
    signals = StopSignals()
    signals.agree([0.0, 0.0])
    assert signals.agreed is None
    signals.agree([1.0, 0.0])  # summed votes: one rank got SIGINT
    assert signals.agreed == signal.SIGINT
    signals.agree([1.0, 3.0])  # the others a SIGTERM: it wins
    assert signals.agreed == signal.SIGTERM

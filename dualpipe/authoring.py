"""Writing a schedule: :class:`Emitter` builds one rank's action list the way the reference's methods read.

A generator is a pure function ``(layout, rank, num_chunks) -> [Action]``; with an :class:`Emitter` it reads
like the paper's pseudo-code (``forward_chunk``, ``backward_chunk``, ``weight_chunk``, ...). Register it with
:func:`dualpipe.schedule.register_schedule` (the built-in ones: :mod:`dualpipe.generators`).
"""

from __future__ import annotations

from dualpipe.schedule import Action, Layout, Op

__all__ = ["Emitter"]


class Emitter:
    """Emits one rank's actions while tracking per-module counters the way the reference does.

    The helper names mirror the reference's methods (``forward_chunk``, ``backward_chunk``, ...), so a
    generator reads like the paper's pseudo-code; every call appends data, nothing runs.
    """

    def __init__(self, layout: Layout, rank: int) -> None:
        self.layout = layout
        self.rank = rank
        m = layout.modules_per_rank
        self.actions: list[Action] = []
        self._f = [0] * m
        self._b = [0] * m
        self._send_f = [0] * m
        self._send_b = [0] * m
        self._recv_f = [0] * m
        self._recv_b = [0] * m

    # -- communication ------------------------------------------------------------------------------
    def _remote(self, loc: tuple[int, int] | None) -> int | None:
        if loc is None or loc[0] == self.rank:
            return None  # no neighbour, or a local hand-over (DualPipeV's turn)
        return loc[0]

    def _comm(self, op: Op, m: int, neighbour: tuple[int, int] | None, counter: list[int]) -> None:
        peer = self._remote(neighbour)
        if peer is not None:
            self.actions.append(Action(op, m, counter[m], peer=peer))
            counter[m] += 1

    def recv_forward(self, m: int) -> None:
        self._comm(Op.RECV_F, m, self.layout.prev(self.rank, m), self._recv_f)

    def send_forward(self, m: int) -> None:
        self._comm(Op.SEND_F, m, self.layout.next(self.rank, m), self._send_f)

    def recv_backward(self, m: int) -> None:
        self._comm(Op.RECV_B, m, self.layout.next(self.rank, m), self._recv_b)

    def send_backward(self, m: int) -> None:
        self._comm(Op.SEND_B, m, self.layout.prev(self.rank, m), self._send_b)

    # -- compute ------------------------------------------------------------------------------------
    def forward(self, m: int) -> None:
        self.actions.append(Action(Op.F, m, self._f[m]))
        self._f[m] += 1

    def backward(self, m: int, defer_weights: bool = False) -> None:
        self.actions.append(Action(Op.I if defer_weights else Op.B, m, self._b[m]))
        self._b[m] += 1

    def forward_backward(self, m_f: int, m_b: int, defer_weights: bool = False) -> None:
        self.actions.append(
            Action(Op.FB, m_f, self._f[m_f], b_module=m_b, b_chunk=self._b[m_b], deferred=defer_weights)
        )
        self._f[m_f] += 1
        self._b[m_b] += 1

    def pairable(self, m_f: int, m_b: int) -> bool:
        """The next forward of ``m_f`` and the next backward of ``m_b`` can run as one pair: they are of
        different (module, micro-batch), so the backward does not start from that forward's loss."""
        return m_f != m_b or self._f[m_f] != self._b[m_b]

    def weight(self) -> None:
        self.actions.append(Action(Op.W))

    # -- the reference's composite steps ------------------------------------------------------------
    def forward_chunk(self, m: int, recv: bool = True, send: bool = True) -> None:
        if recv:
            self.recv_forward(m)
        self.forward(m)
        if send:
            self.send_forward(m)

    def backward_chunk(self, m: int, defer_weights: bool = False, recv: bool = True, send: bool = True) -> None:
        if recv:
            self.recv_backward(m)
        self.backward(m, defer_weights)
        if send:
            self.send_backward(m)

    def forward_backward_chunk(self, m_f: int, m_b: int, recv_f: bool = True, defer_weights: bool = False) -> None:
        if recv_f:
            self.recv_forward(m_f)
        self.recv_backward(m_b)
        self.forward_backward(m_f, m_b, defer_weights)
        self.send_forward(m_f)
        self.send_backward(m_b)

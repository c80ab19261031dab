"""Asynchronous collectives for communication pieces: a pending handle, uneven all-to-all, count exchange.

Legend for shape suffixes: S rows this rank sends, R rows it receives, W ranks of the group, E experts
per rank (or any per-destination breakdown of the counts).

Every call starts its collective with ``async_op=True`` and returns a :class:`Pending`; ``wait()`` is called
where the result is consumed. On NCCL the collective runs on the process group's internal stream, ordered
after the work already queued on the current stream, and ``wait()`` makes the current stream wait for it,
so compute queued in between overlaps. On gloo the transfer runs in gloo's worker thread. The list form
``all_to_all`` is avoided: with uneven sizes it fails on gloo.

A model's dispatch with uneven row counts takes two exchanges: :func:`exchange_counts` first (a few
integers per peer, started right after routing), then the rows, whose receive buffer is sized from the
received counts::

    counts = exchange_counts(send_counts_WE, group)              # in Comm.prepare
    a2a = AllToAll(send_counts_WE.sum(1).tolist(), counts.wait().sum(1).tolist(), group)

(:func:`exchange_counts_to_host` is the same exchange with both sides' counts read on the host once, as late
as possible.)
    rows = a2a.forward(x_SD)                                     # Pending; rows.wait() -> [R, D]
    grad = a2a.backward(grad_RD)                                 # the gradient goes back: -> [S, D]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import torch
import torch.distributed as dist

__all__ = ["AllToAll", "Pending", "all_to_all", "exchange_counts", "exchange_counts_to_host"]

T = TypeVar("T")


class Pending(Generic[T]):
    """A result that may still be in flight. ``wait()`` finishes it once and returns it (idempotent)."""

    __slots__ = ("_finish", "_value")

    def __init__(self, finish: Callable[[], T]) -> None:
        self._finish: Callable[[], T] | None = finish
        self._value: T | None = None

    @classmethod
    def done(cls, value: T) -> Pending[T]:
        """An already finished result (a backend or a rank with nothing to send)."""
        pending: Pending[T] = cls(lambda: value)
        pending.wait()
        return pending

    @classmethod
    def after(cls, works: Sequence[dist.Work], value: T | Callable[[], T]) -> Pending[T]:
        """``value`` (or ``value()``) once every work handle in ``works`` has been waited."""

        def finish() -> T:
            for work in works:
                work.wait()
            return value() if callable(value) else value

        return cls(finish)

    @property
    def finished(self) -> bool:
        return self._finish is None

    def wait(self) -> T:
        if self._finish is not None:
            self._value = self._finish()
            self._finish = None
        return self._value  # type: ignore[return-value]


def all_to_all(
    x_SX: torch.Tensor,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    group: dist.ProcessGroup | None = None,
) -> Pending[torch.Tensor]:
    """Start sending ``send_splits[w]`` consecutive rows of ``x`` to rank ``w`` of ``group``.

    Returns the received rows ``[sum(recv_splits), ...]``, grouped by source rank in rank order. Splits may
    be uneven and zero; every rank must call with matching splits (rank ``w``'s ``recv_splits[r]`` equals
    rank ``r``'s ``send_splits[w]``).
    """
    world = dist.get_world_size(group)
    if len(send_splits) != world or len(recv_splits) != world:
        raise ValueError(
            f"all_to_all needs one split per rank ({world}), got {len(send_splits)} and {len(recv_splits)}"
        )
    if sum(send_splits) != x_SX.shape[0]:
        raise ValueError(f"send splits sum to {sum(send_splits)} rows, the tensor has {x_SX.shape[0]}")
    out_RX = x_SX.new_empty(sum(recv_splits), *x_SX.shape[1:])
    work = dist.all_to_all_single(
        out_RX, x_SX.contiguous(), list(recv_splits), list(send_splits), group=group, async_op=True
    )
    return Pending.after([work], out_RX)


class AllToAll:
    """One exchange pattern between the ranks of ``group``, usable in both directions.

    :meth:`forward` sends ``send_splits[w]`` rows to rank ``w`` and receives ``recv_splits[w]`` from it;
    :meth:`backward` is its gradient: the same exchange with the splits swapped.
    """

    __slots__ = ("group", "recv_splits", "send_splits")

    def __init__(
        self, send_splits: Sequence[int], recv_splits: Sequence[int], group: dist.ProcessGroup | None = None
    ) -> None:
        self.send_splits = [int(s) for s in send_splits]
        self.recv_splits = [int(s) for s in recv_splits]
        self.group = group

    @property
    def num_send(self) -> int:
        return sum(self.send_splits)

    @property
    def num_recv(self) -> int:
        return sum(self.recv_splits)

    def forward(self, x_SX: torch.Tensor) -> Pending[torch.Tensor]:
        """``[S, ...] -> [R, ...]``."""
        return all_to_all(x_SX, self.send_splits, self.recv_splits, self.group)

    def backward(self, grad_RX: torch.Tensor) -> Pending[torch.Tensor]:
        """``[R, ...] -> [S, ...]``: the gradient of :meth:`forward`."""
        return all_to_all(grad_RX, self.recv_splits, self.send_splits, self.group)


def exchange_counts(send_counts_W: torch.Tensor, group: dist.ProcessGroup | None = None) -> Pending[torch.Tensor]:
    """Start telling every rank how much this rank will send it; returns what every rank will send here.

    ``send_counts_W`` is ``[W]`` or ``[W, E]`` (e.g. rows per destination rank and local expert); entry
    ``w`` goes to rank ``w``. The result has the same shape: entry ``w`` is what rank ``w`` sends here.
    """
    world = dist.get_world_size(group)
    if send_counts_W.shape[0] != world:
        raise ValueError(f"exchange_counts needs one row of counts per rank ({world}), got {send_counts_W.shape[0]}")
    counts = send_counts_W.contiguous()
    recv = torch.empty_like(counts)
    work = dist.all_to_all_single(recv, counts, group=group, async_op=True)
    return Pending.after([work], recv)


def exchange_counts_to_host(
    send_counts_W: torch.Tensor, group: dist.ProcessGroup | None = None
) -> Pending[tuple[list[int], list[int]]]:
    """:func:`exchange_counts`, read on the host: ``wait()`` returns ``(sent, received)`` as Python lists.

    The host must know the split sizes of an uneven all-to-all, and reading them is a host sync. On CUDA both
    count vectors are copied, on a side stream that waits for the exchange, into pinned memory behind an event:
    ``wait()`` blocks the host only until those few bytes have landed, not until the compute queued on the
    current stream since has finished, so call it as late as possible. Elsewhere ``wait()`` waits the exchange
    and reads the tensors.
    """
    world = dist.get_world_size(group)
    if send_counts_W.dim() != 1 or send_counts_W.shape[0] != world:
        raise ValueError(f"exchange_counts_to_host needs [W={world}] counts, got {tuple(send_counts_W.shape)}")
    counts = send_counts_W.contiguous()
    recv = torch.empty_like(counts)
    work = dist.all_to_all_single(recv, counts, group=group, async_op=True)
    if counts.device.type != "cuda":

        def read() -> tuple[list[int], list[int]]:
            work.wait()
            sent, received = torch.stack([counts, recv]).tolist()  # one read, as on CUDA
            return sent, received

        return Pending(read)
    side = torch.cuda.Stream(device=counts.device)  # from torch's stream pool: no new stream per call
    side.wait_stream(torch.cuda.current_stream(counts.device))  # the counts were computed there
    host = torch.empty((2, world), dtype=counts.dtype, pin_memory=True)
    with torch.cuda.stream(side):
        work.wait()  # NCCL: the side stream waits for the exchange; the host does not
        host[0].copy_(counts, non_blocking=True)
        host[1].copy_(recv, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record(side)
    counts.record_stream(side)
    recv.record_stream(side)

    def read_pinned() -> tuple[list[int], list[int]]:
        landed.synchronize()
        sent, received = host.tolist()
        return sent, received

    return Pending(read_pinned)

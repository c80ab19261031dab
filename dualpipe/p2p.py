"""Point-to-point transport between pipeline ranks: messages of several tensors, declared or inferred shapes.

A *message* is the list of tensors one stage hands to its neighbour for one micro-batch (activations
forward, gradients backward); entries may be ``None`` (no gradient). Two modes:

- **declared**: shapes (and dtypes) per tensor are known up front (:meth:`P2P.declare`, or the reference's
  ``set_p2p_tensor_shapes``/``set_p2p_tensor_dtype``). Receive buffers are allocated when the receive is
  posted; nothing but the data crosses the wire. A produced tensor that does not match its declaration
  raises ``ValueError`` on the sender before anything is sent.
- **inferred**: every message is preceded by a small int64 header (count, then per tensor: present flag,
  dtype, rank, sizes). The receive posts the header only; the data receive is posted once the header has
  arrived. Shapes may then change from step to step (sequence length) and between tensors.

On gloo, every operation carries a tag derived from the message identity, so messages between the same
two ranks can be posted in any order. NCCL ignores tags and matches by issue order; the schedules keep the
order identical on both sides (checked by :func:`dualpipe.checks.check_matching`), and with inferred
shapes the data receive is posted right after its header arrives, which keeps the reference's grouping.

Waits (:func:`wait_work`): on gloo every wait is bounded by the pipeline's ``timeout``. On NCCL a timed
``Work.wait`` would block the host until the transfer completes, so the wait is the plain one (the current
stream waits, the host runs ahead) and the process group's own timeout bounds a hang: create the group
with ``timeout=`` (examples/train.py passes ``--timeout``).
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dualpipe.host_sync import to_device

__all__ = ["HEADER_LEN", "P2P", "Message", "PendingRecv", "PipelineCommError", "wait_work"]

# A header holds 1 + per tensor (3 + ndim) int64 entries: 256 covers e.g. 30 tensors of rank 5.
HEADER_LEN = 256
# Tag layout (gloo): ((chunk * paths + path) * 2 + is_grad) * _SLOTS + slot; slot 0 is the header.
_SLOTS = 64

_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}


class PipelineCommError(RuntimeError):
    """A wait on a peer failed: it timed out or the peer's connection closed (the peer failed), or the
    ranks disagree on the schedule."""


def wait_work(work: dist.Work, backend: str, timeout: datetime.timedelta | None) -> None:
    """Wait for ``work`` of a group on ``backend`` (``dist.get_backend``), bounded by ``timeout`` on gloo.

    NCCL: ``Work.wait``'s docstring (torch 2.13) says a plain ``wait()`` lets the current stream block on the
    work, but "if timeout is set, it will block the CPU thread until the NCCL work is completed or timed
    out". A timed wait would stop the host from queueing the next computation behind the transfer, so NCCL
    gets the plain wait; a hang is then bounded by the process group's timeout (its watchdog aborts the
    communicator and, with ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, the process), not by ``timeout``.
    A mixed group ("cpu:gloo,cuda:nccl") is treated as NCCL: its CPU waits fall back to the group's timeout.
    """
    if timeout is None or "nccl" in backend:
        work.wait()
    else:
        work.wait(timeout)


@dataclass(frozen=True, slots=True)
class Message:
    """Identity of one transfer: activation (``is_grad=False``) or gradient of ``chunk`` on ``path``, across
    the boundary after stage ``boundary`` of that path (interleaved layouts send several stages' messages
    between the same two ranks)."""

    path: int
    chunk: int
    is_grad: bool
    boundary: int = 0

    def tag(self, num_paths: int, num_stages: int, slot: int) -> int:
        link = self.path * num_stages + self.boundary
        return ((self.chunk * num_paths * num_stages + link) * 2 + int(self.is_grad)) * _SLOTS + slot

    def describe(self) -> str:
        kind = "gradient" if self.is_grad else "activation"
        return f"{kind} of micro-batch {self.chunk} on path {self.path} (after stage {self.boundary})"


def encode_header(tensors: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """int64 header describing ``tensors`` (``None`` entries included)."""
    if len(tensors) >= _SLOTS:
        raise ValueError(f"a pipeline message carries at most {_SLOTS - 1} tensors (got {len(tensors)})")
    values = [len(tensors)]
    for t in tensors:
        if t is None:
            values += [0, 0, 0]
            continue
        if t.dtype not in _DTYPE_CODE:
            raise ValueError(f"dtype {t.dtype} cannot cross a pipeline boundary")
        values += [1, _DTYPE_CODE[t.dtype], t.dim(), *t.shape]
    if len(values) > HEADER_LEN:
        raise ValueError(f"pipeline message too complex for its {HEADER_LEN}-entry header")
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64)


def decode_header(header: torch.Tensor) -> list[tuple[torch.Size, torch.dtype] | None]:
    values = header.tolist()
    count, i = values[0], 1
    specs: list[tuple[torch.Size, torch.dtype] | None] = []
    for _ in range(count):
        present, code, ndim = values[i : i + 3]
        i += 3
        if not present:
            specs.append(None)
            continue
        specs.append((torch.Size(values[i : i + ndim]), _DTYPES[code]))
        i += ndim
    return specs


@dataclass(slots=True)
class PendingRecv:
    """A posted receive. ``tensors`` is filled once :meth:`P2P.complete` has waited for it."""

    message: Message
    peer: int
    works: list[dist.Work] = field(default_factory=list)
    header: torch.Tensor | None = None
    tensors: list[torch.Tensor | None] | None = None


@dataclass(slots=True)
class _Declared:
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]


class P2P:
    """Sends and receives pipeline messages to pipeline ranks over ``group``.

    ``to_group_rank`` maps a pipeline rank to its rank in ``group`` (the reference's ``rank_mapping``).
    On gloo every wait is bounded by ``timeout`` when given (else by the process group's own timeout); on
    NCCL by the process group's timeout only (:func:`wait_work`).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        to_group_rank: Sequence[int],
        device: torch.device,
        num_paths: int,
        timeout: datetime.timedelta | None = None,
        num_stages: int = 1,
    ) -> None:
        self.group = group
        self.to_group_rank = list(to_group_rank)
        self.device = device
        self.num_paths = num_paths
        self.num_stages = num_stages
        self.timeout = timeout
        self.backend = str(dist.get_backend(group))
        self.use_tags = self.backend == dist.Backend.GLOO
        self.declared: _Declared | None = None
        # NCCL matches by order: an inferred receive must post its data right after the header arrives.
        self.eager_data = not self.use_tags

    def declare(self, shapes: Sequence[Sequence[int]] | None, dtypes: Sequence[torch.dtype] | None) -> None:
        """Fix the shapes and dtypes of every message (``None`` shapes: infer them per message)."""
        if shapes is None:
            self.declared = None
            return
        shapes = [tuple(int(d) for d in s) for s in shapes]
        if dtypes is None:
            raise ValueError("declared shapes need dtypes too (set_p2p_tensor_dtype)")
        if len(dtypes) == 1 and len(shapes) > 1:
            dtypes = list(dtypes) * len(shapes)
        if len(dtypes) != len(shapes):
            raise ValueError(f"{len(shapes)} declared shapes but {len(dtypes)} dtypes")
        self.declared = _Declared(shapes, list(dtypes))

    # -- op construction -----------------------------------------------------------------------------
    def _op(self, fn, tensor: torch.Tensor, peer: int, message: Message, slot: int) -> dist.P2POp:
        tag = message.tag(self.num_paths, self.num_stages, slot) if self.use_tags else 0
        return dist.P2POp(fn, tensor, group=self.group, group_peer=self.to_group_rank[peer], tag=tag)

    def _grad_slots(self) -> list[bool]:
        # Gradients exist only for floating tensors; both sides know this from the declaration.
        assert self.declared is not None
        return [dt.is_floating_point for dt in self.declared.dtypes]

    def send_ops(self, peer: int, message: Message, tensors: Sequence[torch.Tensor | None]) -> list[dist.P2POp]:
        """Operations that send ``tensors`` to ``peer`` (validated against the declaration)."""
        ops: list[dist.P2POp] = []
        if self.declared is None:
            header = to_device(encode_header(tensors), self.device)  # pinned, non-blocking: no host wait
            ops.append(self._op(dist.isend, header, peer, message, 0))
            payload = [(i, t) for i, t in enumerate(tensors) if t is not None]
        else:
            payload = self._declared_payload(message, tensors)
        for i, t in payload:
            ops.append(self._op(dist.isend, t.contiguous(), peer, message, i + 1))
        return ops

    def _declared_payload(
        self, message: Message, tensors: Sequence[torch.Tensor | None]
    ) -> list[tuple[int, torch.Tensor]]:
        assert self.declared is not None
        shapes, dtypes = self.declared.shapes, self.declared.dtypes
        if len(tensors) != len(shapes):
            raise ValueError(
                f"stage produced {len(tensors)} tensors for the {message.describe()}, "
                f"but {len(shapes)} shapes were declared with set_p2p_tensor_shapes"
            )
        payload = []
        wanted = self._grad_slots() if message.is_grad else [True] * len(shapes)
        for i, (t, shape, dtype, want) in enumerate(zip(tensors, shapes, dtypes, wanted)):
            if not want:
                continue
            if t is None:  # a floating input that received no gradient: send zeros, the peer expects data
                t = torch.zeros(shape, dtype=dtype, device=self.device)
            if tuple(t.shape) != shape or t.dtype != dtype:
                raise ValueError(
                    f"tensor {i} of the {message.describe()} is {tuple(t.shape)} {t.dtype}, but "
                    f"{shape} {dtype} was declared (set_p2p_tensor_shapes / set_p2p_tensor_dtype); "
                    "declare the shapes the stage really produces, or declare none to infer them"
                )
            payload.append((i, t))
        return payload

    def recv_ops(self, pending: PendingRecv) -> list[dist.P2POp]:
        """Operations that start receiving ``pending`` (the header only, in inferred mode)."""
        if self.declared is None:
            pending.header = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            return [self._op(dist.irecv, pending.header, pending.peer, pending.message, 0)]
        shapes, dtypes = self.declared.shapes, self.declared.dtypes
        wanted = self._grad_slots() if pending.message.is_grad else [True] * len(shapes)
        pending.tensors = [
            torch.empty(s, dtype=dt, device=self.device) if w else None for s, dt, w in zip(shapes, dtypes, wanted)
        ]
        return [
            self._op(dist.irecv, t, pending.peer, pending.message, i + 1)
            for i, t in enumerate(pending.tensors)
            if t is not None
        ]

    # -- issuing and waiting -------------------------------------------------------------------------
    def issue(self, ops: list[dist.P2POp]) -> list[dist.Work]:
        """Issue ``ops`` as one group (one NCCL group on CUDA)."""
        if not ops:
            return []
        try:
            return list(dist.batch_isend_irecv(ops))
        except RuntimeError as exc:  # gloo fails the post itself once a peer's connection has closed
            raise PipelineCommError(
                f"pipeline rank could not post its sends and receives: {exc}. A peer rank probably failed "
                "(see its error)."
            ) from exc

    def wait(self, works: Sequence[dist.Work], what: str) -> None:
        for w in works:
            try:
                wait_work(w, self.backend, self.timeout)
            except RuntimeError as exc:  # gloo reports timeouts and closed peers as RuntimeError
                raise PipelineCommError(
                    f"pipeline rank waited in vain for {what}: {exc}. A peer rank probably failed "
                    "(see its error) or the ranks run different schedules or num_chunks."
                ) from exc

    def start_data(self, pending: PendingRecv) -> None:
        """Inferred mode: wait for the header, then post the data receives."""
        if pending.tensors is not None:
            return
        assert pending.header is not None
        self.wait(pending.works, f"the header of the {pending.message.describe()} from pipeline rank {pending.peer}")
        specs = decode_header(pending.header.cpu())
        pending.tensors = [None if s is None else torch.empty(s[0], dtype=s[1], device=self.device) for s in specs]
        ops = [
            self._op(dist.irecv, t, pending.peer, pending.message, i + 1)
            for i, t in enumerate(pending.tensors)
            if t is not None
        ]
        pending.works = self.issue(ops)

    def complete(self, pending: PendingRecv) -> list[torch.Tensor | None]:
        """Block until ``pending`` has arrived; return its tensors."""
        if pending.header is not None and pending.tensors is None:
            self.start_data(pending)
        self.wait(pending.works, f"the {pending.message.describe()} from pipeline rank {pending.peer}")
        pending.works = []
        assert pending.tensors is not None
        return pending.tensors

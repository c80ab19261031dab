"""A block declared as pieces, and one micro-batch's run through it.

A block is an ordered list of pieces over named values (each name assigned once):

- :class:`Compute` runs ``fn(ctx, *inputs)`` under autograd on detached leaves of its inputs. Its backward
  is split: *dX* back-propagates from its outputs to its input leaves, with every weight-gradient closure
  that layers hand to ``WeightGradStore`` held back; *dW* runs those closures.
- :class:`Comm` starts a communication, ``forward(ctx, *inputs) -> Pending``, whose result is waited where
  it is consumed; its backward, ``backward(ctx, *output_grads) -> Pending``, is the opposite transfer. An
  optional ``prepare(ctx, *inputs)`` starts a small exchange the transfer needs first (row counts).

The block's output is the sum of the values its ``output`` names (the residual stream), its input the value
named ``input``. ``ctx`` is one :class:`Context` per block and micro-batch, shared by the block's pieces
(stash what a backward or a later piece needs there, as in an autograd function).

A weight gradient is deferred the way DualPipe's layers do it: inside a custom autograd function's backward,
``if WeightGradStore.enabled: WeightGradStore.put(closure)`` else compute it at once. During a dX the runtime
enables a store of its own (unless the pipeline's zero-bubble ``I`` action already enabled the pipeline's),
so the closures run in the dW that follows. Layers that compute weight gradients in autograd are fine too:
their weight gradients are simply part of dX.

:class:`BlockRun` keeps the per-value bookkeeping: leaves, gradients accumulated from every consumer, which
communication results are still in flight. :mod:`dualpipe.overlap` drives it, alone or interleaved.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dualpipe.collectives import Pending
from dualpipe.events import Recorder, record_edge, record_span
from dualpipe.utils import run_backward
from dualpipe.weight_grad import GradStore, active_store

__all__ = ["BlockRun", "Comm", "Compute", "Context", "Pieces", "Recorder"]


def _names(value: str | Sequence[str]) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class Compute:
    """A compute piece: ``fn(ctx, *inputs)`` returns one value per name in ``outputs`` (a tuple, or the
    value itself for one output; a tuple is always read as the values). ``recompute`` (None: the stage's
    setting) runs it without a graph in forward and again under autograd right before its backward, with
    ``ctx.recomputing`` set."""

    name: str
    fn: Callable[..., Any]
    inputs: tuple[str, ...] | str
    outputs: tuple[str, ...] | str
    recompute: bool | None = None
    no_grad: tuple[str, ...] | str = ()
    """Floating-point inputs that get no gradient from this piece by design (read for their value only). Every
    other floating-point input must get one: a backward that leaves it without raises, naming the block, the
    piece and the input."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", _names(self.inputs))
        object.__setattr__(self, "outputs", _names(self.outputs))
        object.__setattr__(self, "no_grad", _names(self.no_grad))


@dataclass(frozen=True)
class Comm:
    """A communication piece. ``forward(ctx, *inputs)`` starts the transfer and returns a ``Pending`` of one
    value per name in ``outputs`` (a tuple, or the value itself for one output); ``backward(ctx,
    *output_grads)`` starts the gradient's transfer and returns a ``Pending`` of one gradient (or None) per
    input. ``prepare(ctx, *inputs)``, when given, is called as soon as the inputs exist and may return a
    ``Pending`` that ``forward`` needs finished first (e.g. a row-count exchange): in a pair the runtime then
    starts ``forward`` after the other micro-batch's side pieces' backward, before its main pieces'
    (:mod:`dualpipe.pair_order`), so that wait flies under the other's compute. ``no_grad``: inputs
    whose gradient ``backward`` gives as None by design; every other floating-point input must get a tensor
    of its shape and dtype, or the step raises naming the block, the piece and the input. ``communicates``
    False (nothing to send, e.g. one rank) records no events. ``stream``: the CUDA stream the transfer runs
    on, when the backend exposes one (DeepEP's ``Buffer.get_comm_stream()``); its ``wait`` events are
    recorded there (:func:`dualpipe.events.record_edge`). None (NCCL collectives: the process group's
    stream is internal) records them on the current stream. A zero-argument callable is asked at each
    record (a backend that creates its stream lazily, at the first transfer)."""

    name: str
    forward: Callable[..., Pending[Any]]
    backward: Callable[..., Pending[Any]]
    inputs: tuple[str, ...] | str
    outputs: tuple[str, ...] | str
    prepare: Callable[..., Pending[Any] | None] | None = None
    prepare_name: str = "counts"
    communicates: bool = True
    stream: Any = None
    no_grad: tuple[str, ...] | str = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", _names(self.inputs))
        object.__setattr__(self, "outputs", _names(self.outputs))
        object.__setattr__(self, "no_grad", _names(self.no_grad))


Piece = Compute | Comm


@dataclass(frozen=True)
class Pieces:
    """One block: its pieces in forward order, the names of its input and of the values summed into its
    output, the ``layer`` recorded in events, and whether overlapped pairs interleave it (``paired``; the
    embedding and head of a stage are not: they run alone at the ends of a pair's sequence)."""

    pieces: tuple[Piece, ...]
    input: str = "x"
    output: tuple[str, ...] | str = "out"
    layer: int = -1
    paired: bool = True
    consumers: dict[str, list[int]] = field(init=False, repr=False, compare=False)
    """Value name -> indices of the pieces reading it (the block output counts as ``len(pieces)``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "pieces", tuple(self.pieces))
        object.__setattr__(self, "output", _names(self.output))
        where = f"block {self.layer}"
        if not self.pieces or not any(isinstance(p, Compute) for p in self.pieces):
            raise ValueError(f"{where}: a block needs at least one Compute piece")
        defined = {self.input}
        consumers: dict[str, list[int]] = {self.input: []}
        named: set[str] = set()
        for i, piece in enumerate(self.pieces):
            if not isinstance(piece, (Compute, Comm)):
                raise TypeError(f"{where}: piece {i} is a {type(piece).__name__}, not a Compute or a Comm")
            if piece.name in named:
                raise ValueError(f"{where}: two pieces are named {piece.name!r} (their events would be ambiguous)")
            named.add(piece.name)
            for name in piece.inputs:
                if name not in defined:
                    raise ValueError(f"{where}: piece {piece.name!r} reads {name!r} before any piece produces it")
                consumers[name].append(i)
            stray = [n for n in piece.no_grad if n not in piece.inputs]
            if stray:
                raise ValueError(f"{where}: piece {piece.name!r} declares no_grad={stray}, which it does not read")
            for name in piece.outputs:
                if name in defined:
                    raise ValueError(f"{where}: piece {piece.name!r} produces {name!r} again (assign each once)")
                defined.add(name)
                consumers[name] = []
        for name in self.output:
            if name not in defined:
                raise ValueError(f"{where}: the output names {name!r}, which no piece produces")
            consumers[name].append(len(self.pieces))
        object.__setattr__(self, "consumers", consumers)


class Context:
    """Scratch space of one block for one micro-batch, shared by its pieces (set any attribute)."""

    recomputing: bool = False
    """True while a compute piece runs again before its backward (activation recompute)."""
    side: tuple[Any, ...] = ()
    """The stage's inputs beyond the first (a last stage's labels, when it asks for them: no gradient)."""


def _leaf(value: Any) -> Any:
    # A piece boundary: the piece's backward stops here and leaves the gradient in .grad.
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().requires_grad_(value.is_floating_point() and torch.is_grad_enabled())


def _tuple(value: Any, n: int, what: str) -> tuple[Any, ...]:
    # A tuple is always the values, one per name: for one output, (a, b) is a mistake, not a tuple value.
    if isinstance(value, tuple):
        if len(value) != n:
            raise ValueError(f"{what} returned a tuple of {len(value)} values, expected {n} value(s)")
        return value
    if n != 1:
        raise ValueError(f"{what} returned {type(value).__name__}, expected a tuple of {n} values")
    return (value,)


def _pending(value: Any, what: str) -> Pending[Any]:
    if not isinstance(value, Pending):
        raise TypeError(f"{what} returned {type(value).__name__}, not a Pending (finished: Pending.done(value))")
    return value


def _wants_grad(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


class BlockRun:
    """One micro-batch through one block (:class:`Pieces`), piece by piece, forward then backward.

    Forward: :meth:`begin` with the block input, then each compute with :meth:`compute` and each
    communication with :meth:`start` (when :meth:`startable`); results are waited lazily, when a compute
    or the :meth:`output` reads them. Backward: :meth:`begin_backward` with the output gradient, then
    :meth:`compute_dx` / :meth:`compute_dw` and :meth:`start_backward` in reverse order; the input gradient
    is :meth:`grad_in` once :meth:`input_grad_final`.
    """

    def __init__(
        self,
        decl: Pieces,
        *,
        recompute: bool = False,
        recorder: Recorder | None = None,
        grad: bool = True,
        side: tuple[Any, ...] = (),
    ) -> None:
        self.decl = decl
        self.ctx = Context()
        self.ctx.side = side
        self.recompute = recompute
        self.recorder = recorder
        self.grad = grad
        self.values: dict[str, Any] = {}
        self._in_flight: dict[int, Pending[Any]] = {}  # comm index -> its forward result
        self._prepared: dict[int, Pending[Any] | None] = {}  # comm index -> its prepare exchange, if any
        self._leaves: dict[int, tuple[Any, ...]] = {}  # compute index -> its input leaves
        self._outs: dict[int, tuple[Any, ...]] = {}  # compute index -> its outputs (graph roots)
        self._stores: dict[int, GradStore | None] = {}  # compute index -> held-back weight gradients (None: none)
        self._needs: dict[int, tuple[tuple[torch.Size, torch.dtype] | None, ...]] = {}  # piece -> inputs' grads
        self.started: set[int] = set()
        self.done: set[int] = set()
        # backward
        self.grads: dict[str, torch.Tensor] = {}
        self._waiting: dict[str, int] = {}  # value name -> consumers that have not given their gradient yet
        self._bwd_in_flight: dict[int, Pending[Any]] = {}
        self.bwd_started: set[int] = set()
        self.bwd_done: set[int] = set()

    # ---- events ------------------------------------------------------------------------------------------
    def _edge(self, piece: Comm, name: str, direction: str, edge: str) -> None:
        if piece.communicates:
            stream = piece.stream if edge == "wait" else None
            if callable(stream):
                stream = stream()
            record_edge(self.recorder, name, direction, self.decl.layer, edge, stream=stream)

    def span(self, name: str, direction: str, work: bool = True) -> contextlib.AbstractContextManager[None]:
        return record_span(self.recorder, name, direction, self.decl.layer, work)

    # ---- forward -----------------------------------------------------------------------------------------
    def begin(self, x: Any) -> None:
        self.values[self.decl.input] = x

    def available(self, name: str) -> bool:
        return name in self.values

    def value(self, name: str) -> Any:
        """A value, waiting for the communication that produces it if it is still in flight."""
        if name not in self.values:
            i = next(i for i, p in enumerate(self.decl.pieces) if name in p.outputs)
            self.wait(i)
        return self.values[name]

    def startable(self, i: int) -> bool:
        piece = self.decl.pieces[i]
        return i not in self.started and all(self.available(n) for n in piece.inputs)

    def prepare(self, i: int) -> bool:
        """Call comm ``i``'s ``prepare``; True when it left an exchange in flight that ``start`` must wait."""
        piece = self.decl.pieces[i]
        assert isinstance(piece, Comm)
        if i not in self._prepared:
            pending = None
            if piece.prepare is not None:
                pending = piece.prepare(self.ctx, *(self._plain(n) for n in piece.inputs))
                pending = None if pending is None else _pending(pending, f"Comm {piece.name!r} prepare")
            if pending is not None:
                self._edge(piece, piece.prepare_name, "fwd", "start")
            self._prepared[i] = pending
        return self._prepared[i] is not None

    def start(self, i: int) -> None:
        piece = self.decl.pieces[i]
        assert isinstance(piece, Comm) and i not in self.started
        self.prepare(i)
        prepared = self._prepared.pop(i, None)
        if prepared is not None:
            prepared.wait()
            self._edge(piece, piece.prepare_name, "fwd", "wait")
        inputs = [self._plain(n) for n in piece.inputs]  # may wait an earlier transfer: before our start edge
        if self.grad:
            self._needs[i] = self._wanted(piece, inputs)
        self.started.add(i)
        pending = piece.forward(self.ctx, *inputs)
        # in flight from here: the call's own work (packing the rows to send) comes before any byte can move
        self._edge(piece, piece.name, "fwd", "start")
        self._in_flight[i] = _pending(pending, f"Comm {piece.name!r} forward")

    def wait(self, i: int) -> None:
        piece = self.decl.pieces[i]
        assert isinstance(piece, Comm)
        if i not in self.started:
            self.start(i)
        result = _tuple(self._in_flight.pop(i).wait(), len(piece.outputs), f"Comm {piece.name!r}")
        self._edge(piece, piece.name, "fwd", "wait")
        self.values.update(zip(piece.outputs, result))
        self.done.add(i)

    @staticmethod
    def _wanted(piece: Piece, values: Sequence[Any]) -> tuple[tuple[torch.Size, torch.dtype] | None, ...]:
        """(shape, dtype) of the gradient each input must get back, None where it needs none."""
        return tuple(
            (v.shape, v.dtype) if _wants_grad(v) and name not in piece.no_grad else None
            for name, v in zip(piece.inputs, values)
        )

    def _check_grad(self, i: int, name: str, grad: Any) -> None:
        """One line naming the block, the piece and the input when ``grad`` is not the gradient it needs."""
        piece = self.decl.pieces[i]
        need = self._needs[i][piece.inputs.index(name)]
        if need is None:
            return
        kind = type(piece).__name__
        where = f"block {self.decl.layer}: {kind} {piece.name!r}"
        shape, dtype = need
        if grad is None:
            raise RuntimeError(
                f"{where} gave no gradient for its input {name!r} ({tuple(shape)}, {dtype}); a floating-point input "
                f"that needs none is declared {kind}(..., no_grad=({name!r},))"
            )
        if not isinstance(grad, torch.Tensor):
            raise TypeError(f"{where} gave a {type(grad).__name__} as the gradient of {name!r}, not a tensor")
        if grad.shape != shape or grad.dtype != dtype:
            raise RuntimeError(
                f"{where} gave a gradient of {tuple(grad.shape)}, {grad.dtype} for its input {name!r}, which is "
                f"{tuple(shape)}, {dtype}"
            )

    def _plain(self, name: str) -> Any:
        v = self.value(name)
        return v.detach() if isinstance(v, torch.Tensor) else v

    def _recomputes(self, piece: Compute) -> bool:
        return self.grad and (self.recompute if piece.recompute is None else piece.recompute)

    def _run(self, i: int, leaves: tuple[Any, ...], grad: bool) -> tuple[Any, ...]:
        piece = self.decl.pieces[i]
        assert isinstance(piece, Compute)
        with torch.set_grad_enabled(grad):
            out = piece.fn(self.ctx, *leaves)
        return _tuple(out, len(piece.outputs), f"Compute {piece.name!r}")

    def compute(self, i: int) -> None:
        piece = self.decl.pieces[i]
        assert isinstance(piece, Compute)
        leaves = tuple(_leaf(self.value(n)) for n in piece.inputs)
        with self.span(piece.name, "fwd"):
            recompute = self._recomputes(piece)
            outs = self._run(i, leaves, self.grad and not recompute)
        if self.grad:
            self._leaves[i] = leaves
            self._needs[i] = self._wanted(piece, leaves)
            if not recompute:
                self._outs[i] = outs
        self.values.update(zip(piece.outputs, outs))
        self.done.add(i)

    def output(self) -> Any:
        """The block output: the sum of the ``output`` values (no graph: the backward starts from it)."""
        names = self.decl.output
        values = [self.value(n) for n in names]
        for i, piece in enumerate(self.decl.pieces):
            # A transfer whose result nothing reads still finishes with its block: else its backward would
            # get no output gradient (None, not zeros) and its start would have no wait.
            if isinstance(piece, Comm) and i not in self.done:
                self.wait(i)
        if len(values) == 1:
            out = values[0]
            out = out.detach() if isinstance(out, torch.Tensor) else out
        else:
            with self.span("residual", "fwd"), torch.no_grad():
                out = values[0].detach()
                for v in values[1:]:
                    out = out + v.detach()
        self._drop_recomputed()
        return out

    def _drop_recomputed(self) -> None:
        # Keep only what backward needs: piece inputs (leaves), and outputs of pieces not recomputed.
        for piece in self.decl.pieces:
            if isinstance(piece, Compute) and self._recomputes(piece):
                for name in piece.outputs:
                    self.values.pop(name, None)

    @property
    def holds_graph(self) -> bool:
        """Whether any compute piece's autograd graph is kept for backward (False when all recompute)."""
        return bool(self._outs)

    # ---- backward ----------------------------------------------------------------------------------------
    def begin_backward(self, grad_out: torch.Tensor | None) -> None:
        """Every output value receives the output gradient (the output is their sum)."""
        self._waiting = {name: len(c) for name, c in self.decl.consumers.items()}
        for name in self.decl.output:
            self._give(name, grad_out)

    def _give(self, name: str, grad: torch.Tensor | None) -> None:
        if grad is not None:
            have = self.grads.get(name)
            self.grads[name] = grad if have is None else have + grad
        self._waiting[name] -= 1

    def grads_final(self, names: Sequence[str]) -> bool:
        return all(self._waiting[n] == 0 for n in names)

    def finish_input_grad(self) -> None:
        """Wait for whatever gradient of the block input is still in flight."""
        self._finish_grads([self.decl.input])

    def input_grad_final(self) -> bool:
        return self._waiting.get(self.decl.input, 1) == 0

    def grad_in(self) -> torch.Tensor | None:
        return self.grads.get(self.decl.input)

    def startable_backward(self, i: int) -> bool:
        piece = self.decl.pieces[i]
        return i not in self.bwd_started and self.grads_final(piece.outputs)

    def _finish_grads(self, names: Sequence[str]) -> None:
        # Wait for the in-flight gradients of later communications that feed these values.
        for name in names:
            for j in self.decl.consumers[name]:
                if j < len(self.decl.pieces) and isinstance(self.decl.pieces[j], Comm) and j not in self.bwd_done:
                    self.wait_backward(j)
        if not self.grads_final(names):
            missing = [n for n in names if self._waiting[n]]
            raise RuntimeError(f"block {self.decl.layer}: gradients of {missing} are not complete")

    def start_backward(self, i: int) -> None:
        piece = self.decl.pieces[i]
        assert isinstance(piece, Comm) and i not in self.bwd_started
        self._finish_grads(piece.outputs)
        grads = []
        for name in piece.outputs:
            g = self.grads.pop(name, None)
            if g is None and _wants_grad(self.values.get(name)):
                g = torch.zeros_like(self.values[name])
            grads.append(g)
        self.bwd_started.add(i)
        pending = piece.backward(self.ctx, *grads)
        self._edge(piece, piece.name, "bwd", "start")  # after the call, as the forward's
        self._bwd_in_flight[i] = _pending(pending, f"Comm {piece.name!r} backward")
        for name in piece.outputs:
            self.values.pop(name, None)

    def wait_backward(self, i: int) -> None:
        piece = self.decl.pieces[i]
        assert isinstance(piece, Comm)
        if i not in self.bwd_started:
            self.start_backward(i)
        result = _tuple(self._bwd_in_flight.pop(i).wait(), len(piece.inputs), f"Comm {piece.name!r} backward")
        self._edge(piece, piece.name, "bwd", "wait")
        self.bwd_done.add(i)
        for name, g in zip(piece.inputs, result):
            self._check_grad(i, name, g)
            self._give(name, g)

    def compute_dx(self, i: int, record: bool = True) -> None:
        """Input gradients of compute ``i``; its weight gradients are held for :meth:`compute_dw`."""
        piece = self.decl.pieces[i]
        assert isinstance(piece, Compute)
        self._finish_grads(piece.outputs)
        with self.span(f"{piece.name}.dx", "bwd") if record else contextlib.nullcontext():
            leaves = self._leaves.pop(i)
            if i in self._outs:
                outs = self._outs.pop(i)
            else:  # recomputed: run it again under autograd, replaying what ctx recorded
                self.ctx.recomputing = True
                try:
                    outs = self._run(i, leaves, True)
                finally:
                    self.ctx.recomputing = False
            roots, grads = [], []
            for name, out in zip(piece.outputs, outs):
                g = self.grads.pop(name, None)
                self.values.pop(name, None)
                if g is not None and isinstance(out, torch.Tensor) and out.requires_grad:
                    roots.append(out)
                    grads.append(g)
            del outs
            outer = active_store()
            if outer.enabled:  # the pipeline defers weight gradients to its own W action
                self._backward(i, roots, grads)
            else:
                store = GradStore()
                with store.activate(enabled=True):
                    self._backward(i, roots, grads)
                # None: the layers handed over no closures (autograd did their weight gradients in dX)
                self._stores[i] = None if store.is_empty() else store
                store.flush()
        for name, leaf in zip(piece.inputs, leaves):
            grad = leaf.grad if isinstance(leaf, torch.Tensor) else None
            self._check_grad(i, name, grad)
            self._give(name, grad)
        self.bwd_done.add(i)

    def _backward(self, i: int, roots: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """Compute ``i``'s backward from its outputs, stopping with one line where it reaches another piece's
        graph: a tensor with autograd history went from one piece to the other outside the named values
        (through ``ctx``), which would give the other piece's inputs gradients twice, or none."""
        piece = self.decl.pieces[i]
        where = f"block {self.decl.layer}: the backward of Compute {piece.name!r}"
        fix = (
            "a tensor with autograd history went from one piece to another outside the named values (through "
            "ctx?); pass it as a named value (an output of the piece that makes it, an input of the one that "
            "reads it), or keep it in ctx detached"
        )
        try:
            run_backward(roots, grads)
        except RuntimeError as e:
            if "backward through the graph a second time" not in str(e):
                raise
            raise RuntimeError(f"{where} ran into a graph another piece's backward had freed: {fix}") from e
        for j, leaves in self._leaves.items():  # pieces whose dX is still to come
            for name, leaf in zip(self.decl.pieces[j].inputs, leaves):
                if isinstance(leaf, torch.Tensor) and leaf.grad is not None:
                    other = self.decl.pieces[j].name
                    raise RuntimeError(f"{where} reached the input {name!r} of Compute {other!r}: {fix}")

    def compute_dw(self, i: int, record: bool = True) -> None:
        if i not in self._stores:
            return
        store = self._stores.pop(i)
        piece = self.decl.pieces[i]
        # with nothing to run the span still shows in a timeline, marked as no work (dualpipe.events)
        span = self.span(f"{piece.name}.dw", "bwd", work=store is not None) if record else contextlib.nullcontext()
        with span, torch.no_grad():
            if store is not None:
                store.pop()

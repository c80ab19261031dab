"""The overlap runtime: a stage of blocks declared as pieces gets ``overlapped_forward_backward``.

A stage module subclasses :class:`OverlapStage` and implements ``pieces()`` (its blocks, each a
:class:`dualpipe.pieces.Pieces`); the forward, the plain backward and the hook come from here::

    class MyStage(OverlapStage):
        def pieces(self):
            return [Pieces([...], layer=i) for i in ...]

**Forward and plain backward.** ``forward`` runs the pieces in order on detached leaves and returns the
stage output through one autograd node (:func:`stage_output`) whose backward replays the pieces backward,
so the pipeline's ``run_backward(outputs, grads)`` or ``loss.backward()`` works unchanged.

**The overlapped pair.** ``overlapped_forward_backward`` runs the forward of one micro-batch (F) and the
backward of an earlier one (B) interleaved, in the order :mod:`dualpipe.pair_order` writes down
(DeepSeek-V3 Figure 4; Megatron-Core's combined 1F1B uses the same). Forward block i is paired with
backward block L-1-i; within a pair the steps of :data:`~dualpipe.pair_order.PAIR_ORDER` run the pieces of
each role. For an attention / dispatch / shared expert / MLP / combine block that gives::

    comm:     B.combine              | F.dispatch   B.dispatch            | F.combine  (next B.combine)
    compute:  F.attention  B.shared  | B.mlp (dX, dW)  F.shared  F.mlp    | B.attention (dX | dW)

Every communication starts as soon as its inputs exist (for B: between the dX that completes its gradient
and that piece's dW) and is waited where its result is consumed, so each is in flight during the other
micro-batch's compute. A communication whose ``prepare`` left an exchange in flight (row counts) starts
at the order's ``START_PREPARED`` step: its exchange flies under B's side pieces (the shared expert's
backward, dX and dW), and the transfer under B's MLP (beside a B block without main pieces, a dense one,
it starts after B's last side dX instead: :mod:`dualpipe.pair_order`). The pairs straddle
block boundaries by themselves: B's next combine starts once this block's input gradient exists, behind
B.attention dW and the next F.attention. Unpaired blocks (embedding, head) run alone at the ends: B's head
first, then F's embedding; B's embedding backward and the input-gradient delivery run while F's last
combine is in flight. Outside a pair (a plain forward or backward) the pieces run in declaration order.

Every rank of an expert-parallel group walks the same sequence, so all ranks issue their collectives in
the same order; that is what lets gloo and NCCL match them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from dualpipe.pair_order import PAIR_ORDER, SIDE, START_PREPARED, Roles, Step, roles
from dualpipe.pieces import BlockRun, Compute, Pieces, Recorder
from dualpipe.utils import run_backward

__all__ = [
    "OverlapStage",
    "StageRun",
    "deliver_input_grad",
    "overlapped_forward_backward",
    "pending_backward",
    "stage_output",
]


class StageRun:
    """One micro-batch through one :class:`OverlapStage`: a :class:`BlockRun` per block."""

    def __init__(self, stage: OverlapStage, inputs: Sequence[Any]) -> None:
        if len(inputs) != 1 and not (stage.forward_takes_labels and len(inputs) > 1):
            raise ValueError(f"{type(stage).__name__}: a stage built from pieces takes one input, got {len(inputs)}")
        decls = list(stage.pieces() or ())  # a forgotten return (None) reads as no blocks
        _check_blocks(type(stage).__name__, decls)
        grad = torch.is_grad_enabled()
        self.stage = stage
        self.inputs = tuple(inputs)
        side = tuple(inputs[1:])
        self.blocks = [
            BlockRun(d, recompute=stage.recompute, recorder=stage.recorder, grad=grad, side=side) for d in decls
        ]
        self.capture = False
        self.captured_grad: torch.Tensor | None = None

    def forward(self) -> Any:
        fwd = _Forward(self)
        return fwd.finish()

    def backward(self, grad_out: torch.Tensor) -> torch.Tensor | None:
        """The whole backward, piece by piece; returns the input gradient (None when the input has none)."""
        return _Backward(self, grad_out).finish()

    def deliver(self, grad_in: torch.Tensor | None) -> None:
        deliver_input_grad(self.inputs, grad_in)


def _check_blocks(owner: str, decls: Sequence[Pieces]) -> None:
    if not decls:
        raise ValueError(f"{owner}.pieces() returned no blocks")
    for d in decls:
        if not isinstance(d, Pieces):
            raise TypeError(f"{owner}.pieces() must return Pieces, got {type(d).__name__}")
    paired = [i for i, d in enumerate(decls) if d.paired]
    if paired and paired != list(range(paired[0], paired[-1] + 1)):
        raise ValueError(f"{owner}.pieces(): unpaired blocks (paired=False) may only come first or last")


class _Side:
    """One micro-batch's walk through a stage's blocks, one compute piece per step: in a pair, a paired block's
    pieces by role (:mod:`dualpipe.pair_order`), otherwise in declaration order (reversed for the backward)."""

    def __init__(self, run: StageRun, direction: str, pair: bool) -> None:
        self.blocks = run.blocks
        self._roles = [roles(blk.decl) for blk in run.blocks]
        walk = range(len(self.blocks)) if direction == "fwd" else reversed(range(len(self.blocks)))
        self.steps = [(b, i) for b in walk for i in self._order(b, direction, pair)]
        self.pos = 0

    def _order(self, b: int, direction: str, pair: bool) -> tuple[int, ...]:
        decl = self.blocks[b].decl
        if pair and decl.paired:
            return self._roles[b].order(direction)
        computes = tuple(i for i, p in enumerate(decl.pieces) if isinstance(p, Compute))
        return computes if direction == "fwd" else computes[::-1]

    def roles(self, b: int) -> Roles:
        """Block ``b``'s compute pieces by role."""
        return self._roles[b]


class _Forward(_Side):
    """F: one micro-batch's forward through a stage, one compute piece per :meth:`step`."""

    def __init__(self, run: StageRun, pair: bool = False) -> None:
        super().__init__(run, "fwd", pair)
        self.cur = 0
        self.due: list[int] = []  # comms of the current block whose prepare left an exchange in flight
        self.blocks[0].begin(run.inputs[0])

    def _enter(self, b: int) -> None:
        while self.cur < b:
            self.start_due()
            out = self.blocks[self.cur].output()
            self.cur += 1
            self.blocks[self.cur].begin(out)

    def step(self) -> None:
        b, i = self.steps[self.pos]
        self.pos += 1
        self._enter(b)
        self.blocks[b].compute(i)

    def start_ready(self) -> None:
        blk = self.blocks[self.cur]
        for i, piece in enumerate(blk.decl.pieces):
            if isinstance(piece, Compute) or i in self.due or not blk.startable(i):
                continue
            if blk.prepare(i):
                self.due.append(i)
            else:
                blk.start(i)

    def start_due(self) -> None:
        blk = self.blocks[self.cur]
        for i in self.due:
            if i not in blk.started:
                blk.start(i)
        self.due.clear()

    def alone(self, until: int | None = None) -> None:
        """Run the steps up to block ``until`` (exclusive; None: all), nothing to interleave with."""
        while self.pos < len(self.steps) and (until is None or self.steps[self.pos][0] < until):
            self.step()
            self.start_ready()
            self.start_due()

    def finish(self) -> Any:
        self.alone()
        self._enter(len(self.blocks) - 1)
        self.start_due()
        return self.blocks[-1].output()


class _Backward(_Side):
    """B: one micro-batch's backward through a stage, one compute piece (dX, then dW) per step."""

    def __init__(self, run: StageRun, grad_out: torch.Tensor | None, pair: bool = False) -> None:
        super().__init__(run, "bwd", pair)
        for blk in self.blocks:  # events go to the stage's recorder of the moment, attached after the forward too
            blk.recorder = run.stage.recorder
        self.cur = len(run.blocks) - 1
        self.blocks[-1].begin_backward(grad_out)

    def _propagate(self, force_to: int | None = None) -> None:
        # Block b's input gradient is block b-1's output gradient: hand it over as soon as it is complete.
        while self.cur > 0:
            blk = self.blocks[self.cur]
            if not (blk.input_grad_final() or (force_to is not None and self.cur > force_to)):
                break
            blk.finish_input_grad()
            self.cur -= 1
            self.blocks[self.cur].begin_backward(blk.grad_in())

    def start_ready(self) -> None:
        for b in range(len(self.blocks) - 1, self.cur - 1, -1):
            blk = self.blocks[b]
            for i in reversed(range(len(blk.decl.pieces))):
                if not isinstance(blk.decl.pieces[i], Compute) and blk.startable_backward(i):
                    blk.start_backward(i)

    def dx(self) -> tuple[int, int]:
        b, i = self.steps[self.pos]
        self.pos += 1
        self._propagate(force_to=b)
        self.blocks[b].compute_dx(i, record=self.blocks[b].decl.paired)
        self._propagate()
        return b, i

    def dw(self, at: tuple[int, int]) -> None:
        b, i = at
        self.blocks[b].compute_dw(i, record=self.blocks[b].decl.paired)

    def step_alone(self) -> None:
        b, i = self.steps[self.pos]
        blk = self.blocks[b]
        if blk.decl.paired:
            at = self.dx()
            self.start_ready()
            self.dw(at)
        else:  # nothing interleaves with it: dX and dW as one span, then start what became ready
            with blk.span(blk.decl.pieces[i].name, "bwd"):
                at = self.dx()
                self.dw(at)
            self.start_ready()

    def alone(self, until: int | None = None) -> None:
        """Run the steps down to block ``until`` (exclusive; None: all)."""
        while self.pos < len(self.steps) and (until is None or self.steps[self.pos][0] > until):
            self.step_alone()

    def finish(self) -> torch.Tensor | None:
        """The remaining steps; returns the stage's input gradient."""
        self.alone()
        self._propagate(force_to=0)
        self.blocks[0].finish_input_grad()
        return self.blocks[0].grad_in()


def _paired(blocks: list[BlockRun]) -> list[int]:
    return [b for b, blk in enumerate(blocks) if blk.decl.paired]


def _pair(fwd: _Forward, fb: int, bwd: _Backward, bb: int) -> None:
    """Forward block ``fb`` beside backward block ``bb``, step by step of :data:`PAIR_ORDER`."""
    for step in PAIR_ORDER:
        if step == START_PREPARED:
            fwd.start_due()
            continue
        assert isinstance(step, Step)
        if step.direction == "fwd":
            for i in fwd.roles(fb).of(step):
                assert fwd.steps[fwd.pos] == (fb, i)
                fwd.step()
                fwd.start_ready()
        else:
            b_roles = bwd.roles(bb)
            pieces = b_roles.of(step)
            for j, i in enumerate(pieces):
                assert bwd.steps[bwd.pos] == (bb, i)
                at = bwd.dx()
                if step.role == SIDE and not b_roles.main and j == len(pieces) - 1:
                    fwd.start_due()  # B has no main pieces (a dense block): F's transfer flies under this dW
                bwd.start_ready()
                bwd.dw(at)


def _interleave(run0: StageRun, run1: StageRun, grad1: torch.Tensor | None) -> Any:
    """F of ``run0`` and B of ``run1`` interleaved; B's input gradient is delivered; returns F's output."""
    fwd, bwd = _Forward(run0, pair=True), _Backward(run1, grad1, pair=True)
    f_pairs, b_pairs = _paired(run0.blocks), _paired(run1.blocks)[::-1]
    bwd.start_ready()  # the output gradient is there: B's first communication starts at once
    if b_pairs:
        bwd.alone(until=b_pairs[0])  # the head's backward
    if f_pairs:
        fwd.alone(until=f_pairs[0])  # the embedding
    for fb, bb in zip(f_pairs, b_pairs):
        _pair(fwd, fb, bwd, bb)
    if len(b_pairs) <= len(f_pairs):
        # B is done with its blocks: its input gradient is computed while F's last communication flies.
        run1.deliver(bwd.finish())
        return fwd.finish()
    bwd.alone(until=b_pairs[-1] - 1)
    out = fwd.finish()
    run1.deliver(bwd.finish())
    return out


class _StageNode(torch.autograd.Function):
    """Autograd node standing for a whole stage: backward replays ``run.backward`` piece by piece."""

    @staticmethod
    def forward(ctx, run: Any, output: list[torch.Tensor], anchor: torch.Tensor, *inputs: torch.Tensor):
        ctx.run = run
        ctx.num_inputs = len(inputs)
        # Handed in a list, so it is not an input of the node and comes out as itself, not as a view: the
        # pipeline frees it once sent (it frees no views), and torch.distributed.pipelining's backward can
        # detach_() it in place.
        return output.pop()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        run = ctx.run
        if run is None:
            raise RuntimeError("this stage micro-batch was already backpropagated")
        ctx.run = None
        num_inputs = ctx.num_inputs
        if run.capture:
            # overlapped_forward_backward asked for the output gradient only; it runs the backward itself.
            run.captured_grad = grad_out
            return (None, None, None, *([None] * num_inputs))
        grad_in = run.backward(grad_out)
        grads = [None] * num_inputs
        if grad_in is not None and ctx.needs_input_grad[3]:
            grads[0] = grad_in
        return (None, None, None, *grads)


def stage_output(run: Any, output: torch.Tensor, inputs: Sequence[Any]) -> torch.Tensor:
    """``output`` made differentiable through one node whose backward is ``run.backward(grad) -> grad_in``.

    ``run`` also carries ``inputs`` and the ``capture`` / ``captured_grad`` pair :func:`pending_backward`
    uses. The node hangs off an empty anchor leaf too, so the output needs a gradient even when the input
    is token ids. Only tensors among ``inputs`` are graph inputs.
    """
    if not torch.is_grad_enabled():
        return output
    anchor = torch.empty(0, device=output.device, requires_grad=True)
    tensors = [x for x in inputs if isinstance(x, torch.Tensor)]
    return _StageNode.apply(run, [output.detach()], anchor, *tensors)


def _find_run(roots: Iterable[torch.Tensor]) -> Any:
    # Walk the graph from the roots to the nearest stage node (the loss graph above it is small).
    stack = [r.grad_fn for r in roots]
    # Nodes are kept, not only their ids: torch (2.11) makes a fresh Python object for a node on each
    # next_functions and frees it with its last reference, so a dropped node's id can come back as another's.
    seen: dict[int, Any] = {}
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if hasattr(node, "run") and type(node).__name__ == "_StageNodeBackward":
            if node.run is None:
                break
            return node.run
        stack.extend(nxt for nxt, _ in node.next_functions)
    raise RuntimeError("no pending stage forward found behind the given outputs/loss (already backpropagated?)")


def pending_backward(
    module1: nn.Module,
    loss1: torch.Tensor | None,
    outputs1: Sequence[torch.Tensor] | None,
    output_grads1: Sequence[torch.Tensor] | None,
) -> tuple[Any, torch.Tensor] | None:
    """The earlier micro-batch the hook must backpropagate: ``(its run, its output gradient)``.

    From ``loss1`` (a last stage: the loss the pipeline handed over, already scaled by its loss
    reduction): the loss graph above the stage is back-propagated to the stage output and ``loss1`` is
    detached in place, as the hook's contract asks. From ``outputs1`` and ``output_grads1`` (other stages):
    the gradient is the given one, and the node is told not to replay the backward again. ``None`` when
    nothing reaches module1's outputs (the reference's ``run_backward`` would be a no-op).
    """
    if loss1 is not None:
        run = _find_run([loss1])
        run.capture = True
        try:
            run_backward([loss1], [torch.ones_like(loss1)])
        finally:
            run.capture = False
        loss1.detach_()
        grad, run.captured_grad = run.captured_grad, None
        if grad is None:
            raise RuntimeError("loss1 does not depend on module1's output")
    elif not outputs1:
        return None
    else:
        if output_grads1 is None or len(output_grads1) != len(outputs1):
            raise ValueError("outputs1 needs one gradient per output in output_grads1")
        run = _find_run(outputs1)
        grad = output_grads1[0]
        # The backward is run here, piece by piece: the node must not replay it again.
        outputs1[0].grad_fn.run = None
    if getattr(run, "stage", module1) is not module1:
        raise RuntimeError("the outputs/loss given for module1 come from another module")
    return run, grad


def deliver_input_grad(inputs: Sequence[Any], grad_in: torch.Tensor | None) -> None:
    """Put the input gradient where a plain backward through the stage would: ``inputs[0].grad``, or on
    through whatever graph produced that input."""
    x = inputs[0] if inputs else None
    if grad_in is not None and isinstance(x, torch.Tensor) and x.requires_grad:
        run_backward([x], [grad_in])


def overlapped_forward_backward(
    module0: OverlapStage,
    inputs0: Sequence[torch.Tensor],
    criterion0: Callable[..., torch.Tensor] | None,
    labels0: Sequence[torch.Tensor],
    module1: OverlapStage,
    loss1: torch.Tensor | None,
    outputs1: Sequence[torch.Tensor] | None,
    output_grads1: Sequence[torch.Tensor] | None,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """DualPipe's hook for stages built from pieces (see the module docstring for the order)."""
    pending = pending_backward(module1, loss1, outputs1, output_grads1)
    if pending is None:
        outputs0 = [module0(*inputs0)]
    else:
        run1, grad1 = pending
        run0 = StageRun(module0, inputs0)
        out0 = _interleave(run0, run1, grad1)
        outputs0 = [stage_output(run0, out0, run0.inputs)]
    loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
    return outputs0, loss0


class OverlapStage(nn.Module):
    """A pipeline stage declared as blocks of pieces; subclasses implement :meth:`pieces`.

    ``recompute`` re-runs every compute piece before its backward instead of keeping its graph (a piece's
    own ``recompute`` overrides it); ``recorder`` (any object with ``record(name, direction, layer,
    edge)``) receives the pieces' events.
    """

    recompute: bool = False
    recorder: Recorder | None = None
    forward_takes_labels: bool = False
    """A stage that needs its micro-batch's labels in forward (a loss computed inside the stage, such
    as multi-token prediction's) sets this: the pipeline then calls ``stage(x, *labels)`` and the labels
    reach every piece as ``ctx.side``."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # class S(MyStage, OverlapStage): MyStage.forward would run instead of the pieces, and the overlapped
        # hook would later find no pending stage forward. Say so where the class is written.
        super().__init_subclass__(**kwargs)
        owner = next(c for c in cls.__mro__ if "forward" in vars(c))
        if not issubclass(owner, OverlapStage):
            raise TypeError(
                f"class {cls.__name__}: {owner.__name__}.forward comes before OverlapStage.forward in its bases and "
                f"would bypass the pieces; put OverlapStage first: class {cls.__name__}(OverlapStage, {owner.__name__})"
            )

    def pieces(self) -> Sequence[Pieces]:
        """The stage's blocks in forward order (built per micro-batch; cheap)."""
        raise NotImplementedError(f"{type(self).__name__} must implement pieces()")

    def forward(self, *inputs: Any) -> Any:
        run = StageRun(self, inputs)
        out = run.forward()
        return stage_output(run, out, run.inputs)

    @classmethod
    def overlapped_forward_backward(cls, *args: Any) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """DualPipe's hook (contract: :mod:`dualpipe.hooks`), built from the stages' pieces by
        :func:`overlapped_forward_backward`."""
        return overlapped_forward_backward(*args)

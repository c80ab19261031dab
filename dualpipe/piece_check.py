"""Check each piece of a stage's blocks on its own: the backward the runtime runs against a reference.

:func:`dualpipe.testing.check_overlap` proves that the overlapped hook leaves what a plain forward and backward
of the same stage would: it compares the stage with itself, two ways of running the same pieces. A wrong piece
(a communication whose backward is not the transfer back, a layer whose deferred weight gradient adds the
wrong thing) is wrong in both runs and passes it. :func:`check_pieces` checks the pieces themselves::

    from dualpipe.piece_check import check_pieces

    check_pieces(stage, x).raise_if_failed()   # on every rank of the stage's groups, same structure

For each block of ``stage.pieces()`` in order, fed with the previous block's output (the first with ``x``):

- a :class:`~dualpipe.pieces.Compute` piece runs under autograd twice on the same inputs with the same
  random output gradients: the reference backward with weight gradients computed at once (every
  ``WeightGradStore`` closure runs where it is put), then the runtime's split, its input gradients (*dX*)
  with the closures held back and then run (*dW*). Every input gradient and every parameter gradient must
  agree: a closure that captures the wrong tensor, runs twice or never, or a layer that needs the store
  disabled, shows here, named.
- a :class:`~dualpipe.pieces.Comm` piece is a linear map of its floating-point inputs (a transfer, a sum of
  partial rows), so its backward must be its adjoint: ``<forward(x), y> == <x, backward(y)>`` for random
  ``y``, summed over the ranks of ``group`` (the dot-product test). Each input is tested alone (the others
  zeroed), so a failure names it; a gradient of the wrong shape or dtype, or missing, is named too. A transfer
  that quantizes (FP8 dispatch) is linear only up to its rounding: loosen ``rtol`` for it (1e-2 holds).

What it does not prove: that a layer's own autograd formula is right (the reference is autograd through the
same layers; test those against their own references), and that the overlap schedules the pieces well. Each
piece's forward runs more than once, so stateful layers (running statistics, load counters) advance; the
random state is restored before each rerun, so dropout draws the same masks. Call it on every rank of the
stage's communication groups, with inputs of the same structure: the pieces' collectives run in the same order
everywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dualpipe.collectives import Pending
from dualpipe.pieces import Comm, Compute, Context, Pieces
from dualpipe.testing import Check, OverlapReport, _Comparer
from dualpipe.utils import run_backward
from dualpipe.weight_grad import GradStore

__all__ = ["check_pieces"]


def check_pieces(
    stage: nn.Module,
    *inputs: Any,
    rtol: float = 1e-5,
    atol: float = 1e-8,
    seed: int = 0,
    group: dist.ProcessGroup | None = None,
) -> OverlapReport:
    """Check every piece of ``stage.pieces()`` (an :class:`~dualpipe.overlap.OverlapStage`) on ``inputs`` (the
    stage's input, then any side inputs such as a last stage's labels).

    rtol, atol: a tensor passes when ``max |got - ref| <= atol + rtol * max |ref|``; the dot products when
    ``|<forward(x), y> - <x, backward(y)>| <= atol + rtol * max(|forward(x)| |y|, |x| |backward(y)|)`` (norms
    over the group). seed: the random output
    gradients. group: the ranks the communication pieces span (their dot products are summed over it);
    None: the default group when one is initialised.

    Returns an :class:`~dualpipe.testing.OverlapReport` whose rows are ``block L piece/tensor``.
    """
    report = OverlapReport(type(stage).__name__, rtol, atol, title="pieces")
    cmp = _Comparer(report, rtol, atol)
    gen = torch.Generator().manual_seed(seed)
    params = {name: p for name, p in stage.named_parameters() if p.requires_grad}
    kept = _take_grads(params.values())
    if group is None and dist.is_available() and dist.is_initialized():
        group = dist.group.WORLD
    try:
        x, side = inputs[0], tuple(inputs[1:])
        for block in stage.pieces():
            x = _check_block(block, x, side, params, cmp, gen, group)
    finally:
        _restore_grads(params.values(), kept)
    return report


def _check_block(
    block: Pieces,
    x: Any,
    side: tuple[Any, ...],
    params: dict[str, nn.Parameter],
    cmp: _Comparer,
    gen: torch.Generator,
    group: dist.ProcessGroup | None,
) -> Any:
    ctx = Context()
    ctx.side = side
    values: dict[str, Any] = {block.input: _plain(x)}
    comms: list[tuple[Comm, tuple[Any, ...], tuple[Any, ...]]] = []
    for piece in block.pieces:
        where = f"block {block.layer} {piece.name}"
        args = tuple(values[n] for n in piece.inputs)
        if isinstance(piece, Compute):
            outs = _check_compute(piece, ctx, args, params, where, cmp, gen)
        else:
            alone, outs = _comm_forwards(piece, ctx, args)
            comms.append((piece, args, (outs, alone)))
        values.update(zip(piece.outputs, (_plain(o) for o in outs)))
    # The transfers back in the runtime's order (last first): a backward may use what a later forward left.
    for piece, args, outs in reversed(comms):
        _check_comm(piece, ctx, args, outs, f"block {block.layer} {piece.name}", cmp, gen, group)
    return sum(values[n] for n in block.output)


# -- compute pieces ---------------------------------------------------------------------------------------
def _check_compute(
    piece: Compute,
    ctx: Context,
    args: tuple[Any, ...],
    params: dict[str, nn.Parameter],
    where: str,
    cmp: _Comparer,
    gen: torch.Generator,
) -> tuple[Any, ...]:
    rng = _rng_state()
    # Reference: one backward, every weight-gradient closure run where a layer puts it.
    with GradStore().activate(enabled=False):
        ref_leaves, ref_outs = _run(piece, ctx, args)
        output_grads = [_randn_like(o, gen) if _differentiable(o) else None for o in ref_outs]
        _backward(ref_outs, output_grads)
    ref_inputs = [_grad_of(leaf) for leaf in ref_leaves]
    ref_weights = _take_grads(params.values())
    # The runtime: dX with the closures held in a store, then dW runs them.
    _set_rng_state(rng)
    store = GradStore()
    with store.activate(enabled=True):
        leaves, outs = _run(piece, ctx, args)
        _backward(outs, output_grads)
    store.flush()
    for name, leaf, want in zip(piece.inputs, leaves, ref_inputs):
        if want is not None or _grad_of(leaf) is not None:
            _compare(cmp, where, f"dX {name}", _grad_of(leaf), want)
    with torch.no_grad():
        store.pop()
    got_weights = _take_grads(params.values())
    for (name, _), got, want in zip(params.items(), got_weights, ref_weights):
        if got is not None or want is not None:
            _compare(cmp, where, f"dW {name}", got, want)
    return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in ref_outs)


def _run(piece: Compute, ctx: Context, args: tuple[Any, ...]) -> tuple[list[Any], tuple[Any, ...]]:
    # Fresh copies each run: a piece may free an input it is the last reader of (the rows an all-to-all
    # delivered, moe.models.experts' free_input).
    leaves = [
        a.detach().clone().requires_grad_(a.is_floating_point()) if isinstance(a, torch.Tensor) else a for a in args
    ]
    with torch.enable_grad():
        out = piece.fn(ctx, *leaves)
    outs = out if isinstance(out, tuple) else (out,)
    if len(outs) != len(piece.outputs):
        raise ValueError(f"Compute {piece.name!r} returned {len(outs)} values for outputs {piece.outputs}")
    return leaves, outs


def _backward(outs: Sequence[Any], grads: Sequence[torch.Tensor | None]) -> None:
    pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
    if pairs:
        run_backward([o for o, _ in pairs], [g for _, g in pairs])


# -- communication pieces ---------------------------------------------------------------------------------
def _comm_forwards(
    piece: Comm, ctx: Context, args: tuple[Any, ...]
) -> tuple[dict[int, tuple[Any, ...]], tuple[Any, ...]]:
    """(per floating-point input, the outputs with every other floating-point input zeroed; the outputs). The
    whole forward runs last, so what it leaves in ctx is what the backward finds."""
    floating = [i for i, a in enumerate(args) if _floating(a)]
    alone = {}
    for i in floating:
        only = tuple(a if j == i or j not in floating else torch.zeros_like(a) for j, a in enumerate(args))
        alone[i] = _transfer(piece, ctx, only)
    return alone, _transfer(piece, ctx, args)


def _transfer(piece: Comm, ctx: Context, args: tuple[Any, ...]) -> tuple[Any, ...]:
    if piece.prepare is not None:
        prepared = piece.prepare(ctx, *args)
        if isinstance(prepared, Pending):
            prepared.wait()
    out = piece.forward(ctx, *args).wait()
    return out if isinstance(out, tuple) else (out,)


def _check_comm(
    piece: Comm,
    ctx: Context,
    args: tuple[Any, ...],
    forwards: tuple[Any, ...],
    where: str,
    cmp: _Comparer,
    gen: torch.Generator,
    group: dist.ProcessGroup | None,
) -> None:
    outs, alone = forwards
    output_grads = [_randn_like(o, gen) if _floating(o) else None for o in outs]
    grads = piece.backward(ctx, *output_grads).wait()
    grads = grads if isinstance(grads, tuple) else (grads,)
    for i, (name, arg) in enumerate(zip(piece.inputs, args)):
        if not _floating(arg):
            continue
        grad = grads[i] if i < len(grads) else None
        if grad is None:
            if name not in piece.no_grad:
                cmp.fail(where, f"adjoint {name}", "the backward gave no gradient for this input")
            continue
        if grad.shape != arg.shape or grad.dtype != arg.dtype:
            note = f"gradient {tuple(grad.shape)}, {grad.dtype} for an input of {tuple(arg.shape)}, {arg.dtype}"
            cmp.fail(where, f"adjoint {name}", note)
            continue
        sent = [(o, g) for o, g in zip(alone[i], output_grads) if g is not None]
        sums = torch.stack(
            [
                sum((_dot(o, g) for o, g in sent), torch.zeros((), dtype=torch.float64)),
                _dot(arg, grad),
                sum((_dot(o, o) for o, _ in sent), torch.zeros((), dtype=torch.float64)),
                sum((_dot(g, g) for _, g in sent), torch.zeros((), dtype=torch.float64)),
                _dot(arg, arg),
                _dot(grad, grad),
            ]
        )
        if group is not None:
            sums = sums.to(_collective_device(group, arg.device))
            dist.all_reduce(sums, group=group)
        fwd, bwd, out_sq, y_sq, x_sq, g_sq = sums.tolist()
        err = abs(fwd - bwd)
        # the products' natural size (Cauchy-Schwarz): a dot product of random vectors nearly cancels
        scale = max((out_sq * y_sq) ** 0.5, (x_sq * g_sq) ** 0.5)
        ok = err <= cmp.atol + cmp.rtol * scale
        note = "" if ok else f"<forward(x), y> = {fwd:.6g} but <x, backward(y)> = {bwd:.6g}: not the transfer back"
        cmp.report.checks.append(Check(where, f"adjoint {name}", ok, err, err / scale if scale else 0.0, note))


# -- helpers ----------------------------------------------------------------------------------------------
def _compare(cmp: _Comparer, where: str, name: str, got: torch.Tensor | None, want: torch.Tensor | None) -> None:
    if got is None or want is None:
        missing = "the runtime's dX/dW" if got is None else "the reference backward"
        cmp.fail(where, name, f"no gradient from {missing}")
        return
    cmp.compare(where, name, got, want)


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.detach().double() * b.detach().double()).sum()


def _floating(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _differentiable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.requires_grad


def _randn_like(t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(t.shape, generator=gen, dtype=torch.float32).to(device=t.device, dtype=t.dtype)


def _plain(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _grad_of(leaf: Any) -> torch.Tensor | None:
    return leaf.grad if isinstance(leaf, torch.Tensor) else None


def _take_grads(params: Iterator[nn.Parameter] | Any) -> list[torch.Tensor | None]:
    """Each parameter's ``.grad`` (None where it has none), leaving them all None."""
    out = []
    for p in params:
        out.append(p.grad)
        p.grad = None
    return out


def _restore_grads(params: Any, grads: list[torch.Tensor | None]) -> None:
    for p, g in zip(params, grads):
        p.grad = g


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _collective_device(group: dist.ProcessGroup, device: torch.device) -> torch.device:
    # gloo reduces CPU tensors, NCCL CUDA ones
    with contextlib.suppress(RuntimeError):
        if dist.get_backend(group) == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu") if device.type != "cuda" else device

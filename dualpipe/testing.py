"""Check a stage class's ``overlapped_forward_backward`` hook against a plain forward-then-backward.

A hook (:class:`dualpipe.hooks.OverlappedForwardBackward`) must leave exactly what the pipeline would get
without it: the same loss and outputs for the forward micro-batch, the same gradients for the backward one.
:func:`check_overlap` runs two micro-batches A and B on two fresh copies of a stage and compares::

    reference:  F(A)  B(A)  F(B)                       |  B(B)  |
    tested:     F(A)  hook[F(B) overlapped with B(A)]  |  B(B)  |
                                      checks at "hook" ^        ^ checks at "B(B)"

At "hook": loss and outputs of B, every parameter gradient (by name), every buffer, the input
gradients of A (where the pipeline reads them), ``loss1`` detached in place, and outputs (or loss) of B
still differentiable. Then a plain backward of B runs on both copies and every gradient is compared again
(the pipeline later backpropagates through what the hook returned). Example, in a user's test::

    from dualpipe.testing import check_overlap

    def make_stage():
        torch.manual_seed(0)  # both copies must start from the same weights
        return MyStage(hidden=16).double()

    check_overlap(make_stage, (x_a, x_b), criterion=mse, labels=(y_a, y_b)).raise_if_failed()

``raise_if_failed`` raises an ``AssertionError`` whose message is the report's table (``str(report)``)::

    overlapped_forward_backward of ScaledGrad: FAILED, 5 of 9 checks (rtol=1e-05, atol=1e-08)
    after  check                     max abs err  rel err   result
    setup  copies identical          -            -         ok
    hook   outputs B[0]              0            0         ok
    hook   outputs B[0] has a graph  -            -         ok
    hook   input grad A[0]           1.93e+00     1.00e+00  FAIL
    hook   grad up.weight            2.44e+00     1.00e+00  FAIL
    ...

Where it can tell, a failing row says what went wrong: "the hook did not deliver the input gradient (.grad is
None)", "loss1 still holds its graph: call loss1.detach_() after its backward", "detached: the pipeline
cannot backpropagate through outputs0", ".grad overwritten instead of accumulated into".

How the pipeline calls the hook, and so how the tester does:

- a last stage (``criterion`` given) backpropagates micro-batch A from ``loss1 = criterion(*outputs,
  *labels)``; other stages from their outputs with output gradients (``output_grads``, or seeded random ones
  shaped like the floating-point outputs);
- before the hook, A's outputs have their storage freed, as the pipeline frees activations it has sent
  (only the autograd graph may be used, never the values);
- floating-point inputs are fresh leaves that require grad (as received activations); integer inputs
  (token ids) get no gradient;
- parameter gradients of the tested copy are primed with seeded random values before the hook, and
  compared as the increment over them: a hook must accumulate into ``.grad`` (earlier micro-batches'
  gradients are there in a pipeline), not overwrite it. The priming adds rounding of about half an ulp of
  the largest gradient entry: compare in float32 or float64, or loosen ``rtol`` for low precision.

Two different stage modules (a DualPipeV rank holds stage r and 2N-1-r; DualPipe pairs r and N-1-r):
``make_stage`` returns ``(module0, module1)``: A runs on ``module1`` (its backward is the hook's), B on
``module0``; ``criterion`` then takes one per micro-batch, ``(for A, for B)``, ``None`` where that stage is
not last. With expert parallelism call it on every rank of the ep group with the same arguments' structure:
the stages' collectives run in the same order on every rank (the reference copy first, then the tested one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from dualpipe.hooks import has_overlap_hook
from dualpipe.utils import run_backward
from dualpipe.weight_grad import GradStore

__all__ = ["Check", "OverlapReport", "check_overlap"]

Tensors = torch.Tensor | Sequence[torch.Tensor | None]
Criterion = Callable[..., torch.Tensor]
_A, _B = 0, 1  # micro-batch indices in every (A, B) pair


@dataclass(frozen=True, slots=True)
class Check:
    """One comparison: ``phase`` ("setup", "hook" or "B(B)"), what was checked, and how it went."""

    phase: str
    name: str
    ok: bool
    max_abs: float | None = None  # max |got - reference|
    rel: float | None = None  # max_abs / max |reference|
    note: str = ""


@dataclass(slots=True)
class OverlapReport:
    """Every check of one :func:`check_overlap` run; ``str(report)`` is a table, failures included."""

    subject: str
    rtol: float
    atol: float
    checks: list[Check] = field(default_factory=list)
    title: str = "overlapped_forward_backward"
    """What was checked (the report's first words): the hook, or the ``pieces`` (:mod:`dualpipe.piece_check`)."""

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def check(self, name: str, phase: str = "hook") -> Check:
        """The check called ``name`` in ``phase`` (``KeyError`` if none ran)."""
        for c in self.checks:
            if c.name == name and c.phase == phase:
                return c
        raise KeyError(f"no check {name!r} in phase {phase!r}")

    def raise_if_failed(self) -> OverlapReport:
        """Raise ``AssertionError(str(self))`` when any check failed; return ``self`` otherwise."""
        if not self.ok:
            raise AssertionError(str(self))
        return self

    def __str__(self) -> str:
        verdict = "ok" if self.ok else f"FAILED, {len(self.failures)} of {len(self.checks)} checks"
        head = f"{self.title} of {self.subject}: {verdict} (rtol={self.rtol:g}, atol={self.atol:g})"
        rows = [
            (
                "after" if self.title == "overlapped_forward_backward" else "where",
                "check",
                "max abs err",
                "rel err",
                "result",
            )
        ]
        for c in self.checks:
            result = ("ok" if c.ok else "FAIL") + (f"  {c.note}" if c.note else "")
            rows.append((c.phase, c.name, _num(c.max_abs), _num(c.rel), result))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
        return "\n".join([head, *lines])


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return "0" if x == 0 else f"{x:.2e}"


def check_overlap(
    make_stage: Callable[[], nn.Module | tuple[nn.Module, nn.Module]],
    inputs: tuple[Tensors, Tensors],
    *,
    criterion: Criterion | tuple[Criterion | None, Criterion | None] | None = None,
    labels: tuple[Tensors | None, Tensors | None] | None = None,
    output_grads: tuple[Tensors | None, Tensors | None] | None = None,
    rtol: float = 1e-5,
    atol: float = 1e-8,
    seed: int = 0,
) -> OverlapReport:
    """Run the stage's hook (forward of B overlapped with backward of A) against plain autograd.

    Args:
        make_stage: builds a fresh stage with identical deterministic parameters on every call (called
            twice: the reference and the copy under test); or a pair ``(module0, module1)`` of one class.
        inputs: ``(inputs of A, inputs of B)``, each a tensor or a sequence of tensors.
        criterion: ``criterion(*outputs, *labels) -> loss`` for a last stage (then A's backward starts from
            its loss); with a pair of modules, one per micro-batch ``(for A, for B)``.
        labels: ``(labels of A, labels of B)`` for the criterion.
        output_grads: ``(for A's outputs, for B's outputs)`` where no criterion applies; ``None`` (or a
            ``None`` entry) draws seeded random gradients for the floating-point outputs.
        rtol, atol: a tensor passes when ``max |got - ref| <= atol + rtol * max |ref|``.
        seed: seeds the generated output gradients and the primed parameter gradients.

    Returns an :class:`OverlapReport`; it raises only for misuse (wrong arguments, a class without the hook)
    and lets exceptions of the stage itself propagate.
    """
    ref_modules, test_modules = _build(make_stage), _build(make_stage)
    if not has_overlap_hook(*test_modules):
        raise TypeError(
            f"{type(test_modules[0]).__name__} does not define overlapped_forward_backward "
            "(or the two modules are of different classes)"
        )
    mbs = _micro_batches(inputs, criterion, labels, output_grads)
    pair = test_modules[0] is not test_modules[1]
    subject = type(test_modules[0]).__name__ + (" (two modules)" if pair else "")
    report = OverlapReport(subject, rtol, atol)
    cmp = _Comparer(report, rtol, atol)
    cmp.same_copies(ref_modules, test_modules)
    gen = torch.Generator().manual_seed(seed)
    # A private weight-gradient store, disabled, as the executor runs the hook: a WeightGradStore flag
    # left set by the caller must not defer (and so hide) weight gradients here.
    with GradStore().activate(enabled=False):
        expected = _reference(ref_modules, mbs, gen)
        _tested(test_modules, mbs, expected, cmp, gen)
    return report


# -- the two runs ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class _MicroBatch:
    inputs: list[torch.Tensor | None]
    criterion: Criterion | None
    labels: list[torch.Tensor]
    output_grads: list[torch.Tensor | None] | None  # None: generate


@dataclass(slots=True)
class _Expected:
    """What the reference left at both check points, and the gradients it fed."""

    loss_b: torch.Tensor | None = None
    outputs_b: list[torch.Tensor] = field(default_factory=list)
    differentiable_b: list[bool] = field(default_factory=list)
    input_grads: list[list[torch.Tensor | None]] = field(default_factory=list)  # per micro-batch
    grads: list[dict[str, torch.Tensor | None]] = field(default_factory=list)  # per check point
    buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    output_grads: list[list[torch.Tensor | None]] = field(default_factory=lambda: [[], []])


def _reference(modules: tuple[nn.Module, nn.Module], mbs: list[_MicroBatch], gen: torch.Generator) -> _Expected:
    module0, module1 = modules
    exp = _Expected()
    inputs_a, inputs_b = _leaves(mbs[_A].inputs), _leaves(mbs[_B].inputs)
    outputs_a = _forward(module1, inputs_a)
    exp.output_grads[_A] = _output_grads(mbs[_A], outputs_a, gen)
    _backward(mbs[_A], outputs_a, exp.output_grads[_A])
    exp.input_grads.append(_input_grads(inputs_a))
    outputs_b = _forward(module0, inputs_b)
    exp.outputs_b = [o.detach().clone() for o in outputs_b]
    exp.differentiable_b = [o.requires_grad for o in outputs_b]
    if mbs[_B].criterion is not None:
        exp.loss_b = mbs[_B].criterion(*outputs_b, *mbs[_B].labels)
    exp.grads.append(_grads(modules))
    exp.buffers = _buffers(modules)
    exp.output_grads[_B] = _output_grads(mbs[_B], outputs_b, gen)
    _backward(mbs[_B], outputs_b, exp.output_grads[_B], exp.loss_b)
    exp.input_grads.append(_input_grads(inputs_b))
    exp.grads.append(_grads(modules))
    if exp.loss_b is not None:
        exp.loss_b = exp.loss_b.detach()
    return exp


def _tested(
    modules: tuple[nn.Module, nn.Module], mbs: list[_MicroBatch], exp: _Expected, cmp: _Comparer, gen: torch.Generator
) -> None:
    module0, module1 = modules
    primes = _prime_grads(modules, exp.grads, gen)
    inputs_a, inputs_b = _leaves(mbs[_A].inputs), _leaves(mbs[_B].inputs)
    outputs_a = _forward(module1, inputs_a)
    a, b = mbs
    if a.criterion is not None:
        loss1 = a.criterion(*outputs_a, *a.labels)
        outputs1, grads1 = [], []
    else:
        loss1 = None
        outputs1, grads1 = _pairs(outputs_a, exp.output_grads[_A])
        for t in outputs1:  # the pipeline frees sent activations: only their graph is left
            if t._base is None:
                t.data = torch.empty(0, dtype=t.dtype, device=t.device)
    try:
        result = type(module0).overlapped_forward_backward(
            module0, inputs_b, b.criterion, list(b.labels), module1, loss1, outputs1, grads1
        )
    except Exception as e:
        if outputs1 and hasattr(e, "add_note"):  # Python 3.11+
            e.add_note(
                "(check_overlap freed the storage of outputs1 before the hook, as the pipeline frees the "
                "activations it sent: if the error is about their shape or values, backpropagate with "
                "dualpipe.utils.run_backward, which needs only their graph)"
            )
        raise

    if not (isinstance(result, (tuple, list)) and len(result) == 2):
        cmp.fail("hook", "returns (outputs0, loss0)", f"it returned {type(result).__name__}")
        return
    outputs0, loss0 = result
    outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else list(outputs0)
    differentiable = cmp.forward_b(outputs0, loss0, exp, b.criterion is not None)
    if loss1 is not None:
        cmp.detached(loss1)
    cmp.tensors("hook", "input grad A", _input_grads(inputs_a), exp.input_grads[_A], inputs_a)
    cmp.grads("hook", _grads(modules), exp.grads[0], primes)
    cmp.buffers(_buffers(modules), exp.buffers)

    if not differentiable:
        cmp.fail("B(B)", "plain backward of B", "skipped: the hook's outputs (or loss) of B have no graph")
        return
    _backward(b, outputs0, exp.output_grads[_B], loss0)
    cmp.tensors("B(B)", "input grad B", _input_grads(inputs_b), exp.input_grads[_B], inputs_b)
    cmp.grads("B(B)", _grads(modules), exp.grads[1], primes)


# -- comparisons ----------------------------------------------------------------------------------------
class _Comparer:
    def __init__(self, report: OverlapReport, rtol: float, atol: float) -> None:
        self.report, self.rtol, self.atol = report, rtol, atol

    def add(self, phase: str, name: str, ok: bool, max_abs=None, rel=None, note: str = "") -> None:
        self.report.checks.append(Check(phase, name, ok, max_abs, rel, note))

    def fail(self, phase: str, name: str, note: str) -> None:
        self.add(phase, name, False, note=note)

    def compare(self, phase: str, name: str, got: torch.Tensor, want: torch.Tensor, note: str = "") -> bool:
        """Add the check ``max |got - want| <= atol + rtol * max |want|``; ``note`` explains a failure."""
        if got.shape != want.shape:
            self.fail(phase, name, f"shape {tuple(got.shape)}, reference {tuple(want.shape)}")
            return False
        if got.dtype != want.dtype:
            self.fail(phase, name, f"dtype {got.dtype}, reference {want.dtype}")
            return False
        if got.numel() == 0:
            self.add(phase, name, True, 0.0, 0.0)
            return True
        got64, want64 = got.detach().double(), want.detach().double()
        max_abs = (got64 - want64).abs().max().item()
        scale = want64.abs().max().item()
        rel = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else math.inf)
        ok = max_abs <= self.atol + self.rtol * scale  # NaN fails
        self.add(phase, name, ok, max_abs, rel, "" if ok else note)
        return ok

    def same_copies(self, ref: tuple[nn.Module, nn.Module], test: tuple[nn.Module, nn.Module]) -> None:
        a, b = _state(ref), _state(test)
        differ = sorted(n for n in a.keys() | b.keys() if n not in a or n not in b or not torch.equal(a[n], b[n]))
        if differ:
            more = f" (+{len(differ) - 3} more)" if len(differ) > 3 else ""
            self.fail(
                "setup",
                "copies identical",
                f"make_stage() built different copies: {', '.join(differ[:3])}{more}; seed its initialisation",
            )
        else:
            self.add("setup", "copies identical", True)

    def forward_b(self, outputs0: list, loss0, exp: _Expected, is_last: bool) -> bool:
        """Loss and outputs of B; returns whether what B's backward starts from is differentiable."""
        differentiable = True
        if is_last:
            if not isinstance(loss0, torch.Tensor):
                self.fail("hook", "loss B", "the hook returned no loss for a last stage (loss0 is None)")
                return False
            assert exp.loss_b is not None
            self.compare("hook", "loss B", loss0, exp.loss_b)
            differentiable = loss0.requires_grad
            self.add("hook", "loss B has a graph", differentiable, note="" if differentiable else "loss0 is detached")
        elif loss0 is not None:
            self.fail("hook", "loss B", "the hook returned a loss without a criterion (loss0 must be None)")
        if len(outputs0) != len(exp.outputs_b):
            self.fail("hook", "outputs B", f"{len(outputs0)} outputs, reference {len(exp.outputs_b)}")
            return False
        for i, (got, want) in enumerate(zip(outputs0, exp.outputs_b)):
            self.compare("hook", f"outputs B[{i}]", got, want)
            if not is_last and exp.differentiable_b[i]:
                ok = got.requires_grad
                note = "" if ok else "detached: the pipeline cannot backpropagate through outputs0"
                self.add("hook", f"outputs B[{i}] has a graph", ok, note=note)
                differentiable &= ok
        return differentiable

    def detached(self, loss1: torch.Tensor) -> None:
        ok = loss1.grad_fn is None and not loss1.requires_grad
        note = "" if ok else "loss1 still holds its graph: call loss1.detach_() after its backward"
        self.add("hook", "loss1 detached in place", ok, note=note)

    def tensors(self, phase: str, name: str, got: list, want: list, inputs: list) -> None:
        """Input gradients: ``None`` where the plain backward leaves none must stay ``None``."""
        for i, (g, w, x) in enumerate(zip(got, want, inputs)):
            label = f"{name}[{i}]"
            if x is None or not x.requires_grad:
                continue  # integer inputs (token ids) get no gradient
            if g is None and w is None:
                self.add(phase, label, True, note="no gradient, as the reference")
            elif g is None:
                self.fail(phase, label, "the hook did not deliver the input gradient (.grad is None)")
            elif w is None:
                self.fail(phase, label, "a gradient where the plain backward leaves none")
            else:
                self.compare(phase, label, g, w)

    def grads(self, phase: str, got: dict, want: dict, primes: dict) -> None:
        """Parameter gradients, as the increment over the primed ``.grad`` (``None``: zero increment)."""
        for name, w in want.items():
            g, prime = got[name], primes.get(name)
            label = f"grad {name}"
            if g is None:
                if prime is None and w is None:
                    self.add(phase, label, True, note="no gradient, as the reference")
                else:
                    self.fail(phase, label, ".grad was reset to None")
                continue
            increment = g if prime is None else g - prime
            w = torch.zeros_like(increment) if w is None else w
            self.compare(phase, label, increment, w, _grad_hint(g, increment, w, prime))

    def buffers(self, got: dict, want: dict) -> None:
        for name, w in want.items():
            self.compare("hook", f"buffer {name}", got[name], w)


def _grad_hint(grad: torch.Tensor, increment: torch.Tensor, want: torch.Tensor, prime: torch.Tensor | None) -> str:
    """Name the likely mistake behind a wrong parameter gradient (shown only when the check fails)."""
    if prime is None or grad.shape != want.shape:
        return ""
    scale = want.abs().max().item()
    if scale > 0 and not increment.any():
        return "no gradient accumulated into .grad"
    if scale > 0 and (grad - want).abs().max().item() <= 1e-3 * scale:
        return ".grad overwritten instead of accumulated into"
    return ""


# -- helpers --------------------------------------------------------------------------------------------
def _build(make_stage: Callable[[], nn.Module | tuple[nn.Module, nn.Module]]) -> tuple[nn.Module, nn.Module]:
    built = make_stage()
    if isinstance(built, nn.Module):
        return built, built
    if isinstance(built, (tuple, list)) and len(built) == 2 and all(isinstance(m, nn.Module) for m in built):
        return built[0], built[1]
    raise TypeError(f"make_stage() must return a module or a pair of modules, got {type(built).__name__}")


def _pair(value, what: str) -> tuple:
    if not (isinstance(value, (tuple, list)) and len(value) == 2):
        raise ValueError(f"{what} must be a pair (for micro-batch A, for micro-batch B)")
    return tuple(value)


def _listed(x: Tensors | None) -> list:
    if x is None:
        return []
    return [x] if isinstance(x, torch.Tensor) else list(x)


def _micro_batches(inputs, criterion, labels, output_grads) -> list[_MicroBatch]:
    inputs = _pair(inputs, "inputs")
    criteria = _pair(criterion, "criterion") if isinstance(criterion, (tuple, list)) else (criterion, criterion)
    labels = _pair(labels, "labels") if labels is not None else (None, None)
    grads = _pair(output_grads, "output_grads") if output_grads is not None else (None, None)
    return [
        _MicroBatch(
            _listed(inputs[i]), criteria[i], _listed(labels[i]), None if grads[i] is None else _listed(grads[i])
        )
        for i in (_A, _B)
    ]


def _leaves(inputs: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Fresh copies: floating-point ones are leaves that require grad (as activations received from the
    previous stage), the others (token ids) are plain."""
    out = []
    for x in inputs:
        if x is None:
            out.append(None)
        elif x.is_floating_point():
            out.append(x.detach().clone().requires_grad_())
        else:
            out.append(x.clone())
    return out


def _forward(module: nn.Module, inputs: list) -> list[torch.Tensor]:
    outputs = module(*inputs)
    return [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)


def _output_grads(mb: _MicroBatch, outputs: list[torch.Tensor], gen: torch.Generator) -> list:
    if mb.criterion is not None:
        return []
    if mb.output_grads is not None:
        if len(mb.output_grads) != len(outputs):
            raise ValueError(f"output_grads has {len(mb.output_grads)} tensors for {len(outputs)} outputs")
        return mb.output_grads
    return [
        torch.randn(o.shape, generator=gen).to(o.device, o.dtype) if o.requires_grad and o.is_floating_point() else None
        for o in outputs
    ]


def _pairs(outputs: list[torch.Tensor], grads: list) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs backward starts from and their gradients, selected as the executor does."""
    kept = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
    return [o for o, _ in kept], [g for _, g in kept]


def _backward(mb: _MicroBatch, outputs: list, grads: list, loss: torch.Tensor | None = None) -> None:
    if mb.criterion is not None:
        if loss is None:
            loss = mb.criterion(*outputs, *mb.labels)
        loss.backward()
        return
    outs, gs = _pairs(outputs, grads)
    if outs:
        run_backward(outs, gs)


def _input_grads(inputs: list) -> list[torch.Tensor | None]:
    return [None if x is None or x.grad is None else x.grad.detach().clone() for x in inputs]


def _named(modules: tuple[nn.Module, nn.Module], what: str) -> dict[str, torch.Tensor]:
    """Parameters (or buffers) by name, ``module0.``/``module1.`` prefixed for a pair. A tensor both
    modules share (tied embedding and head on a DualPipeV rank) is listed once, under its first name."""
    pair = modules[0] is not modules[1]
    out, seen = {}, set()
    for i, m in enumerate(modules[: 2 if pair else 1]):
        prefix = f"module{i}." if pair else ""
        for n, t in m.named_parameters() if what == "parameters" else m.named_buffers():
            if id(t) not in seen:
                seen.add(id(t))
                out[prefix + n] = t
    return out


def _grads(modules: tuple[nn.Module, nn.Module]) -> dict[str, torch.Tensor | None]:
    return {
        n: None if p.grad is None else p.grad.detach().clone()
        for n, p in _named(modules, "parameters").items()
        if p.requires_grad
    }


def _buffers(modules: tuple[nn.Module, nn.Module]) -> dict[str, torch.Tensor]:
    return {n: b.detach().clone() for n, b in _named(modules, "buffers").items()}


def _state(modules: tuple[nn.Module, nn.Module]) -> dict[str, torch.Tensor]:
    return {**_named(modules, "parameters"), **_named(modules, "buffers")}


def _prime_grads(
    modules: tuple[nn.Module, nn.Module], expected: list[dict[str, torch.Tensor | None]], gen: torch.Generator
) -> dict[str, torch.Tensor]:
    """Set every parameter's ``.grad`` to seeded values a sixteenth of the reference gradients' magnitude.

    Large enough that a hook overwriting ``.grad`` fails by far; small enough that accumulating into them
    rounds the gradient by at most about half an ulp of its largest entry. Zero where no backward reaches.
    """
    primes = {}
    for name, p in _named(modules, "parameters").items():
        if not p.requires_grad:
            continue
        scale = max((g.abs().max().item() for g in (e[name] for e in expected) if g is not None), default=0.0)
        prime = (torch.randn(p.shape, generator=gen) * (scale / 16)).to(p.device, p.dtype)
        p.grad = prime.clone()
        primes[name] = prime
    return primes

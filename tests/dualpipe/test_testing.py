"""``dualpipe.testing.check_overlap``: the toy's hook passes, broken hooks fail with the right message, and
the MoE stage's hook matches plain autograd on 2 gloo ranks (expert parallelism)."""

from __future__ import annotations

import re

import pytest
import torch

from dualpipe.testing import OverlapReport, check_overlap
from dualpipe.utils import run_backward
from tests.dualpipe.toy import NoInputGrad, ToyStage, ToyStageOverlap, criterion, plain_backward

HIDDEN = 8


def _make(cls: type[ToyStage] = ToyStageOverlap, seed: int = 0):
    def make() -> ToyStage:
        torch.manual_seed(seed)
        return cls(HIDDEN).double()

    return make


def _data(seed: int = 1) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    x_a, x_b, y_a, y_b = (torch.randn(4, HIDDEN, generator=gen, dtype=torch.float64) for _ in range(4))
    return (x_a, x_b), (y_a, y_b)


def _check(cls: type[ToyStage], last: bool) -> OverlapReport:
    inputs, labels = _data()
    if last:
        return check_overlap(_make(cls), inputs, criterion=criterion, labels=labels)
    return check_overlap(_make(cls), inputs)


def _failed(report: OverlapReport) -> dict[str, str]:
    return {f"{c.phase}: {c.name}": c.note for c in report.failures}


@pytest.mark.parametrize("last", [True, False], ids=["from-loss", "from-outputs"])
def test_toy_hook_passes(last: bool):
    report = _check(ToyStageOverlap, last).raise_if_failed()
    names = {(c.phase, c.name) for c in report.checks}
    assert ("hook", "input grad A[0]") in names and ("B(B)", "grad down.weight") in names
    assert (("hook", "loss1 detached in place") in names) == last
    assert (("hook", "outputs B[0] has a graph") in names) == (not last)
    forward_b = report.check("loss B" if last else "outputs B[0]")
    assert forward_b.ok and forward_b.max_abs == 0.0


def test_toy_pair_of_modules():
    # A DualPipeV rank: module1 a first stage backpropagated from its outputs, module0 the last stage.
    def make():
        torch.manual_seed(0)
        return ToyStageOverlap(HIDDEN).double(), ToyStageOverlap(HIDDEN).double()

    (x_a, x_b), (_, y_b) = _data()
    report = check_overlap(make, (x_a, x_b), criterion=(None, criterion), labels=(None, y_b)).raise_if_failed()
    assert report.subject == "ToyStageOverlap (two modules)"
    assert report.check("grad module0.up.weight").max_abs == 0.0  # F(B) alone leaves module0 untouched
    assert report.check("grad module1.up.weight").rel is not None


def test_toy_pair_with_a_shared_layer():
    # Tied weights across a rank's two stages (an embedding tied to the head): the shared parameter is
    # primed and compared once, under module0's name.
    def make():
        torch.manual_seed(0)
        m0, m1 = ToyStageOverlap(HIDDEN).double(), ToyStageOverlap(HIDDEN).double()
        m1.up = m0.up
        return m0, m1

    inputs, _ = _data()
    report = check_overlap(make, inputs).raise_if_failed()
    names = {c.name for c in report.checks}
    assert "grad module0.up.weight" in names and "grad module1.up.weight" not in names


# -- broken hooks ---------------------------------------------------------------------------------------
class NoDetach(ToyStageOverlap):
    """Forgets ``loss1.detach_()``."""

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, grads1):
        outputs0 = [module0(*inputs0)]
        loss1.backward()
        return outputs0, criterion0(*outputs0, *labels0)


class ScaledGrad(ToyStageOverlap):
    """Backpropagates twice the gradient."""

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, grads1):
        outputs0 = [module0(*inputs0)]
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        if loss1 is not None:
            (2 * loss1).backward()
            loss1.detach_()
        else:
            run_backward(outputs1, [2 * g for g in grads1])
        return outputs0, loss0


class DetachedOutputs(ToyStageOverlap):
    """Runs the forward without a graph (say, under ``no_grad`` by mistake)."""

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, grads1):
        outputs0 = [module0(*inputs0).detach()]
        loss0 = criterion0(*outputs0, *labels0) if criterion0 is not None else None
        plain_backward(loss1, outputs1, grads1)
        return outputs0, loss0


class OverwritesGrad(ToyStageOverlap):
    """Clears the parameter gradients before its backward, dropping what earlier micro-batches left."""

    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, grads1):
        outputs0 = [module0(*inputs0)]
        module1.zero_grad(set_to_none=True)
        run_backward(outputs1, grads1)
        return outputs0, None


@pytest.mark.parametrize("last", [True, False], ids=["from-loss", "from-outputs"])
def test_missing_input_grad(last: bool):
    report = _check(NoInputGrad, last)
    failed = _failed(report)
    assert failed == {"hook: input grad A[0]": "the hook did not deliver the input gradient (.grad is None)"}
    with pytest.raises(AssertionError, match=r"FAILED, 1 of \d+ checks") as info:
        report.raise_if_failed()
    assert str(info.value) == str(report)


def test_loss1_not_detached():
    failed = _failed(_check(NoDetach, last=True))
    assert failed == {
        "hook: loss1 detached in place": "loss1 still holds its graph: call loss1.detach_() after its backward"
    }


@pytest.mark.parametrize("last", [True, False], ids=["from-loss", "from-outputs"])
def test_scaled_gradient(last: bool):
    report = _check(ScaledGrad, last)
    # Everything B(A) produced is twice the reference (relative error 1); B's own backward is right.
    assert set(_failed(report)) == {
        "hook: input grad A[0]",
        "hook: grad up.weight",
        "hook: grad down.weight",
        "B(B): grad up.weight",
        "B(B): grad down.weight",
    }
    assert report.check("input grad A[0]").rel == pytest.approx(1.0)
    assert report.check("input grad B[0]", "B(B)").ok


@pytest.mark.parametrize("last", [True, False], ids=["from-loss", "from-outputs"])
def test_detached_outputs(last: bool):
    failed = _failed(_check(DetachedOutputs, last))
    skipped = {"B(B): plain backward of B": "skipped: the hook's outputs (or loss) of B have no graph"}
    if last:
        assert failed == {"hook: loss B has a graph": "loss0 is detached", **skipped}
    else:
        note = "detached: the pipeline cannot backpropagate through outputs0"
        assert failed == {"hook: outputs B[0] has a graph": note, **skipped}


def test_overwritten_grads():
    failed = _failed(_check(OverwritesGrad, last=False))
    hint = ".grad overwritten instead of accumulated into"
    assert failed == {f"{phase}: grad {n}.weight": hint for phase in ("hook", "B(B)") for n in ("up", "down")}


def test_report_table():
    text = str(_check(NoInputGrad, last=True))
    lines = text.splitlines()
    assert lines[0] == "overlapped_forward_backward of NoInputGrad: FAILED, 1 of 11 checks (rtol=1e-05, atol=1e-08)"
    assert lines[1].split() == ["after", "check", "max", "abs", "err", "rel", "err", "result"]
    row = next(line for line in lines if "input grad A[0]" in line)
    note = "the hook did not deliver the input gradient (.grad is None)"
    assert re.fullmatch(r"hook +input grad A\[0\] +- +- +FAIL  " + re.escape(note), row)
    assert all(line[5:7] == "  " and line[7] != " " for line in lines[1:])  # aligned after "setup", the widest


def test_given_output_grads():
    inputs, (g_a, g_b) = _data()
    report = check_overlap(_make(), inputs, output_grads=(g_a, None)).raise_if_failed()  # B's drawn
    assert report.check("input grad A[0]").max_abs == 0.0
    with pytest.raises(ValueError, match="output_grads has 2 tensors for 1 outputs"):
        check_overlap(_make(), inputs, output_grads=((g_a, g_b), None))


class ReturnsOutputsOnly(ToyStageOverlap):
    @classmethod
    def overlapped_forward_backward(cls, module0, inputs0, criterion0, labels0, module1, loss1, outputs1, grads1):
        run_backward(outputs1, grads1)
        return module0(*inputs0)


def test_wrong_return_value():
    failed = _failed(_check(ReturnsOutputsOnly, last=False))
    assert failed == {"hook: returns (outputs0, loss0)": "it returned Tensor"}


def test_nondeterministic_make_stage():
    seeds = iter([0, 1])

    def make():
        torch.manual_seed(next(seeds))
        return ToyStageOverlap(HIDDEN).double()

    (x_a, x_b), _ = _data()
    report = check_overlap(make, (x_a, x_b))
    assert not report.check("copies identical", "setup").ok
    assert "seed its initialisation" in report.check("copies identical", "setup").note


def test_misuse():
    inputs, _ = _data()
    with pytest.raises(TypeError, match="does not define overlapped_forward_backward"):
        check_overlap(_make(ToyStage), inputs)
    with pytest.raises(ValueError, match="inputs must be a pair"):
        check_overlap(_make(), inputs[:1])
    with pytest.raises(TypeError, match="make_stage"):
        check_overlap(lambda: None, inputs)

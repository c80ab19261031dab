"""The overlap runtime (:mod:`dualpipe.pieces`, :mod:`dualpipe.overlap`, :mod:`dualpipe.collectives`) on small
generic stages written here in plain torch (float64), checked against plain-torch reference models.

Legend: T rows (tokens), D hidden width, V vocabulary, W ranks.

The test stage :class:`Net` is ``[embedding] -> block x L -> [head]``; a block is ``attn -> dispatch ->
mlp -> combine`` with output ``a + y`` (``shared=True`` adds a side piece ``shared`` reading ``z``, as a shared
expert, summed into the output), where the two communications are local stand-ins for all-to-alls: a fixed
row permutation (and a scale), returned as :class:`Pending` results computed only when waited.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from dualpipe.collectives import AllToAll, Pending, all_to_all, exchange_counts
from dualpipe.events import EventRecorder
from dualpipe.overlap import OverlapStage
from dualpipe.pieces import BlockRun, Comm, Compute, Context, Pieces
from dualpipe.testing import OverlapReport, check_overlap
from dualpipe.utils import run_backward
from dualpipe.weight_grad import GradStore
from tests.distributed import run_ranks
from tests.dualpipe.toy import DeferredLinearFn

f64 = torch.float64
T, D, V = 6, 4, 7
PERM = torch.tensor([3, 0, 5, 1, 4, 2])  # the local "dispatch" sends row PERM[j] to slot j
INV = torch.argsort(PERM)
SEND_SCALE = 2.0  # the local dispatch also scales, so a wrong backward cannot cancel out


class Log:
    """A recorder: every event in order; ``watch()``, when given, is snapshotted with each event."""

    def __init__(self, watch: Callable[[], Any] | None = None) -> None:
        self.events: list[tuple[str, str, int, str]] = []
        self.seen: list[Any] = []
        self.watch = watch

    def record(self, name: str, direction: str, layer: int, edge: str) -> None:
        self.events.append((name, direction, layer, edge))
        if self.watch is not None:
            self.seen.append(self.watch())

    def at(self, event: tuple[str, str, int, str]) -> Any:
        return self.seen[self.events.index(event)]


def _param(gen: torch.Generator, *shape: int) -> nn.Parameter:
    return nn.Parameter(torch.randn(*shape, generator=gen, dtype=f64) / 2)


class _Block(nn.Module):
    def __init__(self, layer: int, gen: torch.Generator, shared: bool = False) -> None:
        super().__init__()
        self.layer = layer
        self.wa = _param(gen, D, D)  # autograd weight gradient (part of dX)
        self.wm = _param(gen, D, D)  # deferred weight gradient (dW)
        self.ws = _param(gen, D, D) if shared else None  # a side piece beside the MLP (a shared expert)

    def pieces(self, net: Net) -> Pieces:
        side = (Compute("shared", self._shared, "z", "s"),) if self.ws is not None else ()
        return Pieces(
            (
                Compute("attn", self._attn, "h", ("a", "z")),
                Comm(
                    "dispatch",
                    net._later(lambda ctx, z: z[PERM] * SEND_SCALE),
                    net._later(lambda ctx, g: g[INV] * SEND_SCALE),
                    "z",
                    "zr",
                    prepare=net._counts if net.prepare else None,
                    communicates=net.communicates,
                ),
                *side,
                Compute("mlp", self._mlp, "zr", "yr", recompute=net.recompute_mlp),
                Comm(
                    "combine",
                    net._later(lambda ctx, y: y[INV]),
                    net._later(lambda ctx, g: g[PERM]),
                    "yr",
                    "y",
                    communicates=net.communicates,
                ),
            ),
            input="h",
            output=("a", "y", *(p.outputs[0] for p in side)),
            layer=self.layer,
        )

    def _attn(self, ctx: Context, h_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a_TD = torch.tanh(h_TD @ self.wa.t())
        return a_TD, a_TD * h_TD

    def _mlp(self, ctx: Context, zr_TD: torch.Tensor) -> torch.Tensor:
        return torch.sin(DeferredLinearFn.apply(zr_TD, self.wm))

    def _shared(self, ctx: Context, z_TD: torch.Tensor) -> torch.Tensor:
        return torch.tanh(DeferredLinearFn.apply(z_TD, self.ws))

    def reference(self, h_TD: torch.Tensor) -> torch.Tensor:
        a_TD = torch.tanh(h_TD @ self.wa.t())
        zr_TD = (a_TD * h_TD)[PERM] * SEND_SCALE
        out = a_TD + torch.sin(zr_TD @ self.wm.t())[INV]
        return out if self.ws is None else out + torch.tanh((a_TD * h_TD) @ self.ws.t())


class Net(OverlapStage):
    """``[embedding] -> layers x block -> [head]``; the input is token ids with an embedding, else ``[T, D]``."""

    def __init__(
        self,
        layers: int = 2,
        *,
        embed: bool = True,
        head: bool = True,
        seed: int = 0,
        prepare: bool = False,
        communicates: bool = True,
        recompute_mlp: bool | None = None,
        shared: bool = False,
    ) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = _param(gen, V, D) if embed else None
        self.blocks = nn.ModuleList(_Block(i, gen, shared) for i in range(layers))
        self.head = _param(gen, D, D) if head else None
        self.prepare, self.communicates, self.recompute_mlp = prepare, communicates, recompute_mlp
        self.pendings: list[Pending[Any]] = []  # every "transfer" started, to check each is waited

    def _later(self, fn: Callable[..., torch.Tensor]) -> Callable[..., Pending[torch.Tensor]]:
        def start(ctx: Context, x: torch.Tensor) -> Pending[torch.Tensor]:
            pending = Pending(lambda: fn(ctx, x))
            self.pendings.append(pending)
            return pending

        return start

    def _counts(self, ctx: Context, z_TD: torch.Tensor) -> Pending[int]:
        ctx.rows = Pending(lambda: z_TD.shape[0])
        return ctx.rows

    def pieces(self) -> list[Pieces]:
        blocks = [b.pieces(self) for b in self.blocks]
        if self.embed is not None:
            blocks.insert(0, Pieces((Compute("embed", self._embed, "ids", "h"),), "ids", "h", paired=False))
        if self.head is not None:
            blocks.append(Pieces((Compute("head", self._head, "h", "out"),), "h", "out", paired=False))
        return blocks

    def _embed(self, ctx: Context, ids_T: torch.Tensor) -> torch.Tensor:
        return self.embed[ids_T]

    def _head(self, ctx: Context, h_TD: torch.Tensor) -> torch.Tensor:
        return DeferredLinearFn.apply(h_TD, self.head)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed[x] if self.embed is not None else x
        for block in self.blocks:
            h = block.reference(h)
        return h @ self.head.t() if self.head is not None else h


def mse(out_TD: torch.Tensor, y_TD: torch.Tensor) -> torch.Tensor:
    return 0.5 * ((out_TD - y_TD) ** 2).sum()


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(V, (T,), generator=torch.Generator().manual_seed(seed))


def _floats(seed: int, rows: int = T) -> torch.Tensor:
    return torch.randn(rows, D, generator=torch.Generator().manual_seed(seed), dtype=f64)


def _grads(module: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}


def _assert_close_grads(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] is None) == (want[name] is None), name
        if want[name] is not None:
            torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)


# ---- 1. declaration errors ------------------------------------------------------------------------------
def _ident(ctx: Context, *xs: torch.Tensor) -> Any:
    return xs[0] if len(xs) == 1 else xs


def _comm(name: str, inputs: Any, outputs: Any) -> Comm:
    return Comm(name, lambda ctx, x: Pending.done(x), lambda ctx, g: Pending.done(g), inputs, outputs)


@pytest.mark.parametrize(
    ("pieces", "kwargs", "error", "match"),
    [
        ([Compute("f", _ident, "y", "z")], {}, ValueError, r"block 3: piece 'f' reads 'y' before any piece produces"),
        (
            [Compute("f", _ident, "x", "y"), _comm("c", "y", "y")],
            {},
            ValueError,
            r"piece 'c' produces 'y' again",
        ),
        ([Compute("f", _ident, "x", "x")], {}, ValueError, r"piece 'f' produces 'x' again"),
        ([Compute("f", _ident, "x", "y")], {"output": ("y", "w")}, ValueError, r"output names 'w', which no piece"),
        ([_comm("c", "x", "y")], {}, ValueError, r"block 3: a block needs at least one Compute piece"),
        ([], {}, ValueError, r"at least one Compute piece"),
        ([Compute("f", _ident, "x", "y"), "g"], {}, TypeError, r"piece 1 is a str, not a Compute or a Comm"),
        (
            [Compute("f", _ident, "x", "z"), Compute("f", _ident, "z", "y")],
            {},
            ValueError,
            r"two pieces are named 'f'",
        ),
    ],
    ids=[
        "read-before-produce",
        "produced-twice",
        "input-produced-again",
        "unknown-output",
        "no-compute",
        "empty",
        "not-a-piece",
        "same-name",
    ],
)
def test_declaration_errors(pieces: list, kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        Pieces(pieces, **({"output": "y", "layer": 3} | kwargs))


class _Declared(OverlapStage):
    def __init__(self, blocks: Callable[[], Any]) -> None:
        super().__init__()
        self._blocks = blocks

    def pieces(self) -> Any:
        return self._blocks()


def _block(*, paired: bool = True, fn: Callable[..., Any] | None = None, outputs: Any = "y") -> Pieces:
    return Pieces((Compute("f", fn or _ident, "x", outputs),), output=outputs, paired=paired)


@pytest.mark.parametrize(
    ("blocks", "error", "match"),
    [
        (lambda: [], ValueError, r"_Declared.pieces\(\) returned no blocks"),
        (lambda: None, ValueError, r"_Declared.pieces\(\) returned no blocks"),
        (lambda: [_block(), "b"], TypeError, r"_Declared.pieces\(\) must return Pieces, got str"),
        (
            lambda: [_block(paired=False), _block(), _block(paired=False), _block()],
            ValueError,
            r"unpaired blocks \(paired=False\) may only come first or last",
        ),
        (
            lambda: [_block(fn=lambda ctx, x: (x, x))],
            ValueError,
            r"Compute 'f' returned a tuple of 2 values, expected 1 value",
        ),
        (
            lambda: [_block(fn=lambda ctx, x: x, outputs=("y", "z"))],
            ValueError,
            r"Compute 'f' returned Tensor, expected a tuple of 2 values",
        ),
        (
            lambda: [_block(fn=lambda ctx, x: [x, x], outputs=("y", "z"))],
            ValueError,
            r"Compute 'f' returned list, expected a tuple of 2 values",
        ),
    ],
    ids=[
        "no-blocks",
        "returns-none",
        "not-pieces",
        "unpaired-in-the-middle",
        "one-output-two-values",
        "two-outputs-one-value",
        "list",
    ],
)
def test_stage_declaration_errors(blocks: Callable[[], Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        _Declared(blocks)(_floats(0))


def test_a_user_class_first_in_the_bases_is_named_where_the_class_is_written() -> None:
    class MyStage(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    with pytest.raises(
        TypeError, match=r"class S: MyStage.forward comes before OverlapStage.forward .* put OverlapStage"
    ):

        class S(MyStage, OverlapStage):
            pass

    class T(OverlapStage, MyStage):  # the right order
        def pieces(self) -> list[Pieces]:
            return [_block()]

    assert T()(_floats(0)).shape == _floats(0).shape


def test_stage_call_errors() -> None:
    stage = _Declared(lambda: [_block()])
    with pytest.raises(ValueError, match=r"_Declared: a stage built from pieces takes one input, got 2"):
        stage(_floats(0), _floats(1))
    with pytest.raises(NotImplementedError, match=r"OverlapStage must implement pieces\(\)"):
        OverlapStage()(_floats(0))


@pytest.mark.parametrize("where", ["prepare", "forward", "backward"])
def test_a_comm_that_returns_no_pending(where: str) -> None:
    # The natural slip for a local communication: returning the tensor itself.
    def done(ctx: Context, x: torch.Tensor) -> Pending[torch.Tensor]:
        return Pending.done(x)

    fns = {"prepare": done, "forward": done, "backward": done} | {where: lambda ctx, x: x}
    comm = Comm("c", fns["forward"], fns["backward"], "y", "yr", prepare=fns["prepare"])
    w = nn.Parameter(torch.ones(D, dtype=f64))
    stage = _Declared(lambda: [Pieces((Compute("f", lambda ctx, x: x * w, "x", "y"), comm), output="yr")])
    with pytest.raises(TypeError, match=rf"Comm 'c' {where} returned Tensor, not a Pending"):
        stage(_floats(0)).sum().backward()


def test_unpaired_blocks_at_both_ends_are_accepted() -> None:
    stage = _Declared(lambda: [_block(paired=False), _block(paired=False), _block(), _block(paired=False)])
    x = _floats(0)
    torch.testing.assert_close(stage(x), x, rtol=0, atol=0)


# ---- 2. single process: the stage against plain torch, and the hook against plain backward ------------------
@pytest.mark.parametrize("recompute", [False, True], ids=["graph", "recompute"])
def test_forward_and_backward_match_plain_torch(recompute: bool) -> None:
    ids, labels = _ids(1), _floats(2)
    net, ref = Net(3), Net(3)
    net.recompute = recompute
    out = net(ids)
    want = ref.reference(ids)
    torch.testing.assert_close(out, want, rtol=0, atol=0)  # the same ops in the same order: exact
    assert out.requires_grad and type(out.grad_fn).__name__ == "_StageNodeBackward"
    assert all(p.finished for p in net.pendings), "the output needs every transfer finished"
    mse(out, labels).backward()
    mse(want, labels).backward()
    _assert_close_grads(_grads(net), _grads(ref))
    assert all(p.finished for p in net.pendings)
    assert len(net.pendings) == 2 * 3 * 2  # forward and backward, two transfers per block, three blocks


def test_input_gradient_matches_plain_torch() -> None:
    x, labels = _floats(1).requires_grad_(), _floats(2)
    x_ref = x.detach().clone().requires_grad_()
    net, ref = Net(2, embed=False), Net(2, embed=False)
    mse(net(x), labels).backward()
    mse(ref.reference(x_ref), labels).backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    _assert_close_grads(_grads(net), _grads(ref))


def test_a_sent_output_can_be_freed() -> None:
    # The pipeline frees the storage of activations it has sent, unless they are views (freeing a view
    # would free its base): a stage output must not be a view, and its backward must not read its values.
    x, g = _floats(1).requires_grad_(), _floats(2)
    x_ref = x.detach().clone().requires_grad_()
    net, ref = Net(2, embed=False, head=False), Net(2, embed=False, head=False)
    out = net(x)
    assert out._base is None
    out.data = torch.empty(0, dtype=out.dtype)
    run_backward([out], [g])
    ref.reference(x_ref).backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    _assert_close_grads(_grads(net), _grads(ref))


def _check(make: Callable[[], Any], last: bool, ids: bool = True) -> OverlapReport:
    inputs = (_ids(1), _ids(2)) if ids else (_floats(1), _floats(2))
    if last:
        return check_overlap(make, inputs, criterion=mse, labels=(_floats(3), _floats(4)), rtol=1e-12, atol=0)
    return check_overlap(make, inputs, rtol=1e-12, atol=0)


@pytest.mark.parametrize("last", [True, False], ids=["from-loss", "from-outputs"])
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"recompute": True},
        {"recompute_mlp": True},
        {"prepare": True},
        {"communicates": False},
        {"shared": True, "prepare": True},
        {"shared": True, "recompute": True},
    ],
    ids=["plain", "recompute", "recompute-one-piece", "prepare", "local", "side-piece", "side-piece-recompute"],
)
def test_hook_matches_plain_backward(kwargs: dict, last: bool) -> None:
    def make() -> Net:
        recompute = kwargs.get("recompute", False)
        net = Net(2, head=last, **{k: v for k, v in kwargs.items() if k != "recompute"})
        net.recompute = recompute
        return net

    report = _check(make, last).raise_if_failed()
    assert report.check("grad blocks.1.wm").rel is not None


@pytest.mark.parametrize(("layers0", "layers1"), [(3, 2), (2, 3), (1, 3), (0, 2), (2, 0)])
def test_hook_with_modules_of_different_depth(layers0: int, layers1: int) -> None:
    # A runs on module1 (its backward is the hook's), B on module0; both are first and last stages.
    def make() -> tuple[Net, Net]:
        return Net(layers0, seed=0), Net(layers1, seed=1)

    report = _check(make, last=True).raise_if_failed()
    assert report.subject == "Net (two modules)"
    assert report.check("grad module1.head").rel is not None


@pytest.mark.parametrize(("layers0", "layers1"), [(3, 2), (2, 3)])
def test_hook_with_modules_of_different_depth_without_ends(layers0: int, layers1: int) -> None:
    def make() -> tuple[Net, Net]:
        return Net(layers0, embed=False, head=False, seed=0), Net(layers1, embed=False, head=False, seed=1)

    _check(make, last=False, ids=False).raise_if_failed()


def test_hook_on_a_dualpipev_rank() -> None:
    # Stage r (embedding, 2 blocks) and stage 2N-1-r (3 blocks, head): B is the first stage's forward from
    # token ids, A the last stage's backward from its loss.
    def make() -> tuple[Net, Net]:
        return Net(2, head=False, seed=0), Net(3, embed=False, seed=1)

    report = check_overlap(
        make, (_floats(1), _ids(2)), criterion=(mse, None), labels=(_floats(3), None), rtol=1e-12, atol=0
    ).raise_if_failed()
    assert report.check("input grad A[0]").rel is not None


# ---- 3. order, communication overlap, weight gradients ------------------------------------------------
def _begins(log: Log) -> list[str]:
    return [
        f"{'F' if d == 'fwd' else 'B'}.{n}{'' if layer < 0 else layer}" for n, d, layer, e in log.events if e == "begin"
    ]


def _overlapped_hook(**kwargs: Any) -> tuple[Net, Log]:
    net = Net(2, **kwargs)
    return net, _record_hook(net)


def _record_hook(net: Net) -> Log:
    """The events of one overlapped hook call on ``net`` (micro-batch 1's forward first, not recorded)."""
    net.recorder = log = Log()
    labels = _floats(3)
    loss1 = mse(net(_ids(1)), labels)
    log.events.clear()
    Net.overlapped_forward_backward(net, [_ids(2)], mse, [labels], net, loss1, None, None)
    return log


def test_overlapped_pair_order() -> None:
    _, log = _overlapped_hook()
    assert _begins(log) == [
        "B.head",
        "F.embed",
        *("F.attn0", "B.mlp.dx1", "B.mlp.dw1", "F.mlp0", "B.attn.dx1", "B.attn.dw1"),
        "F.residual0",  # F's next block begins: its input is the sum a + y, once F.combine0 is waited
        *("F.attn1", "B.mlp.dx0", "B.mlp.dw0", "F.mlp1", "B.attn.dx0", "B.attn.dw0"),
        "B.embed",  # B's input gradient while F.combine1 is in flight
        "F.residual1",
        "F.head",
    ]


def test_overlapped_pair_order_with_a_side_piece() -> None:
    # dualpipe.pair_order: B's side piece (the shared expert) right after F.attn, F's before F.mlp
    _, log = _overlapped_hook(shared=True)
    pair = ("F.attn{f}", "B.shared.dx{b}", "B.shared.dw{b}", "B.mlp.dx{b}", "B.mlp.dw{b}", "F.shared{f}", "F.mlp{f}")
    assert _begins(log) == [
        "B.head",
        "F.embed",
        *(step.format(f=0, b=1) for step in pair),
        *("B.attn.dx1", "B.attn.dw1", "F.residual0"),
        *(step.format(f=1, b=0) for step in pair),
        *("B.attn.dx0", "B.attn.dw0", "B.embed", "F.residual1", "F.head"),
    ]


def _compute_between(events: list, start: int, stop: int, direction: str) -> bool:
    return any(e[3] == "begin" and e[1] == direction for e in events[start + 1 : stop])


@pytest.mark.parametrize("shared", [False, True], ids=["two-computes", "side-piece"])
@pytest.mark.parametrize("prepare", [False, True], ids=["plain", "prepare"])
def test_every_communication_hides_behind_the_other_micro_batch(prepare: bool, shared: bool) -> None:
    _, log = _overlapped_hook(prepare=prepare, shared=shared)
    ev = log.events
    comms = [e for e in ev if e[3] == "start"]
    assert len(comms) == 8 + 2 * prepare  # F and B, dispatch and combine, two blocks (+ F's counts)
    for name, d, layer, _ in comms:
        start, wait = ev.index((name, d, layer, "start")), ev.index((name, d, layer, "wait"))
        other = "bwd" if d == "fwd" else "fwd"
        if name == "counts" and not shared:  # nothing of B before its MLP: the exchange is waited at once
            assert wait == start + 1
            continue
        assert _compute_between(ev, start, wait, other), (name, d, layer, ev[start : wait + 1])


@pytest.mark.parametrize("shared", [False, True], ids=["two-computes", "side-piece"])
def test_prepare_starts_the_transfer_before_the_backward_mlp(shared: bool) -> None:
    _, log = _overlapped_hook(prepare=True, shared=shared)
    ev = log.events
    for layer, b_layer in ((0, 1), (1, 0)):
        counts = ev.index(("counts", "fwd", layer, "start"))
        assert ev[counts - 1] == ("attn", "fwd", layer, "end")  # right after the compute that produced z
        start = ev.index(("dispatch", "fwd", layer, "start"))
        waited = ev.index(("counts", "fwd", layer, "wait"))
        if shared:  # the exchange flies under B's side piece, its dX and its dW
            assert counts < ev.index(("shared.dx", "bwd", b_layer, "begin"))
            assert ev.index(("shared.dw", "bwd", b_layer, "begin")) < waited
        else:
            assert waited == counts + 1
        # the transfer flies under B's MLP, dX and dW
        assert waited < start < ev.index(("mlp.dx", "bwd", b_layer, "begin"))
    # the backward has no prepare step: nothing but the transfers
    assert not [e for e in ev if e[0] == "counts" and e[1] == "bwd"]
    # a prepare that returns a Pending is still waited once, before its transfer starts
    assert [e[3] for e in ev if e[0] == "counts"] == ["start", "wait"] * 2


def test_a_prepare_that_returns_none_starts_the_transfer_at_once() -> None:
    net = Net(2, prepare=True)
    net._counts = lambda ctx, z: None  # nothing to exchange first (one rank, or even splits)
    ev = _record_hook(net).events
    for layer in (0, 1):
        assert ev[ev.index(("attn", "fwd", layer, "end")) + 1] == ("dispatch", "fwd", layer, "start")
    assert not [e for e in ev if e[0] == "counts"]


def test_local_communications_record_no_events() -> None:
    net, log = _overlapped_hook(communicates=False, prepare=True)
    # compute spans only; attn's dW has no work (wa's gradient comes with dX), so its span ends "empty"
    assert {e[3] for e in log.events} == {"begin", "end", "empty"}
    assert net.pendings and all(p.finished for p in net.pendings)


def test_weight_gradients_wait_for_dw() -> None:
    net = Net(2)
    _, b1 = net.blocks

    def watch() -> tuple[bool, bool]:
        return b1.wm.grad is not None, b1.wa.grad is not None

    net.recorder = log = Log(watch)
    labels = _floats(3)
    loss1 = mse(net(_ids(1)), labels)
    Net.overlapped_forward_backward(net, [_ids(2)], mse, [labels], net, loss1, None, None)
    assert log.at(("mlp.dx", "bwd", 1, "end")) == (False, False)  # dX held the deferred wm gradient back
    assert log.at(("mlp.dw", "bwd", 1, "end")) == (True, False)
    assert log.at(("attn.dx", "bwd", 1, "end")) == (True, True)  # wa's autograd gradient comes with dX


def _block_run(net: Net, h: torch.Tensor, **kwargs: Any) -> BlockRun:
    """One block's forward, driven by hand."""
    run = BlockRun(net.blocks[0].pieces(net), **kwargs)
    run.begin(h)
    run.compute(0)
    run.start(1)
    assert not net.pendings[-1].finished  # in flight until mlp reads it
    run.compute(2)
    run.start(3)
    return run


def test_block_run_by_hand_splits_dx_and_dw() -> None:
    net = Net(1, embed=False, head=False)
    h, g = _floats(1).requires_grad_(), _floats(2)
    run = _block_run(net, h)
    torch.testing.assert_close(run.output(), net.blocks[0].reference(h), rtol=0, atol=0)
    run.begin_backward(g)
    run.compute_dx(2)  # waits the combine's backward first
    assert net.blocks[0].wm.grad is None
    assert run.startable_backward(1) and not run.input_grad_final()
    run.compute_dw(2)
    assert net.blocks[0].wm.grad is not None
    run.compute_dx(0)  # waits the dispatch's backward first
    run.compute_dw(0)
    assert run.input_grad_final()

    ref = Net(1, embed=False, head=False)
    h_ref = h.detach().clone().requires_grad_()
    ref.blocks[0].reference(h_ref).backward(g)
    torch.testing.assert_close(run.grad_in(), h_ref.grad, rtol=1e-12, atol=1e-12)
    _assert_close_grads(_grads(net), _grads(ref))


def test_an_enabled_pipeline_store_takes_the_weight_gradients() -> None:
    # A zero-bubble "I" action: the pipeline's store is enabled around the backward; the runtime must hand
    # the closures to it and run none itself (no dW spans).
    net, ref = Net(2), Net(2)
    net.recorder = log = Log()
    labels = _floats(3)
    loss = mse(net(_ids(1)), labels)
    store = GradStore()
    with store.activate(enabled=True):
        loss.backward()
    assert net.head.grad is None and all(b.wm.grad is None for b in net.blocks)
    assert net.blocks[0].wa.grad is not None and net.embed.grad is not None  # autograd's are part of dX
    assert not [e for e in log.events if e[0].endswith(".dw")]
    store.flush()
    store.pop()
    assert store.is_empty()
    mse(ref.reference(_ids(1)), labels).backward()
    _assert_close_grads(_grads(net), _grads(ref))


def test_an_enabled_pipeline_store_in_the_hook() -> None:
    net, ref = Net(2), Net(2)
    labels = _floats(3)
    loss1 = mse(net(_ids(1)), labels)
    store = GradStore()
    with store.activate(enabled=True):
        Net.overlapped_forward_backward(net, [_ids(2)], mse, [labels], net, loss1, None, None)
    assert all(b.wm.grad is None for b in net.blocks)
    store.flush()
    store.pop()
    mse(ref.reference(_ids(1)), labels).backward()
    _assert_close_grads(_grads(net), _grads(ref))


# ---- 5. edge cases -------------------------------------------------------------------------------------
class _Edge(OverlapStage):
    """One block ``f -> (c, g) -> out`` with knobs for the edge cases: ``z`` read by a compute and a comm
    (``shared``), a comm whose result nothing reads (``dead``), the input passed through to the output."""

    def __init__(self, *, dead: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.w1, self.w2 = _param(gen, D, D), _param(gen, D, D)
        self.dead = dead
        self.pendings: list[Pending[Any]] = []

    def _send(self, scale: float) -> Callable[..., Pending[torch.Tensor]]:
        def start(ctx: Context, x: torch.Tensor) -> Pending[torch.Tensor]:
            pending = Pending(lambda: x * scale)
            self.pendings.append(pending)
            return pending

        return start

    def pieces(self) -> list[Pieces]:
        comms = [Comm("c", self._send(3.0), self._send(3.0), "z", "zc")]
        if self.dead:
            comms.append(Comm("dead", self._send(5.0), self._send(5.0), "z", "unused"))
        return [
            Pieces(
                (
                    Compute("f", lambda ctx, x: torch.tanh(x @ self.w1.t()), "x", "z"),
                    *comms,
                    Compute(
                        "g", lambda ctx, z, zc: torch.sin(DeferredLinearFn.apply(z * zc, self.w2)), ("z", "zc"), "y"
                    ),
                ),
                output=("x", "z", "y"),  # the input itself is part of the residual sum
            )
        ]

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.tanh(x @ self.w1.t())
        return x + z + torch.sin((z * (z * 3.0)) @ self.w2.t())


@pytest.mark.parametrize("dead", [False, True], ids=["shared-value", "unused-comm-result"])
def test_shared_values_and_unused_results(dead: bool) -> None:
    x, g = _floats(1).requires_grad_(), _floats(2)
    x_ref = x.detach().clone().requires_grad_()
    net, ref = _Edge(dead=dead), _Edge()
    out = net(x)
    torch.testing.assert_close(out, ref.reference(x_ref), rtol=0, atol=0)
    assert all(p.finished for p in net.pendings), "a started transfer is waited before the block ends"
    out.backward(g)
    ref.reference(x_ref).backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    _assert_close_grads(_grads(net), _grads(ref))
    assert all(p.finished for p in net.pendings)
    check_overlap(lambda: _Edge(dead=dead), (_floats(1), _floats(2)), rtol=1e-12, atol=0).raise_if_failed()


class _Chain(OverlapStage):
    """Blocks ``gather(x) -> f -> c1 -> c2 -> g(., x)``: a communication of the block input, and one that
    reads another's result."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.ws = nn.ParameterList(_param(gen, D, D) for _ in range(2))

    @staticmethod
    def _scale(s: float) -> Callable[..., Pending[torch.Tensor]]:
        return lambda ctx, x: Pending(lambda: x * s)

    def pieces(self) -> list[Pieces]:
        return [
            Pieces(
                (
                    Comm("gather", self._scale(2.0), self._scale(2.0), "x", "xg"),
                    Compute("f", lambda ctx, xg, w=w: torch.tanh(DeferredLinearFn.apply(xg, w)), "xg", "u"),
                    Comm("c1", self._scale(3.0), self._scale(3.0), "u", "u1"),
                    Comm("c2", self._scale(0.5), self._scale(0.5), "u1", "u2"),
                    Compute("g", lambda ctx, u2, x: u2 * x, ("u2", "x"), "y"),
                ),
                output=("x", "y"),
                layer=i,
            )
            for i, w in enumerate(self.ws)
        ]


@pytest.mark.parametrize("last", [True, False], ids=["from-loss", "from-outputs"])
def test_chained_communications_and_one_of_the_block_input(last: bool) -> None:
    _check(_Chain, last, ids=False).raise_if_failed()


def test_a_transfer_is_recorded_as_started_after_its_input_arrived() -> None:
    net = _Chain()
    net.recorder = log = Log()
    out1 = net(_floats(1).requires_grad_())
    log.events.clear()
    _Chain.overlapped_forward_backward(net, [_floats(2)], None, [], net, None, [out1], [_floats(3)])
    ev = log.events
    for layer in (0, 1):
        assert ev.index(("c1", "fwd", layer, "wait")) < ev.index(("c2", "fwd", layer, "start"))
        assert ev.index(("c2", "bwd", 1 - layer, "wait")) < ev.index(("c1", "bwd", 1 - layer, "start"))


def test_forward_without_grad_keeps_nothing() -> None:
    net = Net(2)
    with torch.no_grad():
        out = net(_ids(1))
    assert out.grad_fn is None and not out.requires_grad
    torch.testing.assert_close(out, Net(2).reference(_ids(1)), rtol=0, atol=0)
    # and a later forward with grad is unaffected
    mse(net(_ids(1)), _floats(3)).backward()
    assert net.blocks[0].wm.grad is not None


def test_a_value_no_gradient_reaches() -> None:
    # "aux" is neither read nor in the output: its gradient is None, and its compute's dX runs from "y" only.
    w = nn.Parameter(torch.ones(D, dtype=f64))
    stage = _Declared(
        lambda: [Pieces((Compute("f", lambda ctx, x: (x * w, (x * w).sum()), "x", ("y", "aux")),), output="y")]
    )
    x = _floats(1).requires_grad_()
    stage(x).backward(torch.ones(T, D, dtype=f64))
    torch.testing.assert_close(w.grad, _floats(1).sum(0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, torch.ones(T, D, dtype=f64), rtol=0, atol=0)


def test_a_stage_micro_batch_backpropagates_once() -> None:
    net = Net(1)
    loss = mse(net(_ids(1)), _floats(3))
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="already backpropagated"):
        loss.backward()


def test_a_value_read_twice_by_one_piece_and_named_twice_in_the_output() -> None:
    w = nn.Parameter(torch.full((D,), 0.5, dtype=f64))
    stage = _Declared(
        lambda: [Pieces((Compute("f", lambda ctx, a, b: a * b * w, ("x", "x"), "y"),), output=("y", "y"))]
    )
    x = _floats(1).requires_grad_()
    out = stage(x)
    torch.testing.assert_close(out, 2 * _floats(1) ** 2 * 0.5, rtol=0, atol=0)
    out.sum().backward()
    torch.testing.assert_close(x.grad, 4 * 0.5 * _floats(1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(w.grad, 2 * (_floats(1) ** 2).sum(0), rtol=1e-12, atol=1e-12)


def test_recompute_replays_with_ctx_recomputing() -> None:
    seen: list[bool] = []

    def f(ctx: Context, x: torch.Tensor) -> torch.Tensor:
        seen.append(ctx.recomputing)
        return torch.tanh(x)

    stage = _Declared(lambda: [Pieces((Compute("f", f, "x", "y", recompute=True),), output="y")])
    x = _floats(1).requires_grad_()
    out = stage(x)
    assert not out.grad_fn.run.blocks[0].holds_graph
    out.sum().backward()
    assert seen == [False, True]
    torch.testing.assert_close(x.grad, 1 - torch.tanh(_floats(1)) ** 2, rtol=1e-12, atol=1e-12)


# ---- 4. two gloo ranks: all-to-alls with uneven and zero splits --------------------------------------------
# Destination rank of every row, by (rank, rows, layer): uneven splits, a rank sending nothing to a peer or
# to itself, and (micro-batch B, layer 1) rank 0 receiving no rows at all.
ROUTES = {
    (0, 5, 0): [1, 1, 1, 0, 1],
    (0, 5, 1): [0, 0, 0, 0, 0],
    (1, 3, 0): [1, 1, 1],
    (1, 3, 1): [0, 1, 0],
    (0, 2, 0): [0, 0],
    (0, 2, 1): [1, 1],
    (1, 4, 0): [0, 1, 0, 0],
    (1, 4, 1): [1, 1, 1, 1],
}
ROWS = {0: (5, 2), 1: (3, 4)}  # rows of micro-batches A and B per rank


class _EPBlock(nn.Module):
    def __init__(self, layer: int, gen: torch.Generator) -> None:
        super().__init__()
        self.layer = layer
        self.wa, self.wm = _param(gen, D, D), _param(gen, D, D)

    def pieces(self) -> Pieces:
        return Pieces(
            (
                Compute("attn", self._attn, "h", ("a", "z", "dest")),
                Comm("dispatch", self._dispatch, self._dispatch_backward, ("z", "dest"), "zr", prepare=self._plan),
                Compute("mlp", lambda ctx, zr: torch.sin(DeferredLinearFn.apply(zr, self.wm)), "zr", "yr"),
                Comm("combine", self._combine, self._combine_backward, "yr", "y"),
            ),
            input="h",
            output=("a", "y"),
            layer=self.layer,
        )

    def _attn(self, ctx: Context, h_TD: torch.Tensor):
        rank = torch.distributed.get_rank()
        dest_T = torch.tensor(ROUTES[rank, h_TD.shape[0], self.layer])
        a_TD = torch.tanh(h_TD @ self.wa.t())
        return a_TD, a_TD * h_TD, dest_T

    def _plan(self, ctx: Context, z_TD: torch.Tensor, dest_T: torch.Tensor) -> Pending[torch.Tensor]:
        ctx.order_S = torch.argsort(dest_T, stable=True)
        ctx.send_W = torch.bincount(dest_T, minlength=torch.distributed.get_world_size())
        ctx.recv_W = exchange_counts(ctx.send_W)
        return ctx.recv_W

    def _dispatch(self, ctx: Context, z_TD: torch.Tensor, dest_T: torch.Tensor) -> Pending[torch.Tensor]:
        assert ctx.recv_W.finished  # the runtime waited the prepare step before starting the transfer
        ctx.a2a = AllToAll(ctx.send_W.tolist(), ctx.recv_W.wait().tolist())
        return ctx.a2a.forward(z_TD[ctx.order_S])

    def _unsort(self, ctx: Context, x_SD: torch.Tensor) -> torch.Tensor:
        out_TD = torch.empty_like(x_SD)
        out_TD[ctx.order_S] = x_SD
        return out_TD

    def _dispatch_backward(self, ctx: Context, g_RD: torch.Tensor) -> Pending[tuple[torch.Tensor, None]]:
        back = ctx.a2a.backward(g_RD)
        return Pending(lambda: (self._unsort(ctx, back.wait()), None))

    def _combine(self, ctx: Context, y_RD: torch.Tensor) -> Pending[torch.Tensor]:
        back = ctx.a2a.backward(y_RD)
        return Pending(lambda: self._unsort(ctx, back.wait()))

    def _combine_backward(self, ctx: Context, g_TD: torch.Tensor) -> Pending[torch.Tensor]:
        return ctx.a2a.forward(g_TD[ctx.order_S])


class EPNet(OverlapStage):
    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.blocks = nn.ModuleList(_EPBlock(i, gen) for i in range(2))

    def pieces(self) -> list[Pieces]:
        return [b.pieces() for b in self.blocks]


def _errors(calls: Sequence[Callable[[], Any]]) -> list[str | None]:
    out: list[str | None] = []
    for call in calls:
        try:
            call()
        except ValueError as e:
            out.append(str(e))
        else:
            out.append(None)
    return out


def _ep_ranks(rank: int, world: int) -> tuple[list[OverlapReport], list[str | None]]:
    def make() -> EPNet:
        return EPNet(seed=rank)  # expert weights differ per rank

    inputs = tuple(_floats(10 * rank + i, rows) for i, rows in enumerate(ROWS[rank]))
    labels = tuple(_floats(100 + i, rows) for i, rows in enumerate(ROWS[rank]))
    reports = [
        check_overlap(make, inputs, criterion=mse, labels=labels, rtol=1e-12, atol=0),
        check_overlap(make, inputs, rtol=1e-12, atol=0),
    ]
    x = _floats(0, 3)
    errors = _errors(
        [
            lambda: all_to_all(x, [3], [3]),
            lambda: all_to_all(x, [1, 1], [2, 0]),
            lambda: AllToAll([2, 2], [1, 1]).forward(x),
            lambda: exchange_counts(torch.tensor([1, 2, 0])),
        ]
    )
    return reports, errors


def test_all_to_all_pieces_on_two_ranks() -> None:
    for reports, errors in run_ranks(_ep_ranks, world_size=2, timeout=60):
        for report in reports:
            report.raise_if_failed()
        assert errors == [
            "all_to_all needs one split per rank (2), got 1 and 1",
            "send splits sum to 2 rows, the tensor has 3",
            "send splits sum to 4 rows, the tensor has 3",
            "exchange_counts needs one row of counts per rank (2), got 3",
        ]


def test_routes_cover_the_cases() -> None:
    # The table above really has uneven splits, zero splits and a rank receiving nothing.
    def splits(rank: int, rows: int, layer: int) -> list[int]:
        return torch.bincount(torch.tensor(ROUTES[rank, rows, layer]), minlength=2).tolist()

    sends = {
        (r, mb, layer): splits(r, ROWS[r][mb], layer) for r, mb, layer in itertools.product((0, 1), (0, 1), (0, 1))
    }
    assert any(0 in s for s in sends.values()) and any(s[0] != s[1] for s in sends.values())
    assert sends[0, 1, 1][0] + sends[1, 1, 1][0] == 0  # micro-batch B, layer 1: rank 0 receives no rows


class _StreamLog(Log):
    """A recorder that takes ``stream=`` (as :class:`dualpipe.events.EventRecorder` does on CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: list[Any] = []

    def record(self, name: str, direction: str, layer: int, edge: str, stream: Any = None) -> None:
        super().record(name, direction, layer, edge)
        self.streams.append(stream)


def _run_block(decl: Pieces, h: torch.Tensor, recorder: Any) -> torch.Tensor:
    run = BlockRun(decl, recorder=recorder)
    run.begin(h)
    for i, piece in enumerate(decl.pieces):
        if isinstance(piece, Compute):
            run.compute(i)
        else:
            run.start(i)
    return run.output()


@pytest.mark.parametrize("lazy", [False, True], ids=["stream", "callable"])
def test_a_comm_stream_carries_the_wait_edges(lazy: bool) -> None:
    net = Net(1, embed=False, head=False)
    decl = net.blocks[0].pieces(net)
    comm_stream = object()  # stands in for a CUDA stream: only passed through
    given = (lambda: comm_stream) if lazy else comm_stream  # a callable is asked at each record
    pieces = tuple(dataclasses.replace(p, stream=given) if isinstance(p, Comm) else p for p in decl.pieces)
    decl = Pieces(pieces, input=decl.input, output=decl.output, layer=decl.layer, paired=decl.paired)
    h = _floats(1).requires_grad_()
    log = _StreamLog()
    torch.testing.assert_close(_run_block(decl, h, log), net.blocks[0].reference(h), rtol=0, atol=0)
    assert [e[3] for e in log.events].count("wait") == 2
    assert log.streams == [comm_stream if e[3] == "wait" else None for e in log.events]
    cpu = EventRecorder()  # on CPU it takes the stream and ignores it: same events
    _run_block(decl, h, cpu)
    assert cpu.order() == log.events

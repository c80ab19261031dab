"""Pipelines on CPU ranks over gloo against the single-process oracle.

Losses must be bitwise equal (``torch.equal``), gradients equal within 1e-12 relative (float64, only the
order of accumulation differs), inference outputs equal. One process group per world size runs many
cases, because starting ranks dominates the cost on two cores.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from dualpipe import (
    PIPELINES,
    SCHEDULES,
    DualPipeV,
    set_p2p_tensor_dtype,
    set_p2p_tensor_shapes,
    sum_mirrored_grads,
)
from dualpipe.observer import PipelineObserver
from dualpipe.schedule import Op, build_schedule, compute_order
from tests.distributed import run_ranks
from tests.dualpipe.toy import ToyStage, ToyStageOverlap, criterion, make_stages, reference_step, rel_diff

HIDDEN = 8
MICRO_BATCH = 2
SEQ = 3
GRAD_RTOL = 1e-12


@dataclass(frozen=True)
class Case:
    schedule: str
    chunks: int
    overlap: bool = False
    declared: str = ""  # "", "instance" (pipe.set_p2p_tensor_shapes) or "global" (the reference's setters)
    reduction: str = "sum"
    seq: int = SEQ
    early_receives: bool | None = None  # None: the backend's default (on for gloo)
    modules: int | None = None  # modules per rank, for schedules that take any number (None: theirs)
    extra_warmup: int = 0  # the 1F1B family's extra warm-up forwards

    def __str__(self) -> str:
        return (
            f"{self.schedule} chunks={self.chunks} overlap={self.overlap} declared={self.declared} "
            f"{self.reduction} seq={self.seq} early_receives={self.early_receives} modules={self.modules} "
            f"extra_warmup={self.extra_warmup}"
        )


class _Spans(PipelineObserver):
    """Checks what the executor reports: spans nest, and the top-level actions are the schedule's."""

    def __init__(self) -> None:
        self.open: list[str] = []
        self.top_actions: list[str] = []
        self.kinds: dict[str, int] = {}
        self.recv_outside_actions = 0

    def begin(self, kind, subject) -> None:
        if kind == "action" and not self.open:
            self.top_actions.append(str(subject))
        if kind == "recv" and "action" not in self.open:
            self.recv_outside_actions += 1
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        self.open.append(kind)

    def end(self, kind, subject) -> None:
        assert self.open.pop() == kind


def _stage_ids(schedule: str, rank: int, world: int, modules: int | None = None) -> list[int]:
    """The stages this rank's local modules run, from the schedule's layout."""
    layout = SCHEDULES[schedule].stage_layout(world, modules)
    return [layout.stage_of(rank, m) for m in range(layout.modules_per_rank)]


def _run_case(rank: int, world: int, case: Case) -> dict:
    layout = SCHEDULES[case.schedule].stage_layout(world, case.modules)
    cls = ToyStageOverlap if case.overlap else ToyStage
    full = make_stages(layout.num_stages, HIDDEN, seed=1234, cls=cls)
    ids = _stage_ids(case.schedule, rank, world, case.modules)
    local = make_stages(len(ids), HIDDEN, seed=99, cls=cls)
    for mod, i in zip(local, ids):
        mod.load_state_dict(full[i].state_dict())
    pipe = PIPELINES[case.schedule](
        local, timeout=60, early_receives=case.early_receives, extra_warmup=case.extra_warmup
    )
    set_p2p_tensor_shapes(None)
    if case.declared == "instance":
        pipe.set_p2p_tensor_shapes([(MICRO_BATCH, case.seq, HIDDEN)])
        pipe.set_p2p_tensor_dtype(torch.float64)
    elif case.declared == "global":
        set_p2p_tensor_shapes([(MICRO_BATCH, case.seq, HIDDEN)])
        set_p2p_tensor_dtype(torch.float64)

    g = torch.Generator().manual_seed(7)
    n = case.chunks * MICRO_BATCH
    x = torch.randn(n, case.seq, HIDDEN, generator=g, dtype=torch.float64)
    y = torch.randn(n, case.seq, HIDDEN, generator=g, dtype=torch.float64)
    x2 = torch.randn(n, case.seq, HIDDEN, generator=g, dtype=torch.float64)  # DualPipe's second direction
    y2 = torch.randn(n, case.seq, HIDDEN, generator=g, dtype=torch.float64)
    scale = 1.0 / case.chunks if case.reduction == "mean" else 1.0

    # One share of the batch per path (DualPipe: one entering at each end), each its own reference run;
    # a path's loss comes out where its last stage lives.
    paths = len(layout.paths)
    xs, ys = [x[: n // paths], x2[: n // paths]][:paths], [y[: n // paths], y2[: n // paths]][:paths]
    expect = {}
    for path, (xp, yp) in enumerate(zip(xs, ys)):
        exit_rank = layout.paths[path][-1][0]
        expect[exit_rank] = reference_step(full, xp, yp, case.chunks // paths, scale)
    inputs, labels = pipe.split_batch((torch.cat(xs),), (torch.cat(ys),))

    ToyStageOverlap.calls = 0
    spans = _Spans()
    pipe.add_observer(spans)
    loss, outputs = pipe.step(
        *inputs, num_chunks=case.chunks, criterion=criterion, labels=labels, loss_reduction=case.reduction
    )
    pipe.remove_observer(spans)
    overlapped_calls = ToyStageOverlap.calls
    assert spans.open == [] and spans.recv_outside_actions == 0
    assert spans.top_actions == compute_order(pipe.schedule(case.chunks).ranks[rank])
    # as run with or without overlap: the V family's pairs only with it
    built = build_schedule(
        case.schedule, world, case.chunks, pipe.early_receives, case.modules, case.extra_warmup, case.overlap
    )
    assert pipe.schedule(case.chunks) == built
    if world > 1:
        assert spans.kinds["recv"] > 0 and spans.kinds["post"] > 0 and spans.kinds["drain"] == 1
    sum_mirrored_grads(pipe)
    if rank in expect:
        assert torch.equal(loss, expect[rank][0]), f"{case}: loss {loss} != {expect[rank][0]}"
    else:
        assert loss is None
    assert outputs is None
    worst = 0.0
    for mod, i in zip(local, ids):
        for p, p_ref in zip(mod.parameters(), full[i].parameters()):
            worst = max(worst, rel_diff(p.grad, p_ref.grad))
    assert worst < GRAD_RTOL, f"{case}: gradient relative error {worst:.3e} on rank {rank}"

    with torch.no_grad():
        loss_inf, out_inf = pipe.step(
            *inputs, num_chunks=case.chunks, criterion=criterion, labels=labels, return_outputs=True
        )
    if rank in expect:
        assert torch.equal(loss_inf, expect[rank][0]), f"{case}: inference loss differs"
        assert torch.equal(out_inf, expect[rank][1]), f"{case}: inference outputs differ"
    else:
        assert loss_inf is None and out_inf is None
    return {"case": str(case), "grad_rel": worst, "overlapped_calls": overlapped_calls}


def _run_cases(rank: int, world: int, cases: list[Case]) -> list[dict]:
    torch.use_deterministic_algorithms(True)
    results = []
    for case in cases:
        results.append(_run_case(rank, world, case))
        dist.barrier()
    return results


def _cases(world: int) -> list[Case]:
    cases = []
    v_chunks = sorted({2 * world, 2 * world + 1, 3 * world + 2})
    for chunks in v_chunks:
        cases.append(Case("dualpipev", chunks))
        cases.append(Case("dualpipev", chunks, overlap=True))
    cases.append(Case("dualpipev", 2 * world + 2, overlap=True, declared="global", reduction="mean"))
    if world % 2 == 0:
        for chunks in (2 * world, 2 * world + 4):
            cases.append(Case("dualpipe", chunks))
            cases.append(Case("dualpipe", chunks, overlap=True))
        cases.append(Case("dualpipe", 2 * world + 2, overlap=True, declared="instance"))
    for sched in ("1f1b", "zb1p"):
        cases.append(Case(sched, world + 1))
        cases.append(Case(sched, 2 * world, reduction="mean", declared="instance"))
    # interleaved 1F1B with v = 2 virtual stages per rank (micro-batches in groups of world), and v = 3
    cases.append(Case("interleaved-1f1b", 2 * world, modules=2))
    cases.append(Case("interleaved-1f1b", 3 * world, reduction="mean", declared="instance", modules=2))
    cases.append(Case("interleaved-1f1b", world, modules=3, early_receives=False))
    # The 1F1B family's steady pairs, overlapped (ZB1P's defer their weight gradients) and run half after half
    for sched in ("1f1b", "zb1p"):
        cases.append(Case(sched, world + 2, overlap=True, extra_warmup=1))
        cases.append(Case(sched, world + 2, extra_warmup=1, reduction="mean"))
    cases.append(Case("interleaved-1f1b", 2 * world, overlap=True, modules=2))
    cases.append(Case("interleaved-1f1b", 2 * world, overlap=True, modules=2, extra_warmup=1, early_receives=False))
    # The zero-bubble V family (deferred weight gradients; with overlap, pairs where the step ends no later; without,
    # its plan unpaired), also with the reference's receive placement
    for name in ("zbv", "v-half", "v-min"):
        cases.append(Case(name, 4 * world + 2, overlap=True))
        cases.append(Case(name, 2 * world + 1, reduction="mean", declared="instance", early_receives=False))
    cases.append(Case("dualpipev", 2 * world, seq=SEQ + 2))  # the sequence length changes between steps
    # The reference's receive placement (what NCCL uses), declared and inferred.
    cases.append(Case("dualpipev", 2 * world + 1, overlap=True, early_receives=False))
    cases.append(Case("zb1p", world + 2, declared="instance", early_receives=False))
    if world % 2 == 0:
        cases.append(Case("dualpipe", 2 * world, overlap=True, declared="instance", early_receives=False))
    return cases


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_schedules_match_single_process(world: int) -> None:
    cases = _cases(world)
    results = run_ranks(_run_cases, world, args=(cases,), timeout=240)
    for rank_results in results:
        assert [r["case"] for r in rank_results] == [str(c) for c in cases]
    # The hook ran once per pair the schedule made (no pair, no call), and never without overlap.
    for case, per_rank in zip(cases, zip(*results)):
        calls = sum(r["overlapped_calls"] for r in per_rank)
        schedule = build_schedule(case.schedule, world, case.chunks, False, case.modules, case.extra_warmup)
        pairs = sum(a.op is Op.FB for actions in schedule.ranks for a in actions)
        assert calls == (pairs if case.overlap else 0), f"{case}: {calls} hook calls for {pairs} pairs"
        if case.extra_warmup:  # the 1F1B family pairs on every rank that can (tests/dualpipe/test_schedule.py)
            assert pairs > 0, f"{case}: no overlapped pair"
        # DualPipe(V) pair from 2 x world + 1 chunks; zbv, which pairs only where the step ends no later, by
        # 4 x world + 2 (its deferred weight gradients pay for its pairs: tests/dualpipe/test_v_family.py counts them)
        dual = case.schedule in ("dualpipe", "dualpipev") and case.chunks > 2 * world
        if case.overlap and (dual or (case.schedule == "zbv" and case.chunks >= 4 * world + 2)):
            assert pairs > 0, f"{case}: no overlapped pair"


def _cuda_case(rank: int, world: int) -> float:
    device = torch.device("cuda", torch.cuda.current_device())
    full = [m.to(device) for m in make_stages(2 * world, HIDDEN, seed=3, cls=ToyStageOverlap)]
    local = [m.to(device) for m in make_stages(2, HIDDEN, seed=4, cls=ToyStageOverlap)]
    for mod, i in zip(local, _stage_ids("dualpipev", rank, world)):
        mod.load_state_dict(full[i].state_dict())
    pipe = DualPipeV(local)
    assert not pipe.early_receives  # NCCL keeps the reference's receive placement
    x = torch.randn(4 * MICRO_BATCH, SEQ, HIDDEN, dtype=torch.float64, device=device)
    loss_ref, _ = reference_step(full, x, x.cos(), 2 * world)
    loss, _ = pipe.step(
        *((x,) if rank == 0 else ()), num_chunks=2 * world, criterion=criterion, labels=(x.cos(),) if rank == 0 else ()
    )
    if rank == 0:
        assert torch.equal(loss, loss_ref)
    return max(
        rel_diff(p.grad, q.grad)
        for mod, i in zip(local, _stage_ids("dualpipev", rank, world))
        for p, q in zip(mod.parameters(), full[i].parameters())
    )


@pytest.mark.gpu
def test_dualpipev_on_nccl() -> None:
    world = torch.cuda.device_count()
    assert max(run_ranks(_cuda_case, world, backend="nccl", timeout=300)) < GRAD_RTOL

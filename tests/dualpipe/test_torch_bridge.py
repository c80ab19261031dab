"""torch's ScheduleDualPipeV running our overlapped forward-and-backward (:mod:`dualpipe.torch_bridge`).

On the same weights and micro-batches, three runs per case: torch's schedule without the bridge, with it,
and our DualPipeV. Losses and gradients must agree: the toy (float64) exactly between torch's two runs and
within 1e-12 of ours; the MoE stages (float32, the hook computes in another order) within 1e-5. And the
hook must have run: the toy counts its calls (as many as our DualPipeV makes), the MoE stages record
all-to-alls under the other micro-batch's compute (:func:`dualpipe.events.hidden_fraction`), which only
overlapped pairs do.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV
from torch.distributed.pipelining import schedules as torch_schedules

from dualpipe import DualPipeV, GradStoreStage, PipelineObserver, overlap_torch_schedule
from dualpipe import _torch_pipelining as tp
from dualpipe.events import hidden_fraction
from dualpipe.torch_bridge import TorchPipeliningMismatch
from moe import EventRecorder, lm_loss
from moe.parallel import ParallelConfig, build_stages, init_layout
from tests.distributed import run_ranks
from tests.dualpipe.toy import ToyStage, ToyStageOverlap, criterion, make_stages, rel_diff
from tests.moe.helpers import SEED, assert_rel_close, batch, tiny_config

HIDDEN, SEQ, MICRO_BATCH, CHUNKS = 8, 3, 2, 4
SCHEDULES = "torch.distributed.pipelining.schedules"


def _example(*shape: int, dtype: torch.dtype = torch.float32, grad: bool = True) -> torch.Tensor:
    """A stage boundary's shape for torch's static mode (no shape-inference pass through the modules)."""
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=grad)


# torch 2.11's ScheduleDualPipeV cannot start on gloo ranks (its warm-up sends to the stage on its own rank):
# the bridge refuses such a schedule in one line, and on that torch the refusal is what the runs check.
CANNOT_START_ON_GLOO = tp.internals().greets_own_rank


def _refusal(schedule: ScheduleDualPipeV) -> str:
    with pytest.raises(TorchPipeliningMismatch, match=r"cannot start on CPU ranks over gloo") as refused:
        overlap_torch_schedule(schedule)
    return str(refused.value)


def _torch_step(schedule: ScheduleDualPipeV, first: bool, *inputs: torch.Tensor, target=None) -> torch.Tensor | None:
    """One step; rank 0 (stage 0 and the last stage) feeds the batch and gets the micro-batch losses."""
    if not first:
        schedule.step()
        return None
    losses: list[torch.Tensor] = []
    schedule.step(*inputs, target=target, losses=losses)
    return torch.stack([x.detach() for x in losses])


# ------------------------------------------------------------------------------------------------ toy


class _Pairs(PipelineObserver):
    """The overlapped pairs the bridge reports, by label."""

    def __init__(self) -> None:
        self.labels: list[str] = []
        self.open = 0

    def begin(self, kind, subject) -> None:
        assert kind == "action" and self.open == 0
        self.labels.append(str(subject))
        self.open += 1

    def end(self, kind, subject) -> None:
        self.open -= 1


def _toy_rank(rank: int, world: int) -> dict:
    torch.use_deterministic_algorithms(True)
    num_stages = 2 * world
    ids = [rank, num_stages - 1 - rank]  # the V: stages r and 2N-1-r
    g = torch.Generator().manual_seed(7)
    x = torch.randn(CHUNKS * MICRO_BATCH, SEQ, HIDDEN, generator=g, dtype=torch.float64)
    y = torch.randn(CHUNKS * MICRO_BATCH, SEQ, HIDDEN, generator=g, dtype=torch.float64)
    boundary = _example(MICRO_BATCH, SEQ, HIDDEN, dtype=torch.float64)
    out: dict = {"pairs": _Pairs()}
    for run in ("torch", "torch-overlap", "dualpipev"):
        full = make_stages(num_stages, HIDDEN, seed=1234, cls=ToyStageOverlap)
        mods = [full[i] for i in ids]
        ToyStageOverlap.calls = 0
        if run == "dualpipev":
            pipe = DualPipeV(mods, timeout=60)
            args = dict(criterion=criterion, labels=(y,)) if rank == 0 else {}
            loss, _ = pipe.step(*((x,) if rank == 0 else ()), num_chunks=CHUNKS, loss_reduction="mean", **args)
        else:
            stages = [
                GradStoreStage(m, i, num_stages, torch.device("cpu"), input_args=boundary, output_args=boundary)
                for m, i in zip(mods, ids)
            ]
            # scale_grads averages gradients over micro-batches: our loss_reduction="mean"
            schedule = ScheduleDualPipeV(stages, n_microbatches=CHUNKS, loss_fn=criterion, scale_grads=True)
            if CANNOT_START_ON_GLOO:
                return {"refused": _refusal(schedule)}
            if run == "torch-overlap":
                overlap_torch_schedule(schedule, observer=out["pairs"])
            loss = _torch_step(schedule, rank == 0, x, target=y)
        out[run] = {
            "loss": loss,
            "calls": ToyStageOverlap.calls,
            "grads": [p.grad for m in mods for p in m.parameters()],
        }
        dist.barrier()
    return out


def test_toy_stages_pp2_match_without_bridge_and_dualpipev():
    results = run_ranks(_toy_rank, world_size=2, timeout=60)
    if CANNOT_START_ON_GLOO:
        assert all(r.keys() == {"refused"} for r in results), results
        return
    for rank, r in enumerate(results):
        plain, bridged, ours = r["torch"], r["torch-overlap"], r["dualpipev"]
        assert plain["calls"] == 0
        assert bridged["calls"] == ours["calls"] > 0, (rank, bridged["calls"], ours["calls"])
        # one reported span per pair: the forward of one local stage and the backward of the other
        assert len(r["pairs"].labels) == bridged["calls"] and r["pairs"].open == 0
        for label in r["pairs"].labels:
            f, b = map(int, re.fullmatch(r"\(F(\d+)\.\d+&B(\d+)\.\d+\)", label).groups())
            assert {f, b} == {rank, 3 - rank}, label
        if rank == 0:
            assert torch.equal(bridged["loss"], plain["loss"])
            assert torch.equal(bridged["loss"], ours["loss"])
        for got, same, want in zip(bridged["grads"], plain["grads"], ours["grads"]):
            assert torch.equal(got, same)
            assert rel_diff(got, want) < 1e-12


# ------------------------------------------------------------------------------------------------ MoE

PP, EP, PER_REPLICA = 2, 2, 4


def _moe_rank(rank: int, world: int) -> dict:
    cfg = tiny_config()
    layout = init_layout(ParallelConfig(pp=PP, ep=EP, schedule="dualpipev"))
    ids, labels = batch(cfg, EP * PER_REPLICA, 16)
    mine = slice(layout.ep_rank * PER_REPLICA, (layout.ep_rank + 1) * PER_REPLICA)
    ids, labels = ids[mine], labels[mine]
    mb, seq = PER_REPLICA // CHUNKS, ids.shape[1]
    num_stages = 2 * PP
    first = layout.pp_rank == 0
    out = {}
    for run in ("torch", "torch-overlap", "dualpipev"):
        stages = build_stages(cfg, layout, seed=SEED, piecewise=True)
        recorder = EventRecorder()
        for s in stages:
            s.recorder = recorder
        if run == "dualpipev":
            pipe = DualPipeV(stages, process_group=layout.pp_group, overlap=True, timeout=60)
            args = dict(criterion=lm_loss, labels=(labels,)) if first else {}
            loss, _ = pipe.step(*((ids,) if first else ()), num_chunks=CHUNKS, **args)
        else:
            torch_stages = []
            for s in stages:
                sid = s.stage_index
                inputs = (
                    _example(mb, seq, dtype=torch.long, grad=False) if sid == 0 else _example(mb, seq, cfg.hidden_size)
                )
                width = cfg.vocab_size if sid == num_stages - 1 else cfg.hidden_size
                stage = GradStoreStage(
                    s, sid, num_stages, torch.device("cpu"), group=layout.pp_group,
                    input_args=inputs, output_args=_example(mb, seq, width),
                )  # fmt: skip
                torch_stages.append(stage)
            # summed over micro-batches, as our DualPipeV's default
            schedule = ScheduleDualPipeV(torch_stages, n_microbatches=CHUNKS, loss_fn=lm_loss, scale_grads=False)
            if CANNOT_START_ON_GLOO:
                return {"refused": _refusal(schedule)}
            if run == "torch-overlap":
                overlap_torch_schedule(schedule)
            loss = _torch_step(schedule, first, ids, target=labels)
        grads = {n: p.grad.clone() for m in stages for n, p in m.named_parameters()}
        out[run] = {"loss": loss, "grads": grads, "hidden": hidden_fraction(recorder)}
        dist.barrier()
    return out


def test_moe_stages_pp2_ep2_match_without_bridge_and_dualpipev():
    results = run_ranks(_moe_rank, world_size=PP * EP, timeout=120)
    if CANNOT_START_ON_GLOO:
        assert all(r.keys() == {"refused"} for r in results), results
        return
    for rank, r in enumerate(results):
        plain, bridged, ours = r["torch"], r["torch-overlap"], r["dualpipev"]
        # all-to-alls under compute: outside pairs only under a chunk's own pieces (the shared expert under its
        # dispatch), the rest in overlapped pairs, the same pairs in both pipelines, so the forward micro-batch's
        # run under as much in torch's schedule with the bridge as in ours, kind by kind. (Unpaired backward
        # chunks differ: ours runs a full backward's dW while its dispatch gradient is in flight, torch runs W
        # as an action of its own.)
        forward = {
            run: {k: (h.count, h.covered) for k, h in r[run]["hidden"].kinds.items() if k.endswith(".fwd")} for run in r
        }
        alone = {k for k, h in plain["hidden"].kinds.items() if h.covered}
        assert alone <= {"dispatch.fwd", "dispatch.bwd"}, (rank, alone)
        assert bridged["hidden"].covered > plain["hidden"].covered and bridged["hidden"].fraction > 0, rank
        assert forward["torch-overlap"] == forward["dualpipev"], (rank, forward)
        if plain["loss"] is not None:  # the forward computes in the same order in every run
            assert torch.equal(bridged["loss"], plain["loss"]) and torch.equal(ours["loss"], plain["loss"]), rank
        assert set(bridged["grads"]) == set(plain["grads"]) == set(ours["grads"])
        for name, want in plain["grads"].items():
            assert_rel_close(bridged["grads"][name], want, 1e-5, f"rank {rank} {name} (bridge vs torch)")
            assert_rel_close(ours["grads"][name], want, 1e-5, f"rank {rank} {name} (dualpipev vs torch)")


# ------------------------------------------------------------------------------------------------ errors


def test_a_missing_private_name_is_named(monkeypatch):
    monkeypatch.delattr(torch_schedules, "_wait_batch_p2p")
    with pytest.raises(
        TorchPipeliningMismatch,
        match=r"schedules\._wait_batch_p2p, a torch\.distributed\.pipelining internal as of torch 2\.\d+;",
    ):
        overlap_torch_schedule(object())


def test_a_reshaped_private_method_is_named(monkeypatch):
    monkeypatch.setattr(torch_schedules._PipelineScheduleRuntime, "_maybe_get_loss", lambda self, mb_index: None)
    with pytest.raises(TorchPipeliningMismatch, match=r"_PipelineScheduleRuntime\._maybe_get_loss\(stage, mb_index"):
        overlap_torch_schedule(object())


def test_an_untested_torch_version_is_named(monkeypatch):
    # the minor after the running torch's: not in the table, and the running one's internals are its nearest
    major, minor = map(int, torch.__version__.split(".")[:2])
    untested = f"{major}.{minor + 1}.0"
    assert (major, minor + 1) not in tp.KNOWN_TORCH
    monkeypatch.setattr(torch, "__version__", untested)
    with pytest.raises(TorchPipeliningMismatch, match=rf"tested there only; this is torch {re.escape(untested)}\."):
        overlap_torch_schedule(object())
    with pytest.raises(TypeError):  # past the version check, the next one
        overlap_torch_schedule(object(), allow_untested_torch=True)


def test_a_schedule_that_runs_no_overlapped_pairs_is_refused():
    with pytest.raises(TypeError, match=r"ScheduleDualPipeV .*got object"):
        overlap_torch_schedule(object())
    # a runtime schedule whose order has separate F and B actions (torch's ScheduleInterleaved1F1B's kind)
    from torch.distributed.pipelining.schedules import _Action, _ComputationType, _PipelineScheduleRuntime

    unpaired = object.__new__(_PipelineScheduleRuntime)
    unpaired.rank = 0
    unpaired.pipeline_order = {
        0: [_Action(0, _ComputationType.FORWARD, 0), _Action(0, _ComputationType.FULL_BACKWARD, 0)]
    }
    with pytest.raises(ValueError, match="runs no OVERLAP_F_B action on this rank"):
        overlap_torch_schedule(unpaired)


# ------------------------------------------------------------------------------------------------ recording


def _spans(log: list[tuple[str, str | None, str]]):
    @contextlib.contextmanager
    def span(kind: str, desc: str | None):
        log.append((kind, desc, "begin"))
        try:
            yield
        finally:
            log.append((kind, desc, "end"))

    return span


def test_recording_wraps_torchs_posts_and_waits_and_restores_them():
    post, wait = torch_schedules._batch_p2p, torch_schedules._wait_batch_p2p
    log: list[tuple[str, str | None, str]] = []
    with tp.record_batch_p2p(_spans(log)):
        assert torch_schedules._batch_p2p is not post and torch_schedules._wait_batch_p2p is not wait
        # looked up in the module as torch's runtime does (no ops: nothing is sent, nothing to wait for)
        torch_schedules._wait_batch_p2p(torch_schedules._batch_p2p([], desc="fwd_send"))
        torch_schedules._batch_p2p([])
    assert log == [
        ("post", "fwd_send", "begin"), ("post", "fwd_send", "end"),
        ("wait", None, "begin"), ("wait", None, "end"),
        ("post", None, "begin"), ("post", None, "end"),
    ]  # fmt: skip
    assert torch_schedules._batch_p2p is post and torch_schedules._wait_batch_p2p is wait
    with pytest.raises(KeyError), tp.record_batch_p2p(_spans(log)):
        raise KeyError("a failed step")
    assert torch_schedules._batch_p2p is post and torch_schedules._wait_batch_p2p is wait


def test_a_post_torch_splits_is_one_recorded_post(monkeypatch):
    # torch 2.15 posts a batch spanning several process groups as one post per group, through the module name
    def split_post(p2p_ops, desc=None):
        return [w for op in p2p_ops for w in torch_schedules._batch_p2p([op], desc=desc)] if len(p2p_ops) > 1 else []

    monkeypatch.setattr(torch_schedules, "_batch_p2p", split_post)
    log: list[tuple[str, str | None, str]] = []
    with tp.record_batch_p2p(_spans(log)):
        torch_schedules._batch_p2p(["op0", "op1"], desc="fwd_send_bwd_recv")
    assert log == [("post", "fwd_send_bwd_recv", "begin"), ("post", "fwd_send_bwd_recv", "end")]
    assert torch_schedules._batch_p2p is split_post


@pytest.mark.parametrize("name", ["_batch_p2p", "_wait_batch_p2p"])
def test_recording_refuses_a_torch_without_its_functions_in_one_line(monkeypatch, name: str):
    other = "_wait_batch_p2p" if name == "_batch_p2p" else "_batch_p2p"
    kept = getattr(torch_schedules, other)
    monkeypatch.delattr(torch_schedules, name)
    with pytest.raises(TorchPipeliningMismatch) as refused, tp.record_batch_p2p(_spans([])):
        pass
    msg = str(refused.value)
    assert "\n" not in msg and msg.startswith(f"recording torch's pipeline messages needs {SCHEDULES}.{name}, ")
    assert not hasattr(torch_schedules, name) and getattr(torch_schedules, other) is kept  # nothing swapped in


def test_recording_refuses_a_reshaped_post(monkeypatch):
    monkeypatch.setattr(torch_schedules, "_batch_p2p", lambda ops, tag=None: [])
    reshaped = r"_batch_p2p\(p2p_ops, desc, \.\.\.\), found \(ops, tag\)"
    with pytest.raises(TorchPipeliningMismatch, match=reshaped), tp.record_batch_p2p(_spans([])):
        pass


def test_the_bridge_does_not_need_the_recorded_name(monkeypatch):
    """Only recording (the benchmark) swaps _batch_p2p: a torch without it still runs the bridge, whose first
    complaint about a non-schedule is then the schedule's, not a private name."""
    monkeypatch.delattr(torch_schedules, "_batch_p2p")
    with pytest.raises(Exception) as refused:
        overlap_torch_schedule(object())
    assert "_batch_p2p" not in str(refused.value) and "pipelining internal" not in str(refused.value)


def _stage_errors(rank: int, world: int) -> dict[str, str]:
    boundary = _example(MICRO_BATCH, SEQ, HIDDEN, dtype=torch.float64)
    msgs = {}
    for cls in (ToyStage, ToyStageOverlap):
        mods = make_stages(2, HIDDEN, seed=0, cls=cls)
        stages = [
            PipelineStage(m, i, 2, torch.device("cpu"), input_args=boundary, output_args=boundary)
            for i, m in enumerate(mods)
        ]
        schedule = ScheduleDualPipeV(stages, n_microbatches=2, loss_fn=criterion)
        try:
            overlap_torch_schedule(schedule)
            overlap_torch_schedule(schedule)
        except (ValueError, TorchPipeliningMismatch) as exc:
            msgs[cls.__name__] = str(exc)
    return msgs


def test_stages_without_the_hook_are_refused_before_any_step():
    (msgs,) = run_ranks(_stage_errors, world_size=1, timeout=60)
    assert "stage 0's module class ToyStage defines no overlapped_forward_backward" in msgs["ToyStage"]
    # stages the bridge takes: refused for gloo where torch cannot start them, else refused when bridged twice
    twice = "already runs its pairs through the hook"
    assert ("cannot start on CPU ranks over gloo" if CANNOT_START_ON_GLOO else twice) in msgs["ToyStageOverlap"]

"""examples/overlap_moe.py: a user's plain-torch MoE, overlapped through its pieces, equals the
single-process model at pp=2 x ep=2 (4 gloo ranks) on our DualPipeV and on torch's ScheduleDualPipeV
through the bridge, and its all-to-alls run during the other micro-batch's compute."""

from __future__ import annotations

import pytest
import torch

from dualpipe import DualPipeV, overlap_torch_schedule
from dualpipe import _torch_pipelining as tp
from dualpipe.events import EventRecorder, HiddenFraction, hidden_fraction
from examples.overlap_moe import Config, Model, average_replicas, build, dualpipev_layers, loss_fn
from tests.distributed import RankFailure, run_ranks

PP, EP, CHUNKS, MICRO, SEQ = 2, 2, 4, 2, 8
CFG = Config(dim=16, heads=2, ffn=24)


def _replica_batch(ep_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7 + ep_rank)
    ids = torch.randint(CFG.vocab, (MICRO * CHUNKS, SEQ), generator=gen)
    return ids, ids.roll(1, dims=1)


def _boundary(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    # A stage boundary's shape for torch's static mode (no shape-inference pass through the stages).
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)


def _torch_schedule(stages, pp_group, pp_rank: int):
    """torch's ScheduleDualPipeV over the same stages (rank r: stages r and 2N-1-r), bridged to our hook."""
    from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

    num = 2 * PP
    hidden, ids = _boundary(MICRO, SEQ, CFG.dim), _boundary(MICRO, SEQ, dtype=torch.int64)
    torch_stages = []
    for index, stage in zip((pp_rank, num - 1 - pp_rank), stages):
        inputs = ids if index == 0 else hidden
        outputs = _boundary(MICRO, SEQ, CFG.vocab) if index == num - 1 else hidden
        torch_stages.append(
            PipelineStage(
                stage, index, num, torch.device("cpu"), input_args=inputs, output_args=outputs, group=pp_group
            )
        )
    # Losses summed over micro-batches, as DualPipeV does: no scaling of the gradients.
    schedule = ScheduleDualPipeV(torch_stages, n_microbatches=CHUNKS, loss_fn=loss_fn, scale_grads=False)
    overlap_torch_schedule(schedule)
    return schedule


def _step(rank: int, world: int, runtime: str):
    stages, pp_group, ep_group, pp_rank, ep_rank = build(CFG, PP, EP, seed=3)
    recorder = EventRecorder()
    for stage in stages:
        stage.recorder = recorder
    ids, labels = _replica_batch(ep_rank)
    feeds = pp_rank == 0
    if runtime == "dualpipev":
        pipe = DualPipeV(stages, batch_dim=0, process_group=pp_group)
        loss, _ = pipe.step(
            *((ids,) if feeds else ()), num_chunks=CHUNKS, criterion=loss_fn, labels=(labels,) if feeds else ()
        )
    else:
        schedule, loss = _torch_schedule(stages, pp_group, pp_rank), None
        if feeds:
            losses: list[torch.Tensor] = []
            schedule.step(ids, target=labels, losses=losses)
            loss = torch.stack(losses)
        else:
            schedule.step()
    average_replicas(stages, ep_group)
    grads = [{n: p.grad.clone() for n, p in s.named_parameters()} for s in stages]
    return pp_rank, ep_rank, None if loss is None else loss.detach(), grads, hidden_fraction(recorder)


@pytest.mark.parametrize("runtime", ["dualpipev", "torch-dualpipev-bridge"])
def test_user_moe_equals_the_single_process_model(runtime: str):
    model = Model(CFG, seed=3)
    ref_losses = {}
    for ep_rank in range(EP):
        ids, labels = _replica_batch(ep_rank)
        losses = []
        for mb_ids, mb_labels in zip(ids.tensor_split(CHUNKS), labels.tensor_split(CHUNKS)):
            loss = loss_fn(model(mb_ids), mb_labels)
            loss.backward()
            losses.append(loss.detach())
        ref_losses[ep_rank] = torch.stack(losses)
    # the ep ranks are replicas: the step's gradient is the mean over them of the summed micro-batch losses
    ref_grads = {n: p.grad / EP for n, p in model.named_parameters()}

    if runtime != "dualpipev" and tp.internals().greets_own_rank:
        # a torch whose ScheduleDualPipeV cannot start on gloo ranks: the bridge refuses it in one line
        with pytest.raises(RankFailure, match="cannot start on CPU ranks over gloo"):
            run_ranks(_step, world_size=PP * EP, args=(runtime,), timeout=120)
        return
    results = run_ranks(_step, world_size=PP * EP, args=(runtime,), timeout=120)
    hidden = sum((r[-1] for r in results), HiddenFraction())
    assert hidden.covered > 0 and hidden.fraction > 0, "no all-to-all ran under compute: the overlap hook did not run"
    for pp_rank, ep_rank, losses, grads, _ in results:
        if pp_rank == 0:
            torch.testing.assert_close(losses, ref_losses[ep_rank], rtol=1e-5, atol=1e-6)
        for layers, got in zip(dualpipev_layers(CFG, PP, pp_rank), grads):
            want = model.stage_state(list(got), layers, EP, ep_rank, full=ref_grads)
            assert set(want) == set(got)
            for name, g in got.items():
                torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-7, msg=f"{pp_rank, ep_rank} {name}")

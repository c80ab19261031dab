"""examples/overlap_moe.py: a user's plain-torch MoE, overlapped through its pieces, equals the
single-process model on DualPipeV at pp=2 x ep=2 (4 gloo ranks)."""

from __future__ import annotations

import torch

from dualpipe import DualPipeV
from examples.overlap_moe import Config, Model, average_replicas, build, dualpipev_layers, loss_fn
from tests.distributed import run_ranks

PP, EP, CHUNKS, SEQ = 2, 2, 4, 8
CFG = Config(dim=16, heads=2, ffn=24)


def _replica_batch(ep_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7 + ep_rank)
    ids = torch.randint(CFG.vocab, (2 * CHUNKS, SEQ), generator=gen)
    return ids, ids.roll(1, dims=1)


class _Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, int, str]] = []

    def record(self, name: str, direction: str, layer: int, edge: str) -> None:
        self.events.append((name, direction, layer, edge))


def _hidden(events) -> int:
    """All-to-alls in flight while a compute of the other micro-batch ran (the overlap happened)."""
    hidden, opened = 0, {}
    for i, (name, direction, layer, edge) in enumerate(events):
        if edge == "start":
            opened[(name, direction, layer)] = i
        elif edge == "wait":
            start = opened.pop((name, direction, layer))
            other = "bwd" if direction == "fwd" else "fwd"
            hidden += any(e == "end" and d == other for _, d, _, e in events[start:i])
    return hidden


def _dualpipev_step(rank: int, world: int):
    stages, pp_group, ep_group, pp_rank, ep_rank = build(CFG, PP, EP, seed=3)
    recorder = _Recorder()
    for stage in stages:
        stage.recorder = recorder
    pipe = DualPipeV(stages, batch_dim=0, process_group=pp_group)
    ids, labels = _replica_batch(ep_rank)
    feeds = pp_rank == 0
    loss, _ = pipe.step(
        *((ids,) if feeds else ()), num_chunks=CHUNKS, criterion=loss_fn, labels=(labels,) if feeds else ()
    )
    average_replicas(stages, ep_group)
    grads = [{n: p.grad.clone() for n, p in s.named_parameters()} for s in stages]
    return pp_rank, ep_rank, None if loss is None else loss.detach(), grads, _hidden(recorder.events)


def test_user_moe_on_dualpipev_equals_the_single_process_model():
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

    results = run_ranks(_dualpipev_step, world_size=PP * EP, timeout=120)
    assert sum(r[-1] for r in results) > 0, "no all-to-all was hidden: the overlap hook did not run"
    for pp_rank, ep_rank, losses, grads, _ in results:
        if pp_rank == 0:
            torch.testing.assert_close(losses, ref_losses[ep_rank], rtol=1e-5, atol=1e-6)
        for layers, got in zip(dualpipev_layers(CFG, PP, pp_rank), grads):
            want = model.stage_state(list(got), layers, EP, ep_rank, full=ref_grads)
            assert set(want) == set(got)
            for name, g in got.items():
                torch.testing.assert_close(g, want[name], rtol=1e-5, atol=1e-7, msg=f"{pp_rank, ep_rank} {name}")

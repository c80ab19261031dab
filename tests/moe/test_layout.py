"""(pp, dp, ep) training with expert replicas inside data parallelism equals one process, step after step.

8 gloo ranks at pp=2 x dp=4 x ep=2: each stage's 4 data-parallel ranks form 2 expert replicas of 2 ranks.
Every rank feeds its quarter of the global batch; after ``reduce_gradients`` every gradient must be the
single-process gradient of the whole global batch (summed over micro-batches, averaged over dp). The
optimizer is the trainer's: ZeRO-1 AdamW with the global gradient norm clipped to a value every step
exceeds; the norms must be the single process's ``clip_grad_norm_`` and, three steps later, so must the
losses.
"""

from __future__ import annotations

import pytest
import torch

from dualpipe import DualPipe, DualPipeV
from moe import lm_loss
from moe.models.model import MoEModel
from moe.parallel import ParallelConfig, build_stages, init_layout
from moe.train.grad_sync import make_optimizer, reduce_gradients
from tests.distributed import run_ranks
from tests.moe.helpers import SEED, assert_rel_close, batch, tiny_config

PP, DP, EP, PER_RANK, CHUNKS, STEPS, LR, CLIP = 2, 4, 2, 4, 4, 3, 1e-2, 0.5
PIPELINES = {"dualpipev": DualPipeV, "dualpipe": DualPipe}


def _global_batch(cfg, step: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    return batch(cfg, dp * PER_RANK, 16, seed=step)


ADAMW = {"lr": LR, "weight_decay": 0.01, "betas": (0.9, 0.95)}


def _train(rank: int, world: int, schedule: str, dp: int):
    cfg = tiny_config()
    layout = init_layout(ParallelConfig(pp=PP, dp=dp, ep=EP, schedule=schedule))
    stages = build_stages(cfg, layout, seed=SEED)
    pipe = PIPELINES[schedule](stages, batch_dim=0, process_group=layout.pp_group, overlap=True)
    optimizer = make_optimizer(stages, layout, zero=True, **ADAMW)
    mine = slice(layout.dp_rank * PER_RANK, (layout.dp_rank + 1) * PER_RANK)
    losses, norms, first_grads = [], [], {}
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        ids, labels = _global_batch(cfg, step, dp)
        inputs, targets = pipe.split_batch((ids[mine],), (labels[mine],))
        loss, _ = pipe.step(*inputs, num_chunks=CHUNKS, criterion=lm_loss, labels=targets)
        reduce_gradients(stages, layout)
        if step == 0:
            first_grads = {n: p.grad.clone() for m in stages for n, p in m.named_parameters()}
        norms.append(optimizer.clip_grad_norm_(CLIP))
        optimizer.step()
        losses.append(None if loss is None else loss.detach().clone())
    experts = list(stages[0].dispatcher.local_experts)
    coords = (layout.pp_rank, layout.edp_rank, layout.ep_rank)
    return coords, losses, first_grads, experts, norms


def _reference(cfg, dp: int) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """Mean micro-batch loss per step, the first step's gradients and every step's gradient norm of one
    process on the global batch."""
    model = MoEModel(cfg, seed=SEED)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    means, first, norms = [], {}, []
    for step in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        ids, labels = _global_batch(cfg, step, dp)
        total = 0.0
        for d in range(dp):
            rows = slice(d * PER_RANK, (d + 1) * PER_RANK)
            for x, y in zip(ids[rows].tensor_split(CHUNKS), labels[rows].tensor_split(CHUNKS)):
                loss = lm_loss(model(x), y)
                loss.backward()  # not (loss / dp): the balance loss's gradient is injected at its own scale
                total += loss.item()
        for p in model.parameters():
            p.grad /= dp  # summed over micro-batches, averaged over the dp ranks
        if step == 0:
            first = {n: p.grad.clone() for n, p in model.named_parameters()}
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        optimizer.step()
        means.append(total / (dp * CHUNKS))
    return means, first, norms


def _train_each(rank: int, world: int, dp: int) -> dict:
    return {schedule: _train(rank, world, schedule, dp) for schedule in PIPELINES}


@pytest.fixture(scope="module")
def trained() -> tuple[tuple, dict[str, list]]:
    """The single process's run, and every rank's run of each schedule: both in turn on one spawn of 8 ranks."""
    per_rank = run_ranks(_train_each, world_size=PP * DP, args=(DP,), timeout=360)
    return _reference(tiny_config(), DP), {schedule: [r[schedule] for r in per_rank] for schedule in PIPELINES}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_pp2_dp4_ep2_trains_like_one_process(trained: tuple, schedule: str, dp: int = DP) -> None:
    (ref_means, ref_grads, ref_norms), runs = trained
    results = runs[schedule]

    seen: dict[tuple[int, int], set[str]] = {}
    for (pp_rank, edp_rank, ep_rank), _, grads, experts, norms in results:
        assert norms == pytest.approx(ref_norms, rel=1e-5)  # every rank: each parameter counted once
        for name, g in grads.items():
            want = ref_grads[name]
            if ".experts." in name:
                want = want[experts[0] : experts[-1] + 1]
            assert_rel_close(g, want, 1e-5, f"rank ({pp_rank}, {edp_rank}, {ep_rank}) {name}")
            seen.setdefault((edp_rank, ep_rank), set()).add(name)
    # Every parameter was checked on every data-parallel rank (both replicas of every expert).
    assert len(seen) == dp and all(names == set(ref_grads) for names in seen.values())
    for step in range(STEPS):
        # Every micro-batch's loss is computed on exactly one rank: their mean is the global batch's.
        got = torch.cat([r[1][step].flatten() for r in results if r[1][step] is not None])
        assert got.numel() == dp * CHUNKS
        assert abs(got.mean().item() - ref_means[step]) <= 2e-5 * abs(ref_means[step]), (step, got, ref_means)
    assert all(n > CLIP for n in ref_norms)  # the clipping acted at every step

"""PP x EP training steps through the dualpipe executor equal the single-process model.

PP=2 x EP=2 on 4 gloo ranks, with DualPipeV (4 stages, one layer each) and DualPipe (2 stages, two
mirrored copies), on our blocks and on both published architectures (DeepSeek-V3 with its MTP module, whose
embedding is the first stage's on the same rank; Qwen3-MoE), with every activation kept, recomputed in full
or selectively. Each ep rank is a data-parallel replica with its own half of the batch; after
``reduce_gradients`` every gradient must equal the single-process gradient of the same micro-batches
(losses summed over micro-batches, as DualPipe does, averaged over the replicas).
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh

from dualpipe import DualPipe, DualPipeV, ZeroBubble1P
from dualpipe.events import HiddenFraction, hidden_fraction
from moe import EventRecorder, lm_loss
from moe.models.config import preset
from moe.parallel import ParallelConfig, build_stages, init_layout
from moe.train.grad_sync import reduce_gradients
from tests.distributed import run_ranks
from tests.moe.helpers import SEED, assert_rel_close, batch, single_process_grads, tiny_config

PP, EP, PER_REPLICA, CHUNKS = 2, 2, 4, 4
ARCHITECTURES = {
    "ours": tiny_config,
    "deepseek_v3": lambda: preset("deepseek-v3-tiny"),
    "qwen3_moe": lambda: preset("qwen3-moe-tiny"),
}


def _replica_batch(cfg, ep_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, labels = batch(cfg, EP * PER_REPLICA, 16)
    mine = slice(ep_rank * PER_REPLICA, (ep_rank + 1) * PER_REPLICA)
    return ids[mine], labels[mine]


def _pipeline_step(rank: int, world: int, schedule: str, recompute: bool | str, overlap: bool, arch: str):
    cfg = ARCHITECTURES[arch]()
    layout = init_layout(ParallelConfig(pp=PP, ep=EP, schedule=schedule, recompute=recompute))
    stages = build_stages(cfg, layout, seed=SEED)
    ids, labels = _replica_batch(cfg, layout.ep_rank)
    if schedule == "dualpipev":
        pipe = DualPipeV(stages, batch_dim=0, process_group=layout.pp_group, overlap=overlap)
        first = layout.pp_rank == 0
        args = (ids,) if first else ()
        lab = (labels,) if first else ()
    elif schedule == "zb1p":
        # The single-module baseline whose backward defers weight gradients through WeightGradStore.
        pipe = ZeroBubble1P(stages, batch_dim=0, process_group=layout.pp_group)
        args = (ids,) if layout.pp_rank == 0 else ()
        lab = (labels,) if layout.pp_rank == PP - 1 else ()
    else:
        pipe = DualPipe(stages, batch_dim=0, process_group=layout.pp_group, overlap=overlap)
        # Direction 0 enters at pp rank 0 with the first half; direction 1 at the last rank with the second.
        half = PER_REPLICA // 2
        top, bottom = slice(0, half), slice(half, PER_REPLICA)
        first, last = layout.pp_rank == 0, layout.pp_rank == PP - 1
        args = (ids[top],) if first else (ids[bottom],)
        lab = (labels[bottom],) if first else (labels[top],)
        assert first or last
    recorder = EventRecorder()
    for stage in stages:
        stage.recorder = recorder
    loss, _ = pipe.step(*args, num_chunks=CHUNKS, criterion=lm_loss, labels=lab)
    reduce_gradients(stages, layout)
    assert isinstance(layout.mesh, DeviceMesh) and layout.mesh.mesh_dim_names == ("pp", "edp", "ep")
    grads = {n: p.grad.numpy().copy() for m in stages for n, p in m.named_parameters()}
    experts = list(stages[0].dispatcher.local_experts)
    losses = None if loss is None else loss.detach().numpy().copy()
    return layout.pp_rank, layout.ep_rank, losses, grads, experts, hidden_fraction(recorder)


@pytest.mark.parametrize(
    ("schedule", "recompute", "overlap", "arch"),
    [
        ("dualpipev", False, True, "ours"),
        ("dualpipev", True, True, "ours"),
        ("dualpipev", False, False, "ours"),
        ("dualpipe", False, True, "ours"),
        ("zb1p", False, False, "ours"),
        ("dualpipev", False, True, "deepseek_v3"),
        ("dualpipe", True, True, "deepseek_v3"),
        ("dualpipev", "selective", True, "deepseek_v3"),  # norms and MLA up-projections recomputed, MTP included
        ("zb1p", False, False, "deepseek_v3"),  # the MTP stage's embedding copy on the other pipeline rank
        ("dualpipev", True, True, "qwen3_moe"),
        ("zb1p", False, False, "qwen3_moe"),
    ],
)
def test_pp2_ep2_matches_single_process(schedule: str, recompute: bool | str, overlap: bool, arch: str):
    cfg = ARCHITECTURES[arch]()
    micro = []
    for ep_rank in range(EP):
        ids, labels = _replica_batch(cfg, ep_rank)
        micro += list(zip(ids.tensor_split(CHUNKS), labels.tensor_split(CHUNKS)))
    ref_losses, ref_grads, _ = single_process_grads(cfg, micro)
    results = run_ranks(_pipeline_step, world_size=PP * EP, args=(schedule, recompute, overlap, arch), timeout=180)

    # With overlap the executor handed paired chunks to MoEStage.overlapped_forward_backward, which ran the
    # forward micro-batch's all-to-alls under the other one's compute. Without, only a chunk's own pieces run
    # under its transfers: the forward dispatch under the shared expert, a backward's dispatch gradient under
    # its mlp dW and shared expert (MTP's too); the combines are waited before the next compute.
    hidden = sum((r[-1] for r in results), HiddenFraction())
    under_work = {kind for kind, h in hidden.kinds.items() if h.covered}
    if overlap:
        assert hidden.fraction > 0 and {"dispatch.fwd", "combine.fwd"} <= under_work, hidden.kinds
    else:
        assert hidden.count > 0 and all(k.split(".")[-2] == "dispatch" for k in under_work), hidden.kinds
    seen: dict[int, set[str]] = {e: set() for e in range(EP)}
    for pp_rank, ep_rank, losses, grads, experts, _ in results:
        if losses is not None:
            mine = ref_losses[ep_rank * CHUNKS : (ep_rank + 1) * CHUNKS]
            if schedule == "dualpipe":
                # pp rank 0 computes the losses of direction 1 (second half), the last rank of direction 0.
                half = CHUNKS // 2
                mine = mine[half:] if pp_rank == 0 else mine[:half]
            for got, want in zip(losses.tolist(), mine):
                assert abs(got - want) <= 1e-5 * abs(want), (pp_rank, ep_rank, got, want)
        for name, g in grads.items():
            want = ref_grads[name] / EP  # summed over micro-batches, averaged over the replicas
            if ".experts." in name:
                want = want[experts[0] : experts[-1] + 1]
            assert_rel_close(torch.from_numpy(g), want, 1e-5, f"rank ({pp_rank}, {ep_rank}) {name}")
            seen[ep_rank].add(name)
    # Every parameter of the model was checked on every replica.
    assert all(names == set(ref_grads) for names in seen.values())

"""DualPipeV with pp=2 x ep=2 on 4 GPUs over NCCL against the single-process model (fp32).

The CPU twin is ``tests.moe.test_pipeline`` (gloo); this one puts each rank on its own GPU, so the P2P
sends and receives, the expert all-to-alls and the gradient reductions all run on NCCL, the expert MLPs on
the Triton kernels (fp32 takes their exact, non-tf32 path), and the overlapped pair on CUDA streams.
The oracle is the same: one ordinary autograd graph on the CPU over the same micro-batches.
"""

from __future__ import annotations

import pytest
import torch

from dualpipe import DualPipeV
from dualpipe.events import HiddenFraction, hidden_fraction
from moe import EventRecorder, lm_loss
from moe.parallel import ParallelConfig, build_stages, init_layout
from moe.train.grad_sync import reduce_gradients
from tests.distributed import run_ranks
from tests.moe.helpers import SEED, assert_rel_close, single_process_grads, tiny_config
from tests.moe.test_pipeline import CHUNKS, EP, PP, _replica_batch

pytestmark = pytest.mark.multigpu(gpus=PP * EP)


def _dualpipev_step(rank: int, world: int, overlap: bool):
    cfg = tiny_config()
    layout = init_layout(ParallelConfig(pp=PP, ep=EP, schedule="dualpipev", dispatcher="alltoall"), "cuda")
    stages = build_stages(cfg, layout, seed=SEED, device="cuda")
    ids, labels = _replica_batch(cfg, layout.ep_rank)
    pipe = DualPipeV(stages, batch_dim=0, process_group=layout.pp_group, overlap=overlap)
    first = layout.pp_rank == 0
    recorder = EventRecorder("cuda")
    for stage in stages:
        stage.recorder = recorder
    loss, _ = pipe.step(
        *((ids.cuda(),) if first else ()),
        num_chunks=CHUNKS,
        criterion=lm_loss,
        labels=(labels.cuda(),) if first else (),
    )
    reduce_gradients(stages, layout)
    torch.cuda.synchronize()
    grads = {n: p.grad.cpu().numpy() for m in stages for n, p in m.named_parameters()}
    losses = None if loss is None else loss.detach().cpu().numpy()
    experts = list(stages[0].dispatcher.local_experts)
    # CUDA events on the compute and communication streams, resolved here (they do not leave the process)
    return layout.pp_rank, layout.ep_rank, losses, grads, experts, hidden_fraction(recorder)


@pytest.mark.parametrize("overlap", [True, False])
def test_dualpipev_pp2_ep2_matches_single_process(overlap: bool):
    cfg = tiny_config()
    micro = []
    for ep_rank in range(EP):
        ids, labels = _replica_batch(cfg, ep_rank)
        micro += list(zip(ids.tensor_split(CHUNKS), labels.tensor_split(CHUNKS)))
    ref_losses, ref_grads, _ = single_process_grads(cfg, micro)
    results = run_ranks(_dualpipev_step, world_size=PP * EP, args=(overlap,), timeout=300, backend="nccl")
    # as on CPU (tests.moe.test_pipeline): only overlapped pairs put forward all-to-alls under compute
    hidden = sum((r[-1] for r in results), HiddenFraction())
    under_work = {kind for kind, h in hidden.kinds.items() if h.covered}
    if overlap:
        assert hidden.fraction > 0 and {"dispatch.fwd", "combine.fwd"} <= under_work, hidden.kinds
    else:
        assert hidden.count > 0 and under_work <= {"dispatch.bwd"}, hidden.kinds
    for pp_rank, ep_rank, losses, grads, experts, _ in results:
        if losses is not None:
            for got, want in zip(losses.tolist(), ref_losses[ep_rank * CHUNKS : (ep_rank + 1) * CHUNKS]):
                assert got == pytest.approx(want, rel=1e-4), (pp_rank, ep_rank)
        for name, g in grads.items():
            want = ref_grads[name] / EP  # summed over micro-batches, averaged over the replicas
            if ".experts." in name:
                want = want[experts[0] : experts[-1] + 1]
            # fp32 on the GPU (cuBLAS for the dense layers, Triton's exact path for experts) against the CPU:
            # the bound the one-GPU model test uses (tests/moe/test_gpu.py, 10 x 1e-4).
            assert_rel_close(torch.from_numpy(g), want, 1e-3, f"rank ({pp_rank}, {ep_rank}) {name}")

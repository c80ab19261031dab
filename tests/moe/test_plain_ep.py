"""The plain-graph expert-parallel path (``MoEStage(piecewise=False)`` with a communicating dispatcher).

Each all-to-all is a blocking autograd node there (what torch.distributed.pipelining's split backward
walks). At EP=2 it must give the piecewise path's loss and gradients, including the skewed case where one
rank's experts receive no rows (its dispatch output is unused, its gradient comes back as zeros).
"""

from __future__ import annotations

import pytest
import torch

from moe import EventRecorder, MoEStage, lm_loss
from moe.dispatch import DispatchOptions, make_dispatcher
from moe.parallel import ParallelConfig, init_layout
from tests.distributed import run_ranks
from tests.moe.helpers import SEED, assert_rel_close, batch, tiny_config

EP = 2


def _loss_and_grads(rank: int, world: int, skewed: bool):
    cfg = tiny_config()
    layout = init_layout(ParallelConfig(pp=1, ep=world))
    ids, labels = batch(cfg, 4, 16)
    mine = slice(2 * rank, 2 * rank + 2)
    out = {}
    for piecewise in (True, False):
        dispatcher = make_dispatcher(
            "alltoall", cfg.num_experts, layout.ep_group, DispatchOptions(hidden_size=cfg.hidden_size)
        )
        stage = MoEStage(cfg, range(cfg.num_layers), first=True, last=True, dispatcher=dispatcher, piecewise=piecewise)
        stage.reset_parameters(SEED)
        if skewed:
            for layer in range(cfg.num_dense_layers, cfg.num_layers):
                stage.blocks[str(layer)].router.expert_bias[: cfg.num_experts // 2] = 10.0
        stage.recorder = EventRecorder()
        loss = lm_loss(stage(ids[mine]), labels[mine])
        loss.backward()
        comms = sorted({(e.name, e.direction) for e in stage.recorder.events if e.edge == "wait"})
        grads = {n: p.grad.numpy().copy() for n, p in stage.named_parameters()}
        out[piecewise] = (loss.item(), grads, comms)
    return out


@pytest.mark.parametrize("skewed", [False, True])
def test_plain_graph_ep_matches_piecewise(skewed: bool):
    for out in run_ranks(_loss_and_grads, world_size=EP, args=(skewed,), timeout=120):
        (ref_loss, ref_grads, ref_comms), (loss, grads, comms) = out[True], out[False]
        assert abs(loss - ref_loss) <= 1e-6 * abs(ref_loss)
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            got, want = torch.from_numpy(g), torch.from_numpy(ref_grads[name])
            if not want.any():  # skewed: the experts of ep rank 1 received no rows
                assert not got.any(), name
                continue
            assert_rel_close(got, want, rel=1e-5, what=name)
        # Both paths record every all-to-all, forward and backward.
        assert (
            comms
            == ref_comms
            == [
                ("combine", "bwd"),
                ("combine", "fwd"),
                ("counts", "fwd"),
                ("dispatch", "bwd"),
                ("dispatch", "fwd"),
            ]
        )

"""The model on one CUDA device (Triton kernels, CUDA events): skipped without a GPU.

Tolerances: bf16 runs compare against the fp32 CPU model with bf16-level error (about 2^-8 relative per
operation, compounded over a few layers), fp32 runs against fp32 tightly.
"""

from __future__ import annotations

import pytest
import torch

from dualpipe.weight_grad import GradStore
from moe import EventRecorder, MoEModel, lm_loss
from tests.moe.helpers import SEED, assert_rel_close, batch, tiny_config

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("dtype", "rel"), [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
def test_cuda_model_matches_cpu(dtype: torch.dtype, rel: float) -> None:
    cfg = tiny_config()
    ids, labels = batch(cfg)
    ref = MoEModel(cfg, seed=SEED)
    ref_loss = lm_loss(ref(ids), labels)
    ref_loss.backward()
    got = MoEModel(cfg, seed=SEED, piecewise=True).to("cuda", dtype)
    loss = lm_loss(got(ids.cuda()), labels.cuda())
    loss.backward()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=rel)
    want = {n: p.grad for n, p in ref.named_parameters()}
    for name, p in got.named_parameters():
        assert_rel_close(p.grad.float().cpu(), want[name], 10 * rel, name)


def test_weight_grads_defer_on_autograd_device_threads() -> None:
    # CUDA backward runs on autograd's device thread: deferral must still reach the active store.
    cfg = tiny_config()
    ids, labels = batch(cfg)
    model = MoEModel(cfg, seed=SEED, piecewise=True).cuda()
    store = GradStore()
    with store.activate(enabled=True):
        lm_loss(model(ids.cuda()), labels.cuda()).backward()
        store.flush()
    expert_w = model.blocks["1"].experts.w1
    assert expert_w.grad is None or not expert_w.grad.any()  # deferred, not yet computed
    store.pop()
    assert expert_w.grad is not None and expert_w.grad.any()


def test_cuda_events_time_the_sub_stages() -> None:
    cfg = tiny_config()
    ids, _ = batch(cfg)
    model = MoEModel(cfg, seed=SEED, piecewise=True).cuda()
    model.recorder = EventRecorder("cuda")
    model(ids.cuda())
    timeline = model.recorder.timeline()
    assert timeline and all(t >= 0 for *_, t in timeline)
    assert {name for name, *_ in timeline} >= {"attn", "mlp"}

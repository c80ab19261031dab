"""One MoE block, forward and backward, on the Triton path (the CUDA path; the interpreter without CUDA) under
:class:`HostSyncDetector`: in sync-free mode nothing of the layer syncs the host, experts included.

The interpreter runs kernels outside aten, so what the detector flags is exactly what the host code of the
block and its kernel launchers would sync on CUDA. Normal mode keeps one sync per layer, permute's read of the
routed row count, and the sync-free mode's padded rows give the same results bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from dualpipe.host_sync import HostSyncDetector
from moe import MoEStage
from moe.dispatch import DispatchOptions, make_dispatcher
from tests.kernels._util import assert_close
from tests.moe.helpers import SEED, tiny_config

# What normal mode flags in one block's forward + backward on the Triton path: the routed row count that sizes
# permute's outputs, read once in forward (the backward reuses the saved row ids and counts).
NORMAL_MODE = {"aten._local_scalar_dense": 1}
NORMAL_MODE_WHERE = "kernels/triton_permute.py"


def _block(sync_free: bool, device: torch.device):
    """Forward + backward of MoE layer 1 (router, local dispatch, routed and shared experts) under the detector.

    Returns (output, gradients by name, flagged ops by name, their summary, the permuted row count seen).
    """
    cfg = tiny_config(num_layers=2)
    dispatcher = make_dispatcher(
        "local", cfg.num_experts, None, DispatchOptions(hidden_size=cfg.hidden_size, sync_free=sync_free)
    )
    stage = MoEStage(cfg, range(1, 2), first=False, last=False, dispatcher=dispatcher)
    stage.reset_parameters(SEED)
    stage.to(device)
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(2, 8, cfg.hidden_size, generator=gen).to(device).requires_grad_()
    dout = torch.randn(2, 8, cfg.hidden_size, generator=gen).to(device)
    with HostSyncDetector() as syncs:
        out = stage(h)
        out.backward(dout)
    grads = {n: p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}
    grads["h"] = h.grad
    return out.detach(), grads, syncs.counts(), syncs.summary()


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_triton_block_is_sync_free_and_equals_normal_mode(device, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("DUALPIPE_KERNELS", "triton")
    out, grads, counts, where = _block(False, device)
    out_f, grads_f, counts_f, where_f = _block(True, device)
    assert counts_f == {}, where_f
    assert counts == NORMAL_MODE, where
    assert NORMAL_MODE_WHERE in where
    assert torch.equal(out, out_f)
    assert grads.keys() == grads_f.keys() and {"h", "blocks.1.experts.w1", "blocks.1.experts.w2"} <= grads.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_f[name]), name

    # The same block on the torch references (the oracle), padded too: the Triton path agrees to fp32 rounding.
    monkeypatch.setenv("DUALPIPE_KERNELS", "torch")
    out_ref, grads_ref, _, _ = _block(True, device)
    assert_close(out_f, out_ref)
    for name in grads:
        assert_close(grads_f[name], grads_ref[name])


def _experts(static_rows: bool, device: torch.device):
    """The expert sub-stage on rows as a sync-free all-to-all delivers them: R = 2 x 9 received rows, the last
    rows of each source padding (ids -1, NaN rows, as DeepEP's ``num_worst_tokens`` leaves them), and real rows
    with some slots served elsewhere. Forward + backward under the detector."""
    from moe.models.experts import GroupedExperts

    num_local, hidden, inter, top_k = 3, 16, 16, 2
    experts = GroupedExperts(num_local, hidden, inter).to(device)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        experts.w1.copy_(torch.randn(experts.w1.shape, generator=gen) / hidden**0.5)
        experts.w2.copy_(torch.randn(experts.w2.shape, generator=gen) / inter**0.5)
    idx_RK = torch.stack([torch.randperm(num_local + 2, generator=gen)[:top_k] for _ in range(18)])
    idx_RK = torch.where(idx_RK < num_local, idx_RK, -1)  # ids past this rank's experts: served elsewhere
    padded_R = torch.zeros(18, dtype=torch.bool)
    padded_R[6:9] = padded_R[15:] = True
    idx_RK[padded_R] = -1
    x_RD = torch.randn(18, hidden, generator=gen).masked_fill(padded_R[:, None], float("nan"))
    x_RD = x_RD.to(device).requires_grad_()
    w_RK = torch.rand(18, top_k, generator=gen).to(device)
    dout_RD = torch.randn(18, hidden, generator=gen).to(device)
    with HostSyncDetector() as syncs:
        out_RD = experts(x_RD, idx_RK.to(device), w_RK, static_rows=static_rows)
        out_RD.backward(dout_RD)
    assert experts.max_rows(18, top_k) == 18 * top_k
    return out_RD.detach(), (x_RD.grad, experts.w1.grad, experts.w2.grad), syncs.counts(), syncs.summary()


# The grouped GEMM leaves padded rows unwritten and SwiGLU runs elementwise over them, whatever memory held:
# the interpreter's numpy may warn of an overflow or an invalid value there, in rows nothing reads.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_padded_expert_rows_are_sync_free_and_exact(device, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("DUALPIPE_KERNELS", "triton")
    out, grads, counts, where = _experts(False, device)
    out_f, grads_f, counts_f, where_f = _experts(True, device)
    assert counts_f == {}, where_f
    assert counts == NORMAL_MODE, where
    assert torch.isfinite(out_f).all() and all(torch.isfinite(g).all() for g in grads_f)  # padding never read
    assert torch.equal(out, out_f)
    for g, g_f in zip(grads, grads_f):
        assert torch.equal(g, g_f)
    monkeypatch.setenv("DUALPIPE_KERNELS", "torch")
    out_ref, grads_ref, _, _ = _experts(True, device)
    assert_close(out_f, out_ref)
    for g, g_ref in zip(grads_f, grads_ref):
        assert_close(g, g_ref)

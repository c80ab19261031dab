"""moe.models.experts.GroupedExperts: the adaptor over kernels.functional.grouped_experts, and what an MoE block keeps
of its received rows (freed once permuted, kept where a recompute reads them again)."""

from __future__ import annotations

import pytest
import torch

from dualpipe.pieces import BlockRun, Compute
from dualpipe.weight_grad import GradStore
from kernels import functional
from moe import MoEStage
from moe.dispatch.base import Dispatched, Pending
from moe.dispatch.local import LocalDispatcher
from moe.models.experts import GroupedExperts
from tests.moe.helpers import SEED, assert_rel_close, tiny_config


def test_weight_grads_wait_in_weight_grad_store_and_equal_autograds():
    torch.manual_seed(0)
    experts = GroupedExperts(4, 8, 6)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x_RD = torch.randn(5, 8)
    local_idx_RK = torch.tensor([[0, -1], [3, 1], [-1, -1], [1, 0], [2, 3]])  # -1: served by another rank
    weights_RK = torch.rand(5, 2)

    store = GradStore()
    x, w = x_RD.clone().requires_grad_(), weights_RK.clone().requires_grad_()
    with store.activate(enabled=True):  # what a compute piece's dX does: weight gradients are held back
        experts(x, local_idx_RK, w).square().sum().backward()
    store.flush()
    assert experts.w1.grad is None and experts.w2.grad is None
    assert w.grad is not None  # the routing weights' gradient is an input gradient: it comes at once
    store.pop()

    # Oracle: the same kernels with the weight gradients left to autograd.
    w1, w2 = (p.detach().clone().requires_grad_() for p in (experts.w1, experts.w2))
    x_ref, w_ref = x_RD.clone().requires_grad_(), weights_RK.clone().requires_grad_()
    x_MD, row_id_M, counts_E = functional.permute_tokens(x_ref, local_idx_RK, 4)
    scale_M = functional.row_weights(w_ref, row_id_M)
    y_MD = functional.grouped_experts(x_MD, w1, w2, counts_E, scale_M=scale_M)
    functional.combine_rows(y_MD, row_id_M, 5, 2).square().sum().backward()
    assert torch.equal(x.grad, x_ref.grad) and torch.equal(w.grad, w_ref.grad)
    assert torch.equal(experts.w1.grad, w1.grad) and torch.equal(experts.w2.grad, w2.grad)


def test_sizes_must_be_positive():
    with pytest.raises(ValueError, match="positive"):
        GroupedExperts(0, 8, 5)


class DeliveringDispatcher(LocalDispatcher):
    """Every expert local, but the rows arrive in new buffers, as an all-to-all delivers them (communicates)."""

    @property
    def communicates(self) -> bool:
        return True

    def dispatch(self, route, x_TD, topk_weights_TK):
        got = super().dispatch(route, x_TD, topk_weights_TK).wait()
        return Pending.done(Dispatched(got.x_RD.clone(), got.local_idx_RK, got.weights_RK.clone()))


def _moe_block(dispatcher):
    stage = MoEStage(tiny_config(num_layers=2), range(1, 2), first=False, last=False, dispatcher=dispatcher)
    stage.reset_parameters(SEED)
    return stage, stage.blocks["1"]


@pytest.mark.parametrize("recompute", [False, True], ids=["kept-graph", "full-recompute"])
def test_received_rows_are_freed_once_permuted(recompute: bool):
    """The overlap runtime keeps the MLP piece's inputs, but the received rows' storage is freed once permute
    has copied them; under full recompute only in the backward's rerun (the rerun reads them). Gradients equal
    the block as one autograd graph without the all-to-all."""
    cfg = tiny_config(num_layers=2)
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(2, 8, cfg.hidden_size, generator=gen)
    g = torch.randn(2, 8, cfg.hidden_size, generator=gen)

    stage, block = _moe_block(DeliveringDispatcher(cfg.num_experts))
    decl = block.pieces()
    run = BlockRun(decl, recompute=recompute)
    run.begin(h)
    computes = [i for i, p in enumerate(decl.pieces) if isinstance(p, Compute)]  # attention, shared, MLP
    for i, piece in enumerate(decl.pieces):
        if isinstance(piece, Compute):
            run.compute(i)
        else:
            run.start(i)
    out = run.output()
    rows = run.values["x_recv"]
    full = rows.numel() * rows.element_size()
    assert rows.untyped_storage().nbytes() == (full if recompute else 0)
    if not recompute:  # the shared expert's and the router's input stays (under recompute it is rebuilt)
        assert run.values["z"].untyped_storage().nbytes() > 0
    run.begin_backward(g)
    for i in reversed(computes):
        run.compute_dx(i)
        run.compute_dw(i)
    assert run.input_grad_final() and rows.untyped_storage().nbytes() == 0

    ref_stage, ref = _moe_block(LocalDispatcher(cfg.num_experts))
    h_ref = h.clone().requires_grad_()
    want = ref(h_ref)
    want.backward(g)
    torch.testing.assert_close(out, want.detach(), rtol=1e-6, atol=1e-6)
    assert_rel_close(run.grad_in(), h_ref.grad, 1e-6, "h")
    for (name, p), q in zip(stage.named_parameters(), ref_stage.parameters()):
        assert_rel_close(p.grad, q.grad, 1e-6, name)

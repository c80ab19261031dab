"""Host syncs inside one overlapped forward/backward pair, counted on CPU by :class:`HostSyncDetector`.

The pair is the MoE stage's hook (:meth:`MoEStage.overlapped_forward_backward`): F of micro-batch B
interleaved with B of micro-batch A, over 2 gloo ranks (``alltoall``, ``deepep`` over the emulation in bf16)
and at ep=1 (``local``). In sync-free mode the routing and the dispatcher issue no op that would block the host
on CUDA, and the losses and gradients equal the normal mode's bit for bit. The expert kernels run their CPU
references here (kernels/reference.py), which read the group sizes on the host; their syncs are counted apart,
and so are the DeepEP emulation's own (it stands for kernels). In sync-free mode the experts take a static row
count (padded permute); the Triton path then issues none (tests/kernels/test_sync_free_experts.py).
"""

from __future__ import annotations

import pytest
import torch

from dualpipe.host_sync import HostSyncDetector
from moe import MoEStage, lm_loss
from moe.dispatch import DispatchOptions, make_dispatcher
from tests.distributed import run_ranks
from tests.moe.helpers import SEED, batch, tiny_config
from tests.moe.test_ep import _use_fake_deep_ep

REFERENCE_KERNELS = "kernels/reference.py"
EMULATION = "tests/moe/dispatch/fake_deep_ep.py"


def _pair(rank: int, world: int, kind: str, sync_free: bool, layers: int):
    """F(A) plainly, then the hook pairs F(B) with B(A) under the detector; B(B) plainly. ``layers`` MoE layers.

    Returns (losses, gradients by name, flagged ops outside the reference kernels by name, count inside).
    """
    cfg = tiny_config()
    dtype = _use_fake_deep_ep(kind)
    group = torch.distributed.group.WORLD if kind != "local" else None
    dispatcher = make_dispatcher(
        kind, cfg.num_experts, group, DispatchOptions(hidden_size=cfg.hidden_size, dtype=dtype, sync_free=sync_free)
    )
    stage = MoEStage(cfg, range(1, 1 + layers), first=False, last=True, dispatcher=dispatcher)
    stage.reset_parameters(SEED)
    stage.to(dtype)
    (_, labels_a), (_, labels_b) = (batch(cfg, 2, 16, seed=10 * rank + i) for i in range(2))
    gen = torch.Generator().manual_seed(rank)
    h_a, h_b = (torch.randn(2, 16, cfg.hidden_size, generator=gen).to(dtype).requires_grad_() for _ in range(2))
    loss_a = lm_loss(stage(h_a), labels_a)
    with HostSyncDetector() as syncs:
        _, loss_b = MoEStage.overlapped_forward_backward(stage, [h_b], lm_loss, [labels_b], stage, loss_a, None, None)
    loss_b.backward()
    grads = {n: p.grad.clone() for n, p in stage.named_parameters()}
    grads["h_a"], grads["h_b"] = h_a.grad, h_b.grad
    outside = HostSyncDetector()
    outside.flagged = [f for f in syncs.flagged if REFERENCE_KERNELS not in f.where and EMULATION not in f.where]
    inside = sum(REFERENCE_KERNELS in f.where for f in syncs.flagged)
    loads = {n: b.clone() for n, b in stage.named_buffers() if n.endswith("expert_load")}
    return [loss_a.item(), loss_b.item()], grads, loads, outside.counts(), outside.summary(), inside


def _both_modes(rank: int, world: int, kind: str, layers: int = 3):
    return _pair(rank, world, kind, False, layers), _pair(rank, world, kind, True, layers)


# Measured, per MoE layer: flagged ops of one pair in normal mode, outside the expert kernels' CPU references.
# Before the host-sync fixes the pair flagged, on every rank and per layer, bincount (router loads), nonzero and
# tolist x2 (alltoall send order and counts); now the one read of the exchanged counts is left.
NORMAL_MODE = {"alltoall": {"Tensor.tolist": 1}, "local": {}, "deepep": {}}
# The references' own (they are the CPU oracle and may sync), per layer: the grouped GEMMs' offsets (tolist, 2
# forward + 2 dgrad + 2 wgrad) in both modes, plus permute's int(sum) where the rows are not padded to a static
# count. tests/kernels/test_sync_free_experts.py shows the Triton path at zero.
REFERENCE_KERNEL_SYNCS = {False: 6 + 1, True: 6}


# On the Triton path (the CUDA path) normal mode adds permute's read of the routed row count, once per MoE layer.
TRITON_PERMUTE = {"aten._local_scalar_dense": 1}


def _per_layers(counts: dict[str, int], layers: int) -> dict[str, int]:
    return {op: n * layers for op, n in counts.items()}


def _check_modes(normal, free, kind: str, triton: bool = False, layers: int = 3) -> None:
    (losses, grads, loads, _, _, inside), (losses_f, grads_f, loads_f, counts_f, where_f, inside_f) = normal, free
    assert losses == losses_f
    assert grads.keys() == grads_f.keys()
    for name in grads:
        assert torch.equal(grads[name], grads_f[name]), name
    for name in loads:
        assert torch.equal(loads[name], loads_f[name]), name
    assert counts_f == {}, where_f
    want = NORMAL_MODE[kind] | TRITON_PERMUTE if triton else NORMAL_MODE[kind]
    assert normal[3] == _per_layers(want, layers), normal[4]
    want_inside = (0, 0) if triton else (REFERENCE_KERNEL_SYNCS[False] * layers, REFERENCE_KERNEL_SYNCS[True] * layers)
    assert (inside, inside_f) == want_inside


def test_alltoall_sync_free_pair():
    results = run_ranks(_both_modes, world_size=2, args=("alltoall",), timeout=120)
    for normal, free in results:
        _check_modes(normal, free, "alltoall")


@pytest.mark.slow
def test_alltoall_sync_free_pair_on_triton():
    """The same pair with the expert kernels on Triton (the interpreter here, which runs kernels outside aten):
    in sync-free mode nothing at all syncs, experts included, and the results still equal normal mode's. One MoE
    layer (the counts are per layer, the plain test above has three): the interpreter runs every kernel program
    in Python."""
    pytest.importorskip("triton")
    env = {"DUALPIPE_KERNELS": "triton"}
    for normal, free in run_ranks(_both_modes, world_size=2, args=("alltoall", 1), timeout=300, env=env):
        _check_modes(normal, free, "alltoall", triton=True, layers=1)


def test_local_sync_free_pair():
    normal, free = _both_modes(0, 1, "local")
    _check_modes(normal, free, "local")


def test_deepep_sync_free_pair():
    # num_worst_tokens: DeepEP's own host wait is gone too (the emulation's syncs stand for kernels); the padded
    # rows (NaN in the emulation) never reach a result.
    for normal, free in run_ranks(_both_modes, world_size=2, args=("deepep",), timeout=120):
        _check_modes(normal, free, "deepep")


def test_sync_free_refused_where_unsupported():
    from moe.dispatch import DISPATCHERS, DispatcherSpec, register_dispatcher, unregister_dispatcher

    assert all(DISPATCHERS.lookup(name).sync_free for name in ("local", "alltoall", "deepep"))
    spec = DispatcherSpec(name="test-no-sync-free", factory=lambda *a, **k: None)
    register_dispatcher(spec)
    try:
        with pytest.raises(ValueError, match="'test-no-sync-free' dispatcher has no sync-free mode"):
            make_dispatcher("test-no-sync-free", 8, None, DispatchOptions(sync_free=True))
    finally:
        unregister_dispatcher(spec.name)


def _worst_tokens(rank: int, world: int):
    """The emulation's ``num_worst_tokens`` against DeepEP's contract, and the dispatcher's padded shapes."""
    _use_fake_deep_ep("deepep")
    from tests.moe.dispatch import fake_deep_ep

    group = torch.distributed.group.WORLD
    buffer = fake_deep_ep.Buffer(group, 1 << 20, explicitly_destroy=True)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(6, 32, generator=gen).to(torch.bfloat16)
    topk_idx = torch.randint(0, 8, (6, 2), generator=gen)
    weights = torch.rand(6, 2, generator=gen)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, 8)
    layout = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    got = {}
    recv_x, recv_idx, recv_w, per_expert_list, handle, _ = buffer.dispatch(
        x, topk_idx=topk_idx, topk_weights=weights, num_worst_tokens=world * 6, **layout
    )
    num_recv = sum(handle[1])
    got["shapes"] = (tuple(recv_x.shape), tuple(recv_idx.shape), tuple(recv_w.shape), per_expert_list)
    got["padding"] = bool((recv_idx[num_recv:] == -1).all()) and bool(recv_x[num_recv:].isnan().all())
    back, _, _ = buffer.combine(torch.zeros_like(recv_x), handle)
    got["combine"] = tuple(back.shape)
    try:
        buffer.combine(recv_x[:num_recv].contiguous(), handle)  # the handle's padded size is required
    except RuntimeError as exc:
        got["combine_unpadded"] = str(exc)
    cached, *_ = buffer.dispatch(x, handle=handle)
    got["cached"] = tuple(cached.shape)
    try:  # fewer rows than this rank receives (every rank sends it at least one here)
        buffer.dispatch(x, topk_idx=topk_idx, topk_weights=weights, num_worst_tokens=1, **layout)
    except RuntimeError as exc:
        got["too_small"] = str(exc)
    torch.distributed.barrier()
    return got, num_recv


def test_emulated_num_worst_tokens_is_strict():
    for got, num_recv in run_ranks(_worst_tokens, world_size=2, timeout=60):
        assert 1 < num_recv < 12  # some rows padded, and more than one row received
        assert got["shapes"] == ((12, 32), (12, 2), (12, 2), [])
        assert got["padding"] and got["combine"] == (6, 32) and got["cached"] == (12, 32)
        assert "src_idx.size(0) == num_tokens" in got["combine_unpadded"]
        assert "num_recv_tokens <= num_worst_tokens" in got["too_small"]

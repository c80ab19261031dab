"""DistributedAdamW: torch's AdamW in fp32, fp32 masters and gradient buffers in bf16, ZeRO-1 (each rank its rows
of every tensor), global clipping.

The multi-rank tests emulate reduced gradients directly (the same tensor on every replica), so they test the
optimizer alone: the reduction over the groups is the caller's.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import moe.train.optimizer
from dualpipe.weight_grad import GradStore
from moe import MoEModel, lm_loss
from moe.models.layers import Linear, RMSNorm
from moe.train.optimizer import DistributedAdamW, ShardGroup, shard_rows
from tests.distributed import run_ranks
from tests.moe.helpers import SEED, assert_rel_close, batch, tiny_config

HYPER = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


class _Tiny(nn.Module):
    """Linear weights (gradients through accumulate_grad) and a norm weight (through autograd)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = Linear(6, 8)
        self.norm = RMSNorm(8, 1e-6)
        self.b = Linear(8, 4)
        for p in self.parameters():
            nn.init.normal_(p, std=0.5)
        self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)))


def _loss(model: nn.Module, step: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return model(torch.randn(5, 6, generator=g).to(dtype)).float().pow(2).mean()


def test_shard_rows_is_torch_chunk_and_dtensor_shard() -> None:
    """The split the optimizer, its checkpoints (DTensor ``Shard(0)`` chunks) and the planner share."""
    from torch.distributed.tensor import Shard

    assert [shard_rows(7, 3, r) for r in range(3)] == [(0, 3), (3, 6), (6, 7)]
    assert [shard_rows(2, 3, r) for r in range(3)] == [(0, 1), (1, 2), (2, 2)]  # the last rank holds nothing
    for rows in range(12):
        for size in range(1, 6):
            chunks = torch.arange(rows).chunk(size)
            for r in range(size):
                start, stop = shard_rows(rows, size, r)
                want = chunks[r].tolist() if r < len(chunks) else []
                assert list(range(start, stop)) == want, (rows, size, r)
                length, offset = Shard.local_shard_size_and_offset(rows, size, r)
                assert (stop - start, start) == (length, offset), (rows, size, r)
    with pytest.raises(ValueError, match="not a rank of a group of size 2"):
        shard_rows(4, 2, 2)


def test_fp32_equals_torch_adamw_exactly() -> None:
    ours, ref = _Tiny(), _Tiny()
    opt = DistributedAdamW([ShardGroup(list(ours.parameters()))], lr=1e-2, **HYPER)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, **HYPER)
    for step in range(4):
        lr = 1e-2 * (step + 1)
        for g in opt.param_groups:
            g["lr"] = lr
        for g in ref_opt.param_groups:
            g["lr"] = lr
        opt.zero_grad()
        ref_opt.zero_grad()
        for micro in range(2):  # two micro-batches accumulate
            _loss(ours, 2 * step + micro, torch.float32).backward()
            _loss(ref, 2 * step + micro, torch.float32).backward()
        for (p, main_grad), q in zip(opt.grads(), ref.parameters()):
            assert p.grad is main_grad  # fp32: autograd and accumulate_grad both add into the buffer
            assert torch.equal(main_grad, q.grad)
        opt.step()
        ref_opt.step()
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert opt.state_bytes() == 2 * 4 * sum(p.numel() for p in ours.parameters())  # two fp32 moments
    with pytest.raises(ValueError, match="already has a main_grad"):
        DistributedAdamW([ShardGroup(list(ours.parameters()))])
    with pytest.raises(ValueError, match="betas"):
        DistributedAdamW([ShardGroup(list(_Tiny().parameters()))], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match=r"a stacked group's parameters are \[entries, rows, ...\], got \(3,\)"):
        DistributedAdamW([ShardGroup([nn.Parameter(torch.ones(3))], stacked=True)])


def test_bf16_steps_fp32_masters_and_copies_them_into_the_params() -> None:
    model = _Tiny(torch.bfloat16)
    params = list(model.parameters())
    opt = DistributedAdamW([ShardGroup(params)], lr=1e-2, **HYPER)
    masters = [opt.master_for(p).clone() for p in params]
    ref_opt = torch.optim.AdamW(masters, lr=1e-2, **HYPER)
    for step in range(3):
        opt.zero_grad()
        _loss(model, step, torch.bfloat16).backward()
        for p, m in zip(params, masters):
            assert p.grad is None and p.main_grad.dtype == torch.float32  # the norm's grad moved by the hook
            m.grad = p.main_grad.clone()
        opt.step()
        ref_opt.step()
    for p, m in zip(params, masters):
        master = opt.master_for(p)
        assert p.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert torch.equal(master, m)  # the fp32 AdamW, fed the fp32 buffers
        assert torch.equal(p, master.to(torch.bfloat16))
        assert all(t.dtype == torch.float32 for k, t in opt.state_for(p).items() if k != "step")
    n = sum(p.numel() for p in params)
    assert opt.state_bytes() == 3 * 4 * n  # fp32 moments + fp32 master
    assert opt.grad_bytes() == 4 * n

    pure = DistributedAdamW([ShardGroup(list(_Tiny(torch.bfloat16).parameters()))], master_weights=False)
    p0 = pure.shard_groups[0].params[0]
    assert pure.master_for(p0) is p0 and p0.main_grad.dtype == torch.bfloat16
    assert pure.state_bytes() == 2 * 2 * n  # bf16 moments, no master


def test_masters_keep_updates_smaller_than_a_bf16_step() -> None:
    """lr 1e-4 against a weight of 1.0 (bf16 spacing 2**-7 there): pure bf16 rounds every update away."""
    finals = {}
    for master_weights in (True, False):
        w = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        opt = DistributedAdamW([ShardGroup([w])], lr=1e-4, weight_decay=0.0, master_weights=master_weights)
        for _ in range(100):
            opt.zero_grad()
            w.main_grad.fill_(1.0)
            opt.step()
        finals[master_weights] = (w.detach().float(), opt.master_for(w).float())
    w, master = finals[True]
    torch.testing.assert_close(master, torch.full((4,), 0.99), rtol=0, atol=1e-5)  # 100 steps of lr
    assert torch.equal(w, master.bfloat16().float())
    assert torch.equal(finals[False][0], torch.ones(4))


def test_deferred_weight_grads_accumulate_in_fp32() -> None:
    """16 micro-batches of a bf16 Linear whose dW runs later from the WeightGradStore: the fp32 buffer ends
    closer to the fp64 sum than bf16 accumulation in .grad does."""
    torch.manual_seed(0)
    fp32_acc, bf16_acc = Linear(32, 32).bfloat16(), Linear(32, 32).bfloat16()
    nn.init.normal_(fp32_acc.weight)
    with torch.no_grad():
        bf16_acc.weight.copy_(fp32_acc.weight)
    opt = DistributedAdamW([ShardGroup([fp32_acc.weight])])
    exact = torch.zeros(32, 32, dtype=torch.float64)
    store = GradStore()
    with store.activate(enabled=True):
        for _ in range(16):
            x = torch.randn(8, 32).bfloat16()
            dy = (torch.randn(8, 32) + 3).bfloat16()  # a common offset makes the sum grow past bf16's digits
            for layer in (fp32_acc, bf16_acc):
                layer(x).backward(dy)
            store.flush()
            exact += dy.double().t() @ x.double()
    assert fp32_acc.weight.main_grad.abs().sum() == 0  # nothing ran yet: the closures wait in the store
    while store.pending:
        store.pop()
    err_fp32 = (opt.grads().__next__()[1].double() - exact).abs().max().item()
    err_bf16 = (bf16_acc.weight.grad.double() - exact).abs().max().item()
    assert fp32_acc.weight.grad is None and bf16_acc.weight.grad.dtype == torch.bfloat16
    assert err_fp32 < 0.5 * err_bf16, (err_fp32, err_bf16)


def test_every_parameter_of_a_moe_model_lands_in_its_buffer() -> None:
    """Embedding, norms, router gate, experts, head: each path (autograd or accumulate_grad) fills main_grad;
    fp32 steps equal torch's AdamW exactly."""
    cfg = tiny_config()
    for dtype in (torch.float32, torch.bfloat16):
        ours, ref = MoEModel(cfg, seed=SEED).to(dtype), MoEModel(cfg, seed=SEED).to(dtype)
        opt = DistributedAdamW([ShardGroup(list(ours.parameters()))], lr=1e-2, **HYPER)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, **HYPER)
        for step in range(2 if dtype == torch.float32 else 1):  # bf16: the grads only (ours steps masters)
            opt.zero_grad()
            ref_opt.zero_grad()
            ids, labels = batch(cfg, 2, 8, seed=step)
            lm_loss(ours(ids), labels).backward()
            lm_loss(ref(ids), labels).backward()
            for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
                assert q.grad is not None and q.grad.abs().sum() > 0, name
                assert torch.equal(p.main_grad, q.grad.float()), name  # the first add into zeros is exact
                assert (p.grad is None) == (dtype == torch.bfloat16), name
            opt.step()
            ref_opt.step()
        if dtype == torch.float32:
            for p, q in zip(ours.parameters(), ref.parameters()):
                assert torch.equal(p, q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deferred_weight_grads_of_a_piecewise_model_land_in_the_buffers(dtype: torch.dtype) -> None:
    """The piecewise model defers every Linear's and the experts' dW to the WeightGradStore: after the
    closures run, the buffers hold the plain model's gradients."""
    cfg = tiny_config()
    plain, piecewise = MoEModel(cfg, seed=SEED).to(dtype), MoEModel(cfg, seed=SEED, piecewise=True).to(dtype)
    opt = DistributedAdamW([ShardGroup(list(piecewise.parameters()))])
    ids, labels = batch(cfg, 2, 8)
    lm_loss(plain(ids), labels).backward()
    store = GradStore()
    with store.activate(enabled=True):
        lm_loss(piecewise(ids), labels).backward()
        store.flush()
    names = [n for n, _ in piecewise.named_parameters()]
    deferred = [n for n, (_, g) in zip(names, opt.grads()) if g.abs().sum() == 0]
    assert "blocks.1.experts.w1" in deferred and "blocks.0.attn.wq.weight" in deferred
    while store.pending:
        store.pop()
    for name, (_, g), q in zip(names, opt.grads(), plain.parameters()):
        assert_rel_close(g, q.grad.float(), rel=1e-5 if dtype == torch.float32 else 2e-2, what=name)


# multi-rank: 4 ranks; dense parameters over ranks 0-2 (rank 3 alone), experts over two replicas each


SHAPES = [(7, 3), (5,), (1, 4), (2, 2), (6, 4), (9,)]
"""Over 3 ranks: uneven rows (7: 3, 3, 1), and tensors with fewer rows than ranks (the last ranks hold none)."""


def _dense(dtype: torch.dtype) -> list[nn.Parameter]:
    torch.manual_seed(1)
    return [nn.Parameter(torch.randn(shape).to(dtype)) for shape in SHAPES]


def _experts(index: int, dtype: torch.dtype) -> list[nn.Parameter]:
    """Two expert tensors of two experts each ``[E, rows, cols]``, split per expert (5 rows: 3, 2; 1 row: 1, 0)."""
    torch.manual_seed(10 + index)
    return [nn.Parameter(torch.randn(2, 5, 3).to(dtype)), nn.Parameter(torch.randn(2, 1, 4).to(dtype))]


def _fake_grads(params: list[nn.Parameter], opt: DistributedAdamW, seed: int) -> None:
    """What the reduction would leave: the same gradient on every replica of a parameter."""
    g = torch.Generator().manual_seed(seed)
    for p in params:
        p.main_grad.copy_(torch.randn(p.shape, generator=g))


# (model dtype, state_dtype, gathered bytes in flight: 0 cuts every chunk into one-row all-gathers)
ZERO_CASES = [(torch.float32, "float32", 256 << 20), (torch.bfloat16, "float32", 0), (torch.bfloat16, "bfloat16", 0)]


def _zero_on_off(rank: int) -> dict:
    ep = rank % 2
    dense_group = dist.new_group([0, 1, 2])  # new_group is collective: all ranks make all
    edp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    out = {}
    for dtype, state_dtype, in_flight in ZERO_CASES:
        moe.train.optimizer._MAX_IN_FLIGHT_BYTES = in_flight
        finals, bytes_ = [], []
        for zero in (False, True):
            dense, experts = _dense(dtype), _experts(ep, dtype)
            groups = [ShardGroup(dense, dense_group if rank < 3 else None), ShardGroup(experts, edp_groups[ep], True)]
            opt = DistributedAdamW(groups, lr=1e-2, zero=zero, state_dtype=state_dtype, **HYPER)
            for step in range(3):
                for g in opt.param_groups:
                    g["lr"] = 1e-2 / (step + 1)
                opt.zero_grad()
                _fake_grads(dense, opt, step)
                _fake_grads(experts, opt, 50 + 10 * ep + step)
                opt.step()
            finals.append([p.detach().clone() for p in dense + experts])
            bytes_.append(opt.state_bytes())
        out[(str(dtype), state_dtype)] = (finals, bytes_)
    return out


def _four_ranks(rank: int, world: int, max_norm: float) -> tuple[dict, tuple[float, list[torch.Tensor]]]:
    # One launch for both tests: starting ranks costs more than the bodies on two shared cores.
    return _zero_on_off(rank), _clip(rank, max_norm)


MAX_NORM = 1.0


@pytest.fixture(scope="module")
def four_ranks() -> list:
    return run_ranks(_four_ranks, 4, args=(MAX_NORM,), timeout=90)


def test_zero_on_and_off_give_the_same_parameters_and_shard_the_state(four_ranks: list) -> None:
    """Bit for bit: the rows step as the whole tensors do (AdamW with weight decay is elementwise)."""
    results = [r[0] for r in four_ranks]
    dense_n, expert_n = sum(torch.Size(s).numel() for s in SHAPES), 2 * 15 + 2 * 4
    # elements of state per rank: its dense rows over [0, 1, 2] (rank 3: all of them) + its experts' rows
    held = {0: 28 + 26, 1: 24 + 26, 2: 15 + 12, 3: dense_n + 12}
    for dtype, state_dtype, _ in ZERO_CASES:
        per_element = 4 * 2 if state_dtype == "float32" else 2 * 2  # two moments
        per_element += 4 if dtype == torch.bfloat16 else 0  # an fp32 master
        key = (str(dtype), state_dtype)
        for rank, r in enumerate(results):
            (off, on), (bytes_off, bytes_on) = r[key]
            for a, b in zip(off, on):
                assert torch.equal(a, b), (key, rank)
            assert bytes_off == per_element * (dense_n + expert_n)
            assert bytes_on == per_element * held[rank], (key, rank, bytes_on)
        n = len(SHAPES)  # replicas agree after the all-gathers: dense over ranks 0-2, experts over 0, 2 and 1, 3
        for rank, peer, part in ((0, 1, slice(n)), (0, 2, slice(None)), (1, 3, slice(n, None))):
            for a, b in zip(results[rank][key][0][1][part], results[peer][key][0][1][part]):
                assert torch.equal(a, b), (key, rank, peer)


# clipping: DualPipe-like, pp=2 x dp=2, ep=2 (one expert set per dp rank, no replicas), pp rank 1 the mirror


def _clip(rank: int, max_norm: float) -> tuple[float, list[torch.Tensor]]:
    pp, dp = divmod(rank, 2)
    dp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dense, experts = _dense(torch.float32), _experts(dp, torch.float32)
    opt = DistributedAdamW(
        [ShardGroup(dense, dp_groups[pp]), ShardGroup(experts, None)],
        lr=1e-2,
        zero=True,
        counts_in_norm=pp == 0,
        **HYPER,
    )
    _fake_grads(dense, opt, 0)
    _fake_grads(experts, opt, 7 + dp)
    norm = opt.clip_grad_norm_(max_norm)
    opt.step()
    return norm, [p.detach().clone() for p in dense + experts]


def test_clip_grad_norm_equals_single_process(four_ranks: list) -> None:
    results, max_norm = [r[1] for r in four_ranks], MAX_NORM
    dense, e0, e1 = _dense(torch.float32), _experts(0, torch.float32), _experts(1, torch.float32)
    params = dense + e0 + e1
    for ps, seed in ((dense, 0), (e0, 7), (e1, 8)):
        g = torch.Generator().manual_seed(seed)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
    ref_norm = torch.nn.utils.clip_grad_norm_(params, max_norm).item()
    assert ref_norm > 4 * max_norm  # the clip is active
    torch.optim.AdamW(params, lr=1e-2, **HYPER).step()
    for rank, (norm, got) in enumerate(results):
        assert norm == pytest.approx(ref_norm, rel=1e-6), rank
        want = dense + (e0 if rank % 2 == 0 else e1)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b.detach(), rtol=1e-6, atol=1e-7)


# checkpoint state: written by 2 ranks (ZeRO over both), loaded by 1


def _shard_state(rank: int, world: int) -> dict:
    mismatched = [nn.Parameter(torch.zeros(2 + rank, 3))]  # the ranks of one group must pass equal shapes
    with pytest.raises(ValueError, match=r"the ranks \[0, 1\] of a shard group passed different parameters"):
        DistributedAdamW([ShardGroup(mismatched, dist.group.WORLD)], zero=True)
    dense = _dense(torch.bfloat16)
    opt = DistributedAdamW([ShardGroup(dense, dist.group.WORLD)], lr=1e-2, zero=True, **HYPER)
    for step in range(2):
        opt.zero_grad()
        _fake_grads(dense, opt, step)
        opt.step()
    saved = {}
    for i, p in enumerate(dense):
        shard, state, master = opt.shard_of(p), opt.state_for(p), opt.master_for(p)
        assert opt.owns(p) == (master.numel() > 0) == (state["exp_avg"].numel() > 0)
        assert master.shape == state["exp_avg"].shape == p[shard.start : shard.stop].shape
        saved[i] = ({k: v.clone() for k, v in state.items()}, master.clone())
    return saved


def test_state_round_trips_into_another_partition() -> None:
    shards = run_ranks(_shard_state, 2, timeout=60)
    # rank 1 holds none of the one-row tensor
    assert [shards[1][i][1].shape[0] for i in range(len(SHAPES))] == [3, 2, 0, 1, 3, 4]

    def whole(i: int) -> tuple[dict, torch.Tensor]:  # each rank's rows, concatenated: the whole tensors
        (s0, m0), (s1, m1) = shards[0][i], shards[1][i]
        state = {k: v if v.dim() == 0 else torch.cat([v, s1[k]]) for k, v in s0.items()}
        return state, torch.cat([m0, m1])

    def single(load: bool) -> DistributedAdamW:
        dense = _dense(torch.bfloat16)
        opt = DistributedAdamW([ShardGroup(dense)], lr=1e-2, **HYPER)
        steps = range(2, 3) if load else range(3)
        if load:
            for i, p in enumerate(dense):
                state, master = whole(i)
                opt.load_weight_(p, master)
                opt.load_state_for(p, state)
        for step in steps:
            opt.zero_grad()
            _fake_grads(dense, opt, step)
            opt.step()
        return opt

    resumed, uninterrupted = single(True), single(False)
    for p, q in zip(resumed.shard_groups[0].params, uninterrupted.shard_groups[0].params):
        assert torch.equal(resumed.master_for(p), uninterrupted.master_for(q))
        assert torch.equal(p, q)
        for k, v in resumed.state_for(p).items():
            assert torch.equal(v, uninterrupted.state_for(q)[k]), k
    with pytest.raises(ValueError, match="lacks"):
        resumed.load_state_for(p, {"step": torch.tensor(1.0)})
    with pytest.raises(ValueError, match=r"state 'exp_avg' has shape \(4,\), expected \(9,\)"):
        resumed.load_state_for(p, {**resumed.state_for(p), "exp_avg": torch.zeros(4)})

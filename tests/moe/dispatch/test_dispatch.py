"""Dispatcher round trips on 4 gloo ranks against an oracle built from every rank's tokens.

Cases include uneven token counts, a rank with no tokens, experts and ranks that receive nothing, for the
``alltoall`` dispatcher (fp32 against the oracle) and the ``deepep`` one over the in-test DeepEP emulation,
in bf16 as DeepEP takes it: its moved rows exact, its sums equal to ``alltoall``'s at the same dtype. Then
the registry: a backend registered from here is selectable everywhere a dispatcher is named; then DeepEP's
limits, refused up front and by the emulation alike.
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
import torch.distributed as dist

from moe.dispatch import (
    DEEPEP_INSTALL_HINT,
    DEFAULT_COMM_SMS,
    DISPATCHERS,
    AllToAllDispatcher,
    DispatcherSpec,
    DispatchOptions,
    Launch,
    LocalDispatcher,
    Route,
    TokenDispatcher,
    make_dispatcher,
    register_dispatcher,
    unregister_dispatcher,
)
from moe.dispatch.deepep import topology_problem
from moe.parallel import ParallelConfig, build_stages, init_layout
from tests.distributed import run_ranks
from tests.moe.helpers import batch, tiny_config

NUM_EXPERTS, TOP_K, HIDDEN = 8, 3, 16  # bf16 rows of 32 bytes: DeepEP moves rows in pairs of int4
TOKENS = (5, 0, 7, 3)  # rank 1 has no tokens at all


def _routing(case: str, rank: int, num_tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 7)
    # skewed: every token goes to experts 0, 2, 3 (rank 0) or 4 (rank 2): expert 1 and ranks 1, 3 get nothing.
    choices = torch.arange(NUM_EXPERTS) if case == "random" else torch.tensor([0, 2, 3, 4])
    rows = [choices[torch.randperm(len(choices), generator=gen)[:TOP_K]] for _ in range(num_tokens)]
    return torch.stack(rows) if rows else torch.zeros(0, TOP_K, dtype=torch.long)


def _expected_recv(
    rank: int, world: int, everyone: list, dtype: torch.dtype, hidden: int = HIDDEN
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows this rank must receive: by source rank, then token; local ids (-1 elsewhere), local weights."""
    e_local = NUM_EXPERTS // world
    xs, ids, ws = [], [], []
    for x_TD, idx_TK, w_TK in everyone:
        for t in range(x_TD.shape[0]):
            owner = idx_TK[t] // e_local
            if (owner == rank).any():
                local = torch.where(owner == rank, idx_TK[t] - rank * e_local, -1)
                xs.append(x_TD[t])
                ids.append(local)
                ws.append(w_TK[t])
    if not xs:
        return torch.zeros(0, hidden, dtype=dtype), torch.zeros(0, TOP_K, dtype=torch.long), torch.zeros(0, TOP_K)
    return torch.stack(xs), torch.stack(ids), torch.stack(ws)


def _check_dispatcher(
    dispatcher, rank: int, world: int, case: str, dtype: torch.dtype, hidden: int = HIDDEN
) -> list[torch.Tensor]:
    """Rows moved (dispatch, combine backward) against the oracle, exactly; sums (combine, dispatch backward)
    against it in fp32 only. Returns every output, for comparing backends at one dtype."""
    num_tokens = TOKENS[rank]
    gen = torch.Generator().manual_seed(rank)
    x_TD = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w_TK = torch.rand(num_tokens, TOP_K, generator=gen) + 0.1
    idx_TK = _routing(case, rank, num_tokens)
    everyone: list = [None] * world
    dist.all_gather_object(everyone, (x_TD, idx_TK, w_TK))
    exp_x, exp_idx, exp_w = _expected_recv(rank, world, everyone, dtype, hidden)
    exact_sums = dtype == torch.float32

    route = dispatcher.plan(idx_TK)
    got = dispatcher.dispatch(route, x_TD, w_TK).wait()
    assert torch.equal(got.x_RD, exp_x), (case, rank)
    assert torch.equal(got.local_idx_RK, exp_idx), (case, rank)
    mask = exp_idx >= 0  # weights of slots served elsewhere are not used (DeepEP zeroes them)
    assert torch.equal(got.weights_RK[mask], exp_w[mask]), (case, rank)

    # Expert side: y = x * sum over local slots of w * (global id + 1); combine sums the ranks' parts.
    e_local = NUM_EXPERTS // world
    gid_RK = got.local_idx_RK + rank * e_local + 1
    scale_R = (got.weights_RK * gid_RK * (got.local_idx_RK >= 0)).sum(1, keepdim=True)
    y_TD = dispatcher.combine(route, (got.x_RD * scale_R).to(dtype)).wait()
    if exact_sums:
        torch.testing.assert_close(y_TD, x_TD * (w_TK * (idx_TK + 1)).sum(1, keepdim=True), rtol=1e-6, atol=1e-6)

    # Backward of dispatch (combine direction): rows scaled by (rank + 1) sum to x * sum of owner ranks + 1.
    owner_TK = idx_TK // e_local
    grad_x_TD, grad_w_TK = dispatcher.dispatch_backward(
        route, got.x_RD * (rank + 1), got.weights_RK * (got.local_idx_RK >= 0) * (rank + 1)
    ).wait()
    rank_sum_T = torch.zeros(num_tokens)
    for r in range(world):
        rank_sum_T += (owner_TK == r).any(1).float() * (r + 1)
    if exact_sums:
        torch.testing.assert_close(grad_x_TD, x_TD * rank_sum_T[:, None], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_w_TK, w_TK * (owner_TK + 1).float(), rtol=1e-6, atol=1e-6)  # fp32 always

    # Backward of combine (dispatch direction): the same rows as a dispatch of the gradient.
    grad_R = dispatcher.combine_backward(route, 2 * x_TD).wait()
    assert torch.equal(grad_R, 2 * exp_x), (case, rank)
    return [got.x_RD, got.local_idx_RK, got.weights_RK[mask], y_TD, grad_x_TD, grad_w_TK, grad_R]


def _round_trips(rank: int, world: int) -> list[str]:
    from tests.moe.dispatch import fake_deep_ep

    sys.modules["deep_ep"] = fake_deep_ep
    calls = []
    bf16 = torch.bfloat16
    # Refused before any Buffer exists (DeepEP itself would fail at the first combine, or in a kernel).
    with pytest.raises(ValueError, match=r"'deepep' dispatcher cannot run.*rows in torch.bfloat16 \(got torch.float32"):
        make_dispatcher(
            "deepep", NUM_EXPERTS, dist.group.WORLD, DispatchOptions(hidden_size=HIDDEN, dtype=torch.float32)
        )
    with pytest.raises(ValueError, match=r"a positive, even --comm-sms \(got 0\)"):
        make_dispatcher("deepep", NUM_EXPERTS, dist.group.WORLD, DispatchOptions(hidden_size=HIDDEN, comm_sms=0))
    with pytest.raises(ValueError, match=r"ep ranks \[0, 1, 2, 3\] span nodes \[0, 1\]"):
        make_dispatcher(
            "deepep", NUM_EXPERTS, dist.group.WORLD, DispatchOptions(hidden_size=HIDDEN, local_world_size=2)
        )
    for case in ("random", "skewed"):
        _check_dispatcher(AllToAllDispatcher(NUM_EXPERTS), rank, world, case, torch.float32)
        want = _check_dispatcher(AllToAllDispatcher(NUM_EXPERTS), rank, world, case, bf16)
        deepep = make_dispatcher(
            "deepep", NUM_EXPERTS, dist.group.WORLD, DispatchOptions(hidden_size=HIDDEN, dtype=bf16)
        )
        got = _check_dispatcher(deepep, rank, world, case, bf16)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (case, rank)
        buffer = deepep.buffer
        deepep.close()
        assert buffer.explicitly_destroy and deepep.buffer is None
        calls.append(",".join(buffer.calls))
    return calls


def test_dispatchers_round_trip_uneven_and_empty_loads():
    calls = run_ranks(_round_trips, world_size=4, timeout=120)
    # The DeepEP path used the layout call, a fresh dispatch, two combines and one cached dispatch, and was
    # destroyed explicitly.
    assert calls[0][0] == "get_dispatch_layout,dispatch,combine,combine,dispatch(cached),destroy"


def test_local_dispatcher_is_identity():
    d = LocalDispatcher(4)
    x = torch.randn(6, 3)
    idx = torch.randint(0, 4, (6, 2))
    w = torch.rand(6, 2)
    route = d.plan(idx)
    got = d.dispatch(route, x, w).wait()
    assert got.x_RD is x and got.local_idx_RK is idx and got.weights_RK is w
    assert d.combine(route, x).wait() is x
    assert not d.communicates and list(d.local_experts) == [0, 1, 2, 3]


class _CountingDispatcher(AllToAllDispatcher):
    """A test-only backend: the all-to-all exchange, counting the routes it plans."""

    def __init__(self, num_experts: int, group: dist.ProcessGroup | None) -> None:
        super().__init__(num_experts, group)
        self.plans = 0

    def plan(self, topk_idx_TK: torch.Tensor) -> Route:
        self.plans += 1
        return super().plan(topk_idx_TK)


def _make_counting(num_experts: int, group: dist.ProcessGroup | None, options: DispatchOptions) -> TokenDispatcher:
    return _CountingDispatcher(num_experts, group)


COUNTING = DispatcherSpec(name="test-counting", factory=_make_counting, needs_group=True)


def test_registered_backend_is_selectable_by_name():
    from moe.train import config_from_args

    register_dispatcher(COUNTING)
    try:
        assert DISPATCHERS[COUNTING.name] is COUNTING
        assert ParallelConfig(ep=2, dispatcher=COUNTING.name).dispatcher == COUNTING.name
        assert config_from_args(["--dispatcher", COUNTING.name], world=1)[0].parallel.dispatcher == COUNTING.name
        with pytest.raises(ValueError, match="needs an expert-parallel process group"):
            make_dispatcher(COUNTING.name, 4)
        with pytest.raises(ValueError, match="already registered"):
            register_dispatcher(COUNTING)
    finally:
        unregister_dispatcher(COUNTING.name)
    assert COUNTING.name not in DISPATCHERS
    with pytest.raises(ValueError, match=r"unknown dispatcher 'test-counting'; choose one of \('"):
        make_dispatcher(COUNTING.name, 4)
    with pytest.raises(ValueError, match="unknown dispatcher"):
        ParallelConfig(dispatcher=COUNTING.name)
    with pytest.raises(SystemExit, match="unknown dispatcher 'test-counting'"):
        config_from_args(["--dispatcher", COUNTING.name], world=1)


def test_every_factory_gets_the_callers_options():
    """One frozen DispatchOptions goes to the factory, less the modes its backend does not take (``deterministic``
    where rows always come in source order, ``counts_group`` without a count exchange); a bad value is refused
    in one line when the options are made, before any dispatcher or communication."""
    got = []

    def factory(num_experts: int, group: dist.ProcessGroup | None, options: DispatchOptions) -> TokenDispatcher:
        got.append(options)
        return LocalDispatcher(num_experts)

    register_dispatcher(DispatcherSpec(name="test-options", factory=factory))
    try:
        asked = DispatchOptions(hidden_size=64, dtype=torch.float32, comm_sms=4, deterministic=True)
        assert isinstance(make_dispatcher("test-options", 4, None, asked), LocalDispatcher)
        assert got == [dataclasses.replace(asked, deterministic=False)]
    finally:
        unregister_dispatcher("test-options")
    with pytest.raises(dataclasses.FrozenInstanceError):
        asked.fp8 = True  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"^DispatchOptions.hidden_size must be >= 0, got -1$"):
        DispatchOptions(hidden_size=-1)
    with pytest.raises(ValueError, match=r"^DispatchOptions.local_world_size must be >= 1, got 0$"):
        DispatchOptions(local_world_size=0)
    with pytest.raises(TypeError, match=r"^DispatchOptions.dtype must be a torch.dtype, got 'bf16'$"):
        DispatchOptions(dtype="bf16")  # type: ignore[arg-type]


def _build_with_registered_backend(rank: int, world: int) -> int:
    register_dispatcher(COUNTING)
    try:
        cfg = tiny_config()
        layout = init_layout(ParallelConfig(pp=1, ep=world, dispatcher=COUNTING.name))
        stages = build_stages(cfg, layout)
        assert all(isinstance(s.dispatcher, _CountingDispatcher) for s in stages)
        first = next(s for s in stages if s.first)
        ids, _ = batch(cfg, 2 * world, 16)
        first(ids[2 * rank : 2 * rank + 2])
        return first.dispatcher.plans
    finally:
        unregister_dispatcher(COUNTING.name)


def test_build_stages_uses_a_registered_backend():
    assert all(plans > 0 for plans in run_ranks(_build_with_registered_backend, world_size=2, timeout=60))


def test_train_flags_come_from_the_registry():
    from moe.train import config_from_args

    for name in DISPATCHERS:
        assert config_from_args(["--dispatcher", name], world=1)[0].parallel.dispatcher == name
    with pytest.raises(SystemExit, match="unknown dispatcher 'nccl'"):
        config_from_args(["--dispatcher", "nccl"], world=1)
    assert config_from_args([], world=1)[0].parallel.comm_sms == ParallelConfig().comm_sms == DEFAULT_COMM_SMS


def test_cuda_and_package_are_reported_limits_enforced(monkeypatch):
    # The round trips build ``deepep`` on CPU over the emulation: CUDA and the package are only reported by
    # check(); the row dtype and DeepEP's limits are refused by make_dispatcher too (see the round trips).
    deepep = DISPATCHERS["deepep"]
    assert deepep.requirements == (
        "an expert-parallel process group",
        "CUDA",
        "rows in torch.bfloat16",
        "the module 'deep_ep'",
    )
    bf16 = Launch(dtype=torch.bfloat16, hidden_size=7168, comm_sms=20)  # DeepSeek-V3's rows
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # not installed
    assert deepep.check(device="cuda", launch=bf16) == [DEEPEP_INSTALL_HINT]
    from tests.moe.dispatch import fake_deep_ep

    monkeypatch.setitem(sys.modules, "deep_ep", fake_deep_ep)
    assert deepep.check(device="cuda", launch=bf16) == []
    assert deepep.check(device="cpu", launch=Launch(dtype=torch.float32)) == [
        "CUDA (got cpu)",
        "rows in torch.bfloat16 (got torch.float32)",
    ]
    assert DISPATCHERS["local"].requirements == () and DISPATCHERS["local"].check(device="cpu") == []


@pytest.mark.parametrize(
    ("launch", "problem"),
    [
        (Launch(comm_sms=0), "a positive, even --comm-sms (got 0)"),
        (Launch(comm_sms=3), "a positive, even --comm-sms (got 3)"),
        # V3's hidden size in fp32: 28,672-byte rows trip the intranode dispatch kernel's TMA assert.
        (Launch(dtype=torch.float32, hidden_size=7168), "rows of at most 16368 bytes"),
        (Launch(dtype=torch.bfloat16, hidden_size=8192), "(hidden 8192 x torch.bfloat16 = 16384)"),
        (Launch(dtype=torch.bfloat16, hidden_size=8184), "rows of at most 16368 bytes"),  # not whole 32 B pairs
        (Launch(dtype=torch.bfloat16, hidden_size=7168, ep_ranks=tuple(range(16)), local_world_size=8), None),
        (
            Launch(dtype=torch.bfloat16, hidden_size=7040, ep_ranks=tuple(range(16)), local_world_size=8),
            "hidden % 256 == 0 across nodes (got 7040)",
        ),
        (Launch(dtype=torch.bfloat16, hidden_size=7040, ep_ranks=tuple(range(8)), local_world_size=8), None),
    ],
)
def test_deepep_limits(launch: Launch, problem: str | None):
    found = DISPATCHERS["deepep"].violations(launch)
    assert found == [] if problem is None else any(problem in p for p in found), found


@pytest.mark.parametrize(
    ("ranks", "local_world_size", "problem"),
    [
        (range(8), 8, None),
        (range(8, 16), 8, None),  # the second node
        ((0, 2, 4, 6), 8, None),  # one node, any ranks of it
        (range(4), 4, None),
        (range(4, 8), 4, None),
        (range(2, 6), 4, "ep ranks [2, 3, 4, 5] span nodes [0, 1]"),
        ((0, 8), 8, "ep ranks [0, 8] span nodes [0, 1]"),  # a pp-major grid: one rank per node
        (range(6), 8, "an ep group of 6 ranks; DeepEP runs 2, 4, 8 ranks within a node and 16, 24, 32,"),
        (range(16), 8, None),
        (range(32), 8, None),
        (range(12), 8, "an ep group of 12 ranks; DeepEP runs"),
        (range(40), 8, "an ep group of 40 ranks; DeepEP runs"),  # whole nodes, but no kernel for 5 RDMA ranks
        (range(16), 4, "ep ranks [0, 1, 2, 3, 4, 5, 6, 7] (group ranks 0-7) are not 8 consecutive ranks of one node"),
        (range(0, 32, 2), 8, "ep ranks [0, 2, 4, 6, 8, 10, 12, 14] (group ranks 0-7)"),
        ((*range(8, 16), *range(8)), 8, None),  # blocks of whole nodes, in any node order
        ((*range(4), *range(12, 16), *range(4, 12)), 8, "ep ranks [0, 1, 2, 3, 12, 13, 14, 15]"),
    ],
)
def test_deepep_topology(ranks, local_world_size: int, problem: str | None):
    found = topology_problem(tuple(ranks), local_world_size)
    assert found is None if problem is None else problem in (found or ""), found


def _emulation_refusals(rank: int, world: int) -> None:
    from tests.moe.dispatch import fake_deep_ep as ep

    bf16 = torch.bfloat16
    buf = ep.Buffer(dist.group.WORLD, 1 << 20, explicitly_destroy=True)
    idx = torch.tensor([[0, 5], [4, 1]])  # every token goes to both ranks (8 experts over 2)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, NUM_EXPERTS)
    w = torch.rand(2, 2)

    def dispatch(x, topk_idx=idx, topk_weights=w, **kw):
        return buf.dispatch(
            x,
            num_tokens_per_rank=per_rank,
            is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert,
            topk_idx=topk_idx,
            topk_weights=topk_weights,
            **kw,
        )

    recv_x, _, _, _, handle, _ = dispatch(torch.randn(2, HIDDEN, dtype=bf16))
    # Each as DeepEP fails: Python asserts (legacy.py), EP_HOST_ASSERT (RuntimeError), a kernel's assert.
    with pytest.raises(RuntimeError, match="Unsupported type"):
        buf.combine(recv_x.float(), handle)  # combine has one dtype case: bf16
    with pytest.raises(AssertionError, match="bf16 rows"):
        dispatch(torch.randn(2, HIDDEN))
    with pytest.raises(RuntimeError, match="device-side assert"):
        dispatch(torch.randn(2, 8192, dtype=bf16))  # 16,384-byte rows: 8 bytes over the TMA buffer
    with pytest.raises(RuntimeError, match="is_contiguous"):
        dispatch(torch.randn(HIDDEN, 2, dtype=bf16).t())
    with pytest.raises(RuntimeError, match="is_contiguous"):
        buf.combine(recv_x.t().contiguous().t(), handle)
    with pytest.raises(RuntimeError, match="int64"):
        buf.get_dispatch_layout(idx.int(), NUM_EXPERTS)
    with pytest.raises(RuntimeError, match="kFloat32"):
        dispatch(torch.randn(2, HIDDEN, dtype=bf16), topk_weights=w.to(bf16))
    with pytest.raises(RuntimeError, match="invalid configuration"):
        dispatch(torch.randn(2, HIDDEN, dtype=bf16), config=ep.Config(0, 6, 256))
    with pytest.raises(AssertionError, match="must be even"):
        ep.Buffer.set_num_sms(3)
    implicit = ep.Buffer(dist.group.WORLD, 1 << 20)
    with pytest.raises(AssertionError, match="`explicitly_destroy` flag must be set"):
        implicit.destroy()
    buf.destroy()
    with pytest.raises(RuntimeError, match="not destroyed"):
        buf.destroy()
    assert buf.calls[-1] == "destroy"


def test_the_emulation_refuses_what_deepep_refuses():
    run_ranks(_emulation_refusals, world_size=2, timeout=60)

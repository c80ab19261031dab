"""The ``deepep-v2`` dispatcher over the DeepEP V2 emulation (tests/moe/dispatch/fake_deep_ep_v2.py), on 2 gloo ranks.

Deterministic (rows in source order), its round trips in bf16 equal ``alltoall``'s bit for bit (rows, sums,
weight gradients), in the host-synced and the sync-free (worst-case allocation) modes; by default rows come
in arrival order and the sums are still ``alltoall``'s; V2's limits are refused up front, by the registry's rules,
and by the emulation as V2 refuses them; a missing or unusable ``deep_ep`` names the install steps.
"""

from __future__ import annotations

import sys

import pytest
import torch
import torch.distributed as dist

from moe.dispatch import (
    DEEPEP_V2_INSTALL_HINT,
    DISPATCHERS,
    AllToAllDispatcher,
    DispatchOptions,
    Launch,
    make_dispatcher,
)
from moe.dispatch.deepep_common import import_deep_ep
from moe.dispatch.deepep_v2 import DeepEPV2Dispatcher, nvlink_domain_problem
from moe.parallel import ParallelConfig, build_stages, init_layout
from tests.distributed import run_ranks
from tests.moe.dispatch.test_dispatch import NUM_EXPERTS, TOP_K, _check_dispatcher, _routing
from tests.moe.helpers import tiny_config

HIDDEN = 256  # V2's combine kernels take hidden % 256 == 0
BF16 = torch.bfloat16


def _use_fake() -> None:
    from tests.moe.dispatch import fake_deep_ep_v2

    sys.modules["deep_ep"] = fake_deep_ep_v2


def _make(**kw) -> DeepEPV2Dispatcher:
    """A deterministic one unless ``deterministic=False``: the oracles compare rows by position."""
    kw.setdefault("deterministic", True)
    return make_dispatcher(
        "deepep-v2", NUM_EXPERTS, dist.group.WORLD, DispatchOptions(hidden_size=HIDDEN, dtype=BF16, **kw)
    )


def _sync_free_equals_synced(rank: int, case: str) -> None:
    """Sync-free: the first rows as the host-synced dispatch gives them, then padding (no expert, no weight)."""
    num_tokens = (5, 0)[rank]
    gen = torch.Generator().manual_seed(rank)
    x_TD = torch.randn(num_tokens, HIDDEN, generator=gen).to(BF16)
    w_TK = torch.rand(num_tokens, TOP_K, generator=gen) + 0.1
    idx_TK = _routing(case, rank, num_tokens)
    synced, free = (
        _make(),
        DeepEPV2Dispatcher(
            NUM_EXPERTS, dist.group.WORLD, hidden_size=HIDDEN, max_tokens_per_rank=8, sync_free=True, deterministic=True
        ),
    )
    routes = synced.plan(idx_TK), free.plan(idx_TK)
    want, got = (d.dispatch(r, x_TD, w_TK).wait() for d, r in zip((synced, free), routes, strict=True))
    n = want.x_RD.shape[0]
    assert got.x_RD.shape == (8 * 2, HIDDEN)  # max_tokens_per_rank x ranks: V2's worst case
    assert torch.equal(got.x_RD[:n], want.x_RD) and torch.equal(got.local_idx_RK[:n], want.local_idx_RK)
    assert torch.equal(got.weights_RK[:n], want.weights_RK)
    assert (got.local_idx_RK[n:] == -1).all() and (got.weights_RK[n:] == 0).all()
    y_want = synced.combine(routes[0], want.x_RD * 3).wait()
    y_pad = torch.cat([want.x_RD * 3, torch.full((got.x_RD.shape[0] - n, HIDDEN), float("nan"), dtype=BF16)])
    assert torch.equal(free.combine(routes[1], y_pad).wait(), y_want)  # padding rows are never read
    grad_R = free.combine_backward(routes[1], 2 * x_TD).wait()
    assert grad_R.shape[0] == got.x_RD.shape[0] and torch.equal(grad_R[:n], 2 * want.x_RD)
    for d in (synced, free):
        d.close()


def _arrival_order(rank: int, world: int) -> None:
    """Not deterministic (the default): rows in arrival order, each with its own expert ids and weights, so
    combine and both backward directions give ``alltoall``'s results; the rows are ``alltoall``'s permuted."""
    gen = torch.Generator().manual_seed(rank)
    x_TD = torch.randn(5, HIDDEN, generator=gen).to(BF16)
    w_TK = torch.rand(5, TOP_K, generator=gen) + 0.1
    idx_TK = _routing("random", rank, 5)
    e_local = NUM_EXPERTS // world
    v2 = _make(deterministic=False)
    results = []
    for d in (AllToAllDispatcher(NUM_EXPERTS), v2):
        route = d.plan(idx_TK)
        got = d.dispatch(route, x_TD, w_TK).wait()
        used_RK = got.local_idx_RK >= 0
        scale_R1 = (got.weights_RK * (got.local_idx_RK + rank * e_local + 1) * used_RK).sum(1, keepdim=True)
        y_TD = d.combine(route, (got.x_RD * scale_R1).to(BF16)).wait()
        grads = d.dispatch_backward(route, got.x_RD * (rank + 1), got.weights_RK * used_RK * (rank + 1)).wait()
        results.append((got, (y_TD, *grads), d.combine_backward(route, 2 * x_TD).wait()))
    (want, want_sums, want_grad_R), (got, got_sums, got_grad_R) = results
    assert v2.buffer.deterministic is False
    assert all(torch.equal(g, w) for g, w in zip(got_sums, want_sums, strict=True)), rank
    # Source order is the order of the tokens' global ids (EPHandle.recv_src_metadata[:, 0]).
    source_R = route.handle.recv_src_metadata[:, 0].long().argsort()
    assert not torch.equal(source_R, torch.arange(len(source_R)))  # they came in another order
    assert torch.equal(got.x_RD[source_R], want.x_RD) and torch.equal(got.local_idx_RK[source_R], want.local_idx_RK)
    assert torch.equal(got_grad_R[source_R], want_grad_R)
    v2.close()


def _round_trips(rank: int, world: int) -> list[str]:
    _use_fake()
    _arrival_order(rank, world)
    # --deterministic-dispatch reaches the dispatcher the trainer builds.
    layout = init_layout(ParallelConfig(ep=world, dispatcher="deepep-v2", deterministic_dispatch=True))
    stages = build_stages(tiny_config(hidden_size=HIDDEN), layout, dtype=BF16)
    assert all(stage.dispatcher.deterministic is True for stage in stages)
    stages[0].dispatcher.close()
    calls = []
    for case in ("random", "skewed"):
        want = _check_dispatcher(AllToAllDispatcher(NUM_EXPERTS), rank, world, case, BF16, HIDDEN)
        v2 = _make()
        got = _check_dispatcher(v2, rank, world, case, BF16, HIDDEN)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (case, rank)
        buffer = v2.buffer
        assert buffer.deterministic and buffer.num_max_tokens_per_rank == 5  # the group's largest first batch
        v2.close()
        v2.close()  # a second close does nothing
        assert buffer.explicitly_destroy and v2.buffer is None
        with pytest.raises(RuntimeError, match="was closed"):
            v2.plan(_routing(case, rank, 1))
        calls.append(",".join(buffer.calls))
        _sync_free_equals_synced(rank, case)
    # The registry's entry has the sync-free mode too (--sync-free --dispatcher deepep-v2): worst-case rows.
    free = _make(sync_free=True)
    route = free.plan(_routing("random", rank, 3))
    got = free.dispatch(route, torch.ones(3, HIDDEN, dtype=BF16), torch.rand(3, TOP_K)).wait()
    assert free.sync_free and got.x_RD.shape[0] == 3 * world  # max_tokens_per_rank x ranks, whatever arrived
    free.close()
    # Refused before any ElasticBuffer exists.
    with pytest.raises(
        ValueError, match=r"'deepep-v2' dispatcher cannot run.*rows in torch.bfloat16 \(got torch.float32"
    ):
        make_dispatcher(
            "deepep-v2", NUM_EXPERTS, dist.group.WORLD, DispatchOptions(hidden_size=HIDDEN, dtype=torch.float32)
        )
    with pytest.raises(ValueError, match=r"hidden % 256 == 0 \(got 32\)"):
        make_dispatcher("deepep-v2", NUM_EXPERTS, dist.group.WORLD, DispatchOptions(hidden_size=32, dtype=BF16))
    with pytest.raises(ValueError, match=r"--comm-sms >= 0"):
        _make(comm_sms=-2)
    # A larger batch than the buffer was built for: the dispatcher says what to pass.
    small = DeepEPV2Dispatcher(NUM_EXPERTS, dist.group.WORLD, hidden_size=HIDDEN, max_tokens_per_rank=2)
    with pytest.raises(ValueError, match="pass max_tokens_per_rank"):
        small.plan(_routing("random", rank, 3))
    small.close()
    # comm_sms=0: DeepEP's own SM count, even and at least 4 (elastic.py get_theoretical_num_sms).
    auto = _make(comm_sms=0)
    auto.plan(_routing("random", rank, 2))
    assert auto.num_sms >= 4 and auto.num_sms % 2 == 0
    auto.close()
    return calls


def test_deepep_v2_round_trips_equal_alltoall_in_bf16():
    calls = run_ranks(_round_trips, world_size=2, timeout=120)
    # No layout call in V2: a fresh dispatch, two combines, a cached dispatch, then the explicit destroy.
    assert calls[0][0] == "dispatch,combine,combine,dispatch(cached),destroy"


@pytest.mark.parametrize(
    ("launch", "problem"),
    [
        (Launch(dtype=BF16, hidden_size=7168, comm_sms=20), None),  # DeepSeek-V3's rows
        (Launch(dtype=BF16, hidden_size=7168, comm_sms=0), None),  # 0: DeepEP picks
        (Launch(dtype=BF16, hidden_size=7168, comm_sms=-1), "a --comm-sms >= 0"),
        (Launch(dtype=BF16, hidden_size=7040), "hidden % 256 == 0 (got 7040)"),  # fine for V1 intranode
        (Launch(dtype=torch.float32, hidden_size=7168), "rows in torch.bfloat16 (got torch.float32)"),
        (Launch(dtype=BF16, hidden_size=7168, ep_ranks=(0, 8), local_world_size=8), None),  # V1 refuses
        (Launch(dtype=BF16, hidden_size=7168, ep_ranks=(0, 1, 2, 8), local_world_size=8), "same number"),
    ],
)
def test_deepep_v2_limits(launch: Launch, problem: str | None):
    found = DISPATCHERS["deepep-v2"].violations(launch)
    assert found == [] if problem is None else any(problem in p for p in found), found


@pytest.mark.parametrize(
    ("ranks", "local_world_size", "problem"),
    [
        (range(8), 8, None),
        (range(6), 8, None),  # V1's intranode kernels take 2, 4 or 8 only; V2 any size
        (range(2, 6), 4, None),  # two nodes, two ranks each, each node's ranks consecutive
        ((0, 8), 8, None),  # one rank per node
        (range(32), 8, None),
        ((*range(8, 16), *range(8)), 8, None),
        ((0, 1, 2, 8), 8, "ep ranks [0, 1, 2, 8] put {0: 3, 1: 1} ranks on nodes"),
        ((0, 8, 1, 9), 8, "a node's ranks are not consecutive in the group"),
        (range(2048), 8, "an ep group of 2048 ranks; DeepEP V2 takes at most 1024"),
    ],
)
def test_deepep_v2_topology(ranks, local_world_size: int, problem: str | None):
    found = nvlink_domain_problem(tuple(ranks), local_world_size)
    assert found is None if problem is None else problem in (found or ""), found


def test_deepep_v2_missing_package_names_the_install_steps(monkeypatch, tmp_path):
    spec = DISPATCHERS["deepep-v2"]
    assert spec.requirements == (
        "an expert-parallel process group",
        "CUDA",
        "rows in torch.bfloat16",
        "the module 'deep_ep'",
    )
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # not installed
    with pytest.raises(ImportError, match=r"NCCL >= 2\.30\.4") as e:
        import_deep_ep(DEEPEP_V2_INSTALL_HINT, needs="ElasticBuffer")
    assert "python setup.py install" in str(e.value) and "github.com/deepseek-ai/DeepEP" in str(e.value)
    assert spec.check(device="cuda", launch=Launch(dtype=BF16, hidden_size=7168)) == [DEEPEP_V2_INSTALL_HINT]
    # A DeepEP 1.x install (the V1 emulation: Buffer, no ElasticBuffer).
    from tests.moe.dispatch import fake_deep_ep

    monkeypatch.setitem(sys.modules, "deep_ep", fake_deep_ep)
    with pytest.raises(ImportError, match=r"has no ElasticBuffer\. the 'deepep-v2' dispatcher needs DeepEP >= 2\.0"):
        import_deep_ep(DEEPEP_V2_INSTALL_HINT, needs="ElasticBuffer")
    # DeepEP 2.x refusing torch's libnccl at import (deep_ep/__init__.py check_nccl_so asserts).
    package = tmp_path / "deep_ep"
    package.mkdir()
    (package / "__init__.py").write_text("assert False, 'Invalid NCCL versions: libnccl.so.2 (loaded)'\n")
    monkeypatch.delitem(sys.modules, "deep_ep")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ImportError, match=r"failed its NCCL check \(Invalid NCCL versions.*NCCL >= 2\.30\.4"):
        import_deep_ep(DEEPEP_V2_INSTALL_HINT, needs="ElasticBuffer")


def _emulation_refusals(rank: int, world: int) -> None:
    from tests.moe.dispatch import fake_deep_ep_v2 as ep

    buf = ep.ElasticBuffer(
        dist.group.WORLD, num_max_tokens_per_rank=4, hidden=HIDDEN, num_topk=2, explicitly_destroy=True
    )
    idx = torch.tensor([[0, 5], [4, 1]])  # every token goes to both ranks (8 experts over 2)
    w = torch.rand(2, 2)
    x = torch.randn(2, HIDDEN, dtype=BF16)

    def dispatch(x=x, topk_idx=idx, topk_weights=w, **kw):
        kw.setdefault("num_sms", 4)
        return buf.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_experts=NUM_EXPERTS, **kw)

    recv_x, recv_idx, _, handle, event = dispatch()
    with pytest.raises(AssertionError):
        event.current_stream_wait()  # not async: the call waited itself, its event cannot be waited
    # Not deterministic: rows in arrival order (here the reverse of source order), ids say where from.
    src = handle.recv_src_metadata[:, 0].long()
    assert torch.equal(src, src.sort(descending=True).values) and recv_idx.shape == (4, 2)  # 2 tokens from each rank
    # Each as V2 fails: Python asserts, EP_HOST_ASSERT (RuntimeError), a kernel's assert, a JIT static assert.
    with pytest.raises(RuntimeError, match="kBFloat16"):
        buf.combine(recv_x.float(), handle)
    with pytest.raises(AssertionError, match="bf16 rows"):
        dispatch(x.float())
    with pytest.raises(RuntimeError, match="JIT compilation failed"):
        narrow = ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=4, hidden=32, explicitly_destroy=True)
        nx, _, _, nh, _ = narrow.dispatch(
            x[:, :32].contiguous(), topk_idx=idx, topk_weights=w, num_experts=8, num_sms=4
        )
        narrow.combine(nx, nh, num_sms=4)
    with pytest.raises(RuntimeError, match="is_contiguous"):
        dispatch(torch.randn(HIDDEN, 2, dtype=BF16).t())
    with pytest.raises(RuntimeError, match="topk_idx_t"):
        dispatch(topk_idx=idx.int())
    with pytest.raises(RuntimeError, match="expected scalar type Float"):
        dispatch(topk_weights=w.to(BF16))
    with pytest.raises(RuntimeError, match="num_sms > 0"):
        dispatch(num_sms=-1)
    with pytest.raises(RuntimeError, match="num_sms <= "):
        dispatch(num_sms=200)
    with pytest.raises(RuntimeError, match="num_tokens <= num_max_tokens_per_rank"):
        dispatch(x.repeat(3, 1), topk_idx=idx.repeat(3, 1), topk_weights=w.repeat(3, 1))
    with pytest.raises(RuntimeError, match="device-side assert"):
        dispatch(topk_idx=torch.tensor([[0, 0], [4, 1]]))  # an expert twice in one token
    with pytest.raises(RuntimeError, match="allocate_on_comm_stream"):
        dispatch(previous_event=ep.ElasticBuffer.capture())
    with pytest.raises(AssertionError, match="Cannot do CPU sync with cached handle"):
        buf.dispatch(x, handle=handle, num_sms=4, do_cpu_sync=True)
    torch.use_deterministic_algorithms(True)  # with fill_uninitialized_memory (torch's default): V2 asserts
    with pytest.raises(AssertionError):
        dispatch()
    torch.use_deterministic_algorithms(False)
    implicit = ep.ElasticBuffer(dist.group.WORLD, num_max_tokens_per_rank=4, hidden=HIDDEN)
    with pytest.raises(AssertionError):
        implicit.destroy()  # needs explicitly_destroy=True
    narrow.destroy()
    buf.destroy()
    buf.destroy()  # the runtime is gone: nothing more to do
    assert buf.calls[-1] == "destroy" and buf.calls.count("destroy") == 1
    with pytest.raises(AttributeError, match="'dispatch'"):
        dispatch()


def test_the_v2_emulation_refuses_what_deepep_v2_refuses():
    run_ranks(_emulation_refusals, world_size=2, timeout=60)

"""Activation offloading (``--offload``): what moves, when, and that nothing else changes.

In one process: the run-time names agree with the planner's table byte for byte (the policy's bytes are the
planner's :func:`moe.plan.footprint.offload_bytes`), the tracked peak drops by exactly what was away, the gradients
are bit for bit those of the run without offloading, the reload points follow the action lists, and bad policies
are one-line errors. In one spawn of 4 gloo ranks: DualPipeV at pp=2 x ep=2 with overlap and DualPipe at pp=4,
each step run without and with offloading on the same stages: equal losses and gradients (``torch.equal``), every
reload at the compute action before its backward, the tracked peak lower, the host pool holding what moved.
"""

from __future__ import annotations

import pytest
import torch

from dualpipe.memory import SavedTensorTracker
from dualpipe.offload import Offloader, reload_points
from dualpipe.schedule import Op, build_schedule
from moe.models.model import MoEModel, lm_loss
from moe.plan.footprint import LEAVES, layer_activations, offload_bytes, offload_names
from moe.plan.offload import parse_offload
from moe.train.cli import config_from_args
from moe.train.offload import SavedNames, build_offloader
from tests.distributed import run_ranks
from tests.moe.helpers import SEED, batch, tiny_config

POLICY = "attn.sdpa_out,mlp.experts_input"


def _model(cfg) -> MoEModel:
    return MoEModel(cfg, seed=SEED, piecewise=True).to(torch.bfloat16)


def _offloader(model: MoEModel, policy: str, tracker: SavedTensorTracker | None = None) -> Offloader:
    offloader = build_offloader(parse_offload(policy), [model], 0, tracker)
    assert offloader is not None
    offloader.exclude([*model.parameters(), *model.buffers()])
    return offloader


def test_names_are_the_planners_byte_for_byte() -> None:
    """Every tensor the runtime names has the planner's bytes under that name, per block (the router's top-k
    state aside: the planner counts its ids and chosen scores only)."""
    cfg = tiny_config()
    model = _model(cfg)
    ids, _ = batch(cfg, 2, 16)
    offloader = Offloader(lambda m, e: False, SavedNames([model]).label)
    offloader.exclude([*model.parameters(), *model.buffers()])
    with offloader.saving((0, 0)):
        logits = model(ids)  # noqa: F841 (its graph holds what was saved)
    got: dict[tuple[int | None, str | None], int] = {}
    for entry in offloader._forwards[(0, 0)].entries.values():
        key = (entry.labels[0].block, entry.name)
        got[key] = got.get(key, 0) + entry.nbytes
    names = set(offload_names(cfg))
    for layer in range(cfg.num_layers):
        table = layer_activations(cfg, layer, 32, 16, 2)
        for name, nbytes in table.items():
            if name in LEAVES or name == "attn.router_topk":
                continue
            assert name in names, name
            assert got[(layer, name)] == nbytes, (layer, name)
    assert {n for _, n in got if n is not None} <= names


def test_offload_moves_what_the_policy_names_and_the_peak_drops_by_it() -> None:
    """Two micro-batches, F0 F1 B0 B1: the second forward runs with the first one's chosen tensors away, so the
    tracked peak is lower by exactly those bytes; the bytes are the planner's figure for the policy; the gradients
    are bit for bit those kept on the device."""
    cfg = tiny_config()
    micro = [batch(cfg, 2, 16, seed=s) for s in (0, 1)]
    results = {}
    for policy in ("", POLICY):
        model = _model(cfg)
        tracker = SavedTensorTracker(exclude=[*model.parameters(), *model.buffers()])
        offloader = _offloader(model, policy or "all@fraction=0.01", tracker)  # fraction of 0 blocks: nothing
        losses = []
        with tracker:
            for k, (ids, labels) in enumerate(micro):
                with offloader.saving((0, k)):
                    losses.append(lm_loss(model(ids), labels))
                offloader.offload((0, k), k)
            for k, loss in enumerate(losses):
                offloader.reload((0, k), 2 + k)
                loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results[policy] = (losses, grads, tracker.peak_bytes, offloader)
    plain, moved = results[""], results[POLICY]
    assert plain[3].log == []
    log = moved[3].log
    assert {e.name for e in log} == set(POLICY.split(",")) and {e.kind for e in log} == {"offload", "reload"}
    first = sum(e.nbytes for e in log if e.kind == "offload" and e.chunk == 0)
    want = offload_bytes(parse_offload(POLICY), 0, cfg, range(cfg.num_layers), 32, 16, 2)
    assert first == want > 0
    assert plain[2] - moved[2] == first
    assert moved[3].pool.peak_bytes == 2 * first and moved[3].pool.resident_bytes == 0
    assert sorted({(e.action, e.chunk, e.kind) for e in log if e.name == "attn.sdpa_out"}) == [
        (0, 0, "offload"),
        (1, 1, "offload"),
        (2, 0, "reload"),
        (3, 1, "reload"),
    ]
    assert all(torch.equal(a, b) for a, b in zip(plain[0], moved[0]))
    assert all(torch.equal(a, b) for a, b in zip(plain[1], moved[1]))


def test_reload_points_are_the_compute_action_before_each_backward() -> None:
    for name, ranks in (("dualpipev", 2), ("dualpipe", 4), ("1f1b", 2)):
        for actions in build_schedule(name, ranks, 2 * ranks).ranks:
            points, kept = reload_points(actions)
            computes = [i for i, a in enumerate(actions) if a.op.is_compute and a.op is not Op.W]
            for at, keys in points.items():
                for key in keys:
                    back = next(i for i in computes if _backward_key(actions[i]) == key)
                    assert at == max((i for i in computes if i < back), default=back), (name, key)
            # a forward whose backward is one of the next two compute actions stays: its copy out and back would
            # run beside the same action
            for key in kept:
                i = computes.index(next(i for i in computes if _backward_key(actions[i]) == key))
                assert any((actions[j].module, actions[j].chunk) == key for j in computes[max(0, i - 2) : i]), key
                assert actions[computes[i - 1]].op is not Op.W
            # and every other forward moves (its backward comes three or more compute actions later)
            for i, a in enumerate(computes):
                if actions[a].op in (Op.F, Op.FB) and (key := (actions[a].module, actions[a].chunk)) not in kept:
                    back = next(j for j in computes if _backward_key(actions[j]) == key)
                    assert computes.index(back) - i >= 3, (name, key)


def _backward_key(a) -> tuple[int, int] | None:
    if a.op in (Op.B, Op.I):
        return (a.module, a.chunk)
    return (a.b_module, a.b_chunk) if a.op is Op.FB else None


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ("attn.nope", "offload = 'attn.nope': no saved tensor is named 'attn.nope'; choose from all, attn."),
        ("attn.sdpa_out@ranks=2", "ranks='2' is outside the pipeline ranks 0..1"),
        ("fraction=0", "fraction='0' must be a number in (0, 1]"),
        ("all@where=1", "unknown option 'where=1'; use @ranks=R or @fraction=F"),
        ("@ranks=0", "a clause names no tensors"),
        ("all@ranks=1-x", "ranks='1-x' is not a list of ranks or ranges"),
    ],
)
def test_bad_policies_are_one_line_errors(policy: str, message: str) -> None:
    with pytest.raises(SystemExit) as err:
        config_from_args(["--pp", "2", "--offload", policy], world=2)
    text = str(err.value)
    assert text.startswith("error: ") and message in text and "\n" not in text, text


def test_policies_parse() -> None:
    p = parse_offload("mlp.*@fraction=0.5@ranks=1;attn.sdpa_out@ranks=0-1", pp=2)
    assert p.picks(1, "mlp.row_ids", 0, 4) and not p.picks(1, "mlp.row_ids", 2, 4) and not p.picks(0, "mlp.x", 0, 4)
    assert p.picks(0, "attn.sdpa_out", 3, 4) and not p.picks(0, None, 0, 4)
    assert parse_offload("fraction=0.5").picks(0, None, 1, 4) and not parse_offload("fraction=0.5").picks(0, None, 2, 4)
    assert not parse_offload("") and not parse_offload("none")
    assert "mlp.experts_input_fp8" in offload_names(tiny_config(), fp8=True)
    assert "attn.sdpa_qkv" not in offload_names(tiny_config(attention="mla", q_lora_rank=16))


# -- 4 ranks ---------------------------------------------------------------------------------------------------------
LAYOUTS = {"dualpipev pp2 ep2": ("dualpipev", 2, 2, 4), "dualpipe pp4": ("dualpipe", 4, 1, 8)}  # + micro-batches


def _two_steps(rank: int, world: int) -> dict[str, dict]:
    """Per layout: one step kept on the device, one with ``all`` offloaded, on the same stages and batch."""
    from dualpipe import DualPipe, DualPipeV
    from moe.parallel import ParallelConfig, build_stages, init_layout
    from moe.train.memory import MemoryMeter

    out = {}
    for name, (schedule, pp, ep, chunks) in LAYOUTS.items():
        cfg = tiny_config()
        layout = init_layout(ParallelConfig(pp=pp, ep=ep, schedule=schedule, num_chunks=chunks))
        stages = build_stages(cfg, layout, seed=SEED)
        ids, labels = batch(cfg, chunks, 16, seed=layout.ep_rank)
        cls = DualPipeV if schedule == "dualpipev" else DualPipe
        pipe = cls(stages, batch_dim=0, process_group=layout.pp_group, overlap=True)
        args, labs = pipe.split_batch((ids,), (labels,))
        meter = MemoryMeter(list(pipe.module), track_saved=True)
        runs = []
        for policy in ("", "all"):
            offloader = build_offloader(parse_offload(policy), list(pipe.module), layout.pp_rank, meter.tracker)
            pipe.set_offloader(offloader)
            meter.watch_offload(offloader)
            for stage in stages:
                stage.zero_grad(set_to_none=True)
            meter.start_step()
            loss, _ = pipe.step(*args, num_chunks=chunks, criterion=lm_loss, labels=labs)
            figures = meter.stop_step()
            peak = figures["peak_activation_bytes"]
            grads = {n: p.grad.clone() for m, s in enumerate(stages) for n, p in s.named_parameters()}
            log = [] if offloader is None else list(offloader.log)
            host = 0 if offloader is None else offloader.pool.peak_bytes
            assert figures["offload_host_bytes"] == host
            assert figures["offloaded_bytes"] == sum(e.nbytes for e in log if e.kind == "offload")
            runs.append((loss, grads, peak, log, host))
        actions = pipe.schedule(chunks).ranks[layout.pp_rank]
        out[name] = {"runs": runs, "actions": actions}
        pipe.set_offloader(None)
    return out


@pytest.mark.slow
def test_offloading_trains_like_keeping_bit_for_bit() -> None:
    results = run_ranks(_two_steps, 4, timeout=240)
    overlapped = 0
    for rank, per_layout in enumerate(results):
        for name, got in per_layout.items():
            (loss0, grads0, peak0, _, _), (loss1, grads1, peak1, log, host) = got["runs"]
            where = f"{name}, rank {rank}"
            assert (loss0 is None) == (loss1 is None) and (loss0 is None or torch.equal(loss0, loss1)), where
            assert grads0.keys() == grads1.keys() and all(torch.equal(grads0[n], grads1[n]) for n in grads0), where
            assert log and peak1 < peak0 and host > 0, where
            offloaded = sum(e.nbytes for e in log if e.kind == "offload")
            assert offloaded == sum(e.nbytes for e in log if e.kind == "reload"), where  # everything came back
            assert peak0 - peak1 <= offloaded, where
            actions = got["actions"]
            computes = [i for i, a in enumerate(actions) if a.op.is_compute and a.op is not Op.W]
            for e in log:
                key = (e.module, e.chunk)
                if e.kind == "offload":  # right after the forward that saved it
                    assert (actions[e.action].module, actions[e.action].chunk) == key, (where, e)
                    assert actions[e.action].op in (Op.F, Op.FB), (where, e)
                    continue
                back = next(i for i in computes if _backward_key(actions[i]) == key)
                # before its backward, while the compute action before it runs
                assert e.action == max(i for i in computes if i < back), (where, e)
                overlapped += actions[back].op is Op.FB
    assert overlapped > 0  # the backward half of an overlapped pair read reloaded tensors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_copies_overlap_and_change_nothing() -> None:
    """The copy stream, pinned buffers and events: the same gradients bit for bit, a lower allocator peak over
    two forwards, and the host buffers reused by the second step."""
    cfg = tiny_config()
    micro = [tuple(t.cuda() for t in batch(cfg, 8, 64, seed=s)) for s in (0, 1)]
    results = {}
    for policy in ("", "all"):
        model = _model(cfg).cuda()
        offloader = _offloader(model, policy or "all@fraction=0.01")
        for _ in range(2):  # the second step takes its host buffers from the pool
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            losses = []
            for k, (ids, labels) in enumerate(micro):
                with offloader.saving((0, k)):
                    losses.append(lm_loss(model(ids), labels))
                offloader.offload((0, k), k)
            peak = torch.cuda.max_memory_allocated()
            for k, loss in enumerate(losses):
                offloader.reload((0, k), 2 + k)
                loss.backward()
            torch.cuda.synchronize()
        results[policy] = ([p.grad.clone() for p in model.parameters()], peak, offloader)
    plain, moved = results[""], results["all"]
    assert all(torch.equal(a, b) for a, b in zip(plain[0], moved[0]))
    assert moved[1] < plain[1]
    pool = moved[2].pool
    assert pool.pin and pool.allocated_bytes == moved[2].offloaded_bytes // 2  # step 2 reused step 1's buffers

"""Memory accounting against the real stages: moe.train.memory.MemoryMeter's CPU figures."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dualpipe.pieces import BlockRun, Compute
from dualpipe.schedule import build_schedule
from dualpipe.simulate import simulate
from moe import MoEModel, MoEStage
from moe.parallel import ParallelConfig, ParallelLayout, build_stages
from moe.plan.costs import Parallelism, Workload
from moe.plan.footprint import (
    LEAVES,
    footprint,
    layer_activations,
    module_activation_bytes,
    state_bytes,
)
from moe.plan.hardware import GPUS
from moe.plan.params import ParamSpec, rank_params
from moe.train.memory import MemoryMeter
from moe.train.optimizer import DistributedAdamW, ShardGroup
from tests.moe.helpers import SEED, tiny_config, tracked_peak_bytes
from tests.moe.models.test_experts import DeliveringDispatcher


def _rank_stages(cfg, schedule: str, pp: int, pp_rank: int, dtype: torch.dtype):
    """The real stages of one pipeline rank at ep = 1, through moe.parallel.build_stages (no process group
    is touched at ep = 1: the local dispatcher needs none)."""
    config = ParallelConfig(pp=pp, dp=1, ep=1, schedule=schedule)
    layout = ParallelLayout(
        config=config, pp_rank=pp_rank, edp_rank=0, ep_rank=0, pp_group=None, dp_group=None, edp_group=None,
        ep_group=None, mirror_group=None, mesh=None,
    )  # fmt: skip
    return build_stages(cfg, layout, dtype=dtype)


@pytest.mark.parametrize(
    ("schedule", "pp", "dtype"),
    [("dualpipev", 2, torch.bfloat16), ("dualpipe", 2, torch.bfloat16), ("1f1b", 2, torch.float32)],
)
def test_state_bytes_equal_the_meter(schedule: str, pp: int, dtype: torch.dtype) -> None:
    cfg = tiny_config()
    for r in range(pp):
        stages = _rank_stages(cfg, schedule, pp, r, dtype)
        specs = rank_params(cfg, pp, 1, schedule, r)
        # names, sizes and the rows ZeRO-1 splits: dim 0, an expert tensor's dim 1 (each expert's rows)
        real = [(n, p.numel(), p.shape[int(".experts." in n)]) for s in stages for n, p in s.named_parameters()]
        assert sorted(real) == sorted((p.name, p.numel, p.entry_rows) for p in specs)
        dense = [p for s in stages for n, p in s.named_parameters() if ".experts." not in n]
        experts = [p for s in stages for p in s.expert_parameters()]
        opt = DistributedAdamW([ShardGroup(dense), ShardGroup(experts, stacked=True)], zero=True)
        meter = MemoryMeter(list(stages), opt)
        meter.start_step()
        got = meter.stop_step()
        want = state_bytes(specs, param_bytes=dtype.itemsize, master_weights=True, dp=1, edp=1, zero=True)
        assert (got["param_bytes"], got["grad_bytes"], got["optimizer_state_bytes"]) == want


def test_zero_shards_by_the_optimizers_rows() -> None:
    # bf16 with masters: 12 bytes of state an element; experts over edp = 2, dense over dp = 4.
    specs = rank_params(tiny_config(), 1, 1, "1f1b", 0)
    _, grads, full = state_bytes(specs, param_bytes=2, master_weights=True, dp=1, edp=1, zero=True)
    _, grads4, sharded = state_bytes(specs, param_bytes=2, master_weights=True, dp=4, edp=2, zero=True)
    assert grads4 == grads == 4 * sum(p.numel for p in specs)  # ZeRO-1 keeps every gradient
    assert full == 12 * sum(p.numel for p in specs)
    # the worst rank (rank 0) holds ceil(rows / size) rows of every tensor, of every expert of an expert tensor
    size = {False: 4, True: 2}
    rank0 = sum(-(-p.entry_rows // size[p.expert]) * (p.numel // p.entry_rows) for p in specs)
    assert sharded == 12 * rank0
    assert 12 * sum(p.numel / size[p.expert] for p in specs) <= sharded < 0.5 * full
    # DeepSeek-V3's embedding [129280, 7168] over 128 ranks: 1010 rows each, not the whole table on one rank
    v3 = [ParamSpec("embed.weight", 129280 * 7168, rows=129280)]
    assert state_bytes(v3, param_bytes=2, master_weights=True, dp=128, edp=1, zero=True)[2] == 12 * 1010 * 7168
    # pure bf16: bf16 gradients and moments, no master
    assert state_bytes(specs, param_bytes=2, master_weights=False, dp=1, edp=1, zero=False)[1:] == (
        2 * sum(p.numel for p in specs),
        4 * sum(p.numel for p in specs),
    )


@pytest.mark.parametrize(("dtype", "b"), [(torch.float32, 4), (torch.bfloat16, 2)])
def test_activation_bytes_match_the_tracker(dtype: torch.dtype, b: int) -> None:
    """One micro-batch through the whole model: the saved tensors listed per sub-stage (the runtime's kept
    piece inputs aside, which the tracker does not see) within 5% of the tracker's peak."""
    cfg = tiny_config()
    measured = tracked_peak_bytes(MoEModel(cfg, seed=0, piecewise=True).to(dtype), cfg, size=4, seq=32)
    tracked = module_activation_bytes(cfg, range(4), 128, 32, b, 1, first=True, last=True, recompute=False)
    leaves = sum(v for i in range(4) for k, v in layer_activations(cfg, i, 128, 32, b).items() if k in LEAVES)
    assert tracked - leaves == pytest.approx(measured, rel=0.05)
    # the model's footprint at pp = 1: one live module, exactly this listing
    fp = footprint(
        cfg,
        Parallelism(pp=1, dp=1, ep=1, schedule="1f1b"),
        Workload(seq_len=32, micro_batch=4, act_bytes=b),
        num_chunks=1,
        param_bytes=b,
    )
    assert fp.peak_modules == 1 and fp.activations == tracked


@pytest.mark.parametrize("recompute", [False, True], ids=["kept-graph", "full-recompute"])
def test_an_moe_layer_keeps_the_listed_piece_inputs(recompute: bool) -> None:
    """The MLP piece's inputs the overlap runtime holds after an MoE block's forward, measured on their storages
    (the rows delivered in a new buffer, as an all-to-all delivers them): the planner's leaf entries of the
    MLP, the received rows being freed once permuted; under full recompute the rows too, as the recompute
    figure keeps them."""
    cfg = tiny_config(num_layers=2)
    t, d = 2 * 8, cfg.hidden_size
    stage = MoEStage(cfg, range(1, 2), first=False, last=False, dispatcher=DeliveringDispatcher(cfg.num_experts))
    stage.reset_parameters(SEED)
    decl = stage.blocks["1"].pieces()
    run = BlockRun(decl, recompute=recompute)
    run.begin(torch.randn(2, 8, d, generator=torch.Generator().manual_seed(0)))
    for i, piece in enumerate(decl.pieces):  # attention, dispatch, shared experts, MLP, combine
        if isinstance(piece, Compute):
            run.compute(i)
        else:
            run.start(i)
    run.output()
    storages = {run.values[n].untyped_storage() for n in ("x_recv", "w_recv")}
    held = sum(s.nbytes() for s in storages)
    listed = sum(v for k, v in layer_activations(cfg, 1, t, 8, 4).items() if k in LEAVES and k.startswith("mlp."))
    assert listed == 4 * t * cfg.top_k  # the routing weights
    assert held == listed + (4 * t * d if recompute else 0)


def test_footprint_uses_the_schedules_peak() -> None:
    cfg = tiny_config(num_layers=8)
    work = Workload(seq_len=32, micro_batch=1)
    for schedule, pp in (("1f1b", 4), ("dualpipe", 4), ("dualpipev", 4)):
        par = Parallelism(pp=pp, dp=8, ep=4, schedule=schedule)
        fp = footprint(cfg, par, work, num_chunks=8)
        sim = simulate(build_schedule(schedule, pp, 8))
        assert fp.peak_modules == sim.peak_activations[fp.pp_rank]
        assert fp.params == 2 * sum(p.numel for p in rank_params(cfg, pp, 4, schedule, fp.pp_rank))
        assert fp.activations > 0 and fp.all_to_all_buffers > 0 and fp.total > fp.activations
    # DualPipe holds every stage twice: twice DualPipeV's parameters on a middle rank
    dp_ = footprint(cfg, Parallelism(pp=4, dp=8, ep=4, schedule="dualpipe"), work, num_chunks=8)
    assert dp_.peak_modules == 5  # PP + 1 on the middle ranks (dualpipe.simulate)


def test_recompute_keeps_only_piece_inputs() -> None:
    cfg = tiny_config(num_layers=8)
    par = Parallelism(pp=4, dp=8, ep=4, schedule="dualpipev")
    work = Workload(seq_len=64, micro_batch=2)
    plain = footprint(cfg, par, work, num_chunks=8)
    again = footprint(cfg, par, dataclasses.replace(work, recompute=True), num_chunks=8)
    assert again.activations < 0.5 * plain.activations
    assert (again.params, again.grads, again.optimizer) == (plain.params, plain.grads, plain.optimizer)


def test_fits_with_headroom() -> None:
    fp = footprint(tiny_config(), Parallelism(pp=1, dp=1, ep=1, schedule="1f1b"), Workload(seq_len=32, micro_batch=1))
    assert fp.fits(GPUS["h100"])
    big = dataclasses.replace(fp, activations=0.95 * GPUS["h100"].hbm_bytes)
    assert not big.fits(GPUS["h100"]) and big.fits(GPUS["h100"], headroom=0.0)  # 10% headroom decides
    assert dataclasses.replace(fp, activations=0.85 * GPUS["h100"].hbm_bytes).fits(GPUS["h100"])

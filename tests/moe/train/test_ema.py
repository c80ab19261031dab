"""The moving average of the weights on the host (moe.train.ema), one process; the trainer's use of it, sharded
under ZeRO-1, resumed and exported, is tested in test_trainer.py."""

from __future__ import annotations

import dataclasses
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import moe.train.ema
from moe.train.cli import config_from_args
from moe.train.ema import HostEMA, ema_reference
from moe.train.optimizer import DistributedOptimizer, ShardGroup
from moe.train.preflight import job_footprint
from tests.distributed import run_ranks


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def _step(model: nn.Module, opt: DistributedOptimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(5, 6, generator=g).to(next(model.parameters()).dtype)
    opt.zero_grad()
    model(x).float().pow(2).mean().backward()
    opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_average_is_plain_torch_over_the_trajectory_of_the_masters(dtype: torch.dtype) -> None:
    model = _model(dtype)
    opt = DistributedOptimizer([ShardGroup(list(model.parameters()))], "adamw", lr=0.05)
    ema = HostEMA(opt, decay=0.8)
    trajectory = {id(p): [opt.master_for(p).detach().clone()] for p in model.parameters()}
    for step in range(5):
        ema.before_step()
        _step(model, opt, step)
        ema.update()
        for p in model.parameters():
            trajectory[id(p)].append(opt.master_for(p).detach().clone())
    ema.wait()
    for p in model.parameters():
        got, want = ema.state_for(p), ema_reference(trajectory[id(p)], 0.8)
        assert got.dtype == torch.float32 and got.device.type == "cpu"
        assert torch.equal(got, want)
    ema.close()


def test_update_returns_before_the_average_is_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """The step's thread queues the average and goes on; a worker thread takes it."""
    gate, seen = threading.Event(), []
    average = moe.train.ema._average_

    def held(*args) -> None:
        seen.append(threading.current_thread().name)
        assert gate.wait(30)
        average(*args)

    monkeypatch.setattr(moe.train.ema, "_average_", held)
    model = _model(torch.float32)
    opt = DistributedOptimizer([ShardGroup(list(model.parameters()))], "sgd", lr=0.1)
    ema = HostEMA(opt, decay=0.5)
    start = {id(p): p.detach().clone() for p in model.parameters()}
    _step(model, opt, 0)
    ema.update()  # returns with the average held at the gate
    assert all(torch.equal(ema.state_for(p), start[id(p)]) for p in model.parameters())
    gate.set()
    ema.wait()
    assert seen and seen[0].startswith("host-ema")
    for p in model.parameters():
        assert torch.equal(ema.state_for(p), ema_reference([start[id(p)], p.detach()], 0.5))
    ema.close()


def test_applied_puts_the_average_in_the_parameters_for_the_block_only() -> None:
    model = _model(torch.float32)
    opt = DistributedOptimizer([ShardGroup(list(model.parameters()))], "sgd", lr=0.1)
    ema = HostEMA(opt, decay=0.5)
    _step(model, opt, 0)
    ema.update()
    weights = {id(p): p.detach().clone() for p in model.parameters()}
    with ema.applied():
        for p in model.parameters():
            assert torch.equal(p.detach(), ema.state_for(p))
    assert all(torch.equal(p.detach(), weights[id(p)]) for p in model.parameters())
    ema.close()


# The trainer's average: one spawn of 2 ranks at dp=2 with ZeRO-1 (each rank holds half the rows of every tensor,
# experts' rows per expert), fp32, so that the exported and evaluated weights are the average exactly.

DECAY = 0.9
LAYOUT = ["--model", "qwen3-moe-tiny", "--pp", "1", "--dp", "2", "--ep", "1", "--zero", "1", "--schedule", "1f1b"]
RUN = [*LAYOUT, "--num-chunks", "2", "--seq-len", "16", "--micro-batch-size", "2", "--val-every", "0"]


def _recorded(rank: int, world: int, argv: list[str]) -> dict:
    """Train through the library with the weights recorded before the run's first step and after each step;
    every rank checks its rows of the average against the plain-torch average of that trajectory, and, with
    ``--save-hf --ema-weights``, the exported tensors against the whole of it."""
    from moe.train.trainer import Trainer

    trainer = Trainer(config_from_args(argv, world)[0])
    ema = trainer.ema
    names = {id(p): f"{m.stage_index}.{n}" for m in trainer.modules for n, p in m.named_parameters()}
    trajectory: dict[str, list[torch.Tensor]] = {}
    before_step, update = ema.before_step, ema.update

    def record() -> None:  # under ZeRO-1 the step has all-gathered every parameter: each rank has all of it
        for p in ema.params:
            trajectory.setdefault(names[id(p)], []).append(p.detach().clone())

    def first_before_step() -> None:
        if not trajectory:  # the weights the run's first step starts from (resumed or not)
            record()
        before_step()

    def recorded_update() -> None:
        update()
        record()

    ema.before_step, ema.update = first_before_step, recorded_update
    trainer.train()
    ema.wait()
    want = {name: ema_reference(ws, ema.decay) for name, ws in trajectory.items()}
    rows, wrong = {}, []
    for p in ema.params:
        shard, name = trainer.optimizer.shard_of(p), names[id(p)]
        rows[name] = (shard.start, shard.stop, shard.rows)
        if not torch.equal(ema.state_for(p), want[name].narrow(shard.dim, shard.start, shard.stop - shard.start)):
            wrong.append(name)
    exported_wrong = None
    if trainer.config.checkpoint.ema_weights:
        from moe.hf import load_hf_weights
        from moe.parallel import build_stages

        fresh = build_stages(trainer.model_config, trainer.layout, seed=1, dtype=torch.float32, device=trainer.device)
        load_hf_weights(fresh, trainer.config.checkpoint.save_hf)
        got = {f"{m.stage_index}.{n}": p for m in fresh for n, p in m.named_parameters()}
        exported_wrong = [name for name in want if not torch.equal(got[name], want[name])]
    trainer.close()
    steps = len(next(iter(trajectory.values()))) - 1
    return {"rows": rows, "wrong": wrong, "steps": steps, "exported": exported_wrong, "host": ema.host_bytes()}


def _eval(rank: int, world: int, argv: list[str]) -> dict:
    from moe.eval import main

    return main(argv)


@pytest.fixture(scope="module")
def ema_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """In turn on 2 ranks: 4 steps with the average, checkpointing every 2 and exporting it ("full", recorded); 2
    steps, then 2 more resumed ("first", "resumed", exporting it); 2 steps without an average, then 1 resumed with
    one ("plain", "late", recorded); then moe.eval of the full run's checkpoint with and without --ema-weights and
    of its export."""
    from tests.moe.train.test_trainer import _in_turn, _train

    tmp = tmp_path_factory.mktemp("ema")
    tokens = np.random.default_rng(0).integers(0, 200, 4096).astype(np.uint16)
    np.save(tmp / "tokens.npy", tokens)
    run = [*RUN, "--data", str(tmp / "tokens.npy")]
    ema = ["--ema", str(DECAY)]

    def ckpt(name: str) -> list[str]:
        return ["--ckpt-dir", str(tmp / name), "--ckpt-every", "2"]

    def export(name: str) -> list[str]:
        return ["--save-hf", str(tmp / name), "--ema-weights"]

    evaluate = ["--data", str(tmp / "tokens.npy"), "--seq-len", "16", "--global-batch-size", "4", "--batches", "2"]
    bodies = [
        (_recorded, ([*run, *ema, "--steps", "4", *ckpt("full"), *export("full-hf")],)),
        (_train, ([*run, *ema, "--steps", "2", *ckpt("split")],)),
        (_train, ([*run, *ema, "--steps", "4", *ckpt("split"), "--resume", *export("split-hf")],)),
        (_train, ([*run, "--steps", "2", *ckpt("plain")],)),
        (_recorded, ([*run, *ema, "--steps", "3", *ckpt("plain"), "--resume"],)),
        (_eval, (["--model", str(tmp / "full"), "--ema-weights", *evaluate],)),
        (_eval, (["--model", str(tmp / "full-hf"), *evaluate],)),
        (_eval, (["--model", str(tmp / "full"), *evaluate],)),
    ]
    per_rank = run_ranks(_in_turn, 2, args=(bodies,), timeout=300)
    names = ["full", "first", "resumed", "plain", "late", "eval-ema", "eval-export", "eval-raw"]
    return tmp, {name: [outcomes[i] for outcomes in per_rank] for i, name in enumerate(names)}


@pytest.mark.slow
def test_the_trainers_average_is_plain_torch_over_the_trajectory_each_rank_its_rows(ema_runs) -> None:
    _, runs = ema_runs
    full = runs["full"]
    assert [r["wrong"] for r in full] == [[], []] and full[0]["steps"] == 4
    assert [r["exported"] for r in full] == [[], []]  # --save-hf --ema-weights wrote the whole average
    # sharded: each rank holds its half of the rows of every tensor with more than one
    for name, (start, stop, rows) in full[0]["rows"].items():
        other = full[1]["rows"][name]
        assert (start, stop) == (0, -(-rows // 2)) and other[:2] == (stop, rows), name
    # the planner's host bytes are the trainer's (the fullest rank: rank 0's rows), and none of them on the GPU
    config = config_from_args([*RUN, "--ema", str(DECAY)], 2)[0]
    with_ema, without = job_footprint(config), job_footprint(config_from_args(RUN, 2)[0])
    assert with_ema.host == max(r["host"] for r in full) > 0 and without.host == 0
    assert with_ema.total == without.total and dataclasses.replace(with_ema, host=0, options={}) == without
    # resumed from a checkpoint without an average: it starts from the checkpoint's weights
    late = runs["late"]
    assert [r["wrong"] for r in late] == [[], []] and late[0]["steps"] == 1


@pytest.mark.slow
def test_a_resumed_run_continues_the_average_bit_for_bit(ema_runs) -> None:
    import torch.distributed.checkpoint as dcp

    from moe.hf import read_safetensors
    from moe.train.checkpoint import has_ema

    tmp, _ = ema_runs
    full, split = tmp / "full" / "step_00000004", tmp / "split" / "step_00000004"
    assert has_ema(full) and has_ema(split) and not has_ema(tmp / "plain" / "step_00000002")
    stored = dcp.FileSystemReader(full).read_metadata().state_dict_metadata
    keys = [k for k in stored if k.startswith("ema.")]
    assert len(stored["ema.embed.weight"].chunks) == 2  # each rank's rows
    got = {}
    for step in (full, split):
        state = {k: torch.empty(stored[k].size, dtype=stored[k].properties.dtype) for k in keys}
        with warnings.catch_warnings():  # that it assumes one process: it is one
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=step, no_dist=True)
        got[step] = state
    assert all(got[full][k].dtype == torch.float32 and torch.equal(got[full][k], got[split][k]) for k in keys)
    a, b = read_safetensors(tmp / "full-hf"), read_safetensors(tmp / "split-hf")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_eval_and_convert_read_the_average_with_ema_weights(ema_runs) -> None:
    from moe.convert import main as convert
    from moe.hf import read_safetensors

    tmp, runs = ema_runs
    ema, export, raw = (runs[name][0]["loss"] for name in ("eval-ema", "eval-export", "eval-raw"))
    assert ema == export and ema != raw
    convert([str(tmp / "full"), str(tmp / "converted"), "--ema-weights"])
    convert([str(tmp / "full"), str(tmp / "converted-raw")])
    exported, converted = read_safetensors(tmp / "full-hf"), read_safetensors(tmp / "converted")
    assert sorted(exported) == sorted(converted) and all(torch.equal(exported[k], converted[k]) for k in exported)
    weights = read_safetensors(tmp / "converted-raw")
    assert not all(torch.equal(weights[k], exported[k]) for k in exported)


@pytest.mark.slow
def test_ema_weights_without_an_average_is_one_line_naming_the_checkpoint(ema_runs) -> None:
    from moe.convert import ConvertError
    from moe.convert import main as convert
    from moe.eval import EvalError
    from moe.eval import main as evaluate

    tmp, _ = ema_runs
    plain = tmp / "plain" / "step_00000002"
    data = ["--data", str(tmp / "tokens.npy"), "--seq-len", "16", "--global-batch-size", "4", "--batches", "1"]
    cases = [
        (lambda: evaluate(["--model", str(tmp / "plain"), "--ema-weights", *data]), EvalError, f"checkpoint {plain}"),
        (lambda: evaluate(["--model", str(tmp / "full-hf"), "--ema-weights", *data]), EvalError, "a Hugging Face"),
        (lambda: convert([str(plain), str(tmp / "no"), "--ema-weights"]), ConvertError, f"checkpoint {plain}"),
    ]
    for call, kind, names in cases:
        with pytest.raises(kind) as err:
            call()  # before any process group: the checks read the checkpoint's metadata only
        text = err.value.code
        assert text.startswith("error: --ema-weights: ") and names in text and "\n" not in text, text
    assert not (tmp / "no").exists()

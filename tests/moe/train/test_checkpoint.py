"""Distributed checkpoints: atomic against crashes, verified before loading (falling back past a damaged
one), weights-only per-rank state, retention; reloadable at another expert-parallel layout."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import pytest
import torch

from tests.distributed import RankFailure, run_ranks

STEPS = (2, 4)


def _stages(world: int, seed: int):
    from moe.models.config import preset
    from moe.parallel import ParallelConfig, build_stages, init_layout

    layout = init_layout(ParallelConfig(pp=1, ep=world, schedule="dualpipev"))
    cfg = preset("tiny", num_layers=2)
    stages = list(build_stages(cfg, layout, seed=seed))
    opt = torch.optim.AdamW([p for s in stages for p in s.parameters()], lr=1e-3)
    return stages, opt


def _train_a_bit(stages, opt, steps: int) -> None:
    for _ in range(steps):
        for s in stages:
            for p in s.parameters():
                p.grad = torch.full_like(p, 0.01)
        opt.step()
    for s in stages:
        for b in s.blocks.values():
            if getattr(b, "is_moe", False):
                b.router.expert_bias.add_(0.5)


def _save_two(rank: int, world: int, ckpt: str) -> None:
    """Steps 2 and 4 (the state ``_load`` checks is step 2's)."""
    import moe.train.checkpoint as ck

    stages, opt = _stages(world, seed=1)
    for step in (2, 4):
        _train_a_bit(stages, opt, 2)
        ck.save_checkpoint(ckpt, step, stages, opt, {"data_step": step}, ck.rng_state())


def _save_then_crash(rank: int, world: int, ckpt: str, how: str) -> None:
    import moe.train.checkpoint as ck

    stages, opt = _stages(world, seed=1)
    _train_a_bit(stages, opt, 2)
    ck.save_checkpoint(ckpt, 2, stages, opt, {"data_step": 2})
    _train_a_bit(stages, opt, 2)
    if how == "exit":

        def crash(*args, **kwargs):  # every rank dies after its shards are written, before the rename
            os._exit(3)

        ck.torch.save = crash
    elif rank == 0:  # "sigkill": rank 0 is killed with the manifest written, just before the rename
        write_manifest = ck.write_manifest

        def crash(*args, **kwargs):
            write_manifest(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)

        ck.write_manifest = crash
    ck.save_checkpoint(ckpt, 4, stages, opt, {"data_step": 4})


def _load(rank: int, world: int, ckpt: str) -> dict:
    from moe.train.checkpoint import CheckpointError, find_checkpoint, load_checkpoint

    try:
        find_checkpoint(ckpt, strict=True)
        strict = None
    except CheckpointError as exc:
        strict = str(exc)
    path, warnings = find_checkpoint(ckpt)
    stages, opt = _stages(world, seed=99)  # different init: everything must come from the checkpoint
    meta, rank_state = load_checkpoint(path, stages, opt)
    ref, ref_opt = _stages(world, seed=1)
    _train_a_bit(ref, ref_opt, 2)
    same_model = all(
        torch.equal(a, b)
        for s, r in zip(stages, ref)
        for a, b in zip([*s.parameters(), *s.buffers()], [*r.parameters(), *r.buffers()])
    )
    same_opt = all(
        torch.equal(opt.state[p]["exp_avg_sq"], ref_opt.state[q]["exp_avg_sq"])
        and float(opt.state[p]["step"]) == float(ref_opt.state[q]["step"])
        for s, r in zip(stages, ref)
        for p, q in zip(s.parameters(), r.parameters())
    )
    return {
        "path": path.name,
        "step": meta["step"],
        "model": same_model,
        "optim": same_opt,
        "rank_state": rank_state is not None,
        "warnings": warnings,
        "strict": strict,
    }


GOOD = {"path": "step_00000002", "step": 2, "model": True, "optim": True, "warnings": [], "strict": None}


# rank 0's death, or its peer seeing it first (gloo says "closed" or "reset", by when the socket went)
KILLED = "exit code -9|Connection (closed|reset) by peer"


CRASHES = [("exit", "exit code 3"), ("sigkill", KILLED)]


def _load_each(rank: int, world: int, ckpts: list[str]) -> list[dict]:
    return [_load(rank, world, ckpt) for ckpt in ckpts]


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Per way to die (``CRASHES``): what the crashed save's spawn reported, what it left on disk, and what each
    rank loaded from it at world 2 and at world 1. Both directories load in turn in one spawn per world."""
    tmp = tmp_path_factory.mktemp("crashed")
    out = {}
    for how, _ in CRASHES:
        ckpt = tmp / how / "ckpt"
        try:
            run_ranks(_save_then_crash, 2, args=(str(ckpt), how), timeout=120)
            report = "the ranks finished"
        except RankFailure as exc:
            report = str(exc)
        partial = ckpt / ".step_00000004.partial"
        out[how] = {
            "report": report,
            "partial": partial.is_dir(),  # the interrupted write
            "manifest": (partial / "manifest.json").is_file(),
            "renamed": (ckpt / "step_00000004").exists(),
        }
    ckpts = [str(tmp / how / "ckpt") for how, _ in CRASHES]
    for world in (2, 1):  # same layout, then all experts on one rank
        per_rank = run_ranks(_load_each, world, args=(ckpts,), timeout=120)
        for i, (how, _) in enumerate(CRASHES):
            out[how][world] = [loaded[i] for loaded in per_rank]
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("how", "died"), CRASHES)
def test_a_crash_during_a_save_keeps_the_last_good_checkpoint(crashed: dict, how: str, died: str) -> None:
    got = crashed[how]
    assert re.search(died, got["report"]), got["report"]
    assert got["partial"]  # the interrupted write
    assert got["manifest"] == (how == "sigkill")
    assert not got["renamed"]
    for world in (2, 1):
        for r in got[world]:
            assert r == {**GOOD, "rank_state": world == 2}, r


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_falls_back_to_the_last_good_one(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    run_ranks(_save_two, 2, args=(str(ckpt),), timeout=120)
    shard = sorted((ckpt / "step_00000004").glob("*.distcp"))[-1]
    with open(shard, "r+b") as f:  # as a full disk or a killed copy leaves it
        f.truncate(shard.stat().st_size // 2)
    before = _files(ckpt)
    damaged = f"{shard}: {shard.stat().st_size} bytes, the manifest says"
    for r in run_ranks(_load, 2, args=(str(ckpt),), timeout=120):
        assert r["strict"].startswith(f"the newest checkpoint is damaged: {damaged}"), r["strict"]
        assert len(r["warnings"]) == 1 and r["warnings"][0].startswith(f"skipping damaged checkpoint {shard.parent}:")
        assert damaged in r["warnings"][0]
        assert {**r, "warnings": [], "strict": None} == {**GOOD, "rank_state": True}, r
    assert _files(ckpt) == before  # a failed load deletes nothing


def test_checkpoint_choice_without_a_process_group(tmp_path: Path) -> None:
    """Which directory ``find_checkpoint`` picks (rank 0's part), on hand-made checkpoint directories."""
    from moe.train.checkpoint import _choose, verify_checkpoint
    from moe.train.manifest import write_manifest

    root = tmp_path / "ckpt"
    assert _choose(root, strict=False) == (None, [], None)  # missing directory: nothing to resume
    for step in (1, 2, 3):
        d = root / f"step_{step:08d}"
        d.mkdir(parents=True)
        (d / "meta.json").write_text("{}")
        (d / "__0_0.distcp").write_bytes(bytes(100))
        if step > 1:  # step 1 is an older version's, without a manifest
            write_manifest(d)
    (root / "latest").write_text("step_00000002")  # step 3: written by a run later rolled back past it
    assert _choose(root, strict=False) == (root / "step_00000002", [], None)
    (root / "step_00000002" / "__0_0.distcp").write_bytes(bytes(99) + b"x")  # same size, other bytes
    assert verify_checkpoint(root / "step_00000002", checksums=False)
    path, warnings, error = _choose(root, strict=False)
    assert path == root / "step_00000001" and error is None
    assert "step_00000002/__0_0.distcp: CRC-32 differs" in warnings[0]
    assert (
        warnings[1]
        == f"{root / 'step_00000001'} has no manifest.json (written by an older version): loading it unverified"
    )
    (root / "step_00000001" / "meta.json").unlink()
    assert _choose(root, strict=False)[2] == f"no intact checkpoint in {root} (2 damaged, none deleted)"
    (root / "latest").write_text("step_00000007")
    path, warnings, _ = _choose(root, strict=True)
    assert path == root / "step_00000003" and "points to step_00000007, which does not exist" in warnings[0]


class _RunsCode:
    """Unpickling this calls ``open(marker, "w")``: any callable could be there instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def _save_one(rank: int, world: int, ckpt: str) -> None:
    import moe.train.checkpoint as ck

    stages, opt = _stages(world, seed=1)
    ck.save_checkpoint(ckpt, 1, stages, opt, {"data_step": 1}, ck.rng_state())


def _load_newest(rank: int, world: int, ckpt: str) -> str:
    import moe.train.checkpoint as ck

    path, _ = ck.find_checkpoint(ckpt)
    stages, opt = _stages(world, seed=1)
    try:
        ck.load_checkpoint(path, stages, opt)
    except ck.CheckpointError as exc:
        return str(exc)
    return "loaded"


@pytest.mark.slow
def test_per_rank_state_that_would_run_code_is_refused(tmp_path: Path) -> None:
    from moe.train.manifest import write_manifest

    ckpt = tmp_path / "ckpt"
    run_ranks(_save_one, 1, args=(str(ckpt),), timeout=120)
    rank_file = ckpt / "step_00000001" / "rank00000.pt"
    assert isinstance(torch.load(rank_file, weights_only=True)["torch_rng"], torch.Tensor)  # ours loads
    marker = tmp_path / "code-ran"
    torch.save({"torch_rng": _RunsCode(marker)}, rank_file)
    write_manifest(rank_file.parent)  # whoever can write the directory can rewrite the manifest
    torch.load(rank_file, weights_only=False)
    assert marker.exists()  # the planted file does run code when fully unpickled
    marker.unlink()
    (err,) = run_ranks(_load_newest, 1, args=(str(ckpt),), timeout=120)
    assert err.startswith(f"loading checkpoint {rank_file.parent} failed: rank 0: {rank_file}: refused, it holds ")
    assert not marker.exists()


def _save_steps(rank: int, world: int, ckpt: str, steps: list[int], keep_last: int) -> None:
    import moe.train.checkpoint as ck

    stages, opt = _stages(world, seed=1)
    for step in steps:
        ck.save_checkpoint(ckpt, step, stages, opt, {"data_step": step}, keep_last=keep_last)


def test_retention_keeps_the_newest_and_what_latest_names(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    (ckpt / ".step_00000002.partial").mkdir(parents=True)  # a crashed save's leftovers
    (ckpt / "step_00000009").mkdir()  # newer than anything saved below: a rolled-back run's, not ours to judge
    run_ranks(_save_steps, 1, args=(str(ckpt), [1, 2, 3, 4, 5], 2), timeout=120)
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step_00000004", "step_00000005", "step_00000009"]
    assert (ckpt / "latest").read_text() == "step_00000005"
    manifest = json.loads((ckpt / "step_00000005" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == [".metadata", "__0_0.distcp", "meta.json", "rank00000.pt"]


# ZeRO-1: each rank saves its rows as DTensor chunks; any other split, or none, loads them


def _zero_stages(world: int, zero: bool, seed: int, steps: int):
    """bf16 stages at (pp=1, dp=world, ep=1), two experts (a router of two rows): dense weights and the experts
    (edp=world) both split over the world with ``zero``; ``steps`` AdamW steps with the same gradients on every
    rank (what the reduction leaves)."""
    from moe.models.config import preset
    from moe.parallel import ParallelConfig, build_stages, init_layout
    from moe.train.grad_sync import make_optimizer

    layout = init_layout(ParallelConfig(pp=1, dp=world, ep=1, schedule="1f1b"))
    cfg = preset("tiny", num_layers=2, num_experts=2)
    stages = list(build_stages(cfg, layout, seed=seed, dtype=torch.bfloat16))
    opt = make_optimizer(stages, layout, zero=zero, lr=1e-2, weight_decay=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        opt.zero_grad()
        for p in opt.params():
            p.main_grad.copy_(torch.randn(p.shape, generator=g))
        opt.step()
    return stages, opt


def _save_zero(rank: int, world: int, ckpt: str) -> None:
    import moe.train.checkpoint as ck

    for name, zero in (("sharded", True), ("whole", False)):  # "whole": one chunk per key, as before ZeRO's rows
        stages, opt = _zero_stages(world, zero, seed=1, steps=2)
        ck.save_checkpoint(f"{ckpt}/{name}", 2, stages, opt, {})


def _load_zero(rank: int, world: int, ckpt: str) -> dict[str, bool]:
    from moe.train.checkpoint import load_checkpoint

    _, ref = _zero_stages(world, False, seed=1, steps=2)
    out = {}
    for name, zero in (("sharded", True), ("whole", True), ("sharded", False)):
        stages, opt = _zero_stages(world, zero, seed=99, steps=1)  # other weights and state: all must be loaded
        load_checkpoint(f"{ckpt}/{name}/step_00000002", stages, opt)
        same = []
        for p, q in zip(opt.params(), ref.params()):
            sh = opt.shard_of(p)  # every row without ZeRO-1
            assert sh.sharded == (zero and world > 1)
            same += [
                torch.equal(p, q),
                torch.equal(opt.master_for(p), ref.master_for(q).narrow(sh.dim, sh.start, sh.stop - sh.start)),
            ]
            for k, v in opt.state_for(p).items():
                want = ref.state_for(q)[k]
                same.append(torch.equal(v, want.narrow(sh.dim, sh.start, sh.stop - sh.start) if v.dim() else want))
        out[f"{name} -> zero={zero}"] = bool(same) and all(same)
    return out


@pytest.mark.slow
def test_zero1_rows_are_dcp_chunks_that_load_at_any_split(tmp_path: Path) -> None:
    """Saved at dp=3 (ZeRO-1 rows, uneven: the last rank holds none of the router's two rows; and whole tensors,
    as older checkpoints hold them), loaded at dp=2 with ZeRO-1 and without: the same weights, masters and state
    as the run that was saved."""
    import torch.distributed.checkpoint as dcp

    from moe.train.optimizer import shard_rows

    run_ranks(_save_zero, 3, args=(str(tmp_path),), timeout=120)
    stored = dcp.FileSystemReader(tmp_path / "sharded" / "step_00000002").read_metadata().state_dict_metadata

    def chunks(key: str) -> list[tuple[int, int]]:
        return sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in stored[key].chunks)

    assert chunks("optim.embed.weight.exp_avg") == [shard_rows(256, 3, r) for r in range(3)]  # 86, 86, 84 rows
    assert chunks("optim.blocks.1.router.gate.weight.exp_avg_sq") == [(0, 1), (1, 2), (2, 2)]
    assert chunks("model.blocks.1.experts.w1.e1") == [shard_rows(32, 3, r) for r in range(3)]  # an expert's rows
    assert stored["model.blocks.1.experts.w1.e1"].properties.dtype == torch.float32  # the master
    whole = dcp.FileSystemReader(tmp_path / "whole" / "step_00000002").read_metadata().state_dict_metadata
    assert len(whole["optim.embed.weight.exp_avg"].chunks) == 1
    for r in run_ranks(_load_zero, 2, args=(str(tmp_path),), timeout=120):
        assert r == {"sharded -> zero=True": True, "whole -> zero=True": True, "sharded -> zero=False": True}, r

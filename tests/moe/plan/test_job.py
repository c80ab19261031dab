"""``moe.plan --emit-config``: the best plan as the trainer's job file, read back by the trainer's own loader with
every option the plan was sized under; the memory line names those options."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import tomllib

from moe.models.config import PRESETS, preset
from moe.plan.cli import main
from moe.plan.costs import MemoryOptions, Precision
from moe.plan.hardware import Cluster, gpu
from moe.plan.job import job_toml
from moe.plan.report import RunShape, evaluate
from moe.plan.search import Candidate
from moe.train.cli import config_from_args


def _read_back(path: Path):
    """The job as ``examples/train.py --config PATH --print-config`` resolves it (in this process)."""
    config, ns = config_from_args(["--config", str(path), "--print-config"], world=None)
    assert ns.print_config
    return config


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_emits_a_job_the_trainer_accepts(name: str, tmp_path: Path) -> None:
    cfg = preset(name)
    cluster = Cluster(gpu("h100"), 64, 8)
    run = RunShape(4096, 256, 1, Precision(fp8=True))
    options = MemoryOptions(state_dtype="bfloat16", fp8_activations=True)
    c = Candidate("dualpipev", 2, 32, 8, 8, 20, "selective", overlap=False, offload="fraction=0.5")
    best = evaluate(cfg, cluster, run, c, options=options)
    path = tmp_path / "job.toml"
    path.write_text(job_toml(best, model=name, cfg=cfg, cluster=cluster, seq_len=4096, global_batch=256,
                             micro_batch=1, precision=run.precision, options=options, command="test"))  # fmt: skip
    job = _read_back(path)
    p, o, t = job.parallel, job.optimizer, job.training
    assert (p.pp, p.dp, p.ep, p.schedule, p.num_chunks, p.comm_sms) == (2, 32, 8, "dualpipev", 8, 20)
    assert (p.recompute, p.overlap, p.offload, p.extra_warmup, p.pipeline_layout) == (
        "selective", False, "fraction=0.5", 0, "auto")  # fmt: skip
    assert (o.zero, o.state_dtype) == (1, "bfloat16")
    assert (t.seq_len, t.micro_batch_size, t.global_batch_size) == (4096, 1, 256)
    assert (t.fp8, t.dispatch_fp8, t.fp8_activations, t.dtype) == (True, True, True, "bfloat16")
    assert job.model_config == cfg


def test_emit_config_matches_the_memory_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "job.toml"
    argv = ["--model", "deepseek-v3-tiny", "--gpus", "8", "--gpu", "h100", "--seq-len", "256", "--top", "2"]
    assert main([*argv, "--state-dtype", "bfloat16", "--emit-config", str(path)]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "memory options:" in x)
    best = re.search(r"best fitting plan: (\S+) pp=(\d+) dp=(\d+) ep=(\d+) chunks=(\d+)", out).groups()
    doc = tomllib.loads(path.read_text())
    job = _read_back(path)
    assert (job.parallel.schedule, job.parallel.pp, job.parallel.dp, job.parallel.ep, job.parallel.num_chunks) == (
        best[0], *map(int, best[1:]))  # fmt: skip
    assert "ZeRO-1" in line and doc["optimizer"]["zero"] == job.optimizer.zero == 1
    assert f"recompute {job.parallel.recompute}," in line and "optimizer state bfloat16" in line
    assert job.optimizer.state_dtype == "bfloat16" and job.training.fp8_activations is False
    assert "MTP shares the embedding and head" in line  # the model has an MTP module
    assert "assumed: global batch 512 sequences (16,384 tokens per GPU" in out and "micro-batch 1" in out
    assert f"wrote {path}" in out


def test_the_memory_line_names_mtp_only_for_a_model_with_mtp(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--model", "qwen3-moe-tiny", "--gpus", "8", "--gpu", "h100", "--seq-len", "256", "--top", "1"])
    line = next(x for x in capsys.readouterr().out.splitlines() if "memory options:" in x)
    assert "MTP" not in line and "ZeRO-1" in line


def test_progress_line_only_after_its_delay(capsys: pytest.CaptureFixture[str]) -> None:
    from moe.plan.cli import Progress

    quiet = Progress()
    quiet("sizing 1/2 candidates")  # under the delay: nothing
    quiet.done()
    slow = Progress()
    slow.start -= 10  # as if the search had run 10 s
    slow("timing 3/9 fitting candidates")
    slow.done()
    off = Progress(enabled=False)  # --json -: never
    off.start -= 10
    off("x")
    err = capsys.readouterr().err
    assert err.count("timing 3/9 fitting candidates (10 s)") == 1 and "sizing" not in err and "x (" not in err
    assert err.endswith("\r\033[K")  # erased at the end

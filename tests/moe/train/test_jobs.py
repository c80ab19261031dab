"""Whole jobs through moe.train: a config file reproduces the flags, real token formats train, a stopped run
resumes bitwise, pre-flight stops what cannot fit, TensorBoard and other optimizers."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.distributed import run_ranks
from tests.moe.train.test_trainer import COMMON, _bad_flags, _in_turn, _train, losses, train, train_each

pytestmark = pytest.mark.slow  # every test here launches ranks or processes

ROOT = Path(__file__).resolve().parents[3]
ONE = [*COMMON, "--layers", "2", "--pp", "1", "--ep", "1", "--num-chunks", "2", "--val-every", "0"]
LEARN = ["--lr", "1e-2", "--warmup", "1", "--steps", "10"]  # a tiny model learning a small vocabulary quickly


def _print_then_train(rank: int, world: int, argv: list[str], path: str) -> None:
    import torch.distributed as dist

    from moe.train import config_from_args, dump_toml

    if rank == 0:
        Path(path).write_text(dump_toml(config_from_args(argv, world)[0]))
    dist.barrier()  # the file is whole before any rank reads it


def test_print_config_then_config_reproduces_the_flags_loss_for_loss(tmp_path: Path) -> None:
    flags = ["--pp", "2", "--ep", "1", "--steps", "3", "--lr-schedule", "wsd", "--vocab-size", "300", "--zero", "1"]
    job = tmp_path / "job.toml"
    # The file alone (COMMON's flags are in it too); only where the metrics go differs. In turn on one set of ranks.
    by_flags, _, from_file = run_ranks(
        _in_turn,
        2,
        args=(
            [
                (_train, ([*COMMON, "--metrics-file", str(tmp_path / "flags.jsonl"), *flags],)),
                (_print_then_train, ([*COMMON, *flags], str(job))),
                (_train, (["--config", str(job), "--metrics-file", str(tmp_path / "file.jsonl")],)),
            ],
        ),
        timeout=240,
    )[0]
    assert sorted(losses(from_file)) == [1, 2, 3] and losses(from_file) == losses(by_flags)  # bitwise


def _pattern_tokens(vocab: int, n: int, seed: int) -> np.ndarray:
    """A stream a small model learns fast: a few dozen ids (some above 65,535) cycled with noise."""
    rng = np.random.default_rng(seed)
    ids = rng.choice(np.arange(vocab), size=48, replace=False)
    ids[:8] = vocab - 1 - np.arange(8)  # the top of the vocabulary is used
    stream = ids[np.arange(n) % len(ids)]
    noise = rng.random(n) < 0.1
    stream[noise] = rng.integers(0, vocab, noise.sum())
    return stream


def test_a_70000_token_vocabulary_trains_on_a_uint32_npy(tmp_path: Path) -> None:
    path = tmp_path / "tokens.npy"
    np.save(path, _pattern_tokens(70_000, 40_000, seed=0).astype(np.uint32))
    big = [*ONE, *LEARN, "--vocab-size", "70000", "--data", str(path), "--metrics-file", str(tmp_path / "big.jsonl")]
    # then one id too many for the model: one line naming the file and the position, before any step
    bodies = [(_train, (big,)), (_bad_flags, ([*ONE, "--vocab-size", "69999", "--data", str(path)],))]
    records, out = run_ranks(_in_turn, 1, args=(bodies,), timeout=240)[0]  # in turn on one rank
    loss = losses(records)
    assert loss[1] == pytest.approx(np.log(70_000), abs=0.3) and loss[10] < loss[1] - 1.0, loss
    assert out.startswith(f"error: --data: {path}: token id 69999 at position ") and "\n" not in out, out


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An indexed dataset written by ``python -m moe.data prepare`` from JSONL, with a real BPE tokenizer."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tmp = tmp_path_factory.mktemp("prepared")
    text = [f"Document {i}: the pipeline hides all-to-all traffic behind compute, step {i % 7}." for i in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(text, trainer=trainer)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "corpus.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in text))
    cmd = [sys.executable, "-m", "moe.data", "prepare", "--tokenizer", str(tmp / "tokenizer.json")]
    cmd += ["--input", str(tmp / "corpus.jsonl"), "--output", str(tmp / "corpus"), "--workers", "2"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120, env=_env())
    assert done.returncode == 0, done.stderr
    return tmp / "corpus"


def test_an_indexed_dataset_from_prepare_trains(prepared: Path, tmp_path: Path) -> None:
    loss = losses(train(1, tmp_path, "indexed", *ONE, *LEARN, "--vocab-size", "300", "--data", str(prepared)))
    assert loss[10] < loss[1] - 1.0, loss


def test_a_blend_trains(prepared: Path, tmp_path: Path) -> None:
    npy = tmp_path / "other.npy"
    np.save(npy, _pattern_tokens(300, 20_000, seed=1).astype(np.uint16))
    data = ["--data", "0.7", str(prepared), "0.3", str(npy)]
    loss = losses(train(1, tmp_path, "blend", *ONE, *LEARN, "--vocab-size", "300", *data))
    assert loss[10] < loss[1] - 1.0, loss


@pytest.mark.parametrize(
    ("world", "layout"), [(4, ["--pp", "2", "--dp", "2", "--ep", "1"]), (2, ["--pp", "1", "--dp", "2", "--ep", "2"])]
)
def test_a_run_stopped_at_a_checkpoint_resumes_bitwise(tmp_path: Path, world: int, layout: list[str]) -> None:
    """Ended by ``--steps 3`` after its checkpoint, resumed with ``--steps 6``: every step equals the
    uninterrupted 6-step run. WSD keeps the learning rates equal: its stable phase does not depend on the run's
    length (0.1 of 3 steps rounds to no decay; of 6, only step 6 decays, in both 6-step runs)."""
    job = [*layout, "--lr-schedule", "wsd", "--lr-schedule.decay-fraction", "0.1", "--num-chunks", "4"]
    ckpt = ["--ckpt-dir", str(tmp_path / "ckpt"), "--ckpt-every", "3"]
    trace = ["--trace-dir", str(tmp_path / "trace")]
    runs = {"full": [*job, "--steps", "6", *trace], "first": [*job, "--steps", "3", *ckpt]}
    runs["resumed"] = [*job, "--steps", "6", *ckpt, "--resume"]
    got = train_each(world, tmp_path, runs)  # in turn on one set of ranks
    full = got["full"]
    for rank in range(world):  # --trace-dir: a torch profiler trace of the second step per rank
        trace = json.loads((tmp_path / "trace" / f"trace_rank{rank}.json").read_text())
        assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert got["first"] == {s: full[s] for s in (1, 2, 3)}
    assert got["resumed"] == {s: full[s] for s in (4, 5, 6)}  # bitwise: same data position, same math


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _plain(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python examples/train.py ARGS`` as a user types it: no torchrun, no rank variables."""
    cmd = [sys.executable, str(ROOT / "examples/train.py"), *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def test_plain_python_runs_one_process(tmp_path: Path) -> None:
    done = _plain("--steps", "2", "--val-every", "0", "--metrics-file", str(tmp_path / "m.jsonl"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pp=1 dp=1 ep=1" in done.stdout and "step     2/2" in done.stdout
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 2


def test_ctrl_c_stops_a_plain_python_run_after_a_step(tmp_path: Path) -> None:
    """A Ctrl-C (SIGINT) after step 2's line: the run stops after a step, with one line saying so and every step's
    record written, and exits with 130, as a shell reports a process ended by SIGINT."""
    from tests.examples.test_launch import signal_when

    metrics = tmp_path / "m.jsonl"
    argv = [sys.executable, str(ROOT / "examples/train.py"), "--steps", "50", "--val-every", "0", "--log-every", "1"]
    argv += ["--metrics-file", str(metrics)]
    status, out, _ = signal_when(argv, lambda lines: lines[-1].startswith("step     2/50"), signal.SIGINT, _env())
    assert status == 130, out[-3000:]
    assert "Traceback" not in out
    stops = re.findall(r"^stopping at step (\d+) on SIGINT: no checkpoint \(checkpoint.dir unset\)$", out, re.M)
    assert len(stops) == 1 and 2 <= int(stops[0]) < 50, out[-3000:]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, int(stops[0]) + 1))


def test_what_cannot_fit_or_cannot_run_stops_in_seconds_with_one_line() -> None:
    t0 = time.monotonic()
    done = _plain("--seq-len", "1000000")
    assert done.returncode == 1 and time.monotonic() - t0 < 30
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: this run needs about "), done.stderr
    assert "GiB per rank" in lines[0] and "--recompute" in lines[0] and "--force" in lines[0]
    done = _plain("--lr", "-1")
    assert done.returncode == 1 and done.stderr == "error: optimizer.lr = -1.0: must be a positive number\n"


def _train_printing(rank: int, world: int, runs: list[list[str]]) -> list[tuple[list[dict], str]]:
    """Several runs in turn; per run, rank 0's metrics records and what this rank printed."""
    out = []
    for argv in runs:
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            records = _train(rank, world, argv)
        out.append((records, printed.getvalue()))
    return out


def test_tensorboard_events_and_mfu_and_a_resume_drops_the_records_past_its_checkpoint(tmp_path: Path) -> None:
    """3 steps with a checkpoint at step 2, then resumed to 4 steps, into the same metrics file and TensorBoard
    directory: each holds steps 1 to 4 once, step 3 the resumed run's (its learning rate follows 4 steps, not 3).
    Each checkpoint gets its line: step, directory, size and seconds."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb, ckpt, metrics = tmp_path / "tb", tmp_path / "ckpt", tmp_path / "m.jsonl"
    sinks = ["--metrics-file", str(metrics), "--tensorboard-dir", str(tb), "--ckpt-dir", str(ckpt)]
    job = [*ONE, *sinks, "--ckpt-every", "2"]
    runs = [[*job, "--steps", "3"], [*job, "--steps", "4", "--resume"]]
    (first, printed), (records, _) = run_ranks(_train_printing, 1, args=(runs,), timeout=240)[0]
    line = re.search(r"^checkpoint step 2 -> (\S+) \((\d+\.\d) (KiB|MiB), (\d+\.\d\d) s\)$", printed, re.M)
    assert line and line[1] == str(ckpt / "step_00000002"), printed
    size = sum(f.stat().st_size for f in (ckpt / "step_00000002").rglob("*") if f.is_file())
    assert float(line[2]) == pytest.approx(size / 2 ** {"KiB": 10, "MiB": 20}[line[3]], abs=0.05)
    assert [r["step"] for r in first] == [1, 2, 3]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[:2] == first[:2] and records[2]["lr"] != first[2]["lr"]  # step 3: the resumed run's
    assert all(0 < r["mfu"] < 1 for r in records)
    assert set(records[-1]["expert_imbalance_per_layer"]) == {"0", "1"}  # JSON keys: every MoE layer
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "mfu", "expert_imbalance"} <= tags
    assert {"expert_imbalance/layer_0", "expert_imbalance/layer_1"} <= tags
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3, 4]
    assert [e.value for e in events.Scalars("lr")] == pytest.approx([r["lr"] for r in records], rel=1e-6)
    assert events.Scalars("loss")[0].value == pytest.approx(records[0]["loss"], rel=1e-6)


def test_sgd_is_one_registry_entry_and_trains(tmp_path: Path) -> None:
    loss = losses(train(1, tmp_path, "sgd", *ONE, "--optimizer", "sgd", "--lr", "0.3", "--steps", "8"))
    assert loss[8] < loss[1] - 0.5, loss

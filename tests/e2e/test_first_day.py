"""A user's first day, as README.md's "Your own checkpoint, start to finish" gives it, end to end.

The section's shell commands run as written, in order, from a scratch directory that mirrors the repository
root (tests/test_docs_commands.py's rules: ``.venv/bin/python`` is this interpreter): a transformers-built
tiny Qwen3-MoE and a trained BPE tokenizer, ``moe.data prepare``, training at pp=2 x ep=2 from a TOML job
(stopped by a SIGTERM to torchrun once it has passed step :data:`STOP_AFTER`, as a scheduler stops a job, then
resumed), ``moe.eval`` on the run's checkpoint directory, and the export by ``moe.convert``. Then the section's
Python block runs (transformers loads the export and generates), and the export's loss in transformers, on
``moe.eval``'s windows, equals ``moe.eval``'s.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bench import process_tree
from tests.test_docs_commands import ROOT, _fenced, _mirror, _shell_line, block_commands

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")

pytestmark = pytest.mark.slow

README = ROOT / "README.md"
SECTION = "**Your own checkpoint, start to finish**"
RUN = "runs/first-day"
STOP_AFTER = 10
"""The step whose progress line sends the SIGTERM (the job checkpoints every 4 steps, so the stop's own
checkpoint is the one the resume starts from)."""


def section() -> tuple[list[str], str]:
    """The section's shell commands (continued lines joined) and its Python block."""
    lines = README.read_text(encoding="utf-8").split("\n")
    first = next(i for i, line in enumerate(lines) if line.startswith(SECTION)) + 1
    blocks = [(start, lang, body) for start, lang, body in _fenced(README) if start > first]
    start, lang, body = blocks[0]
    assert lang == "bash", f"the section's first block is {lang}, not bash"
    commands = [f.command for f in block_commands(README) if start <= int(f.where.split(":")[1]) < start + len(body)]
    python = next(body for _, lang, body in blocks[:2] if lang == "python")
    return commands, "\n".join(python)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _run(command: str, cwd: Path, timeout: float = 120) -> str:
    done = process_tree.run(["bash", "-c", _shell_line(command)], cwd=cwd, env=_env(), timeout=timeout)
    log = done.stdout + done.stderr
    assert done.returncode == 0, f"{command} exited {done.returncode}\n{log[-4000:]}"
    return log


def _train_until_stopped(command: str, cwd: Path, timeout: float = 120) -> tuple[int, str]:
    """Start the training; once a progress line shows a step >= STOP_AFTER, SIGTERM torchrun (not its workers:
    torchrun passes the signal on, as under a scheduler). Returns (exit status, output)."""
    proc = subprocess.Popen(
        ["bash", "-c", "exec " + _shell_line(command)],  # exec: the pid is torchrun's
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.append(line)
            m = re.match(r"step\s+(\d+)/", line)
            if m and int(m.group(1)) >= STOP_AFTER:
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=timeout)
        out.append(rest)
    finally:
        if proc.poll() is None:
            process_tree.kill_tree(proc.pid)
            proc.wait()
    return proc.returncode, "".join(out)


def _hf_loss(export: Path, tokens: Path, seq_len: int, batch_size: int, batches: int) -> float:
    """transformers' mean next-token loss of the export on moe.eval's windows (fp32)."""
    import transformers

    from moe.data import open_data
    from moe.eval import windows

    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    tokens_N = open_data([str(tokens)], val_fraction=0.0).sources[0].tokens_N
    total = 0.0
    with torch.no_grad():
        for b in range(batches):
            ids, labels = windows(tokens_N, seq_len, batch_size, b)
            logits = model(ids).logits
            total += F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten()).item()
    return total / batches


def test_the_readme_first_day_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    commands, python = section()
    assert [c.split(" ")[1] if c.startswith(".venv/bin/python") else "torchrun" for c in commands] == [
        "examples/tiny_hf_model.py",
        "-m",
        "torchrun",
        "torchrun",
        "-m",
        "-m",
    ], commands
    cwd = _mirror(tmp_path)
    with contextlib.suppress(FileNotFoundError):
        (cwd / "runs").unlink()  # a checkout's own runs/ stays out of it
    make, prepare, train, resume, evaluate, convert = commands
    assert resume == train + " --resume"
    run = cwd / RUN

    _run(make, cwd)
    _run(prepare, cwd)
    status, log = _train_until_stopped(train, cwd)
    stopped = [line for line in log.splitlines() if line.startswith("stopping at step")]
    assert len(stopped) == 1, log[-4000:]  # one line, rank 0's
    step = int(re.match(r"stopping at step (\d+)", stopped[0]).group(1))
    assert step >= STOP_AFTER and "SIGTERM" in stopped[0], stopped
    assert status != 0, log[-4000:]  # a stopped run is not a finished one
    assert (run / "ckpt" / "latest").read_text() == f"step_{step:08d}", log[-4000:]
    saved = [line for line in log.splitlines() if line.startswith("checkpoint step")]
    assert len(saved) == step // 4 + (step % 4 > 0), saved  # one line per checkpoint, the stop's included

    log = _run(resume, cwd)
    assert f"resumed from {RUN}/ckpt/step_{step:08d}" in log, log[-4000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 25))  # the stopped run's steps past its checkpoint: none
    assert any((run / "tensorboard").iterdir())

    log = _run(evaluate, cwd)
    m = re.search(r"^loss (\d+\.\d+) over (\d+) tokens", log, re.MULTILINE)
    assert m, log[-4000:]
    eval_loss = float(m.group(1))
    flags = dict(re.findall(r"--([\w-]+) (\S+)", evaluate))
    _run(convert, cwd)

    export, base = run / "hf", run / "base"
    assert json.loads((export / "config.json").read_text()) == json.loads((base / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (export / name).read_bytes() == (base / name).read_bytes(), name
    seq_len, batch_size, batches = int(flags["seq-len"]), int(flags["global-batch-size"]), int(flags["batches"])
    want = _hf_loss(export, cwd / flags["data"], seq_len, batch_size, batches)
    assert abs(eval_loss - want) <= 1e-5 * want + 1e-6, (eval_loss, want)  # eval prints 6 decimals
    assert eval_loss < float(np.log(json.loads((base / "config.json").read_text())["vocab_size"]))  # it trained

    monkeypatch.chdir(cwd)
    printed = io.StringIO()
    names: dict = {"__name__": "__first_day__"}
    with contextlib.redirect_stdout(printed):
        exec(compile(python, f"{README}:python", "exec"), names)
    assert printed.getvalue().startswith("The pipeline"), printed.getvalue()
    assert names["out"].shape[1] == names["ids"].shape[1] + 16  # 16 new tokens (a tiny model may pick blanks)

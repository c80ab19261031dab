"""Every command in README.md and docs/*.md is run here or excluded with its reason; every relative link resolves.

What counts as a command (the pages follow this rule):

1. each line of a fenced code block tagged ``bash``, ``sh``, ``shell`` or ``console`` (in ``console`` blocks only
   the lines that start with ``$ ``; the rest is output), with backslash-continued lines joined and a trailing
   ``# comment`` dropped;
2. an inline code span that starts with a launcher (``.venv/bin/``, ``python``, ``torchrun``, ``bash``, ``pip``,
   ``sbatch``, ``git``, ``PYTHONPATH=``) and has arguments. A bare ``python -m package.module`` or
   ``python examples/x.py`` (no ``.venv/bin/``, no arguments) names an entry point instead: it must exist
   (tests/test_entry_points.py runs every entry point's ``--help``);
3. a line outside fenced blocks that starts with a launcher (an indented code block) is refused: commands go
   in a fenced ``bash`` block, output in a ``text`` block.

A command is compared with whitespace collapsed to single spaces. Each one is either in ``RUN`` (run here, in a
fresh shell, with a timeout, concurrently, each from a scratch directory that mirrors the repository root by
symbolic links, so relative paths resolve and the files a command writes stay out of the tree) or in
``EXCLUDED``, with the reason it is not run here and, where one exists, the test that runs the same job. A
page that gains a command in neither fails, and so does an entry no page has any more. In every command,
``python -m MOD`` must name an entry point and every path into the repository must exist. ``.venv/bin/python``
and ``.venv/bin/torchrun`` run as this interpreter (``python -m torch.distributed.run``), so the test does not
depend on where the suite's interpreter lives.

bench/results/README.md (the history of results) is not scanned for commands, but its links are checked.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.selected import selected_params
from tests.test_entry_points import PACKAGES, discover_entry_points

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
LINKED_PAGES = (*PAGES, ROOT / "bench/results/README.md")
README_MAX_LINES = 250
WORKERS = 3  # CI has 2 cores; the runs partly wait on disk while importing torch
SHELLS = ("bash", "sh", "shell", "console")
LAUNCHERS = (".venv/bin/", "python ", "python3 ", "torchrun ", "bash ", "pip ", "sbatch ", "git ", "PYTHONPATH=")
REPO_DIRS = ("bench", "docs", "dualpipe", "examples", "kernels", "moe", "scripts", "tests")

PAIRS_V = (
    '.venv/bin/python -c "from dualpipe.generators_v import pairs_per_step as n; '
    "print([[n(s, p) for p in (4, 8, 16)] for s in ('zbv', 'v-half', 'v-min')])\""
)
PLAN_JOB = (
    ".venv/bin/python -m moe.plan --model qwen3-moe-tiny --gpu h100 --gpus 16 --seq-len 512 --top 3 --emit-config"
    " job.toml && .venv/bin/python examples/train.py --config job.toml --print-config"
)
PLAN_CPU = (
    ".venv/bin/python -m moe.plan --costs bench/results/costs-cpu-2core-emulated-2node-400mbit-2026-11-26.json"
    " --gpus 2 --gpus-per-node 1 --seq-len 64 --global-batch-size 192 --micro-batch-size 4 --recompute off"
    " --json plan.json --png plan.png"
)
PLAN_V3 = (
    ".venv/bin/python -m moe.plan --model deepseek-v3 --gpu h800 --gpus 2048 --gpus-per-node 8 --seq-len 4096"
    " --global-batch-size 15360 --micro-batch-size 1 --state-dtype bfloat16 --fp8 --fp8-activations --deepseek-v3"
    " --top 5 --explain --json plan.json --png plan.png"
)
COMPARE_V3_INTERLEAVED = (
    ".venv/bin/python -m moe.plan --model deepseek-v3 --gpu h800 --gpus 2048 --gpus-per-node 8 --seq-len 4096"
    " --global-batch-size 16384 --micro-batch-size 1 --state-dtype bfloat16 --fp8 --fp8-activations"
    " --compare-schedules --pp 16 --ep 64 --recompute full --comm-sms 20"
)
COMPARE_QWEN3 = (
    ".venv/bin/python -m moe.plan --model qwen3-235b-a22b --gpu h100 --gpus 256 --gpus-per-node 8 --seq-len 4096"
    " --global-batch-size 1024 --micro-batch-size 1 --state-dtype bfloat16 --fp8 --recompute full"
    " --compare-schedules --pp 8 --ep 32"
)
MAIN_JOB = ".venv/bin/torchrun --standalone --nproc-per-node 4 examples/train.py --config examples/configs/tiny.toml"
FIRST_DAY = "tests/e2e/test_first_day.py::test_the_readme_first_day_runs_as_written"
FIRST_DAY_COMMANDS = (
    ".venv/bin/python examples/tiny_hf_model.py runs/first-day/base --corpus docs",
    ".venv/bin/python -m moe.data prepare --tokenizer runs/first-day/base/tokenizer.json --input docs"
    " --output runs/first-day/tokens",
    ".venv/bin/torchrun --standalone --nproc-per-node 4 examples/train.py --config examples/configs/first-day.toml",
    ".venv/bin/torchrun --standalone --nproc-per-node 4 examples/train.py --config examples/configs/first-day.toml"
    " --resume",
    ".venv/bin/python -m moe.eval --model runs/first-day/ckpt --data runs/first-day/tokens --seq-len 32"
    " --global-batch-size 8 --batches 4",
    ".venv/bin/python -m moe.convert runs/first-day/ckpt runs/first-day/hf",
)
ROOT_CLUSTER = "needs root (builds the emulated cluster) and minutes"
GPU = "needs a CUDA GPU"
PLACEHOLDER = "a placeholder path the user fills in"
INSTALLS = "installs packages from the network"


@dataclass(frozen=True)
class Run:
    """A command run here: it must exit 0, print ``output``, and leave ``file`` holding ``file_text``."""

    output: str = ""
    file: str = ""
    file_text: str = ""
    timeout_s: float = 120.0


RUN: dict[str, Run] = {
    ".venv/bin/python examples/train.py --config examples/configs/tiny.toml --lr 1e-3 --print-config > job.toml": Run(
        file="job.toml", file_text="lr = 0.001"
    ),
    PLAN_CPU: Run(output="best fitting plan: zb1p pp=2 dp=1 ep=1", file="plan.json", file_text='"num_candidates"'),
    PLAN_JOB: Run(output="zero = 1", file="job.toml", file_text="[parallel]"),
    ".venv/bin/python -m dualpipe.simulate --schedule dualpipev --ranks 4 --chunks 10 --F 1 --B 2 --W 1 --FB 2.5": Run(
        output="makespan 59, bubble fraction 0.0699"
    ),
    PAIRS_V: Run(output="[[9, 33, 107], [7, 20, 50], [5, 0, 24]]"),
    ".venv/bin/python -m dualpipe.simulate --compare --ranks 4 --F 1 --B 2 --W 1 --a2a 0.5 --extra-warmup 1"
    " --json compare.json --png compare.png": Run(
        output="4 ranks, 8 micro-batches; per full stage F=1 B=2 W=1 F&B=3 a2a=0.5",
        file="compare.json",
        file_text='"exposed_a2a_fraction"',
    ),
    COMPARE_V3_INTERLEAVED: Run(output="interleaved-1f1b+w1"),
    COMPARE_QWEN3: Run(output="every schedule at pp=8 dp=32 ep=32 chunks=32 comm_sms=20 recompute=full"),
    "bash bench/gpu_session.sh --dry-run": Run(output="dry run of the one-GPU check"),
    "bash bench/cluster_session.sh --dry-run": Run(output="the steps, none of them run"),
}

# command -> (why it is not run here, the test that runs the same job or "" where none can)
EXCLUDED: dict[str, tuple[str, str]] = {
    ".venv/bin/python -m bench.plan_speed --out bench/results": (
        "every preset at 64 and 2,048 GPUs, minutes",
        "tests/moe/plan/test_plan_speed.py::test_the_slowest_preset_answers_in_seconds",
    ),
    "bash scripts/run.sh": (
        "sets up .venv, then trains for about 30 s",
        "tests/examples/test_launch.py::test_the_readme_main_command",
    ),
    "bash scripts/test.sh": ("the whole suite", ""),
    '.venv/bin/python -m pytest -m "not slow"': ("the quick tier of the suite this test belongs to", ""),
    MAIN_JOB: ("the main job, about 30 s", "tests/examples/test_launch.py::test_the_readme_main_command"),
    ".venv/bin/python examples/train.py": (
        "80 steps in one process, about a minute",
        "tests/moe/train/test_jobs.py::test_plain_python_runs_one_process",
    ),
    ".venv/bin/torchrun --standalone --nproc-per-node 4 examples/overlap_moe.py --pp 2 --ep 2": (
        "4 ranks, tens of seconds",
        "tests/examples/test_overlap_moe.py::test_user_moe_equals_the_single_process_model",
    ),
    "torchrun --standalone --nproc-per-node 2 examples/overlap_moe.py --timeline": (
        "the recording behind a figure",
        "tests/examples/test_overlap_pair.py",
    ),
    ".venv/bin/torchrun --standalone --nproc-per-node 4 examples/toy_dualpipev.py": (
        "4 ranks, tens of seconds",
        "tests/examples/test_launch.py::test_the_minimal_dualpipev_example_learns",
    ),
    ".venv/bin/python -m moe.plan --published": (
        "every published run rerun, tens of seconds",
        "tests/moe/plan/test_published.py::test_the_cli_prints_the_table_and_writes_the_json",
    ),
    PLAN_V3: (
        "one to three minutes of CPU",
        "tests/moe/plan/test_cli.py::test_deepseek_v3_side_by_side_in_the_json",
    ),
    ".venv/bin/torchrun --standalone --nproc-per-node 8 examples/train.py --pp 2 --dp 4 --ep 2 --zero 1"
    " --schedule dualpipev --layers 4 --steps 200 --clip-grad 1.0 --metrics-file metrics.jsonl --ckpt-dir ckpt"
    " --ckpt-every 50 --resume": (
        "8 ranks for 200 steps, minutes",
        "tests/moe/train/test_trainer.py::test_zero1_keeps_the_losses_and_shards_the_optimizer_state",
    ),
    "sbatch --nodes 256 examples/launch/slurm.sbatch --preset v3 --pp 16 --dp 128 --ep 64 --zero 1 --dtype bfloat16"
    " --schedule dualpipe --dispatcher deepep --comm-sms 20 --seq-len 4096 --micro-batch-size 1 --num-chunks 32"
    " --clip-grad 1.0 --steps 100000 --ckpt-dir /shared/ckpt/v3 --ckpt-every 500 --resume": (
        "needs a Slurm cluster of 256 GPU nodes",
        "tests/examples/test_launch.py::test_the_readme_deepseek_v3_command_passes_every_launch_check",
    ),
    # the README's first day: one journey, each command depending on the one before
    **{
        command: ("a step of the README's first day, run in order with the others", FIRST_DAY)
        for command in FIRST_DAY_COMMANDS
    },
    # data
    "pip install 'dualpipe-moe[data]'": (INSTALLS, ""),
    "pip install 'dualpipe-moe[tensorboard]'": (INSTALLS, ""),
    "pip install 'dualpipe-moe[hf]'": (INSTALLS, ""),
    "pip install -e .": (INSTALLS, ""),
    "python -m moe.data prepare": ("names the subcommand the block below runs", ""),
    ".venv/bin/python -m moe.data prepare --tokenizer tokenizer.json --input corpus.jsonl"
    " --output /data/web_text_document --workers 8": (
        PLACEHOLDER,
        "tests/moe/data/test_prepare.py",
    ),
    ".venv/bin/python -m moe.data inspect /data/web_text_document": (
        PLACEHOLDER,
        "tests/moe/data/test_prepare.py::test_inspect_and_cli_usage",
    ),
    ".venv/bin/torchrun --standalone --nproc-per-node 1 examples/train.py --config examples/configs/small.toml"
    " --data /data/web_text_document": (
        PLACEHOLDER,
        "tests/moe/train/test_jobs.py::test_an_indexed_dataset_from_prepare_trains",
    ),
    # Hugging Face checkpoints
    ".venv/bin/torchrun --standalone --nproc-per-node 4 examples/train.py --model /ckpt/Qwen3-30B-A3B --pp 2 --ep 2"
    " --data /data/web_text_document --dtype bfloat16": (
        PLACEHOLDER,
        "tests/moe/hf/test_hf_jobs.py::test_training_from_a_checkpoint_pipelined_equals_one_process",
    ),
    ".venv/bin/python -m moe.eval --model /ckpt/Qwen3-30B-A3B --data tokens.npy --seq-len 4096 --global-batch-size 8"
    " --batches 16 --json -": (
        PLACEHOLDER,
        "tests/moe/hf/test_hf_jobs.py::test_eval_equals_transformers_in_one_process_and_pipelined",
    ),
    ".venv/bin/python -m moe.convert runs/ckpt runs/hf --dtype bfloat16": (
        "converts a checkpoint a training run must write first",
        "tests/moe/hf/test_convert.py::test_save_hf_at_the_end_of_training_and_a_converted_checkpoint_resumes",
    ),
    ".venv/bin/python -m moe.convert /ckpt/DeepSeek-V3 runs/v3": (
        PLACEHOLDER,
        "tests/moe/hf/test_convert.py::test_hf_to_ours_and_back_is_the_same_tensors",
    ),
    "python -m moe.convert SRC DST": (PLACEHOLDER, "tests/moe/hf/test_convert.py"),
    # the emulated cluster and the overlap benchmark
    "python -m bench.cluster --nodes 2 4 --rate 400mbit --selftest": (ROOT_CLUSTER, "tests/bench/test_cluster.py"),
    "python -m bench.cluster --cleanup": ("needs root", "tests/bench/test_cluster.py"),
    "python -m bench.overlap.report <out>/events": (PLACEHOLDER, "tests/bench/test_overlap_exposure.py"),
    "python -m bench.overlap --calibrate": (ROOT_CLUSTER, "tests/bench/test_overlap_calibrate.py"),
    ".venv/bin/python -m bench.overlap --cluster --nodes 2 --rate 500mbit --steps 6 --keep-events": (
        ROOT_CLUSTER,
        "tests/bench/test_overlap.py::test_short_run_on_the_emulated_cluster",
    ),
    ".venv/bin/python -m bench.overlap --cluster --nodes 2 --pp 1 --ep 2 --hidden 128 --moe-intermediate 128"
    " --rate 400mbit --chunks 24 --modes dualpipev-overlap dualpipev torch-dualpipev torch-dualpipev-overlap"
    " --steps 8 --keep-events": (ROOT_CLUSTER, "tests/bench/test_overlap.py::test_short_run_on_the_emulated_cluster"),
    ".venv/bin/python -m bench.overlap --cluster --nodes 2 --rate 500mbit --modes dualpipev-overlap dualpipev"
    " interleaved-1f1b-overlap interleaved-1f1b 1f1b-overlap 1f1b --extra-warmup 1 --steps 4": (
        ROOT_CLUSTER,
        "tests/bench/test_overlap_traffic.py::test_fp8_dispatch_adds_a_twin_of_each_of_our_modes",
    ),
    ".venv/bin/python -m bench.overlap --cluster --nodes 2 --rate 500mbit --dtype bfloat16 --modes"
    " dualpipev-overlap dualpipev --fp8-dispatch --steps 5": (
        ROOT_CLUSTER,
        "tests/bench/test_overlap_traffic.py",
    ),
    ".venv/bin/python -m bench.overlap.calibrate": (ROOT_CLUSTER, "tests/bench/test_overlap_calibrate.py"),
    ".venv/bin/python -m bench.overlap.calibrate --pp 2 --ep 2": (
        ROOT_CLUSTER,
        "tests/bench/test_overlap_calibrate.py",
    ),
    # GPUs
    "bash bench/gpu_session.sh": (GPU, "tests/bench/test_gpu_session.py"),
    "bash bench/cluster_session.sh": ("needs 2 or more GPUs", "tests/bench/test_gpu_session.py"),
    "PYTHONPATH=. python -m pytest -m gpu -q": (GPU, ""),
    "PYTHONPATH=. python -m pytest -m multigpu -q": ("needs 2 or 4 GPUs", ""),
    "pip install nvidia-nvshmem-cu12": (INSTALLS, ""),
    "git clone https://github.com/deepseek-ai/DeepEP && cd DeepEP": ("fetches DeepEP from the network", ""),
    "git checkout 567632dd59810d77b3cc05553df953cc0f779799": ("inside a DeepEP clone", ""),
    "TORCH_CUDA_ARCH_LIST=9.0 python setup.py install": ("builds DeepEP with CUDA", ""),
    'PYTHONPATH=. python -c "from moe.dispatch.deepep import deep_ep_api, import_deep_ep;'
    ' print(deep_ep_api(import_deep_ep()).describe())"': (
        "needs DeepEP built",
        "tests/moe/dispatch/test_deepep_version.py",
    ),
    'pip install "nvidia-nccl-cu13>=2.30.4" --no-deps': (INSTALLS, ""),
    "pip install --target build/pydeps pytest": (INSTALLS, ""),
    "python -m bench.kernels --shapes v3": (GPU, "tests/kernels/test_bench_kernels_interpreter.py"),
    "python -m bench.kernels --shapes v3 --costs-out FILE": (
        GPU,
        "tests/bench/test_kernels_costs.py::test_kernel_bench_writes_a_costs_file_the_planner_uses",
    ),
    "python -m bench.gpu_overlap_trace --emulated-gbps 50": (GPU, "tests/bench/test_gpu_overlap_trace.py"),
    ".venv/bin/ruff check .": ("lints the whole tree; scripts/test.sh runs it before the suite", ""),
    ".venv/bin/ruff format --check .": ("checks the whole tree's formatting", ""),
    "bash scripts/compat.sh VERSION": ("installs another torch and runs the suite, tens of minutes", ""),
}


# ---------------------------------------------------------------------------------------------------------
# Reading the pages

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")


@dataclass(frozen=True)
class Found:
    command: str
    where: str  # page:line


def _normal(command: str) -> str:
    return " ".join(command.split())


def _drop_comment(line: str) -> str:
    """``cmd  # note`` -> ``cmd``; a ``#`` inside quotes, or not after whitespace, stays."""
    for m in re.finditer(r"\s#", line):
        head = line[: m.start()]
        try:
            shlex.split(head)
        except ValueError:  # inside an open quote
            continue
        return head
    return line


def _is_launcher(text: str) -> bool:
    """A launcher with arguments: ``bash scripts/run.sh``, not ``PYTHONPATH=.`` or ``torchrun_c10d.sh``."""
    return text.startswith(LAUNCHERS) and " " in text


def _fenced(path: Path) -> Iterator[tuple[int, str, list[str]]]:
    """(first line number, language, body lines) of every fenced block."""
    lines = path.read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        body, j = [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j][len(indent) :] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        yield i + 2, lang.lower(), body
        i = j + 1


def _prose(path: Path) -> str:
    """The page with every fenced block blanked (line numbers kept)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    for start, _, body in _fenced(path):
        for k in range(start - 2, start + len(body)):
            if k < len(lines):
                lines[k] = ""
    return "\n".join(lines)


def block_commands(path: Path) -> Iterator[Found]:
    rel = path.relative_to(ROOT).as_posix()
    for start, lang, body in _fenced(path):
        if lang not in SHELLS:
            continue
        pending, first = "", 0
        for k, line in enumerate(body):
            if lang == "console":
                if not line.startswith("$ ") and not pending:
                    continue
                line = line.removeprefix("$ ")
            text = _drop_comment(line).rstrip()
            if not text and not pending:
                continue
            if not pending:
                first = start + k
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            yield Found(_normal(pending + text), f"{rel}:{first}")
            pending = ""


def inline_spans(path: Path) -> Iterator[Found]:
    rel = path.relative_to(ROOT).as_posix()
    prose = _prose(path)
    for m in _INLINE.finditer(prose):
        text = _normal(m.group(1))
        if _is_launcher(text):
            yield Found(text, f"{rel}:{prose.count(chr(10), 0, m.start()) + 1}")


def _is_name(text: str) -> bool:
    """``python -m pkg.mod`` or ``python examples/x.py`` with no arguments: an entry point's name (written with
    ``.venv/bin/python`` it is a command)."""
    return bool(re.fullmatch(r"python (-m [\w.]+|[\w/]+\.py)", text))


def page_commands() -> dict[str, list[str]]:
    """Every command on the pages -> where it appears."""
    found: dict[str, list[str]] = {}
    for page in PAGES:
        for f in block_commands(page):
            found.setdefault(f.command, []).append(f.where)
        for f in inline_spans(page):
            if not _is_name(f.command):
                found.setdefault(f.command, []).append(f.where)
    return found


def entry_point_names() -> dict[str, list[str]]:
    """Every ``python -m MOD`` / ``python FILE.py`` in a command or named inline -> where."""
    names: dict[str, list[str]] = {}
    for page in PAGES:
        for f in (*block_commands(page), *inline_spans(page)):
            for m in re.finditer(r"(?:^|\s|/)python(?:3)? (-m [\w.]+|[\w/]+\.py)", f.command):
                names.setdefault(m.group(1), []).append(f.where)
            for m in re.finditer(r"(?:^|\s|/)torchrun (?:--[\w-]+ \S+ |--standalone )*([\w/]+\.py)", f.command):
                names.setdefault(m.group(1), []).append(f.where)
    return names


COMMANDS = page_commands()


# ---------------------------------------------------------------------------------------------------------
# Accounting


def test_every_command_is_run_or_excluded():
    missing = {c: w for c, w in COMMANDS.items() if c not in RUN and c not in EXCLUDED}
    assert not missing, "commands neither in RUN nor in EXCLUDED (add them, with a reason to exclude):\n" + "\n".join(
        f"  {w[0]}: {c!r}" for c, w in sorted(missing.items())
    )


def test_no_entry_is_stale():
    both = sorted(set(RUN) & set(EXCLUDED))
    assert not both, f"in RUN and EXCLUDED at once: {both}"
    stale = sorted(c for c in (*RUN, *EXCLUDED) if c not in COMMANDS)
    assert not stale, "entries no page has any more (remove them):\n" + "\n".join(f"  {c!r}" for c in stale)


def test_exclusions_give_a_reason_and_name_real_tests():
    for command, (reason, test) in EXCLUDED.items():
        assert reason.strip(), f"no reason for excluding {command!r}"
        if test:
            path, _, name = test.partition("::")
            assert (ROOT / path).exists(), f"{command!r}: {path} does not exist"
            if name:
                assert f"def {name}(" in (ROOT / path).read_text(), f"{command!r}: {test} does not exist"


def test_commands_are_in_fenced_blocks():
    bare = []
    for page in PAGES:
        for n, line in enumerate(_prose(page).split("\n"), 1):
            if _is_launcher(line.strip()):
                bare.append(f"{page.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bare, "commands outside a fenced bash block:\n" + "\n".join(bare)


def test_entry_points_and_paths_exist():
    entries = discover_entry_points(ROOT)
    wrong = []
    for name, where in sorted(entry_point_names().items()):
        if name.removeprefix("-m ").split("/")[0].split(".")[0] not in (*PACKAGES, "examples"):
            continue  # pytest, setup.py: not ours
        entry = tuple(name.split(" ")) if name.startswith("-m ") else (name,)
        if entry not in entries:
            wrong.append(f"{where[0]}: python {name} is no entry point")
    for command, where in sorted(COMMANDS.items()):
        for token in re.split(r"[\s=]+", command):
            token = token.strip("'\"(),;")
            in_repo = token.split("/")[0] in REPO_DIRS and "/" in token and "<" not in token
            if in_repo and not (ROOT / token).exists():
                wrong.append(f"{where[0]}: {token} does not exist")
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------------------------------------------------
# Running


def _shell_line(command: str) -> str:
    venv_python = f"{shlex.quote(sys.executable)} "
    command = re.sub(r"(^|\s)\.venv/bin/torchrun ", rf"\1{venv_python}-m torch.distributed.run ", command)
    return re.sub(r"(^|\s)\.venv/bin/python ", rf"\1{venv_python}", command)


def _mirror(scratch: Path) -> Path:
    """A directory whose entries link to the repository root's, for a command's relative paths."""
    for entry in ROOT.iterdir():
        if entry.name != ".git":
            (scratch / entry.name).symlink_to(entry)
    return scratch


def _run(command: str, spec: Run, scratch: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    cwd = _mirror(scratch)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    argv = ["bash", "-c", _shell_line(command)]
    try:
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=spec.timeout_s)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        done = subprocess.CompletedProcess(argv, -1, out, f"[timed out after {spec.timeout_s:.0f} s]")
    return done, cwd


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """Starts every RUN command selected in this session (honours -k), a few at a time."""
    selected = selected_params(request, "test_command_runs", "command")
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        futures: dict[str, Future] = {c: pool.submit(_run, c, RUN[c], tmp_path_factory.mktemp("cmd")) for c in selected}
        yield futures


@pytest.mark.parametrize("command", sorted(RUN), ids=lambda c: c[:60])
def test_command_runs(command: str, runs):
    spec = RUN[command]
    done, cwd = runs[command].result()
    log = f"--- stdout\n{done.stdout[-3000:]}\n--- stderr\n{done.stderr[-3000:]}"
    assert done.returncode == 0, f"{command} exited {done.returncode}\n{log}"
    assert spec.output in done.stdout + done.stderr, f"{command} did not print {spec.output!r}\n{log}"
    if spec.file:
        written = cwd / spec.file
        assert written.is_file() and not written.is_symlink(), f"{command} wrote no {spec.file}\n{log}"
        assert spec.file_text in written.read_text(), f"{spec.file} lacks {spec.file_text!r}"


# ---------------------------------------------------------------------------------------------------------
# The pages themselves

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but hyphens dropped, spaces to hyphens."""
    heads = [line.lstrip("#").strip() for line in _prose(path).split("\n") if re.match(r"#{1,6} ", line)]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path):
    broken = []
    for m in _LINK.finditer(_prose(page)):
        target = m.group(1)
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_the_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_MAX_LINES
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in text, f"the README does not link docs/{page.name}"
    assert text.rstrip().split("\n## ")[-1].startswith("Current results"), "the README ends with its results"


def test_every_result_file_is_described():
    results = ROOT / "bench/results"
    described = (results / "README.md").read_text()
    files = [p.name for p in results.iterdir() if p.is_file() and p.name != "README.md"]
    assert files, "bench/results is empty"
    undescribed = sorted(name for name in files if f"({name})" not in described)
    assert not undescribed, f"bench/results/README.md does not link {undescribed}"

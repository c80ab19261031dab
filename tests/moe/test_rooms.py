"""moe/ by role: each room imports only rooms below it, no two modules import each other, few modules at the top.

The rooms, from the top: the commands that read everything (``convert``, ``eval``), ``train/`` (the trainer and
all it keeps), the parallel layout, ``plan/`` (the planner the trainer's pre-flight runs), ``hf/`` (checkpoint
import/export), ``models/`` (what a block is made of), then ``dispatch/`` and ``data/``, and at the bottom the
small shared modules (the optimizers' byte rules, the pipeline layout string, process groups, the command
helpers). Imports are read from the syntax tree (tests/imports.py): those a module runs, at module level or in
a function; ``if TYPE_CHECKING:`` imports are annotations, never executed, and are left out.
"""

from __future__ import annotations

from pathlib import Path

import moe
from tests.imports import runtime_imports

ROOT = Path(moe.__file__).parent

LEVELS = {
    "moe.convert": 7,
    "moe.eval": 7,
    "moe.train": 6,
    "moe.parallel": 5,
    "moe.plan": 4,
    "moe.hf": 3,
    "moe.models": 2,
    "moe.dispatch": 1,
    "moe.data": 1,
    "moe.optim_state": 0,
    "moe.pipeline_layout": 0,
    "moe.groups": 0,
    "moe.command": 0,
}
"""Each room's height: a module imports modules of its own height or lower. ``moe`` itself (the package's front
door, re-exporting the entry points) is above them all."""

TOP_LEVEL = {"__init__", "convert", "eval", "parallel", "optim_state", "pipeline_layout", "groups", "command"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


def _room(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2])


def _graph() -> dict[str, set[str]]:
    return {m: {t for t in runtime_imports(p, m, set(MODULES)) if t in MODULES and t != m} for m, p in MODULES.items()}


GRAPH = _graph()
"""Each module's runtime imports of other moe modules, read once for every test here."""


def test_every_module_sits_in_a_room_with_a_height() -> None:
    rooms = {_room(m) for m in MODULES if m != "moe"}
    assert rooms == set(LEVELS), f"rooms without a height: {sorted(rooms - set(LEVELS))}"


def test_no_module_imports_a_room_above_its_own() -> None:
    up = [
        f"{m} (height {LEVELS[_room(m)]}) imports {t} (height {LEVELS[_room(t)]})"
        for m, targets in GRAPH.items()
        if m != "moe"
        for t in targets
        if t != "moe" and LEVELS[_room(t)] > LEVELS[_room(m)]
    ]
    assert not up, "\n".join(up)
    assert all(t != "moe" for m, targets in GRAPH.items() if m != "moe" for t in targets), "the front door"


def test_the_planner_never_imports_the_trainer() -> None:
    assert not [(m, t) for m, ts in GRAPH.items() if m.startswith("moe.plan") for t in ts if t.startswith("moe.train")]


def test_no_two_modules_import_each_other() -> None:
    loops = sorted({tuple(sorted((a, b))) for a, ts in GRAPH.items() for b in ts if a in GRAPH.get(b, ())})
    assert not loops, loops


def test_a_handful_of_modules_stay_at_the_top() -> None:
    top = {p.stem for p in ROOT.glob("*.py")}
    assert top == TOP_LEVEL, f"new at the top of moe/: {sorted(top - TOP_LEVEL)}; gone: {sorted(TOP_LEVEL - top)}"


def test_the_tests_mirror_the_packages() -> None:
    tests = Path(__file__).parent
    rooms = {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"}
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert rooms <= packages, f"tests/moe/ rooms with no package: {sorted(rooms - packages)}"


def test_the_reader_sees_runtime_imports_only() -> None:
    # mtp names the stage in annotations only (TYPE_CHECKING); the stage runs mtp's code
    assert "moe.models.mtp" in GRAPH["moe.models.stage"] and "moe.models.stage" not in GRAPH["moe.models.mtp"]
    # the config's registry lookup runs inside a function and still counts
    assert "moe.models" in GRAPH["moe.models.config"]

"""scripts/torch_range.py: the torch floor read from pyproject.toml, and the setup rule that an installed
torch inside the range is kept (scripts/setup.sh, scripts/compat.sh)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
_spec = importlib.util.spec_from_file_location("torch_range", ROOT / "scripts" / "torch_range.py")
torch_range = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(torch_range)


def test_the_floor_is_pyprojects():
    floor = torch_range.floor()
    assert f'"torch>={floor}"' in (ROOT / "pyproject.toml").read_text()
    assert re.fullmatch(r"\d+\.\d+\.\d+", floor)
    with pytest.raises(ValueError, match=r'no "torch>=X\.Y\.Z"'):
        torch_range.floor('dependencies = ["numpy>=1.24"]')


@pytest.mark.parametrize(
    ("installed", "kept"),
    [
        ("2.11.0", True),  # the floor itself
        ("2.11.0+cu130", True),  # a cluster's CUDA build
        ("2.13.0+cpu", True),
        ("2.15.0", True),
        ("2.10.1", False),  # below the floor: replaced by the pin
        ("2.11.0rc1", False),  # a pre-release sorts before its release, as pip sorts it
        ("2.11.0.dev20260101", False),
        ("", False),  # none installed
    ],
)
def test_an_installed_torch_is_kept_inside_the_range(installed: str, kept: bool):
    assert torch_range.keep(installed, "2.11.0") is kept


def test_a_version_that_is_not_one_is_refused():
    with pytest.raises(ValueError, match="not a torch version: 'cuda'"):
        torch_range.keep("cuda", "2.11.0")

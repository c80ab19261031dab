"""The torch releases the project supports: from the floor in pyproject.toml's ``torch>=`` on.

Used by scripts/setup.sh (an installed torch inside the range is never replaced) and scripts/compat.sh (a
version below the floor is refused). It imports neither torch nor the project: it runs before either is
installed.

    python scripts/torch_range.py floor           # prints the floor, e.g. 2.11.0
    python scripts/torch_range.py keep VERSION    # exit 0 when torch VERSION (2.13.0+cpu) lies in the range
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
_FLOOR = re.compile(r'^\s*"torch>=([0-9.]+)"', re.MULTILINE)
_VERSION = re.compile(r"(\d+(?:\.\d+)*)(.*)")


def floor(pyproject: str | None = None) -> str:
    """The ``X.Y.Z`` of pyproject.toml's ``"torch>=X.Y.Z"`` dependency."""
    text = PYPROJECT.read_text() if pyproject is None else pyproject
    m = _FLOOR.search(text)
    if m is None:
        raise ValueError('pyproject.toml has no "torch>=X.Y.Z" dependency line')
    return m.group(1)


def _key(version: str) -> tuple[tuple[int, ...], bool]:
    # (release numbers, final?): 2.11.0rc1 and 2.11.0.dev2026 sort just below 2.11.0, as pip sorts them; a
    # local label (+cpu, +cu130) is no pre-release
    m = _VERSION.fullmatch(version.strip())
    if m is None:
        raise ValueError(f"not a torch version: {version!r}")
    release = tuple(int(p) for p in m.group(1).split("."))
    release += (0,) * (3 - len(release))
    return release, m.group(2) == "" or m.group(2).startswith("+")


def keep(installed: str, floor_version: str) -> bool:
    """True when an installed torch ``installed`` (``""``: none) lies in the range from ``floor_version`` on."""
    return bool(installed.strip()) and _key(installed) >= _key(floor_version)


def main(argv: list[str]) -> int:
    if argv == ["floor"]:
        print(floor())
        return 0
    if len(argv) in (1, 2) and argv[0] == "keep":
        return 0 if keep(argv[1] if len(argv) == 2 else "", floor()) else 1
    print("usage: python scripts/torch_range.py floor | keep VERSION", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

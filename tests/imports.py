"""What a source file imports, read from its syntax tree (tests of one import direction between modules)."""

from __future__ import annotations

import ast
from pathlib import Path


def imports(path: Path) -> set[str]:
    """Every module a ``from X import ...`` in ``path`` names, and every ``X.name`` it imports."""
    tree = ast.parse(path.read_text())
    found = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    found |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    return found

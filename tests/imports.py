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


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_imports(path: Path, module: str, modules: set[str] | frozenset[str] = frozenset()) -> set[str]:
    """The modules ``module`` (at ``path``) imports when it runs: at module level or inside a function, relative
    imports resolved, ``if TYPE_CHECKING:`` blocks left out (annotations only, never executed). ``from P import
    name`` yields ``P.name`` where that is one of ``modules`` (a submodule: P's ``__init__`` runs first, as for
    any import under P), else ``P`` (a name P defines)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking_only(child):
                for c in child.orelse:
                    visit(c)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - (child.level - 1)]
                    base = ".".join([*parts, base] if base else parts)
                for a in child.names:
                    found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found

"""The multi-GPU tests skip, naming the import error, where DeepEP is installed but ``import deep_ep`` fails.

A plain (CPU) test: a ``deep_ep`` package whose import raises stands in for a broken build (a library it
links that is not found; V2's NCCL check, which asserts).
"""

from __future__ import annotations

import sys

import pytest

from tests.multigpu.test_dispatchers import _skip_unless_available


@pytest.mark.parametrize(
    ("kind", "body", "first_line"),
    [
        (
            "deepep",
            "raise ImportError('libnvshmem_host.so.3: cannot open shared object file\\nwhile loading deep_ep_cpp')",
            "ImportError: libnvshmem_host.so.3: cannot open shared object file",
        ),
        (
            "deepep-v2",
            "assert False, 'Invalid NCCL versions: libnccl.so.2 (loaded)\\nvs libnccl.so.2 (linked)'",
            "AssertionError: Invalid NCCL versions: libnccl.so.2 (loaded)",
        ),
    ],
    ids=["deepep", "deepep-v2"],
)
def test_a_broken_deep_ep_skips_with_its_import_error(kind: str, body: str, first_line: str, monkeypatch, tmp_path):
    package = tmp_path / "deep_ep"
    package.mkdir()
    (package / "__init__.py").write_text(body + "\n")
    monkeypatch.delitem(sys.modules, "deep_ep", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(pytest.skip.Exception) as info:
        _skip_unless_available(kind)
    reason = str(info.value)
    assert reason == f"dispatcher {kind!r}: 'import deep_ep' fails here: {first_line}", reason

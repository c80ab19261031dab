"""Byte-level text (vocabulary 256): the demo corpus and directories of text files.

The default corpus is the Python standard library's own ``.py`` sources, present wherever Python is, so
nothing is downloaded and every machine with the same Python builds the same corpus. Open it, or a
directory of text, with :func:`moe.data.open_data`.
"""

from __future__ import annotations

import sysconfig
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from moe.data.errors import DataError

__all__ = [
    "BYTE_VOCAB_SIZE",
    "DEFAULT_CORPUS_BYTES",
    "TEXT_SUFFIXES",
    "default_corpus_files",
    "read_text_dir",
    "read_text_files",
    "text_files",
]

BYTE_VOCAB_SIZE = 256
TEXT_SUFFIXES = frozenset({".txt", ".md", ".rst", ".py", ".c", ".h", ".json", ".toml", ".cfg", ".ini", ".html"})
# Enough text that a short CPU run never sees the same window twice, small enough to read in well under 1 s.
DEFAULT_CORPUS_BYTES = 8 * 1024 * 1024


def default_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted (always present, plain English comments and code)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts]
    return sorted(files)


def read_text_files(files: list[Path], limit: int | None) -> np.ndarray:
    """The bytes of ``files`` back to back (uint8 [N]), at most ``limit``; unreadable or binary files skipped."""
    chunks, total = [], 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue
        if b"\x00" in data[:4096]:  # binary file with a text suffix
            continue
        chunks.append(data)
        total += len(data)
        if limit is not None and total >= limit:
            break
    joined = b"".join(chunks)
    return np.frombuffer(joined[:limit] if limit is not None else joined, dtype=np.uint8)


def text_files(path: Path, suffixes: Iterable[str] = TEXT_SUFFIXES) -> list[Path]:
    """The files a directory given as data stands for: every file under ``path``, at any depth, whose name ends
    in one of ``suffixes`` (case-insensitive), sorted by path. The trainer's ``--data DIR`` reads them as text,
    ``moe.data prepare --input DIR`` tokenizes them (and its JSONL files)."""
    ends = tuple(s.lower() for s in suffixes)
    return sorted(p for p in path.rglob("*") if p.is_file() and p.name.lower().endswith(ends))


def read_text_dir(path: Path, limit: int | None = None) -> np.ndarray:
    """Every text file under ``path`` (:func:`text_files`) as bytes (uint8 [N]); held in memory."""
    files = text_files(path)
    if not files:
        raise DataError(f"{path}: no text files ({', '.join(sorted(TEXT_SUFFIXES))}) under this directory")
    return read_text_files(files, limit)

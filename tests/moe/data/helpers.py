"""Tiny data files for the data tests: indexed datasets whose tokens say which document they came from."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moe.data.indexed import IndexedWriter

EOD = 0


def doc_tokens(doc: int, length: int) -> np.ndarray:
    """Document ``doc`` of ``length`` tokens (EOD last): token = doc * 100 + position + 1, so 0 is only EOD."""
    body = doc * 100 + np.arange(length - 1) + 1
    return np.append(body, EOD).astype(np.int64)


def write_docs(prefix: Path, lengths: list[int], dtype=np.uint16) -> list[np.ndarray]:
    """An indexed dataset of ``len(lengths)`` documents from our writer; returns the documents."""
    docs = [doc_tokens(d, n) for d, n in enumerate(lengths)]
    with IndexedWriter(prefix, dtype=dtype) as w:
        for doc in docs:
            w.add_document(doc)
    return docs


def doc_of(token: int) -> int:
    return (int(token) - 1) // 100

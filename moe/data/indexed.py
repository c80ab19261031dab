"""Megatron-LM's indexed dataset (``PREFIX.idx`` + ``PREFIX.bin``): our reader and writer.

Legend for shape suffixes: Q sequences, D documents (the ``_D1`` arrays hold D + 1 boundaries).

``PREFIX.bin`` is the token ids of every sequence back to back, in one dtype. ``PREFIX.idx`` is, little-endian:

    9 bytes   magic b"MMIDIDX\\x00\\x00"
    u64       version, 1
    u8        dtype code of the .bin tokens (:data:`DTYPE_CODES`)
    u64       Q, the sequence count
    u64       D + 1, the length of the document index array
    int32 [Q]      sequence lengths, in tokens
    int64 [Q]      sequence pointers, byte offsets into .bin
    int64 [D + 1]  document indices: 0, then one past the last sequence of each document
    int8  [Q]      sequence modes, only in multimodal files (read and ignored here)

A document is one or more consecutive sequences; :mod:`moe.data.prepare` writes one sequence per document.
"""

from __future__ import annotations

import os
import struct
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe.data.errors import DataError

__all__ = [
    "DTYPE_CODES",
    "INDEX_MAGIC",
    "IndexedFile",
    "IndexedWriter",
    "indexed_prefix",
    "read_indexed",
    "token_dtype_for_vocab",
]

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
# magic, version, dtype code, sequence count, document index count
_HEADER = struct.Struct("<9sQBQQ")
# Megatron's DType enum: the codes are part of the file format.
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int8),
    3: np.dtype(np.int16),
    4: np.dtype(np.int32),
    5: np.dtype(np.int64),
    6: np.dtype(np.float64),
    7: np.dtype(np.float32),
    8: np.dtype(np.uint16),
}
_CODE_OF = {dtype: code for code, dtype in DTYPE_CODES.items()}


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The .bin dtype Megatron's writer picks: uint16 below 65500 tokens (its margin under 65536), else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def indexed_prefix(path: str | os.PathLike) -> str | None:
    """``PREFIX`` when ``path`` is PREFIX, PREFIX.bin or PREFIX.idx and both files exist, else None."""
    text = os.fspath(path)
    candidates = [text]
    if text.endswith((".bin", ".idx")):
        candidates.insert(0, text[:-4])
    for prefix in candidates:
        if os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx"):
            return prefix
    return None


@dataclass(kw_only=True, slots=True, frozen=True)
class IndexedFile:
    """One opened indexed dataset: the .bin memory-mapped, the index arrays read from the .idx."""

    prefix: str
    """The path without ``.bin`` / ``.idx``."""
    dtype: np.dtype
    """Token dtype of the .bin."""
    tokens: np.ndarray
    """Every token of the .bin, 1-D, memory-mapped (read-only)."""
    sequence_lengths_Q: np.ndarray
    """int32, tokens per sequence."""
    document_indices_D1: np.ndarray
    """int64, 0 then one past the last sequence of each document."""
    document_starts_D1: np.ndarray
    """int64, token offset of each document in :attr:`tokens`, then the total token count."""

    @property
    def num_documents(self) -> int:
        return len(self.document_indices_D1) - 1


def read_indexed(prefix: str) -> IndexedFile:
    """Open ``prefix.idx`` + ``prefix.bin`` (every dtype code Megatron defines, with or without sequence modes).

    Reads only the .idx header and index arrays; the tokens stay on disk behind a memmap. Sequences must be
    stored back to back in order (every Megatron writer does this), so a document is one slice of the .bin.
    """
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        head = f.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise DataError(f"{idx_path}: only {size} bytes, shorter than the {_HEADER.size}-byte index header")
    magic, version, code, n_seq, n_doc_idx = _HEADER.unpack(head)
    if magic != INDEX_MAGIC:
        raise DataError(f"{idx_path}: header {magic!r} is not {INDEX_MAGIC!r}; not a Megatron indexed dataset")
    if version != INDEX_VERSION:
        raise DataError(f"{idx_path}: index version {version}, only version {INDEX_VERSION} is known")
    if code not in DTYPE_CODES:
        raise DataError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
    dtype = DTYPE_CODES[code]
    plain = _HEADER.size + 4 * n_seq + 8 * n_seq + 8 * n_doc_idx
    if size not in (plain, plain + n_seq):  # + n_seq: the int8 sequence modes of multimodal files
        raise DataError(
            f"{idx_path}: {size} bytes, but a header of {n_seq} sequences and {n_doc_idx} document indices "
            f"needs {plain} (or {plain + n_seq} with modes); the file is truncated or not from this format"
        )
    raw = np.memmap(idx_path, dtype=np.uint8, mode="r")
    offset = _HEADER.size
    lengths_Q = np.frombuffer(raw, dtype="<i4", count=n_seq, offset=offset)
    offset += lengths_Q.nbytes
    pointers_Q = np.frombuffer(raw, dtype="<i8", count=n_seq, offset=offset)
    offset += pointers_Q.nbytes
    doc_idx_D1 = np.frombuffer(raw, dtype="<i8", count=n_doc_idx, offset=offset)

    seq_starts = np.zeros(n_seq + 1, dtype=np.int64)
    np.cumsum(lengths_Q, out=seq_starts[1:])
    if n_seq and not np.array_equal(pointers_Q, seq_starts[:-1] * dtype.itemsize):
        raise DataError(f"{idx_path}: sequences are not stored back to back in the .bin; rewrite it with moe.data")
    if n_doc_idx < 1 or doc_idx_D1[0] != 0 or doc_idx_D1[-1] != n_seq or np.any(np.diff(doc_idx_D1) < 0):
        raise DataError(f"{idx_path}: document indices must rise from 0 to the sequence count {n_seq}")
    n_tokens = int(seq_starts[-1])
    bin_size = os.path.getsize(bin_path)
    if bin_size != n_tokens * dtype.itemsize:
        raise DataError(
            f"{bin_path}: {bin_size} bytes, but {idx_path} describes {n_tokens} {dtype.name} tokens "
            f"({n_tokens * dtype.itemsize} bytes); the pair does not match"
        )
    tokens = np.memmap(bin_path, dtype=dtype, mode="r") if n_tokens else np.zeros(0, dtype=dtype)
    return IndexedFile(
        prefix=prefix,
        dtype=dtype,
        tokens=tokens,
        sequence_lengths_Q=lengths_Q,
        document_indices_D1=doc_idx_D1,
        document_starts_D1=seq_starts[doc_idx_D1],
    )


class IndexedWriter:
    """Streams documents (one sequence each) into ``prefix.bin``; :meth:`close` writes ``prefix.idx``.

    Both files are written under a ``.tmp`` name and renamed on a clean close, so an interrupted run leaves
    no half-written pair that looks valid. Use as a context manager.

    Args:
        prefix: output path without suffix.
        dtype: token dtype, one of :data:`DTYPE_CODES` (see :func:`token_dtype_for_vocab`).
    """

    def __init__(self, prefix: str | os.PathLike, *, dtype: np.dtype | type) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"dtype {self.dtype} has no Megatron code; use one of {list(DTYPE_CODES.values())}")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin = open(self.prefix + ".bin.tmp", "wb")  # noqa: SIM115 -- closed in close()
        self._lengths = array("i")  # 4 bytes per document in memory, the corpus itself is streamed
        self.num_tokens = 0

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray | list[int]) -> None:
        """Append ``len(lengths)`` documents whose tokens are ``tokens`` back to back."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != len(tokens):
            raise ValueError(f"lengths sum to {int(lengths.sum())} but {len(tokens)} tokens were given")
        if len(lengths) and (lengths.min() < 0 or lengths.max() >= 2**31):
            raise ValueError("a document length must fit an int32")
        if len(tokens) and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            if tokens.min() < info.min or tokens.max() > info.max:
                raise ValueError(f"token ids {tokens.min()}..{tokens.max()} do not fit {self.dtype}")
        self._bin.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.extend(lengths.tolist())
        self.num_tokens += len(tokens)

    def add_document(self, tokens: np.ndarray | list[int]) -> None:
        """Append one document."""
        tokens = np.asarray(tokens)
        self.add_documents(tokens, [len(tokens)])

    @property
    def num_documents(self) -> int:
        return len(self._lengths)

    def close(self) -> None:
        """Write the index and move both files into place."""
        if self._bin.closed:
            return
        self._bin.close()
        lengths_Q = np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
        pointers_Q = np.zeros(len(lengths_Q), dtype=np.int64)
        np.cumsum(lengths_Q[:-1], out=pointers_Q[1:])
        pointers_Q *= self.dtype.itemsize
        doc_idx_D1 = np.arange(len(lengths_Q) + 1, dtype=np.int64)
        header = _HEADER.pack(INDEX_MAGIC, INDEX_VERSION, _CODE_OF[self.dtype], len(lengths_Q), len(doc_idx_D1))
        with open(self.prefix + ".idx.tmp", "wb") as f:
            f.write(header)
            for arr, little in ((lengths_Q, "<i4"), (pointers_Q, "<i8"), (doc_idx_D1, "<i8")):
                f.write(arr.astype(little, copy=False).tobytes())
        os.replace(self.prefix + ".bin.tmp", self.prefix + ".bin")
        os.replace(self.prefix + ".idx.tmp", self.prefix + ".idx")

    def abort(self) -> None:
        """Close and delete the temporary files (after an error)."""
        self._bin.close()
        for suffix in (".bin.tmp", ".idx.tmp"):
            Path(self.prefix + suffix).unlink(missing_ok=True)

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

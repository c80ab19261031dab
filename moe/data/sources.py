"""Token sources: one path of a ``--data-path`` list opened as a flat token array (+ document boundaries).

Legend for shape suffixes: N tokens, D documents (``_D1``: D + 1 boundaries).

A path is one of (checked in this order):

- a directory of text files: byte-level, vocabulary 256 (:mod:`moe.data.text`), read into memory;
- ``PREFIX`` of a Megatron indexed dataset, ``PREFIX.bin`` + ``PREFIX.idx`` (also given as either file);
- ``FILE.npy``: a 1-D integer array, memory-mapped;
- ``FILE.bin`` with no ``.idx`` beside it: raw tokens, uint16 or uint32, the dtype from the caller or from a
  sidecar ``FILE.bin.json`` holding ``{"dtype": "uint32"}``.

Nothing but the .idx arrays and text directories is read eagerly: token files stay behind memmaps.
"""

from __future__ import annotations

import json
import math
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moe.data.errors import DataError
from moe.data.indexed import indexed_prefix, read_indexed
from moe.data.text import BYTE_VOCAB_SIZE, DEFAULT_CORPUS_BYTES, default_corpus_files, read_text_dir, read_text_files

__all__ = ["ACCEPTED_FORMS", "RAW_DTYPES", "TokenSource", "default_source", "open_source", "scan_vocab"]

RAW_DTYPES = ("uint16", "uint32")
ACCEPTED_FORMS = (
    "a directory of text files, PREFIX of PREFIX.bin + PREFIX.idx (Megatron indexed), FILE.npy (1-D integer "
    "array), or FILE.bin (raw uint16/uint32 tokens, dtype from data.dtype / --data-dtype or FILE.bin.json)"
)
# 16M tokens per scan chunk: a few tens of MB of int64 temporaries, and few enough Python steps to be fast.
_SCAN_CHUNK = 1 << 24


@dataclass(kw_only=True, slots=True)
class TokenSource:
    """One opened path: its tokens as one 1-D array and, for indexed data, where each document starts."""

    path: str
    """The file named in messages (the .bin of an indexed dataset)."""
    kind: str
    """``"text"``, ``"indexed"``, ``"npy"`` or ``"bin"``."""
    tokens_N: np.ndarray
    """Every token, 1-D, usually a read-only memmap."""
    document_starts_D1: np.ndarray | None = None
    """int64 token offset of each document, then N; None for flat arrays without documents."""
    vocab_size: int | None = None
    """The vocabulary the source implies (256 for byte-level text), None when the tokenizer decides."""
    title: str | None = None
    """Banner name instead of ``kind path``."""

    @property
    def num_tokens(self) -> int:
        return len(self.tokens_N)

    @property
    def num_documents(self) -> int | None:
        return None if self.document_starts_D1 is None else len(self.document_starts_D1) - 1

    @property
    def description(self) -> str:
        docs = "" if self.num_documents is None else f"{self.num_documents} docs, "
        title = self.title or (f"byte-level text {self.path}" if self.kind == "text" else f"{self.kind} {self.path}")
        return f"{title} ({docs}{_human(self.num_tokens)} tokens)"

    def document_of(self, position: int) -> int | None:
        """The document holding token ``position``, or None without document boundaries."""
        if self.document_starts_D1 is None:
            return None
        return int(np.searchsorted(self.document_starts_D1, position, side="right")) - 1


def _human(n: int) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def default_source() -> TokenSource:
    """The byte-level demo corpus: the standard library's ``.py`` sources (first 8 MiB, sorted by path)."""
    tokens = read_text_files(default_corpus_files(), DEFAULT_CORPUS_BYTES)
    return TokenSource(
        path=f"<python stdlib .py sources under {Path(sysconfig.get_paths()['stdlib'])}>",
        kind="text",
        tokens_N=tokens,
        vocab_size=BYTE_VOCAB_SIZE,
        title="byte-level python standard library sources",
    )


def open_source(path: str, *, dtype: str | None = None) -> TokenSource:
    """Open one data path (see the module docstring); ``dtype`` applies to raw ``.bin`` files only."""
    p = Path(path)
    if p.is_dir():
        return TokenSource(path=path, kind="text", tokens_N=read_text_dir(p), vocab_size=BYTE_VOCAB_SIZE)
    prefix = indexed_prefix(path)
    if prefix is not None:
        f = read_indexed(prefix)
        return TokenSource(
            path=prefix + ".bin", kind="indexed", tokens_N=f.tokens, document_starts_D1=f.document_starts_D1
        )
    if p.is_file() and p.suffix == ".npy":
        return _open_npy(p)
    if p.is_file() and p.suffix == ".bin":
        return _open_raw(p, dtype)
    if p.exists():
        raise DataError(f"{path}: not a data file this loader reads; give {ACCEPTED_FORMS}")
    raise DataError(f"{path}: no such file, directory or PREFIX.bin + PREFIX.idx; give {ACCEPTED_FORMS}")


def _open_npy(p: Path) -> TokenSource:
    try:
        tokens = np.load(p, mmap_mode="r", allow_pickle=False)
    except ValueError as exc:  # object arrays, bad headers
        raise DataError(f"{p}: not a plain .npy array ({exc}); save a 1-D integer array with np.save") from exc
    if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
        raise DataError(
            f"{p}: holds a {tokens.ndim}-D {tokens.dtype} array; save the tokens as a 1-D unsigned integer array "
            "(e.g. np.save(path, ids.reshape(-1).astype(np.uint32)))"
        )
    return TokenSource(path=str(p), kind="npy", tokens_N=tokens)


def _open_raw(p: Path, dtype: str | None) -> TokenSource:
    sidecar = Path(f"{p}.json")
    side = None
    if sidecar.is_file():
        try:
            side = json.loads(sidecar.read_text())["dtype"]
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f'{sidecar}: must be a JSON object like {{"dtype": "uint32"}} ({exc})') from exc
    if dtype is not None and side is not None and dtype != side:
        raise DataError(f"{p}: dtype {dtype} was given but {sidecar} says {side}; drop one or make them agree")
    chosen = dtype if dtype is not None else side
    if chosen is None:
        raise DataError(
            f"{p}: raw tokens of unknown dtype; pass the dtype (data.dtype / --data-dtype uint16 or uint32) "
            f'or write {sidecar} holding {{"dtype": "uint16"}} or {{"dtype": "uint32"}}'
        )
    if chosen not in RAW_DTYPES:
        where = "the given dtype" if dtype is not None else str(sidecar)
        raise DataError(f"{p}: dtype {chosen!r} from {where} is not one of {', '.join(RAW_DTYPES)}")
    np_dtype = np.dtype(chosen)
    size = os.path.getsize(p)
    if size % np_dtype.itemsize:
        raise DataError(f"{p}: {size} bytes is not a whole number of {chosen} tokens; is the dtype right?")
    tokens = np.memmap(p, dtype=np_dtype, mode="r") if size else np.zeros(0, np_dtype)
    return TokenSource(path=str(p), kind="bin", tokens_N=tokens)


def scan_vocab(source: TokenSource, vocab_size: int | None) -> tuple[int, int | None]:
    """(max token id, position of the first id outside [0, vocab_size) or None), in chunks of the memmap.

    Without ``vocab_size`` only the max is computed. Negative ids (signed files) count as out of range.
    """
    tokens, top, bad = source.tokens_N, -1, None
    for start in range(0, len(tokens), _SCAN_CHUNK):
        chunk = np.asarray(tokens[start : start + _SCAN_CHUNK])
        top = max(top, _as_int(chunk.max()))
        if vocab_size is not None and bad is None:
            low = chunk.dtype.kind in "if" and chunk.min() < 0
            if low or _as_int(chunk.max()) >= vocab_size:
                outside = (chunk >= vocab_size) | (chunk < 0)
                bad = start + int(np.argmax(outside))
    return top, bad


def _as_int(value: np.generic) -> int:
    """Token ids as Python ints; float files (Megatron dtype codes 6 and 7) round up so a fraction is caught."""
    return math.ceil(value) if isinstance(value, np.floating) else int(value)

"""Tokenize JSONL or text files into Megatron's indexed format (``python -m moe.data prepare``).

One document per JSONL line (the text under ``json_key``) or per plain text file (a directory stands for its
JSONL and text files, as the trainer's ``--data DIR`` for its text files); every document gets the
end-of-document token appended and becomes one sequence of ``PREFIX.bin`` / ``PREFIX.idx``, in input order.
Worker processes tokenize chunks of documents while the parent reads ahead a bounded number of chunks and
writes results in order, so the output does not depend on the worker count and the corpus is never held in
memory. Needs the ``tokenizers`` package (the ``data`` extra), imported only here.
"""

from __future__ import annotations

import gzip
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from moe.data.errors import DataError
from moe.data.indexed import IndexedWriter, token_dtype_for_vocab
from moe.data.text import TEXT_SUFFIXES, text_files

__all__ = [
    "COMMON_EOD_TOKENS",
    "JSONL_SUFFIXES",
    "PrepareOptions",
    "PrepareResult",
    "input_files",
    "prepare",
    "resolve_eod",
]

COMMON_EOD_TOKENS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<｜end▁of▁sentence｜>")
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson", ".jsonl.gz", ".json.gz", ".ndjson.gz")
# A task for a worker: enough text to amortise pickling, little enough that 2 per worker in flight stay small.
CHUNK_DOCS = 256
CHUNK_BYTES = 4 << 20
PROGRESS_EVERY_S = 0.25


@dataclass(kw_only=True, slots=True)
class PrepareOptions:
    """What ``python -m moe.data prepare`` does."""

    tokenizer: str
    """Path of a HuggingFace ``tokenizer.json``."""
    inputs: list[str]
    """JSONL files (one document per line, ``.gz`` allowed), text files (one document each) or directories of
    them (their JSONL and text files, as :func:`moe.data.text.text_files` finds them)."""
    output: str
    """Output PREFIX: writes PREFIX.bin and PREFIX.idx (a trailing .bin / .idx is dropped)."""
    json_key: str = "text"
    """Field of a JSONL line holding the document text."""
    workers: int = 1
    """Tokenizer processes; 1 tokenizes in this process."""
    eod_token: str | None = None
    """End-of-document token text, looked up in the tokenizer's vocabulary."""
    eod_id: int | None = None
    """End-of-document token id (instead of ``eod_token``)."""
    append_eod: bool = True
    """Append the end-of-document id to every document."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise DataError(f"--workers must be >= 1, got {self.workers}")
        if self.eod_token is not None and self.eod_id is not None:
            raise DataError("give --eod-token or --eod-id, not both")
        if not self.inputs:
            raise DataError("no --input files given")
        if self.output.endswith((".bin", ".idx")):
            self.output = self.output[:-4]


@dataclass(kw_only=True, slots=True, frozen=True)
class PrepareResult:
    documents: int
    tokens: int
    seconds: float
    input_bytes: int
    bin_path: str
    idx_path: str
    eod_id: int | None


def _load_tokenizer(path: str) -> Any:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise SystemExit("moe.data prepare needs the tokenizers package: pip install 'dualpipe-moe[data]'") from None
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such tokenizer file; give a HuggingFace tokenizer.json with --tokenizer")
    try:
        return Tokenizer.from_file(path)
    except Exception as exc:  # the Rust side raises plain Exception subclasses for bad JSON
        raise DataError(f"{path}: not a HuggingFace tokenizer.json ({exc})") from exc


def resolve_eod(tokenizer: Any, eod_token: str | None, eod_id: int | None) -> int:
    """The end-of-document id: ``eod_id``, else ``eod_token``'s id, else the first common EOD name present."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if eod_id is not None:
        if not 0 <= eod_id < vocab:
            raise DataError(f"--eod-id {eod_id} is outside the tokenizer's vocabulary [0, {vocab})")
        return eod_id
    if eod_token is not None:
        found = tokenizer.token_to_id(eod_token)
        if found is None:
            raise DataError(f"--eod-token {eod_token!r} is not in the tokenizer's vocabulary; check its spelling")
        return found
    for name in COMMON_EOD_TOKENS:
        found = tokenizer.token_to_id(name)
        if found is not None:
            return found
    raise DataError(
        f"the tokenizer has none of the usual end-of-document tokens ({', '.join(COMMON_EOD_TOKENS)}); "
        "name one with --eod-token TOKEN or --eod-id N (or pass --no-append-eod)"
    )


def input_files(inputs: list[str]) -> list[str]:
    """The files ``inputs`` name, in order: a file as given, a directory as its JSONL and text files."""
    files = []
    for path in inputs:
        if os.path.isdir(path):
            found = text_files(Path(path), TEXT_SUFFIXES | set(JSONL_SUFFIXES))
            if not found:
                kinds = ", ".join(sorted(TEXT_SUFFIXES | set(JSONL_SUFFIXES)))
                raise DataError(f"{path}: no JSONL or text files ({kinds}) under this directory")
            files += [str(f) for f in found]
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise DataError(f"{path}: no such input file or directory")
    return files


def _open_input(path: str) -> IO[bytes]:
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def _iter_documents(inputs: list[str], json_key: str) -> Iterator[tuple[str, int]]:
    """(document text, input bytes it took), in input order, one file open at a time."""
    for path in inputs:
        with _open_input(path) as f:
            if not path.endswith(JSONL_SUFFIXES):
                data = f.read()
                yield data.decode("utf-8", errors="replace"), len(data)
                continue
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as exc:
                    raise DataError(f"{path}:{lineno}: not a JSON object ({exc})") from None
                if not isinstance(record, dict) or json_key not in record:
                    raise DataError(f"{path}:{lineno}: no {json_key!r} field; name the text field with --json-key")
                text = record[json_key]
                if not isinstance(text, str):
                    raise DataError(f"{path}:{lineno}: {json_key!r} is a {type(text).__name__}, not a string")
                yield text, len(line)


def _chunks(docs: Iterator[tuple[str, int]]) -> Iterator[tuple[list[str], int]]:
    texts, nbytes = [], 0
    for text, size in docs:
        texts.append(text)
        nbytes += size
        if len(texts) >= CHUNK_DOCS or nbytes >= CHUNK_BYTES:
            yield texts, nbytes
            texts, nbytes = [], 0
    if texts:
        yield texts, nbytes


def _encode(tokenizer: Any, texts: list[str], eod: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(token ids of the chunk back to back int64 [N], per-document lengths int64 [docs]), EOD included."""
    # add_special_tokens=False: no BOS/CLS from a post-processor, so the stream decodes back to the text.
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    tail = [] if eod is None else [eod]
    ids = [np.asarray(e.ids + tail, dtype=np.int64) for e in encodings]
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    return (np.concatenate(ids) if ids else np.zeros(0, np.int64)), lengths


_WORKER_TOKENIZER: Any = None  # one per worker process, set by its initializer


def _worker_init(tokenizer_path: str) -> None:
    global _WORKER_TOKENIZER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the pool is the parallelism; threads would oversubscribe
    _WORKER_TOKENIZER = _load_tokenizer(tokenizer_path)


def _worker_encode(texts: list[str], eod: int | None) -> tuple[np.ndarray, np.ndarray]:
    return _encode(_WORKER_TOKENIZER, texts, eod)


class _Progress:
    """One stderr line rewritten in place (``\\r``) at most every :data:`PROGRESS_EVERY_S` seconds."""

    def __init__(self, stream: IO[str] | None) -> None:
        self.stream, self.start, self.last = stream, time.perf_counter(), 0.0

    def update(self, docs: int, nbytes: int, *, force: bool = False) -> None:
        now = time.perf_counter()
        if self.stream is None or (not force and now - self.last < PROGRESS_EVERY_S):
            return
        self.last = now
        secs = max(now - self.start, 1e-9)
        line = f"\r{docs} docs, {docs / secs:.0f} docs/s, {nbytes / secs / 1e6:.2f} MB/s"
        self.stream.write(line)
        self.stream.flush()


def prepare(opts: PrepareOptions, *, progress: IO[str] | bool = True) -> PrepareResult:
    """Tokenize ``opts.inputs`` into ``opts.output``.bin / .idx.

    ``progress``: True writes the progress line and a summary to stderr, a stream writes them there, False is quiet.
    """
    stream = sys.stderr if progress is True else None if progress is False else progress
    tokenizer = _load_tokenizer(opts.tokenizer)
    eod = resolve_eod(tokenizer, opts.eod_token, opts.eod_id) if opts.append_eod else None
    dtype = token_dtype_for_vocab(tokenizer.get_vocab_size(with_added_tokens=True))
    inputs = input_files(opts.inputs)  # fails before any work on a typo in the last of many inputs
    bar = _Progress(stream)
    docs = nbytes = 0
    with IndexedWriter(opts.output, dtype=dtype) as writer:

        def write(result: tuple[np.ndarray, np.ndarray], size: int) -> None:
            nonlocal docs, nbytes
            writer.add_documents(*result)
            docs += len(result[1])
            nbytes += size
            bar.update(docs, nbytes)

        chunks = _chunks(_iter_documents(inputs, opts.json_key))
        if opts.workers == 1:
            for texts, size in chunks:
                write(_encode(tokenizer, texts, eod), size)
        else:
            with multiprocessing.get_context().Pool(opts.workers, _worker_init, (opts.tokenizer,)) as pool:
                pending: deque = deque()
                for texts, size in chunks:
                    pending.append((pool.apply_async(_worker_encode, (texts, eod)), size))
                    if len(pending) >= 2 * opts.workers:  # bounded read-ahead: streaming, ordered output
                        result, size_done = pending.popleft()
                        write(result.get(), size_done)
                while pending:
                    result, size_done = pending.popleft()
                    write(result.get(), size_done)
        tokens = writer.num_tokens
    seconds = time.perf_counter() - bar.start
    out = PrepareResult(
        documents=docs,
        tokens=tokens,
        seconds=seconds,
        input_bytes=nbytes,
        bin_path=opts.output + ".bin",
        idx_path=opts.output + ".idx",
        eod_id=eod,
    )
    if stream is not None:
        bar.update(docs, nbytes, force=True)
        stream.write(
            f"\nwrote {docs} documents, {tokens} tokens ({dtype.name}, eod id {eod}) in {seconds:.1f} s: "
            f"{out.bin_path}, {out.idx_path}\n"
        )
    return out

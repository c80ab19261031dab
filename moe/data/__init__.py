"""Training data: token files (Megatron indexed, .npy, raw .bin), text, blends, packing into batches.

The trainer's API::

    data = open_data(["0.7", "web", "0.3", "code"], dtype=None, val_fraction=0.05)
    data.check_vocab(model_cfg.vocab_size)          # one line naming the file and position if an id is too big
    train = data.loader("train", seq_len=4096, global_batch=512, dp_rank=r, dp_size=dp, seed=0)
    ids_BS, labels_BS = train.batch(consumed_samples)  # a pure function of the global sample index

Modules: :mod:`~moe.data.sources` (opening a path), :mod:`~moe.data.indexed` (Megatron's .idx/.bin reader and
writer), :mod:`~moe.data.loader` (splits, packing, shuffles), :mod:`~moe.data.blend` (blend assignment),
:mod:`~moe.data.text` (byte-level text), :mod:`~moe.data.prepare` (``python -m moe.data prepare``, tokenizing
JSONL / text into the indexed format).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from moe.data.errors import DataError
from moe.data.loader import Loader, TokenData
from moe.data.sources import ACCEPTED_FORMS, TokenSource, default_source, open_source
from moe.data.text import BYTE_VOCAB_SIZE, TEXT_SUFFIXES, default_corpus_files

__all__ = [
    "ACCEPTED_FORMS",
    "BYTE_VOCAB_SIZE",
    "TEXT_SUFFIXES",
    "DataError",
    "Loader",
    "TokenData",
    "TokenSource",
    "default_corpus_files",
    "open_data",
    "parse_data_path",
]


def parse_data_path(items: Sequence[str]) -> list[tuple[float, str]]:
    """Megatron's ``--data-path`` list: ``["PATH"]`` or ``["W1", "PATH1", "W2", "PATH2", ...]``.

    Returns ``[(weight, path), ...]`` with the weights normalised to sum 1 (``["PATH"]`` -> ``[(1.0, "PATH")]``).
    """
    items = list(items)
    if len(items) == 1:
        return [(1.0, items[0])]
    if not items or len(items) % 2:
        raise DataError(
            f"data path {items}: give one PATH, or pairs of WEIGHT PATH (e.g. 0.7 web 0.3 code); got {len(items)} items"
        )
    pairs = []
    for weight, path in zip(items[::2], items[1::2]):
        try:
            w = float(weight)
        except ValueError:
            raise DataError(f"data path {items}: weight {weight!r} before {path!r} is not a number") from None
        if not math.isfinite(w) or w <= 0:
            raise DataError(f"data path {items}: weight {weight!r} of {path!r} must be a positive number")
        pairs.append((w, path))
    total = sum(w for w, _ in pairs)
    return [(w / total, path) for w, path in pairs]


def open_data(items: Sequence[str] | None, *, dtype: str | None = None, val_fraction: float = 0.05) -> TokenData:
    """Open a data path list (see :func:`parse_data_path`); None or ``[]`` is the byte-level demo corpus.

    Each path is a directory of text files (byte-level), a Megatron indexed dataset PREFIX (or PREFIX.bin /
    PREFIX.idx), FILE.npy (1-D integer array) or a raw FILE.bin (uint16 / uint32 from ``dtype`` or the sidecar
    FILE.bin.json ``{"dtype": "uint32"}``). ``val_fraction`` of each source is held out as the val split.
    """
    if not items:
        return TokenData([default_source()], [1.0], val_fraction=val_fraction)
    pairs = parse_data_path(items)
    sources = [open_source(path, dtype=dtype) for _, path in pairs]
    return TokenData(sources, [w for w, _ in pairs], val_fraction=val_fraction)

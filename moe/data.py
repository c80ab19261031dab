"""Byte-level language-modelling data (vocabulary 256) from text already on the machine.

Legend for shape suffixes: B batch, S sequence.

Sources, in order of preference:

- ``--data FILE.bin``: a pre-tokenised corpus, a flat uint16 array (``numpy.memmap``), tokens < vocab;
- ``--data DIR``: every text file under DIR (by suffix, sorted by path, UTF-8 bytes);
- default: the Python standard library's own sources and docs, present wherever Python is, so nothing is
  downloaded and every machine with the same Python builds the same corpus.

Sampling is a pure function of (seed, step): the global batch of a step never depends on the parallel
layout or on how many steps ran before, so a resumed run, or a run at another (pp, ep), sees exactly the
same tokens. Each data-parallel rank takes its slice of the global batch.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["TEXT_SUFFIXES", "ByteCorpus", "default_corpus_files"]

TEXT_SUFFIXES = frozenset({".txt", ".md", ".rst", ".py", ".c", ".h", ".json", ".toml", ".cfg", ".ini", ".html"})
# Enough text that a short CPU run never sees the same window twice, small enough to read in well under 1 s.
DEFAULT_CORPUS_BYTES = 8 * 1024 * 1024


def default_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted (always present, plain English comments and code)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts]
    return sorted(files)


def _read_text_files(files: list[Path], limit: int) -> np.ndarray:
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
        if total >= limit:
            break
    return np.frombuffer(b"".join(chunks)[:limit], dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class _Split:
    tokens: np.ndarray


class ByteCorpus:
    """A token stream split into train and validation, sampled by (seed, step).

    Args:
        source: ``None`` (the standard library), a directory of text files, or a ``.bin`` uint16 file.
        val_fraction: tail of the stream held out for validation.
        max_bytes: cap on the text read from a directory or the default corpus.
    """

    vocab_size = 256

    def __init__(
        self, source: str | Path | None = None, val_fraction: float = 0.05, max_bytes: int = DEFAULT_CORPUS_BYTES
    ) -> None:
        if not 0 < val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        tokens = self._load(source, max_bytes)
        n_val = max(int(len(tokens) * val_fraction), 1)
        if len(tokens) - n_val < 1024:
            raise ValueError(f"corpus {source or 'stdlib'} has only {len(tokens)} tokens; need at least ~2 KB of text")
        self.description = str(source) if source is not None else "python standard library sources"
        self.train = _Split(tokens[:-n_val])
        self.val = _Split(tokens[-n_val:])

    @staticmethod
    def _load(source: str | Path | None, max_bytes: int) -> np.ndarray:
        if source is None:
            return _read_text_files(default_corpus_files(), max_bytes)
        path = Path(source)
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
            if not files:
                raise ValueError(f"no text files ({', '.join(sorted(TEXT_SUFFIXES))}) under {path}")
            return _read_text_files(files, max_bytes)
        if path.is_file() and path.suffix == ".bin":
            tokens = np.memmap(path, dtype=np.uint16, mode="r")
            if len(tokens) and int(tokens.max()) >= ByteCorpus.vocab_size:
                raise ValueError(f"{path} holds token ids >= {ByteCorpus.vocab_size}; this corpus is byte-level")
            return tokens
        raise ValueError(f"--data must be a directory of text files or a .bin uint16 token file, got {path}")

    def __len__(self) -> int:
        return len(self.train.tokens)

    def batch(
        self,
        step: int,
        global_batch: int,
        seq_len: int,
        *,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        split: str = "train",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This data-parallel rank's slice of the global batch of ``step``: ``(ids [B, S], labels [B, S])``.

        ``labels`` are the next bytes. ``global_batch`` must divide by ``dp_size``.
        """
        if global_batch % dp_size:
            raise ValueError(f"global batch {global_batch} does not split over {dp_size} data-parallel ranks")
        tokens = self.train.tokens if split == "train" else self.val.tokens
        if len(tokens) <= seq_len + 1:
            raise ValueError(f"{split} split has {len(tokens)} tokens, too few for seq_len={seq_len}")
        rng = np.random.default_rng([seed, step, 0 if split == "train" else 1])
        starts = rng.integers(0, len(tokens) - seq_len - 1, size=global_batch)
        per_rank = global_batch // dp_size
        mine = starts[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        windows = np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in mine])
        ids_BS = torch.from_numpy(windows[:, :-1].copy())
        labels_BS = torch.from_numpy(windows[:, 1:].copy())
        return ids_BS, labels_BS

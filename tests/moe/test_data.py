"""Byte-level data: sources, deterministic sampling by (seed, step), data-parallel slices."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from moe.data import ByteCorpus


def _text_dir(tmp_path: Path) -> Path:
    d = tmp_path / "text"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 200)
    (d / "sub" / "b.md").write_text("# heading\n\nSome markdown text with numbers 12345.\n" * 100)
    (d / "image.png").write_bytes(b"\x89PNG\x00\x00" * 100)  # not a text suffix: ignored
    return d


def test_directory_of_text(tmp_path: Path) -> None:
    corpus = ByteCorpus(_text_dir(tmp_path))
    data = bytes(np.concatenate([corpus.train.tokens, corpus.val.tokens]).tolist())
    assert b"quick brown fox" in data and b"# heading" in data and b"PNG" not in data
    ids, labels = corpus.batch(0, 4, 16, seed=0)
    assert ids.shape == labels.shape == (4, 16) and ids.dtype == torch.int64
    assert torch.equal(ids[:, 1:], labels[:, :-1])  # labels are the next bytes


def test_pretokenised_uint16_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    np.arange(10_000, dtype=np.uint16).__mod__(251).astype(np.uint16).tofile(path)
    corpus = ByteCorpus(path)
    ids, labels = corpus.batch(3, 2, 8, seed=1)
    assert torch.equal((ids + 1) % 251, labels)  # consecutive tokens of the file
    bad = tmp_path / "big.bin"
    np.full(4096, 300, dtype=np.uint16).tofile(bad)
    with pytest.raises(ValueError, match="token ids >= 256"):
        ByteCorpus(bad)


def test_sampling_depends_on_seed_and_step_only_and_slices_partition_the_batch() -> None:
    corpus = ByteCorpus()  # the default: the Python standard library's sources
    whole, _ = corpus.batch(7, 8, 32, seed=5)
    again, _ = corpus.batch(7, 8, 32, seed=5)
    assert torch.equal(whole, again)
    assert not torch.equal(whole, corpus.batch(8, 8, 32, seed=5)[0])
    assert not torch.equal(whole, corpus.batch(7, 8, 32, seed=6)[0])
    parts = [corpus.batch(7, 8, 32, seed=5, dp_rank=r, dp_size=4)[0] for r in range(4)]
    assert torch.equal(torch.cat(parts), whole)  # any data-parallel layout sees the same global batch
    val, _ = corpus.batch(7, 8, 32, seed=5, split="val")
    assert not torch.equal(val, whole)


def test_bad_sources_fail_clearly(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no text files"):
        ByteCorpus(tmp_path / "empty")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"directory of text files or a \.bin"):
        ByteCorpus(tmp_path / "x.csv")
    with pytest.raises(ValueError, match="does not split over 3"):
        ByteCorpus().batch(0, 8, 16, seed=0, dp_size=3)

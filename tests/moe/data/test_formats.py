"""Opening data paths: .npy, raw .bin (+ sidecar), Megatron indexed (ours and hand-built bytes), text dirs."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from moe.data import DataError, open_data
from moe.data.indexed import DTYPE_CODES, INDEX_MAGIC, IndexedWriter, read_indexed, token_dtype_for_vocab
from tests.moe.data.helpers import write_docs


def _first_rows(path: str, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    data = open_data([path], val_fraction=0.0, **kw)
    return data.loader("train", seq_len=8, global_batch=4, seed=0).batch(0)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_npy_of_any_unsigned_dtype(tmp_path: Path, dtype) -> None:
    top = min(np.iinfo(dtype).max, 70_000)  # past 65535 where the dtype allows it
    tokens = (np.arange(2000) * 37 % (top + 1)).astype(dtype)
    tokens[5] = top
    np.save(tmp_path / "t.npy", tokens)
    data = open_data([str(tmp_path / "t.npy")], val_fraction=0.0)
    assert data.max_token_id() == top and data.num_tokens == 2000 and data.num_documents is None
    assert isinstance(data.sources[0].tokens_N, np.memmap)  # mapped, not read
    ids, labels = data.loader("train", seq_len=8, global_batch=4, seed=0).batch(0)
    assert ids.dtype == labels.dtype == torch.int64 and ids.shape == (4, 8)
    assert torch.equal(ids[:, 1:], labels[:, :-1])
    for row, lab in zip(ids, labels):  # each window is 9 consecutive tokens of the file
        start = int(np.flatnonzero(tokens.astype(np.int64) == int(row[0]))[0])
        want = torch.from_numpy(tokens[start : start + 9].astype(np.int64))
        assert torch.equal(torch.cat([row, lab[-1:]]), want)


def test_npy_must_be_a_1d_integer_array(tmp_path: Path) -> None:
    np.save(tmp_path / "f.npy", np.zeros(100, np.float32))
    with pytest.raises(DataError, match=r"f\.npy: holds a 1-D float32 array; save the tokens as a 1-D unsigned"):
        open_data([str(tmp_path / "f.npy")])
    np.save(tmp_path / "m.npy", np.zeros((10, 10), np.uint16))
    with pytest.raises(DataError, match="2-D"):
        open_data([str(tmp_path / "m.npy")])


def test_raw_bin_with_explicit_dtype_or_sidecar(tmp_path: Path) -> None:
    tokens = (np.arange(1000) + 65_530).astype(np.uint32)  # ids past uint16
    path = tmp_path / "raw.bin"
    tokens.tofile(path)
    with pytest.raises(DataError, match=r"raw\.bin: raw tokens of unknown dtype; pass the dtype \(data\.dtype / --"):
        open_data([str(path)])
    ids, _ = _first_rows(str(path), dtype="uint32")
    assert int(ids.min()) >= 65_530
    (tmp_path / "raw.bin.json").write_text(json.dumps({"dtype": "uint32"}))
    data = open_data([str(path)], val_fraction=0.0)
    assert data.max_token_id() == 65_530 + 999 and data.description.startswith("bin ")
    with pytest.raises(DataError, match="says uint32"):
        open_data([str(path)], dtype="uint16")
    (tmp_path / "raw.bin.json").write_text('{"dtype": "float32"}')
    with pytest.raises(DataError, match="not one of uint16, uint32"):
        open_data([str(path)])
    (tmp_path / "raw.bin.json").write_text("[1]")
    with pytest.raises(DataError, match="must be a JSON object"):
        open_data([str(path)])
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match="not a whole number of uint16"):
        open_data([str(odd)], dtype="uint16")


def test_indexed_round_trip_through_our_writer(tmp_path: Path) -> None:
    docs = write_docs(tmp_path / "c", [5, 1, 9, 3])
    f = read_indexed(str(tmp_path / "c"))
    assert f.dtype == np.uint16 and f.num_documents == 4
    assert f.document_starts_D1.tolist() == [0, 5, 6, 15, 18]
    assert np.array_equal(np.asarray(f.tokens), np.concatenate(docs))
    for given in ("c", "c.bin", "c.idx"):  # the prefix or either file
        data = open_data([str(tmp_path / given)])
        assert data.num_documents == 4 and data.num_tokens == 18
        assert data.description == f"indexed {tmp_path / 'c'}.bin (4 docs, 18 tokens)"


def test_writer_picks_megatrons_dtype_and_rejects_ids_that_do_not_fit(tmp_path: Path) -> None:
    assert token_dtype_for_vocab(65_499) == np.uint16 and token_dtype_for_vocab(65_500) == np.int32
    with IndexedWriter(tmp_path / "big", dtype=token_dtype_for_vocab(200_000)) as w:
        w.add_document([199_999, 70_000, 0])
    f = read_indexed(str(tmp_path / "big"))
    assert f.dtype == np.int32 and np.asarray(f.tokens).tolist() == [199_999, 70_000, 0]
    with pytest.raises(ValueError, match="do not fit uint16"), IndexedWriter(tmp_path / "x", dtype=np.uint16) as w:
        w.add_document([70_000])
    assert not list(tmp_path.glob("x.*"))  # an aborted write leaves nothing behind


def _handmade_idx(
    path: Path, code: int, lengths: list[int], doc_idx: list[int], itemsize: int, modes: bool = False
) -> None:
    """The .idx layout written out with struct, independently of our writer."""
    out = bytearray(b"MMIDIDX\x00\x00")
    out += struct.pack("<Q", 1)  # version
    out += struct.pack("<B", code)
    out += struct.pack("<Q", len(lengths))
    out += struct.pack("<Q", len(doc_idx))
    out += struct.pack(f"<{len(lengths)}i", *lengths)
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * itemsize
    out += struct.pack(f"<{len(lengths)}q", *pointers)
    out += struct.pack(f"<{len(doc_idx)}q", *doc_idx)
    if modes:
        out += struct.pack(f"<{len(lengths)}b", *([0] * len(lengths)))
    path.write_bytes(bytes(out))


@pytest.mark.parametrize("code", sorted(DTYPE_CODES))
def test_indexed_from_hand_built_bytes_every_dtype_code(tmp_path: Path, code: int) -> None:
    fmt = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 6: "d", 7: "f", 8: "H"}[code]
    itemsize = struct.calcsize(fmt)
    # 3 sequences in 2 documents: the first document is two sequences (Megatron allows several per document).
    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    flat = [t for s in seqs for t in s]
    (tmp_path / "h.bin").write_bytes(struct.pack(f"<{len(flat)}{fmt}", *flat))
    _handmade_idx(tmp_path / "h.idx", code, [3, 2, 4], [0, 2, 3], itemsize, modes=code == 4)
    f = read_indexed(str(tmp_path / "h"))
    assert f.dtype == DTYPE_CODES[code] and f.num_documents == 2
    assert f.document_starts_D1.tolist() == [0, 5, 9]
    data = open_data([str(tmp_path / "h")], val_fraction=0.0)
    assert data.max_token_id() == 9
    ids, labels = data.loader("train", seq_len=8, global_batch=1, seed=0).batch(0)
    assert sorted(torch.cat([ids[0], labels[0, -1:]]).tolist()) == flat  # every token, documents in some order


def test_corrupt_indexed_files_fail_with_the_file_named(tmp_path: Path) -> None:
    write_docs(tmp_path / "c", [4, 4])
    idx = tmp_path / "c.idx"
    good = idx.read_bytes()
    idx.write_bytes(b"NOTMAGIC!" + good[9:])
    with pytest.raises(DataError, match=r"c\.idx: header .* is not .*MMIDIDX"):
        open_data([str(tmp_path / "c")])
    idx.write_bytes(good[:-3])
    with pytest.raises(DataError, match="truncated"):
        open_data([str(tmp_path / "c")])
    idx.write_bytes(good)
    (tmp_path / "c.bin").write_bytes(b"\x00" * 6)
    with pytest.raises(DataError, match="does not match"):
        open_data([str(tmp_path / "c")])
    assert good[:9] == INDEX_MAGIC


def test_directory_of_text_is_byte_level(tmp_path: Path) -> None:
    d = tmp_path / "text"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 200)
    (d / "sub" / "b.md").write_text("# heading\n\nSome markdown text with numbers 12345.\n" * 100)
    (d / "image.png").write_bytes(b"\x89PNG\x00\x00" * 100)  # not a text suffix: ignored
    data = open_data([str(d)])
    assert data.vocab_size == 256 and data.description.startswith("byte-level text ")
    stream = bytes(np.asarray(data.sources[0].tokens_N).tolist())
    assert b"quick brown fox" in stream and b"# heading" in stream and b"PNG" not in stream
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no text files"):
        open_data([str(tmp_path / "empty")])


def test_default_is_the_standard_library() -> None:
    data = open_data(None)
    assert data.vocab_size == 256 and data.max_token_id() < 256
    assert data.description.startswith("byte-level python standard library sources")
    assert open_data([]).num_tokens == data.num_tokens


def test_missing_and_unknown_paths_list_the_accepted_forms(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"nope: no such file, directory or PREFIX\.bin \+ PREFIX\.idx; give a dir"):
        open_data([str(tmp_path / "nope")])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match=r"x\.csv: not a data file this loader reads; give .*FILE\.npy"):
        open_data([str(tmp_path / "x.csv")])

"""Batches: packing, splits, per-epoch shuffles, determinism, dp slices, resume, blends, vocab checks."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch

from moe.data import DataError, open_data, parse_data_path
from moe.data.blend import CHECKPOINT_EVERY, BlendSchedule, blend_reference
from tests.moe.data.helpers import EOD, doc_of, write_docs


def _flat(tmp_path: Path, n: int = 1000, name: str = "flat.npy") -> str:
    np.save(tmp_path / name, np.arange(n, dtype=np.uint32))
    return str(tmp_path / name)


def _windows(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.cat([ids, labels[:, -1:]], dim=1)


def test_windows_tile_the_stream_and_each_epoch_visits_every_window_once(tmp_path: Path) -> None:
    data = open_data([_flat(tmp_path, 1001)], val_fraction=0.0)
    loader = data.loader("train", seq_len=10, global_batch=4, seed=3)
    assert loader.windows_per_epoch == (100,)  # (1001 - 1) // 10: stride 10, windows of 11 tokens
    starts = []
    for _ in range(50):  # two epochs
        ids, labels = loader.next()
        w = _windows(ids, labels)
        assert torch.equal(w, w[:, :1] + torch.arange(11))  # consecutive tokens
        starts += w[:, 0].tolist()
    assert sorted(starts[:100]) == sorted(starts[100:]) == list(range(0, 1000, 10))
    assert starts[:100] != starts[100:]  # a new permutation each epoch


def test_same_seed_same_batches_other_seed_other_batches(tmp_path: Path) -> None:
    data = open_data([_flat(tmp_path)], val_fraction=0.1)
    a = data.loader("train", seq_len=8, global_batch=8, seed=1).batch(40)
    again = open_data([_flat(tmp_path)], val_fraction=0.1).loader("train", seq_len=8, global_batch=8, seed=1)
    assert torch.equal(a[0], again.batch(40)[0]) and torch.equal(a[1], again.batch(40)[1])
    assert not torch.equal(a[0], data.loader("train", seq_len=8, global_batch=8, seed=2).batch(40)[0])
    assert not torch.equal(a[0], data.loader("val", seq_len=8, global_batch=8, seed=1).batch(40)[0])


def test_dp_slices_concatenate_to_the_global_batch(tmp_path: Path) -> None:
    data = open_data(["0.6", _flat(tmp_path), "0.4", _flat(tmp_path, 700, "b.npy")])
    whole = data.loader("train", seq_len=8, global_batch=12, seed=0).batch(36)
    for dp in (2, 3, 4):
        parts = [data.loader("train", seq_len=8, global_batch=12, dp_rank=r, dp_size=dp).batch(36) for r in range(dp)]
        assert all(p[0].shape == (12 // dp, 8) for p in parts)
        assert torch.equal(torch.cat([p[0] for p in parts]), whole[0])
        assert torch.equal(torch.cat([p[1] for p in parts]), whole[1])


def test_resume_is_just_consumed_samples_even_across_an_epoch_boundary(tmp_path: Path) -> None:
    write_docs(tmp_path / "c", [7, 3, 12, 5, 9, 4, 6, 8] * 4)  # 216 tokens
    data = open_data([str(tmp_path / "c")], val_fraction=0.0)
    run = data.loader("train", seq_len=8, global_batch=6, seed=5)
    per_epoch = run.windows_per_epoch[0]
    assert per_epoch == (216 - 1) // 8
    for _ in range(4):
        run.next()
    assert run.state_dict() == {"consumed_samples": 24} and 24 < per_epoch < 30  # the next batch spans epochs
    fresh = open_data([str(tmp_path / "c")], val_fraction=0.0).loader("train", seq_len=8, global_batch=6, seed=5)
    fresh.load_state_dict(run.state_dict())
    for _ in range(3):
        got, want = fresh.next(), run.next()
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    new = data.loader("train", seq_len=8, global_batch=6, seed=5)
    assert torch.equal(run.batch(24)[0], new.batch(24)[0])  # batch() is pure: no dependence on history
    assert run.consumed_samples == fresh.consumed_samples == 42


def test_packing_spans_documents_and_shuffles_them_per_epoch(tmp_path: Path) -> None:
    write_docs(tmp_path / "c", [5] * 40)  # 200 tokens, EOD every 5th
    data = open_data([str(tmp_path / "c")], val_fraction=0.0)
    loader = data.loader("train", seq_len=16, global_batch=12, seed=0)
    for _ in range(loader.windows_per_epoch[0] * 2 // 12):
        w = _windows(*loader.next())
        for row in w.tolist():
            assert EOD in row[1:-1]  # a window runs on past the end of a document
            for a, b in itertools.pairwise(row):  # inside a document positions rise; after EOD a document starts
                assert (a == EOD and (b - 1) % 100 == 0) or (a != EOD and (b == a + 1 or b == EOD))
    orders = loader._splits[0]
    assert not np.array_equal(orders._epoch_order(0)[1], orders._epoch_order(1)[1])  # documents reshuffled


def test_val_documents_never_appear_in_train(tmp_path: Path) -> None:
    write_docs(tmp_path / "c", [6, 9, 4, 7, 5, 8, 6, 10, 3, 7])
    data = open_data([str(tmp_path / "c")], val_fraction=0.25)  # ceil(2.5) = 3 documents held out
    val_docs = {7, 8, 9}
    train = data.loader("train", seq_len=4, global_batch=8, seed=0)
    val = data.loader("val", seq_len=4, global_batch=8, seed=0)
    seen_train = {doc_of(t) for _ in range(30) for t in _windows(*train.next()).flatten().tolist() if t != EOD}
    seen_val = {doc_of(t) for _ in range(10) for t in _windows(*val.next()).flatten().tolist() if t != EOD}
    assert seen_train == set(range(7)) and seen_val == val_docs


def test_flat_val_split_is_the_token_tail(tmp_path: Path) -> None:
    data = open_data([_flat(tmp_path, 1000)], val_fraction=0.1)
    val = data.loader("val", seq_len=10, global_batch=9, seed=0).batch(0)
    train = data.loader("train", seq_len=10, global_batch=89, seed=0).batch(0)
    assert int(_windows(*val).min()) >= 900 and int(_windows(*train).max()) < 900


def test_blend_follows_megatrons_rule_exactly(tmp_path: Path) -> None:
    weights = [0.5, 0.3, 0.2]
    n = CHECKPOINT_EVERY + 1500  # past a checkpoint of the schedule
    ref_dataset, ref_local = blend_reference(weights, n)
    for first, count in ((0, 100), (4000, 300), (CHECKPOINT_EVERY + 1000, 500), (17, 1)):
        dataset, local = BlendSchedule(weights).assign(first, count)
        assert np.array_equal(dataset, ref_dataset[first : first + count])
        assert np.array_equal(local, ref_local[first : first + count])
    # The realised counts after every prefix of i samples stay within 1 of weight * i.
    counts_NK = np.cumsum(np.eye(len(weights), dtype=np.int64)[ref_dataset], axis=0)
    expected_NK = np.arange(1, n + 1)[:, None] * np.array(weights)
    assert np.abs(counts_NK - expected_NK).max() <= 1
    assert blend_reference([0.5, 0.5], 4)[0].tolist() == [0, 1, 0, 1]  # ties go to the lower index
    assert BlendSchedule([0.5, 0.5]).assign(0, 4)[0].tolist() == [0, 1, 0, 1]
    # Megatron's build_blending_indices weighs sample i by max(i, 1), so samples 0 and 1 both use 1: dataset 1
    # comes second (a rule weighing by i + 1 would give 0, 0, 1, ...), and sample 4 is a tie (0 = 0) to 0.
    megatron = [0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0]
    assert blend_reference([0.75, 0.25], 12)[0].tolist() == megatron
    assert BlendSchedule([0.75, 0.25]).assign(0, 12)[0].tolist() == megatron


def test_blend_of_two_files_draws_by_weight(tmp_path: Path) -> None:
    a = _flat(tmp_path, 2000, "a.npy")
    np.save(tmp_path / "b.npy", np.arange(100_000, 102_000, dtype=np.uint32))
    items = ["3", a, "1", str(tmp_path / "b.npy")]
    assert parse_data_path(items) == [(0.75, a), (0.25, str(tmp_path / "b.npy"))]
    data = open_data(items)
    assert data.description.startswith("blend of 2: 0.75 x npy ")
    ids, _ = data.loader("train", seq_len=4, global_batch=400, seed=0).batch(0)
    from_b = int((ids[:, 0] >= 100_000).sum())
    assert from_b == 100  # exactly a quarter: the greedy keeps each count within 1 of weight * samples


def test_check_vocab_names_the_file_position_and_document(tmp_path: Path) -> None:
    docs = write_docs(tmp_path / "c", [4, 6, 5], dtype=np.int32)
    tokens = np.concatenate(docs)
    tokens[12] = 70_001  # document 2, position 12
    from moe.data.indexed import IndexedWriter

    with IndexedWriter(tmp_path / "c", dtype=np.int32) as w:
        w.add_documents(tokens, [4, 6, 5])
    data = open_data([str(tmp_path / "c")])
    assert data.max_token_id() == 70_001
    data.check_vocab(70_002)
    with pytest.raises(DataError) as err:
        data.check_vocab(70_000)
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"{tmp_path / 'c'}.bin: token id 70001 at position 12 (document 2) is >= the model's ")
    assert "vocab_size 70000" in msg and "at least 70002" in msg
    np.save(tmp_path / "f.npy", np.array([1, 2, 300, 4], np.uint16))
    with pytest.raises(DataError, match=r"f\.npy: token id 300 at position 2 is >= the model's vocab_size 256"):
        open_data([str(tmp_path / "f.npy")]).check_vocab(256)


@pytest.mark.parametrize(
    ("items", "match"),
    [
        (["0.5", "a", "b"], "pairs of WEIGHT PATH"),
        (["x", "a", "0.5", "b"], "weight 'x' before 'a' is not a number"),
        (["0", "a", "1", "b"], "weight '0' of 'a' must be a positive number"),
        (["-1", "a"], "must be a positive number"),
    ],
)
def test_malformed_data_paths(items: list[str], match: str) -> None:
    with pytest.raises(DataError, match=match):
        parse_data_path(items)


def test_bad_loader_requests_fail_clearly(tmp_path: Path) -> None:
    data = open_data([_flat(tmp_path, 100)], val_fraction=0.1)
    with pytest.raises(DataError, match="global batch 8 does not split over 3 data-parallel ranks"):
        data.loader("train", seq_len=4, global_batch=8, dp_size=3)
    with pytest.raises(DataError, match=r"the val split has 10 tokens, fewer than one window of seq_len \+ 1 = 17"):
        data.loader("val", seq_len=16, global_batch=1)
    with pytest.raises(DataError, match="split must be one of"):
        data.loader("test", seq_len=4, global_batch=1)
    no_val = open_data([_flat(tmp_path, 100)], val_fraction=0.0)
    with pytest.raises(DataError, match="there is no val split: val_fraction is 0"):
        no_val.loader("val", seq_len=4, global_batch=1)
    write_docs(tmp_path / "one", [50])
    with pytest.raises(DataError, match="1 document"):
        open_data([str(tmp_path / "one")]).loader("train", seq_len=4, global_batch=1)
    with pytest.raises(DataError, match="val_fraction must be in"):
        open_data([_flat(tmp_path, 100)], val_fraction=1.0)

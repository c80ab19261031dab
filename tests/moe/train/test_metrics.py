"""The metrics files' helpers: the JSONL file a resumed run rewrites, the sizes the checkpoint line gives.
(A resumed run's records, JSONL and TensorBoard, and the checkpoint line, in a run: test_jobs.py.)"""

from __future__ import annotations

import json
from pathlib import Path

from moe.train.metrics import drop_records_after, format_bytes


def test_a_resumed_run_keeps_the_records_up_to_its_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    records = [json.dumps({"step": s, "loss": 5.0 - s}) for s in (1, 2, 3, 4)]
    path.write_text("\n".join(records) + '\n{"step": 5, "lo')  # a killed run's torn last line
    drop_records_after(path, 2)
    assert path.read_text() == records[0] + "\n" + records[1] + "\n"
    assert not list(tmp_path.glob(".*.tmp"))
    drop_records_after(tmp_path / "none.jsonl", 2)  # nothing to drop: no file is made
    assert not (tmp_path / "none.jsonl").exists()


def test_sizes_read_in_binary_units() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1024, 12.3 * 2**20, 5 * 2**40)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "12.3 MiB",
        "5120.0 GiB",
    ]

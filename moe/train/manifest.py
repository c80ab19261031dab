"""A checkpoint's manifest: every file with its size and CRC-32, so a damaged checkpoint is found before loading.

``manifest.json`` is written into the partial directory once every rank's files are there, before the rename
that makes the checkpoint visible; a checkpoint directory without one was written by an older version.
Plain file operations, no process group: ``moe.train.checkpoint`` decides which rank calls them.

CRC-32 (zlib) rather than SHA-256: the manifest guards against accidental damage (a truncated shard, a
killed copy, a flipped bit), not against someone who can write the directory (they could rewrite the
manifest too; ``torch.load(weights_only=True)`` is what keeps such a directory from running code). It reads
at several GB/s, about 3x SHA-256 here, and verifying is one read of the checkpoint on one rank.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

__all__ = ["MANIFEST", "CheckpointError", "verify_checkpoint", "write_manifest"]

MANIFEST = "manifest.json"
_FORMAT = 1
_CHUNK = 1 << 20  # 1 MiB reads: the checksum streams, shards never sit whole in memory


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, verified or loaded; the message names the checkpoint and why."""


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(directory: str | Path) -> Path:
    """Checksum every file under ``directory`` (read back from disk; one in a subdirectory by its relative path,
    ``hf_source/tokenizer.json``) into its ``manifest.json``; fsync it."""
    directory = Path(directory)
    files = {
        p.relative_to(directory).as_posix(): {"size": p.stat().st_size, "crc32": _crc32(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p != directory / MANIFEST
    }
    path = directory / MANIFEST
    with open(path, "w") as f:
        json.dump({"format": _FORMAT, "checksum": "crc32", "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return path


def verify_checkpoint(path: str | Path, *, checksums: bool = True) -> bool:
    """Check ``path`` against its manifest: True when verified, False for a checkpoint without a manifest
    (an older version's; it must still hold ``meta.json``). Raises :class:`CheckpointError` naming the first
    missing, short or changed file. ``checksums=False`` compares sizes only (no reads)."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.exists():
        if (path / "meta.json").is_file():
            return False
        raise CheckpointError(f"{path}: incomplete, neither {MANIFEST} nor meta.json")
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest}: unreadable ({exc})") from None
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing")
        size = f.stat().st_size
        if size != want["size"]:
            raise CheckpointError(f"{f}: {size} bytes, the manifest says {want['size']} (truncated or rewritten)")
        if checksums and _crc32(f) != want["crc32"]:
            raise CheckpointError(f"{f}: CRC-32 differs from the manifest (corrupted)")
    return True

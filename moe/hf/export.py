"""Writing a Hugging Face checkpoint directory from a model's pipeline stages, rank by rank.

    save_hf(stages, "out/hf", cfg)      # on every rank of the job, each with its own stages

The directory is what transformers' ``save_pretrained`` writes for the architecture: config.json
(:func:`moe.hf.to_hf_config`), safetensors shards ``model-00001-of-0000N.safetensors`` of at most
``max_shard_bytes`` each (a tensor larger than that alone in its shard) and ``model.safetensors.index.json``
(``metadata.total_size`` and the ``weight_map``), the tensors in the hub layout of :func:`moe.hf.to_hub` (one
tensor per expert, global expert indices).

Sharing the work: each rank converts only its own stages and writes its own shards, so no rank holds more than
its stages' tensors plus the shard it is writing. A tensor several ranks hold (dense weights on every
data-parallel rank, DualPipe's mirrored stages, the MTP layer's copies of the embedding and head) is written
once, by the lowest rank holding it: the ranks agree on that and on the global shard numbering with one
``all_gather_object`` of the names and sizes each would write (a few hundred short names per rank). Without a
process group, one process writes everything it is given.

What the model started from is kept (:class:`HFSource`): for a model read from a Hugging Face directory,
config.json is that directory's with only what training changed set (:func:`moe.hf.to_hf_config`'s ``source``),
and its tokenizer files and ``generation_config.json`` (:data:`SOURCE_FILES`) are copied, byte for byte. A
checkpoint of such a model carries both (:meth:`HFSource.into_checkpoint`), so ``moe.convert`` exports it the
same way after the directory has gone. Every file is written with the user's umask (0644 under umask 022).

Atomic: everything goes to ``.<name>.partial`` beside the target, renamed once every rank's shards are in place.
A failure on any rank (a full disk) raises :class:`HFExportError` on every rank and removes the partial
directory; the target is never half-written. The target must not exist, or be an empty directory.

:func:`plan_pieces` and :func:`write_hf_dir` are the parts ``python -m moe.convert`` reuses with tensors read
from one of our checkpoints.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moe.hf.config import to_hf_config
from moe.hf.keys import checkpoint_shapes, to_hub
from moe.models.config import MoEConfig
from moe.models.stage import MoEStage

__all__ = [
    "MAX_SHARD_BYTES",
    "SOURCE_FILES",
    "HFExportError",
    "HFSource",
    "Piece",
    "check_target",
    "plan_pieces",
    "save_hf",
    "write_hf_dir",
]

MAX_SHARD_BYTES = 5 * 10**9
"""transformers' default ``max_shard_size`` ("5GB")."""


SOURCE_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
)
"""The files of a Hugging Face directory besides config.json and the weights that an export copies: the
tokenizer's (fast, BPE vocab and merges, SentencePiece, the chat template) and the generation defaults."""

_CHECKPOINT_DIR = "hf_source"
"""Where a checkpoint of ours keeps the :data:`SOURCE_FILES` of the directory its model came from."""


class HFExportError(RuntimeError):
    """An export that cannot be written (the target exists, a rank failed to write); one line."""


@dataclass(frozen=True, slots=True)
class HFSource:
    """The Hugging Face directory a model started from, as far as an export keeps it: its config.json and its
    :data:`SOURCE_FILES` (a few files of a few MB at most, held in memory: the directory may go away)."""

    config: dict[str, Any]
    """config.json as read."""
    files: dict[str, bytes]
    """The :data:`SOURCE_FILES` it has, by name."""

    @classmethod
    def read(cls, path: str | Path) -> HFSource:
        path = Path(path)
        return cls(json.loads((path / "config.json").read_text()), _source_files(path))

    def into_checkpoint(self, meta: dict[str, Any]) -> dict[str, bytes]:
        """Record the source in a checkpoint's ``meta`` (its config.json under ``hf_config``); returns the files
        to store beside it, by path in the checkpoint directory."""
        meta["hf_config"] = self.config
        return {f"{_CHECKPOINT_DIR}/{name}": data for name, data in self.files.items()}

    @classmethod
    def from_checkpoint(cls, step: str | Path, meta: dict[str, Any]) -> HFSource | None:
        """What :meth:`into_checkpoint` recorded in the checkpoint directory ``step``; None for a model that
        started from no Hugging Face directory (a preset), or a checkpoint written before sources were kept."""
        if meta.get("hf_config") is None:
            return None
        return cls(meta["hf_config"], _source_files(Path(step) / _CHECKPOINT_DIR))


def _source_files(folder: Path) -> dict[str, bytes]:
    """The :data:`SOURCE_FILES` ``folder`` has, by name."""
    return {name: (folder / name).read_bytes() for name in SOURCE_FILES if (folder / name).is_file()}


@dataclass(frozen=True, slots=True)
class Piece:
    """Hub tensors made together from one of our tensors: a dense tensor, or a view of one (``view``: size,
    stride, offset), or one expert's matrices (``row``: its row in our tensor, ``expert``: its global index)."""

    source: int
    """Which of the writer's sources (a stage) holds ``key``."""
    key: str
    """Our tensor's name."""
    names: tuple[str, ...]
    """The hub names it makes."""
    sizes: tuple[int, ...]
    """Their bytes as written."""
    view: tuple[tuple[int, ...], tuple[int, ...], int] | None = None
    row: int | None = None
    expert: int | None = None


def _is_expert(key: str) -> bool:
    return ".experts." in key  # the grouped experts, [E_local, ...] (as MoEStage.expert_parameters)


def plan_pieces(
    shapes: Mapping[str, tuple[torch.Size, torch.dtype]],
    *,
    first_expert: int = 0,
    source: int = 0,
    dtype: torch.dtype | None = None,
) -> list[Piece]:
    """What our tensors of ``shapes`` (name -> shape, dtype; expert tensors holding experts ``first_expert ..``)
    become in the hub layout, planned on meta tensors: nothing is read or copied. ``dtype``: as written (None:
    each tensor's own)."""

    def nbytes(t: torch.Tensor) -> int:
        return t.numel() * (dtype or t.dtype).itemsize

    meta = {k: torch.empty(shape, dtype=dt, device="meta") for k, (shape, dt) in shapes.items()}
    dense = {k: t for k, t in meta.items() if not _is_expert(k)}
    owner = {id(t): k for k, t in dense.items()}
    pieces = []
    # Dense tensors map as a whole: to_hub returns ours, or views of ours (the halves of a fused gate_up; the
    # MTP layer's copies of the embedding and head), so each hub tensor is a view of one of ours.
    for name, h in to_hub(dense).items():
        key = owner.get(id(h)) or owner.get(id(h._base))
        if key is None:
            raise HFExportError(f"{name}: to_hub made a new tensor; export expects our tensors or views of them")
        view = (tuple(h.shape), tuple(h.stride()), h.storage_offset())
        pieces.append(Piece(source, key, (name,), (nbytes(h),), view=view))
    for key, t in meta.items():
        if _is_expert(key):
            for row in range(t.shape[0]):
                hub = to_hub({key: t[row : row + 1]}, first_expert=first_expert + row)
                sizes = tuple(nbytes(h) for h in hub.values())
                pieces.append(Piece(source, key, tuple(hub), sizes, row=row, expert=first_expert + row))
    return pieces


def make_piece(piece: Piece, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A piece's hub tensors from our tensor ``tensor`` (for an expert piece: its one row, ``[1, ...]``)."""
    if piece.view is not None:
        size, stride, offset = piece.view
        tensor = tensor.contiguous()  # the plan's strides are those of a contiguous tensor
        return {piece.names[0]: tensor.as_strided(size, stride, tensor.storage_offset() + offset)}
    return to_hub({piece.key: tensor}, first_expert=piece.expert or 0)


def check_target(path: Path) -> None:
    """An export goes to a new (or empty) directory: anything else is one line, raised before any collective."""
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise HFExportError(f"{path} exists and is not an empty directory: export into a new directory")


def _shards(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Consecutive indices packed into shards of at most ``limit`` bytes (a larger tensor alone in its own)."""
    shards: list[list[int]] = []
    used = limit + 1
    for i, n in enumerate(sizes):
        if shards and used + n <= limit:
            shards[-1].append(i)
            used += n
        else:
            shards.append([i])
            used = n
    return shards


def _shard_name(index: int, total: int) -> str:
    """The standard name of shard ``index`` (0-based) of ``total``."""
    return f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def _gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def _raise_if_failed(errors: list[str | None], what: str) -> None:
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        raise HFExportError(f"{what} failed: {'; '.join(failed)}")


def write_hf_dir(
    path: str | Path,
    config: dict[str, Any],
    pieces: Sequence[Piece],
    make: Callable[[list[Piece]], dict[str, torch.Tensor]],
    *,
    files: dict[str, bytes] | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Write this rank's ``pieces`` (``make(pieces)`` gives their hub tensors by name) as shards of a Hugging
    Face directory at ``path``; rank 0 adds the index, ``config`` and ``files`` (name -> contents: the source's
    tokenizer, :class:`HFSource`). Collective over ``group`` (None: one process). Holds one shard's tensors
    (plus what ``make`` reads for it) at a time."""
    import safetensors.torch  # the hf extra; the caller imported moe.hf, which says how to install it

    path = Path(path)
    check_target(path)
    if max_shard_bytes < 1:
        raise HFExportError(f"max_shard_bytes = {max_shard_bytes}: must be positive")
    rank = dist.get_rank(group) if group is not None else 0
    partial = path.parent / f".{path.name}.partial"
    error = None
    if rank == 0:
        try:
            shutil.rmtree(partial, ignore_errors=True)  # left by an export that crashed
            partial.mkdir(parents=True)
        except OSError as exc:
            error = _first_line(exc)
    names = [(name, size) for p in pieces for name, size in zip(p.names, p.sizes)]
    plans = _gather((error, names), group)
    try:
        _raise_if_failed([e for e, _ in plans], f"exporting to {path}")
        # safetensors writes 0600 whatever the umask; the shards take the mode the umask gives a new file, read
        # off the directory rank 0 just made (0777 & ~umask) without setting the process-wide umask
        mode = partial.stat().st_mode & 0o666
        # The lowest rank that holds a tensor writes it (within a rank, its first piece); every rank derives every
        # rank's shards from the plans, so the global numbering needs no further exchange.
        seen: set[str] = set()
        written: list[list[tuple[str, int]]] = []
        for _, listed in plans:
            written.append([])
            for name, size in listed:
                if name not in seen:
                    seen.add(name)
                    written[-1].append((name, size))
        shards = [[[mine[i] for i in s] for s in _shards([n for _, n in mine], max_shard_bytes)] for mine in written]
        total = sum(len(s) for s in shards)
        first = sum(len(s) for s in shards[:rank])
        error = None
        try:
            maker = {n: p for p in reversed(pieces) for n in p.names}  # reversed: a name's first piece wins
            for k, shard in enumerate(shards[rank]):
                made = make(list({id(maker[n]): maker[n] for n, _ in shard}.values()))
                tensors = {
                    n: made[n].detach().to("cpu", dtype or made[n].dtype, copy=True).contiguous() for n, _ in shard
                }
                del made
                file = partial / _shard_name(first + k, total)
                safetensors.torch.save_file(tensors, str(file), metadata={"format": "pt"})
                os.chmod(file, mode)
        except Exception as exc:  # reported to every rank below
            error = _first_line(exc)
        _raise_if_failed(_gather(error, group), f"exporting to {path}")
        if rank == 0:
            try:
                weight_map, size, index = {}, 0, 0
                for r in range(len(plans)):
                    for shard in shards[r]:
                        index += 1
                        for n, s in shard:
                            weight_map[n] = _shard_name(index - 1, total)
                            size += s
                meta = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
                (partial / "model.safetensors.index.json").write_text(json.dumps(meta, indent=2) + "\n")
                (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
                for name, data in (files or {}).items():
                    (partial / name).write_bytes(data)
                if path.is_dir():
                    path.rmdir()  # empty (check_target): the rename takes its place
                os.rename(partial, path)
            except OSError as exc:
                error = _first_line(exc)
        _raise_if_failed(_gather(error, group), f"exporting to {path}")
    except HFExportError:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise


def _stage_tensors(stage: MoEStage) -> dict[str, torch.Tensor]:
    """The stage's tensors a checkpoint holds (:func:`moe.hf.keys.checkpoint_shapes`), by our name."""
    named = {**dict(stage.named_parameters()), **dict(stage.named_buffers())}
    return {key: named[key].detach() for key in checkpoint_shapes(stage)}


def save_hf(
    stages: Sequence[MoEStage],
    path: str | Path,
    cfg: MoEConfig,
    *,
    source: HFSource | None = None,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    group: dist.ProcessGroup | None = None,
) -> None:
    """Write the model whose stages the ranks hold as a Hugging Face directory at ``path``; collective over
    ``group`` (default: the default process group, if there is one; else this process's ``stages`` are the
    whole model). ``dtype``: of the written tensors and config.json's ``torch_dtype`` (None: the parameters').
    ``source``: the directory the model started from, whose config.json and tokenizer the export keeps (None:
    config.json written afresh from ``cfg``).

    A config the published architectures cannot express, or a target that exists and is not empty, is an error
    raised before any collective (:class:`moe.hf.HFConfigError`, :class:`HFExportError`)."""
    if group is None and dist.is_initialized():
        group = dist.group.WORLD
    written = dtype or next(p.dtype for s in stages for p in s.parameters())
    raw = None if source is None else source.config
    config = to_hf_config(cfg, dtype=str(written).removeprefix("torch."), source=raw)
    check_target(Path(path))
    sources = [_stage_tensors(stage) for stage in stages]
    pieces = []
    for i, (stage, tensors) in enumerate(zip(stages, sources)):
        shapes = {k: (t.shape, t.dtype) for k, t in tensors.items()}
        pieces += plan_pieces(shapes, first_expert=stage.dispatcher.local_experts.start, source=i, dtype=dtype)

    def make(needed: list[Piece]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for p in needed:
            t = sources[p.source][p.key]
            out.update(make_piece(p, t if p.row is None else t[p.row : p.row + 1]))
        return out

    files = source.files if source is not None else None
    write_hf_dir(path, config, pieces, make, files=files, dtype=dtype, max_shard_bytes=max_shard_bytes, group=group)

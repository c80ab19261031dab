"""Distributed checkpoints that survive crashes and change of parallel layout.

Everything is saved with ``torch.distributed.checkpoint`` under *global* names, so a checkpoint written at
one (pp, ep) loads at another:

- stage parameters and buffers are already named by global layer (``blocks.7.attn.wq.weight``);
- expert weights, sharded over the expert-parallel group as ``[E_local, ...]``, are saved one expert per
  entry (``blocks.7.mlp.experts.w1.e42``), so any split of the experts reads its rows;
- optimizer state follows its parameter's names (the keys :attr:`moe.optim_state.OptimizerSpec.state` names), in
  the dtype the optimizer keeps it in (bf16 moments under ``optimizer.state_dtype``); DCP casts on load, so a run
  may resume with the other state dtype;
- under ZeRO-1 each rank holds its rows of every entry's fp32 master and state (:func:`moe.optim_state.shard_rows`,
  an expert tensor's rows per expert) and saves them as a DTensor ``Shard(0)`` over a mesh of its group, whose
  chunks DCP records: a load at any other group size, or without ZeRO-1, reads the rows it needs from them (and
  a rank loading ZeRO-1 state reads its rows from a whole-tensor entry just as well);
- replicated entries (non-expert weights on every ep rank, DualPipe's two copies of a stage, the same chunk
  from two replicas) are written once, the planner de-duplicates them.
- the moving average of the weights (``--ema``, :class:`moe.train.ema.HostEMA`), when the run keeps one, under
  ``ema.<key>`` in fp32, each rank its rows as for the optimizer state (:func:`has_ema` tells whether a
  checkpoint holds it; ``load_checkpoint(..., ema_weights=True)`` loads it as the weights).

Atomicity: all ranks write into ``.step_NNNNNNNN.partial``; once every rank's files are there, rank 0 adds
``meta.json`` and a manifest (``moe.train.manifest``: each file's size and CRC-32), renames the directory to
``step_NNNNNNNN`` and then atomically replaces the ``latest`` pointer. A crash at any point leaves the last
good checkpoint and its pointer untouched; stale partial directories are removed by the next save. A write
that fails on any rank (a full disk) fails the save on every rank and removes the partial directory.

Resuming (:func:`find_checkpoint`) verifies ``latest`` against its manifest and falls back to the newest
intact older checkpoint, with a warning naming the damaged one; all ranks get rank 0's choice before any
loads. :func:`model_source` makes the same choice locally, without a process group, for the commands that
read a model in any form the trainer writes (``moe.eval``, ``moe.convert``). Per-rank state is read with
``torch.load(weights_only=True)``, so a checkpoint directory from elsewhere cannot run code.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from moe.models.config import MoEConfig
from moe.train.ema import HostEMA
from moe.train.manifest import MANIFEST, CheckpointError, verify_checkpoint, write_manifest
from moe.train.optimizer import DistributedOptimizer, ParamShard

Optimizer = torch.optim.Optimizer | DistributedOptimizer

__all__ = [
    "CheckpointError",
    "ModelSource",
    "checkpoint_entries",
    "find_checkpoint",
    "has_ema",
    "latest_checkpoint",
    "load_checkpoint",
    "model_source",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "verify_checkpoint",
    "write_files",
]

_LATEST = "latest"


def _expert_offset(module: nn.Module, name: str) -> int | None:
    """Global index of the first local expert for an expert tensor ``name`` of a stage, else None."""
    parts = name.split(".")
    if "experts" not in parts or parts[0] != "blocks":
        return None
    block = module.blocks[parts[1]]  # type: ignore[index]
    return block.dispatcher.local_experts.start


def checkpoint_entries(
    modules: Sequence[nn.Module],
) -> Iterator[tuple[str, torch.Tensor, nn.Parameter | None, int | None]]:
    """Our checkpoints' entries, the one definition of their names (saving, loading and ``moe.convert``):
    (global key, tensor to save or load in place, owning parameter or None for buffers, expert row)."""
    for module in modules:
        params = dict(module.named_parameters())
        for name, t in [*params.items(), *module.named_buffers()]:
            param = params.get(name)
            offset = _expert_offset(module, name)
            if offset is None:
                yield name, t, param, None
            else:
                for row in range(t.shape[0]):
                    yield f"{name}.e{offset + row}", t[row], param, row


def _optimizer_state(optimizer: Optimizer, p: nn.Parameter) -> dict[str, torch.Tensor]:
    """``p``'s optimizer state to save or load in place (this rank's rows of it under ZeRO-1). A plain torch
    optimizer must be Adam or AdamW."""
    if isinstance(optimizer, DistributedOptimizer):
        return optimizer.state_for(p)
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise TypeError(f"checkpointing supports Adam/AdamW state, not {type(optimizer).__name__}")
    state = optimizer.state[p]
    if not state:  # before the first step: create the state the optimizer would, so it can be loaded into
        state["step"] = torch.tensor(0.0)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def _has_master(optimizer: Optimizer | None, param: nn.Parameter | None) -> bool:
    """Whether ``param``'s weight lives in a separate fp32 master (bf16 training with master weights)."""
    return (
        isinstance(optimizer, DistributedOptimizer)
        and param is not None
        and param.dtype != torch.float32
        and optimizer.master_weights
    )


class _Rows:
    """This rank's rows of checkpoint entries as DTensors ``Shard(0)`` over its ZeRO-1 group, whose chunk
    metadata DCP writes and reads (one mesh per group, made without communication)."""

    def __init__(self) -> None:
        self._meshes: dict[tuple[int, str], DeviceMesh] = {}

    def __call__(
        self, key: str, local: torch.Tensor, entry: torch.Tensor, row: int | None, shard: ParamShard | None
    ) -> torch.Tensor:
        """``local``: this rank's rows of ``entry`` (the parameter, or its expert ``row``); itself when they are
        all of it (``shard`` None: a plain torch optimizer's)."""
        if shard is None or not shard.sharded:
            return local
        if shard.dim != (0 if row is None else 1):  # each entry is split along its own dim 0
            raise ValueError(
                f"{key}: ZeRO-1 state split along dim {shard.dim}; an expert tensor's shard group "
                "must be stacked (ShardGroup(stacked=True)), any other tensor's not"
            )
        assert shard.group is not None
        at = (id(shard.group), local.device.type)
        if at not in self._meshes:
            self._meshes[at] = DeviceMesh.from_group(shard.group, local.device.type)
        stride = torch.empty(entry.shape, device="meta").stride()
        return DTensor.from_local(
            local, self._meshes[at], [Shard(0)], run_check=False, shape=entry.shape, stride=stride
        )


def _state_dict(
    modules: Sequence[nn.Module],
    optimizer: Optimizer | None,
    staged: dict[nn.Parameter, torch.Tensor] | None = None,
    *,
    ema: HostEMA | None = None,
    ema_weights: bool = False,
) -> dict[str, torch.Tensor]:
    """The flat DCP state under global names. A weight with an fp32 master is saved from the master (so every
    copy of a key has one dtype), under ZeRO-1 each rank its rows; to load, pass ``staged``: such weights are
    read whole into fp32 tensors collected there, for :meth:`DistributedOptimizer.load_weight_` to set
    afterwards (from whichever chunks were saved). ``ema``: its average of each parameter too (``ema.<key>``,
    this rank's rows); ``ema_weights`` (no optimizer): the parameters are read from those entries."""
    flat: dict[str, torch.Tensor] = {}
    rows = _Rows()
    for key, t, param, row in checkpoint_entries(modules):
        if ema_weights and param is not None:
            flat[f"ema.{key}"] = t
        elif not _has_master(optimizer, param):
            flat[f"model.{key}"] = t
        elif staged is not None:
            whole = staged.setdefault(param, torch.empty_like(param, dtype=torch.float32))
            flat[f"model.{key}"] = whole if row is None else whole[row]
        else:
            master = optimizer.master_for(param)  # type: ignore[union-attr]
            local = master if row is None else master[row]
            flat[f"model.{key}"] = rows(key, local, t, row, optimizer.shard_of(param))  # type: ignore[union-attr]
        if optimizer is None or param is None or not param.requires_grad:
            continue
        shard = optimizer.shard_of(param) if isinstance(optimizer, DistributedOptimizer) else None
        for name, s in _optimizer_state(optimizer, param).items():
            # "step" is a scalar shared by every row of an expert tensor, the same on every rank of the group
            flat[f"optim.{key}.{name}"] = s if s.dim() == 0 else rows(key, s if row is None else s[row], t, row, shard)
        if ema is not None:
            average = ema.state_for(param)
            flat[f"ema.{key}"] = rows(key, average if row is None else average[row], t, row, shard)
    return flat


def has_ema(path: str | Path) -> bool:
    """Whether the checkpoint ``path`` (a ``step_*`` directory) holds a moving average of the weights (its DCP
    metadata names ``ema.`` entries; nothing else is read)."""
    stored = dcp.FileSystemReader(Path(path)).read_metadata().state_dict_metadata
    return any(key.startswith("ema.") for key in stored)


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every complete-looking ``step_NNNNNNNN`` directory, newest first."""
    found = []
    for p in root.glob("step_*") if root.is_dir() else []:
        suffix = p.name.removeprefix("step_")
        if p.is_dir() and len(suffix) == 8 and suffix.isdigit():
            found.append((int(suffix), p))
    return sorted(found, reverse=True)


def _pointer_target(root: Path) -> Path | None:
    pointer = root / _LATEST
    if not pointer.is_file():
        return None
    return root / pointer.read_text().strip()


def latest_checkpoint(ckpt_dir: str | Path) -> Path | None:
    """The directory ``latest`` points to, or None when there is no complete checkpoint. Not verified: to
    resume, use :func:`find_checkpoint`."""
    target = _pointer_target(Path(ckpt_dir))
    return target if target is not None and (target / "meta.json").exists() else None


def _choose(root: Path, strict: bool, checksums: bool = True) -> tuple[Path | None, list[str], str | None]:
    """(checkpoint to load, warnings, error): the newest intact one, starting from ``latest`` (``checksums``
    False: intact by the manifest's sizes, no reads)."""
    steps = _step_dirs(root)
    if not steps:
        return None, [], None
    warnings: list[str] = []
    candidates = [p for _, p in steps]
    target = _pointer_target(root)
    if target is not None and target.is_dir():
        # Directories newer than ``latest`` were never pointed to (a save that failed after its rename, or
        # steps of a run that was rolled back to an older checkpoint): not candidates.
        candidates = candidates[candidates.index(target) :] if target in candidates else [target, *candidates]
    elif target is not None:
        warnings.append(f"{root / _LATEST} points to {target.name}, which does not exist; using the newest step_*")
    for path in candidates:
        try:
            verified = verify_checkpoint(path, checksums=checksums)
        except CheckpointError as exc:
            if strict:
                return None, warnings, f"the newest checkpoint is damaged: {exc}"
            warnings.append(f"skipping damaged checkpoint {path}: {exc}")
            continue
        if not verified:
            warnings.append(f"{path} has no {MANIFEST} (written by an older version): loading it unverified")
        return path, warnings, None
    return None, warnings, f"no intact checkpoint in {root} ({len(candidates)} damaged, none deleted)"


def find_checkpoint(ckpt_dir: str | Path, *, strict: bool = False) -> tuple[Path | None, list[str]]:
    """Collectively pick the checkpoint to resume from: ``(path or None, warnings)``, the same on every rank.

    Rank 0 verifies candidates against their manifests, newest (``latest``) first, and broadcasts its choice
    before any rank loads, so no two ranks load different checkpoints. A damaged one is skipped with a
    warning naming it and its bad file; ``strict`` makes a damaged newest checkpoint an error. None when
    the directory holds no checkpoint at all. Raises :class:`CheckpointError` on every rank when nothing
    loadable is left. Nothing is deleted.
    """
    decision: list[Any] = [None]
    if dist.get_rank() == 0:
        path, warnings, error = _choose(Path(ckpt_dir), strict)
        decision = [(None if path is None else str(path), warnings, error)]
    dist.broadcast_object_list(decision, src=0)
    path, warnings, error = decision[0]
    if error is not None:
        raise CheckpointError(error)
    return (None if path is None else Path(path)), warnings


@dataclass(frozen=True, slots=True)
class ModelSource:
    """The weights a ``--model`` directory names (:func:`model_source`)."""

    kind: str
    """``"hf"`` (a Hugging Face directory: config.json and safetensors) or ``"ours"`` (a ``step_*`` checkpoint)."""
    path: Path
    """The Hugging Face directory, or the ``step_*`` directory chosen."""
    warnings: tuple[str, ...] = ()
    """Damaged or unverified checkpoints passed over on the way (see :func:`find_checkpoint`)."""

    def config(self) -> MoEConfig:
        """The model's configuration: config.json's, or the one the checkpoint's meta.json records."""
        if self.kind == "hf":
            from moe.hf import HFConfigError, read_hf_config  # the hf package only for its directories

            try:
                return read_hf_config(self.path)
            except HFConfigError as exc:
                raise CheckpointError(str(exc)) from None
        meta = json.loads((self.path / "meta.json").read_text())
        if "model" not in meta:
            raise CheckpointError(f"{self.path}: its meta.json predates the model config; use a newer checkpoint")
        return MoEConfig(**meta["model"])


def model_source(path: str | Path, *, checksums: bool = True) -> ModelSource:
    """What ``path`` holds, in every form the trainer writes: a Hugging Face directory (config.json; what
    ``--save-hf`` and ``moe.convert`` write), a ``step_*`` checkpoint, or the directory of them (its ``latest``,
    else the newest intact ``step_*``, as :func:`find_checkpoint` picks, with its warnings).

    A local decision, no communication: every rank of a job makes it alike, before any process group exists.
    ``checksums`` False checks files against the manifest's sizes only (no reads: N ranks checksumming the
    same checkpoint would read it N times). Raises :class:`CheckpointError` with one line, without the path
    (the caller's prefix names it): ``no such directory`` for a path that is not there.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError("not a directory" if path.exists() else "no such directory")
    if (path / "config.json").is_file():
        return ModelSource(kind="hf", path=path)
    if (path / "meta.json").is_file() or (path / MANIFEST).is_file():
        verify_checkpoint(path, checksums=checksums)
        return ModelSource(kind="ours", path=path)
    step, warnings, error = _choose(path, strict=False, checksums=checksums)
    if error is not None:
        raise CheckpointError(error)
    if step is None:
        raise CheckpointError(
            "neither a Hugging Face directory (config.json + safetensors) nor one of our checkpoints "
            "(a step_* directory, or the directory of them)"
        )
    return ModelSource(kind="ours", path=step, warnings=tuple(warnings))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _reason(exc: BaseException) -> str:
    """The root cause of a failed write in one line ("[Errno 28] No space left on device: ...")."""
    seen = exc
    failures = getattr(exc, "failures", None)  # dcp's CheckpointException: {rank: wrapped exception}
    if isinstance(failures, dict) and failures:
        wrapped = next(iter(failures.values()))
        seen = wrapped[0] if isinstance(wrapped, tuple) else wrapped
    while seen.__cause__ is not None and not isinstance(seen, OSError):
        seen = seen.__cause__
    return f"{type(seen).__name__}: {seen}".splitlines()[0]


def _agree(error: str | None, what: str) -> None:
    """Every rank learns whether any rank failed (a collective, so a failure on one rank stops all)."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointError(f"{what} failed: {'; '.join(failed)}")


def _write_rank_state(rank_state: dict[str, Any], path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(rank_state, f)
        f.flush()
        os.fsync(f.fileno())


def write_files(directory: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` (path relative to ``directory`` -> contents) into a checkpoint directory being made."""
    for name, data in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)


def _prune(root: Path, newest: Path, keep_last: int) -> None:
    """Remove checkpoints older than the ``keep_last`` newest up to ``newest``; never what ``latest`` names."""
    if keep_last <= 0:
        return
    newest_step = int(newest.name.removeprefix("step_"))
    older = [p for step, p in _step_dirs(root) if step <= newest_step]
    protected = {newest, _pointer_target(root)}
    for old in older[keep_last:]:
        if old not in protected:
            shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    ckpt_dir: str | Path,
    step: int,
    modules: Sequence[nn.Module],
    optimizer: Optimizer | None,
    meta: dict[str, Any],
    rank_state: dict[str, Any] | None = None,
    keep_last: int = 3,
    files: dict[str, bytes] | None = None,
    ema: HostEMA | None = None,
) -> Path:
    """Collectively save a checkpoint of ``step``; every rank of the default group must call it.

        ``meta`` (JSON-able: step, data position, config, layout) is written by rank 0; ``rank_state`` (tensors
        and plain values only, e.g. :func:`rng_state`) is saved per rank and restored only at the same world
        size; ``files`` (path in the checkpoint directory -> contents: small ones, the tokenizer of the Hugging Face
        directory the model came from) by rank 0, covered by the manifest; ``ema``: the moving average of the weights
    too (waited for first). Once the new checkpoint is in place and
        matches its manifest, all but the newest ``keep_last`` are removed (0: keep all). A failed write on any rank
        (a full disk) raises :class:`CheckpointError` on every rank after the partial directory is removed; the
        previous checkpoint and ``latest`` are untouched.
    """
    root = Path(ckpt_dir)
    rank = dist.get_rank()
    final = root / f"step_{step:08d}"
    partial = root / f".step_{step:08d}.partial"
    what = f"saving checkpoint {final}"
    error = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".step_*.partial"):  # left by a crash during an earlier save
                shutil.rmtree(stale, ignore_errors=True)
            partial.mkdir()
        except OSError as exc:
            error = _reason(exc)
    _agree(error, what)
    try:
        try:
            if ema is not None:
                ema.wait()
            dcp.save(_state_dict(modules, optimizer, ema=ema), checkpoint_id=partial)
            _write_rank_state(rank_state or {}, partial / f"rank{rank:05d}.pt")
        except (Exception, dcp.CheckpointException) as exc:  # reported to every rank by _agree
            error = _reason(exc)
        _agree(error, what)  # every rank's shards are on disk before the manifest is taken
        if rank == 0:
            try:
                (partial / "meta.json").write_text(
                    json.dumps({**meta, "step": step, "world_size": dist.get_world_size()})
                )
                write_files(partial, files or {})
                write_manifest(partial)
                # The pointer's new content is written before the rename: after it, nothing needs space.
                tmp = root / f".{_LATEST}.tmp"
                with open(tmp, "w") as f:
                    f.write(final.name)
                    f.flush()
                    os.fsync(f.fileno())
                if final.exists():  # a checkpoint of this step from a run since rolled back past it
                    shutil.rmtree(final)
                os.rename(partial, final)
                os.replace(tmp, root / _LATEST)
                _fsync_dir(root)
            except OSError as exc:
                error = _reason(exc)
        _agree(error, what)
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
            (root / f".{_LATEST}.tmp").unlink(missing_ok=True)
        raise
    if rank == 0:
        try:
            verify_checkpoint(final, checksums=False)  # in place and complete before anything older goes
            _prune(root, final, keep_last)
        except CheckpointError as exc:
            error = str(exc)
    _agree(error, f"checking {final} before removing older checkpoints")
    return final


def load_checkpoint(
    path: str | Path,
    modules: Sequence[nn.Module],
    optimizer: Optimizer | None,
    *,
    ema: HostEMA | None = None,
    ema_weights: bool = False,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Load ``path`` (a ``step_*`` directory, from :func:`find_checkpoint`) into ``modules`` and
    ``optimizer`` in place; collective.

    ``ema``: the moving average too, when the checkpoint holds one (:func:`has_ema`); when it does not, the
    average starts over from the loaded weights. ``ema_weights`` (without an optimizer: evaluation, export):
    the parameters get the checkpoint's moving average instead of its weights; a checkpoint without one raises
    :class:`CheckpointError` naming it.

    Returns ``(meta, rank_state)``; ``rank_state`` is None when the world size changed. Per-rank state is
    read with ``torch.load(weights_only=True)``: a file holding anything but tensors and plain values (a
    pickled object could run code) makes every rank raise :class:`CheckpointError` before any weight loads.
    """
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    stored_ema = has_ema(path)
    if ema_weights and not stored_ema:
        raise CheckpointError(f"{path} holds no moving average of the weights (it was trained without --ema)")
    rank_state, error = None, None
    if meta.get("world_size") == dist.get_world_size():
        rank_file = path / f"rank{dist.get_rank():05d}.pt"
        try:
            rank_state = torch.load(rank_file, weights_only=True)
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[0]
            error = f"{rank_file}: refused, it holds more than tensors and plain values ({first})"
        except (OSError, EOFError, RuntimeError) as exc:
            error = f"{rank_file}: {_reason(exc)}"
    _agree(error, f"loading checkpoint {path}")
    staged: dict[nn.Parameter, torch.Tensor] = {}
    if ema is not None:
        ema.wait()
    state = _state_dict(modules, optimizer, staged, ema=ema if stored_ema else None, ema_weights=ema_weights)
    try:
        with torch.no_grad():
            dcp.load(state, checkpoint_id=path)
    except (Exception, dcp.CheckpointException) as exc:  # dcp raises on every rank alike
        raise CheckpointError(f"loading checkpoint {path} failed: {_reason(exc)}") from exc
    for param, weight in staged.items():  # fp32 weights of a bf16 model: into the parameter and its master
        optimizer.load_weight_(param, weight)  # type: ignore[union-attr]
    if ema is not None and not stored_ema:
        ema.reset()
    return meta, rank_state


def rng_state() -> dict[str, Any]:
    """This process's random states as tensors and plain values (loadable with ``weights_only=True``)."""
    version, mt, gauss = random.getstate()
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "torch_rng": torch.get_rng_state(),
        "python_rng": {"version": version, "mt": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy_rng": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda_rng"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured (an older checkpoint's ``torch_rng`` alone is fine too)."""
    torch.set_rng_state(state["torch_rng"])
    if "cuda_rng" in state:
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    if "python_rng" in state:
        py = state["python_rng"]
        random.setstate((py["version"], tuple(py["mt"].tolist()), py["gauss"]))
    if "numpy_rng" in state:
        n = state["numpy_rng"]
        keys = n["keys"].numpy().astype(np.uint32)
        np.random.set_state(("MT19937", keys, n["pos"], n["has_gauss"], n["cached"]))

"""``python -m moe.convert SRC DST``: between our distributed checkpoints and Hugging Face directories, both ways.

    python -m moe.convert runs/ckpt runs/hf --dtype bfloat16      # ours -> HF
    python -m moe.convert /ckpt/DeepSeek-V3 runs/v3               # HF (config.json + safetensors, FP8 too) -> ours

The direction follows SRC, any form the trainer writes (:func:`moe.train.checkpoint.model_source`): a directory
with config.json is a Hugging Face checkpoint; ours is a ``step_*`` directory or the directory of them (its
``latest``, or the newest intact ``step_*`` when that is missing or damaged), verified against its manifest.
DST must not exist (or be empty).

- ours -> HF: config.json from the checkpoint's meta.json (its model config; for a model that started from a
  Hugging Face directory, that directory's config.json with only what training changed set, and its tokenizer
  and generation config copied: the checkpoint carries them), safetensors shards of at most
  ``--max-shard-size`` bytes and their index, in the hub layout (:mod:`moe.hf.export`); optimizer state is left
  out. ``--dtype`` defaults to the checkpoint's (fp32 masters, usually). ``--ema-weights`` writes the checkpoint's
  moving average of the weights (trained with ``--ema``) instead of its weights.
- HF -> ours: a checkpoint ``DST/step_00000000`` (and ``DST/latest``) that :func:`moe.train.checkpoint.load_checkpoint`
  and ``Trainer.resume`` read at any (pp, dp, ep): the weights (FP8 ones dequantized), the buffers a fresh model
  has (expert-load counts, rotary frequencies) and a fresh optimizer state for ``--optimizer`` (zeros at step 0,
  as before a first step; ``none`` leaves it out, for evaluation only), and the source's config.json, tokenizer
  and generation config, for the way back. No data position or random state: a resumed run starts at step 0.
  ``--dtype`` defaults to float32 (what our checkpoints hold: the masters).

One process, never the whole model in memory. Nothing is read to plan: shapes come from a meta-device model of
the config. At peak it holds
- ours -> HF: one shard being written (<= ``--max-shard-size``) and the checkpoint entries it is made from (a
  partial DCP load per shard: the dense tensors and expert rows of that shard, each whole; DCP assembles an
  entry saved under ZeRO-1 from its chunks of rows, one in each file of the ranks that held them);
- HF -> ours: one DCP file (entries are made when DCP writes them, into files of at most 1 GiB; an entry is one
  dense tensor or one expert's matrices, read as safetensors slices) and one block built without weights to
  read its fresh buffers (one expert, uninitialised).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from moe.command import CommandParser, run_command
from moe.dispatch.local import LocalDispatcher
from moe.models.config import MoEConfig
from moe.models.stage import MoEStage
from moe.train.checkpoint import (
    CheckpointError,
    ModelSource,
    checkpoint_entries,
    has_ema,
    model_source,
    write_files,
)
from moe.train.manifest import write_manifest
from moe.train.optimizer import OPTIMIZERS

__all__ = ["ConvertError", "hf_to_ours", "main", "ours_to_hf"]

_DCP_FILE_BYTES = 1 << 30
"""Entries per DCP file, in bytes: DCP keeps a file's tensors until the file is written, so this bounds memory."""
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class ConvertError(SystemExit):
    """A source, target or option that cannot be converted: one line."""


def _parser() -> CommandParser:
    p = CommandParser(
        prog="python -m moe.convert", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("src", help="our checkpoint (a step_* directory or the directory of them) or a Hugging Face one")
    p.add_argument("dst", help="the directory to write (must not exist, or be empty)")
    p.add_argument("--dtype", choices=tuple(_DTYPES), default=None, help="of the weights written (see above)")
    p.add_argument("--max-shard-size", type=int, default=None, metavar="BYTES", help="ours -> HF (default 5e9)")
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=(*OPTIMIZERS, "none"),
        help="HF -> ours: whose fresh state the checkpoint holds, so Trainer.resume loads it (none: weights only)",
    )
    p.add_argument(
        "--ema-weights", action="store_true", help="ours -> HF: the moving average of the weights (trained with --ema)"
    )
    return p


def _skeleton(cfg: MoEConfig) -> MoEStage:
    """The whole model on the meta device: every name and shape, no memory."""
    with torch.device("meta"):
        return MoEStage(cfg, range(cfg.num_layers), first=True, last=True)


@contextmanager
def _one_process() -> Iterator[None]:
    """DCP in this one process (``no_dist``), without its warning that it assumes so."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _empty_target(dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConvertError(f"error: {dst} exists and is not an empty directory: convert into a new directory")


# ours -> HF


def ours_to_hf(
    step: Path, dst: Path, *, dtype: torch.dtype | None, max_shard_bytes: int | None, ema_weights: bool = False
) -> None:
    """Our checkpoint ``step`` (a ``step_*`` directory: :func:`moe.train.checkpoint.model_source` finds it in the
    directory of them) written as a Hugging Face directory ``dst``; ``ema_weights``: its moving average of the
    weights in place of the weights (the buffers are the weights' either way)."""
    from moe.hf import HFConfigError, to_hf_config
    from moe.hf.export import (
        MAX_SHARD_BYTES,
        HFExportError,
        HFSource,
        check_target,
        make_piece,
        plan_pieces,
        write_hf_dir,
    )
    from moe.hf.keys import checkpoint_shapes

    try:
        cfg = ModelSource(kind="ours", path=step).config()
    except CheckpointError as exc:
        raise ConvertError(f"error: {exc}") from None
    meta = json.loads((step / "meta.json").read_text())
    source = HFSource.from_checkpoint(step, meta)  # the Hugging Face directory training started from, if any
    stored = dcp.FileSystemReader(step).read_metadata().state_dict_metadata
    if ema_weights and not has_ema(step):
        raise ConvertError(f"error: --ema-weights: checkpoint {step} holds no moving average of the weights")
    params = {name for name, _ in _skeleton(cfg).named_parameters()}

    def entry(key: str, row: int | None) -> str:
        prefix = "ema" if ema_weights and key in params else "model"
        return f"{prefix}.{key}" if row is None else f"{prefix}.{key}.e{row}"

    shapes: dict[str, tuple[torch.Size, torch.dtype]] = {}
    for key, shape in checkpoint_shapes(_skeleton(cfg)).items():
        expert = ".experts." in key  # stored one expert per entry (moe.train.checkpoint)
        name = entry(key, 0 if expert else None)
        if name not in stored:
            raise ConvertError(f"error: {step}: the checkpoint lacks {name}")
        shapes[key] = (shape, stored[name].properties.dtype)
    written = dtype or next(iter(shapes.values()))[1]
    try:
        raw = None if source is None else source.config
        config = to_hf_config(cfg, dtype=str(written).removeprefix("torch."), source=raw)
        check_target(dst)
        pieces = plan_pieces(shapes, dtype=dtype)
    except (HFConfigError, HFExportError) as exc:
        raise ConvertError(f"error: {exc}") from None

    def make(needed: list) -> dict[str, torch.Tensor]:
        # One partial DCP load per shard: only these entries are read (each chunk at its offset in its file).
        want = {}
        for p in needed:
            shape, dt = shapes[p.key]
            want[entry(p.key, p.row)] = torch.empty(shape if p.row is None else shape[1:], dtype=dt)
        with _one_process():
            dcp.load(want, checkpoint_id=step, no_dist=True)
        out: dict[str, torch.Tensor] = {}
        for p in needed:
            t = want[entry(p.key, p.row)]
            out.update(make_piece(p, t if p.row is None else t.unsqueeze(0)))
        return out

    try:
        files = None if source is None else source.files
        limit = max_shard_bytes or MAX_SHARD_BYTES
        write_hf_dir(dst, config, pieces, make, files=files, dtype=dtype, max_shard_bytes=limit)
    except HFExportError as exc:
        raise ConvertError(f"error: {exc}") from None


# HF -> ours


class _OneExpert(LocalDispatcher):
    """A dispatcher holding one expert: a block built only to read the buffers a fresh model has stays small."""

    def __init__(self, num_experts: int) -> None:
        super().__init__(num_experts)
        self.num_local_experts = 1


class _FreshBuffers:
    """The value a buffer outside the hub layout has in a fresh model (expert-load counts, a softmax router's
    unused bias, rotary frequencies), from its block built without weights (one block kept at a time)."""

    def __init__(self, cfg: MoEConfig, skeleton: MoEStage) -> None:
        self.cfg, self.skeleton = cfg, skeleton
        self.layer: str | None = None
        self.block: torch.nn.Module | None = None

    def __call__(self, key: str) -> torch.Tensor:
        parts = key.split(".")
        if parts[0] != "blocks":
            raise ConvertError(f"error: no value for the buffer {key} (not in the hub layout, not a block's)")
        if self.layer != parts[1]:
            kind = type(self.skeleton.blocks[parts[1]])  # Block, or an MTP block: the same constructor
            self.layer, self.block = parts[1], kind(self.cfg, int(parts[1]), _OneExpert(self.cfg.num_experts))
        assert self.block is not None
        return self.block.get_buffer(".".join(parts[2:])).clone()


class _LazyPlanner(DefaultSavePlanner):
    """Plans from placeholders (the right shapes and dtypes, no memory); each entry is made when DCP writes it."""

    def __init__(self, makers: dict[str, Callable[[], torch.Tensor]]) -> None:
        super().__init__()
        self._makers = makers

    def lookup_object(self, index):  # DefaultSavePlanner's extension point
        return self._makers[index.fqn]()


class _BoundedWriter(dcp.FileSystemWriter):
    """A one-process writer whose files hold at most ``limit`` bytes of entries each: DCP keeps a file's tensors
    until the file is written, so one file is the memory peak (the default puts a rank's entries in one file)."""

    def __init__(self, path: Path, limit: int) -> None:
        super().__init__(path, single_file_per_rank=True, thread_count=1)
        self._limit = limit

    def write_data(self, plan, planner) -> torch.futures.Future:
        buckets: list[list] = [[]]
        used = 0
        for item in plan.items:
            size = item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize
            if buckets[-1] and used + size > self._limit:
                buckets.append([])
                used = 0
            buckets[-1].append(item)
            used += size
        results = []
        for n, items in enumerate(buckets):  # each bucket one file: "<prefix><n>_0.distcp"
            storage = dataclasses.replace(plan.storage_data, prefix=f"{plan.storage_data.prefix}{n}_")
            results += super().write_data(dataclasses.replace(plan, items=items, storage_data=storage), planner).wait()
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(results)
        return done


def hf_to_ours(src: Path, dst: Path, *, dtype: torch.dtype | None, optimizer: str | None) -> Path:
    from moe.hf import HFCheckpointError, HFConfigError, hf_tensors, read_hf_config, to_ours
    from moe.hf.export import HFSource
    from moe.hf.keys import checkpoint_shapes

    try:
        cfg = read_hf_config(src)
        files = hf_tensors(src)
        source = HFSource.read(src)  # kept, so the way back to a Hugging Face directory keeps them
    except (HFConfigError, HFCheckpointError) as exc:
        raise ConvertError(f"error: {src}: {exc}") from None
    _empty_target(dst)
    dtype = dtype or torch.float32
    skeleton = _skeleton(cfg)
    hub = checkpoint_shapes(skeleton)
    fresh = _FreshBuffers(cfg, skeleton)
    spec = OPTIMIZERS.lookup(optimizer) if optimizer else None

    def from_hub(key: str, shape: torch.Size, row: int | None, dt: torch.dtype) -> Callable[[], torch.Tensor]:
        def make() -> torch.Tensor:
            try:
                if row is None:
                    return to_ours(files, {key: shape}, whole=False)[key].to(dt).contiguous()
                return to_ours(files, {key: (1, *shape)}, first_expert=row, whole=False)[key][0].to(dt).contiguous()
            except HFCheckpointError as exc:
                raise ConvertError(f"error: {src}: {exc}") from None

        return make

    placeholders: dict[str, torch.Tensor] = {}
    makers: dict[str, Callable[[], torch.Tensor]] = {}

    def add(name: str, shape: torch.Size, dt: torch.dtype, make: Callable[[], torch.Tensor]) -> None:
        placeholders[name] = torch.zeros((), dtype=dt).expand(shape)  # shape and dtype for the plan, one element
        makers[name] = make

    for key, t, param, row in checkpoint_entries([skeleton]):
        base = key if row is None else key.rsplit(".e", 1)[0]
        dt = dtype if param is not None else t.dtype  # buffers keep theirs (fp32 router state)
        if base in hub:
            add(f"model.{key}", t.shape, dt, from_hub(base, t.shape, row, dt))
        elif param is None:
            add(f"model.{key}", t.shape, dt, lambda key=key: fresh(key))
        else:
            raise ConvertError(f"error: our parameter {key} has no hub tensor (moe.hf.keys.RULES)")
        if spec is not None and param is not None and param.requires_grad:
            for name in spec.state:  # a fresh state: zeros, the step counter at 0
                shape = torch.Size() if name in spec.scalar_state else t.shape
                add(f"optim.{key}.{name}", shape, torch.float32, lambda shape=shape: torch.zeros(shape))
    step = dst / "step_00000000"
    partial = dst / ".step_00000000.partial"
    partial.mkdir(parents=True)
    writer, planner = _BoundedWriter(partial, _DCP_FILE_BYTES), _LazyPlanner(makers)
    with _one_process():
        dcp.save(placeholders, storage_writer=writer, planner=planner, no_dist=True)
    meta = {"step": 0, "consumed_samples": 0, "pp": 1, "dp": 1, "ep": 1, "converted_from": str(src)}
    meta["config"] = {"model": str(src)}
    meta["model"] = dataclasses.asdict(cfg)
    write_files(partial, source.into_checkpoint(meta))
    # No world_size: the checkpoint holds no per-rank state (random states), so no rank looks for one.
    (partial / "meta.json").write_text(json.dumps(meta))
    write_manifest(partial)
    os.rename(partial, step)
    (dst / "latest").write_text(step.name)
    return step


def main(argv: list[str] | None = None) -> Path:
    args = _parser().parse_args(argv)
    src, dst = Path(args.src), Path(args.dst)
    dtype = _DTYPES[args.dtype] if args.dtype else None
    try:
        source = model_source(src)  # ours verified in full: one process reads it once
    except CheckpointError as exc:
        raise ConvertError(f"error: {src}: {exc}") from None
    for line in source.warnings:
        print(f"warning: {line}", file=sys.stderr, flush=True)
    if source.kind == "hf":
        if args.max_shard_size is not None or args.ema_weights:
            flag = "--ema-weights" if args.ema_weights else "--max-shard-size"
            raise ConvertError(f"error: {flag} is for ours -> HF; the source is a Hugging Face directory")
        out = hf_to_ours(src, dst, dtype=dtype, optimizer=None if args.optimizer == "none" else args.optimizer)
    else:
        ours_to_hf(source.path, dst, dtype=dtype, max_shard_bytes=args.max_shard_size, ema_weights=args.ema_weights)
        out = dst
    print(f"{src} -> {out}", flush=True)
    return out


def cli() -> None:
    run_command(main)


if __name__ == "__main__":
    cli()

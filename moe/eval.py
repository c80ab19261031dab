"""``python -m moe.eval``: the mean next-token loss of a model on a token file, forward only, through the pipeline.

    python -m moe.eval --model HF_DIR --data tokens.npy --seq-len 512 --batch-size 8 --batches 4 --json -
    torchrun --nproc-per-node 4 -m moe.eval --model runs/ckpt --pp 2 --ep 2 --data PREFIX ...

Windows: window i is ``tokens[i*S : i*S + S + 1]`` (input its first S tokens, target its last S: stride S from
offset 0, so each target is predicted once); batch b holds windows ``b*B .. b*B + B - 1``. The loss is the mean
cross-entropy of the main head over every target (fp32 by default); a model with multi-token prediction also
reports ``mtp_loss``, the mean over its depths of each depth's cross-entropy (depth k predicts token i+k+2 at
position i, so a window's last k+1 positions have no target for it). ``--model`` is a Hugging Face checkpoint
directory (config.json + safetensors) or one of our checkpoints (a ``step_*`` directory, or the directory of
them: its ``latest``). Under torchrun: world = pp x dp, each data-parallel rank takes its share of a batch, one
sequence per micro-batch.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from dualpipe.schedule import SCHEDULES
from moe.command import run_command
from moe.data import DataError, open_data
from moe.models.config import MoEConfig
from moe.models.model import lm_loss
from moe.parallel import ParallelConfig, build_stages, init_layout
from moe.train.checkpoint import CheckpointError, find_checkpoint, load_checkpoint

__all__ = ["main", "windows"]


class EvalError(SystemExit):
    """A mistake in the arguments, the model or the data: one line on rank 0."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moe.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="a Hugging Face checkpoint directory or one of our checkpoints")
    p.add_argument("--data", required=True, help="a token file or prefix (.npy, raw .bin, Megatron indexed)")
    p.add_argument("--data-dtype", default=None, choices=("uint16", "uint32"), help="raw .bin without a sidecar")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per window's input (S)")
    p.add_argument("--batch-size", type=int, required=True, help="windows per batch (B)")
    p.add_argument("--batches", type=int, required=True, help="batches to evaluate (N)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON to FILE (- for stdout)")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="compute dtype")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks")
    p.add_argument("--dp", type=int, default=None, help="data-parallel ranks (default: world / pp)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks; divides --dp")
    p.add_argument("--schedule", default="dualpipev", choices=tuple(SCHEDULES))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any rank waits for a peer")
    return p


def windows(tokens_N: np.ndarray, seq_len: int, batch_size: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``batch``: ``(ids [B, S], labels [B, S])`` int64 from windows ``batch*B .. batch*B + B - 1``."""
    first = batch * batch_size
    rows = [
        np.asarray(tokens_N[(first + i) * seq_len : (first + i) * seq_len + seq_len + 1]) for i in range(batch_size)
    ]
    w_BS1 = torch.from_numpy(np.stack(rows).astype(np.int64))
    return w_BS1[:, :-1].contiguous(), w_BS1[:, 1:].contiguous()


def _model_source(path: Path) -> tuple[MoEConfig, Path, str]:
    """(config, weights path, kind: "hf" or "ours") of ``--model``."""
    if (path / "config.json").is_file():
        from moe.hf import HFConfigError, read_hf_config

        try:
            return read_hf_config(path), path, "hf"
        except HFConfigError as exc:
            raise EvalError(f"error: --model {path}: {exc}") from None
    try:
        step = path if (path / "meta.json").is_file() else find_checkpoint(path, strict=True)[0]
    except CheckpointError as exc:
        raise EvalError(f"error: --model {path}: {exc}") from None
    if step is None:
        raise EvalError(f"error: --model {path}: neither a Hugging Face directory (config.json) nor a checkpoint")
    meta = json.loads((step / "meta.json").read_text())
    if "model" not in meta:
        raise EvalError(f"error: --model {step}: its meta.json predates the model config; evaluate a newer checkpoint")
    return MoEConfig(**meta["model"]), step, "ours"


def _check(args: argparse.Namespace, world: int, tokens: int) -> tuple[ParallelConfig, int]:
    """The layout and micro-batches per data-parallel rank, or one line saying what to change."""
    for name in ("seq_len", "batch_size", "batches"):
        if getattr(args, name) < 1:
            raise EvalError(f"error: --{name.replace('_', '-')} must be positive")
    need = (args.batches * args.batch_size) * args.seq_len + 1
    if tokens < need:
        raise EvalError(
            f"error: --data {args.data}: {tokens} tokens, {need} needed for --batches x --batch-size windows"
        )
    dp = args.dp or world // args.pp
    if args.pp * dp != world:
        raise EvalError(f"error: --pp {args.pp} x --dp {dp} != the world size {world}")
    if args.batch_size % dp:
        raise EvalError(f"error: --batch-size {args.batch_size} must split over --dp {dp} data-parallel ranks")
    chunks = args.batch_size // dp
    try:
        pc = ParallelConfig(pp=args.pp, dp=dp, ep=args.ep, schedule=args.schedule, num_chunks=chunks, overlap=False)
    except ValueError as exc:
        raise EvalError(f"error: {exc} (micro-batches per rank = --batch-size / --dp = {chunks})") from None
    return pc, chunks


def evaluate(args: argparse.Namespace) -> dict[str, float]:
    from moe.train.ranks import init_process_group, make_pipeline, pick_device

    cfg, weights, kind = _model_source(Path(args.model))
    try:
        data = open_data([args.data], dtype=args.data_dtype, val_fraction=0.0)
        data.check_vocab(cfg.vocab_size)
    except DataError as exc:
        raise EvalError(f"error: --data: {exc}") from None
    if len(data.sources) != 1:
        raise EvalError("error: --data: one token file (a blend has no single window order)")
    tokens_N = data.sources[0].tokens_N
    device = pick_device()
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    pc, chunks = _check(args, world, len(tokens_N))
    owns = init_process_group(device, args.timeout, pc.reserved_sms)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    layout = init_layout(pc, device.type)
    stages = build_stages(cfg, layout, dtype=dtype, device=device)
    if kind == "hf":
        from moe.hf import load_hf_weights

        load_hf_weights(stages, weights)
    else:
        load_checkpoint(weights, stages, None)
    pipe = make_pipeline(stages, layout, micro_batch=1, seq_len=args.seq_len, dtype=dtype, timeout_s=args.timeout)
    pipe.eval()
    total = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, micro-batches; the same for MTP
    per_rank = args.batch_size // pc.dp
    with torch.no_grad():
        for b in range(args.batches):
            ids, labels = windows(tokens_N, args.seq_len, args.batch_size, b)
            mine = slice(layout.dp_rank * per_rank, (layout.dp_rank + 1) * per_rank)
            inputs, targets = pipe.split_batch((ids[mine].to(device),), (labels[mine].to(device),))
            loss, _ = pipe.step(*inputs, num_chunks=chunks, criterion=lm_loss, labels=targets)
            if loss is not None:  # micro-batch means over equal token counts: their sum weighs every token alike
                total[0] += loss.double().sum()
                total[1] += loss.numel()
            for stage in stages:
                mtp = stage.pop_mtp_losses()  # [micro-batches, depths]
                if mtp is not None:
                    total[2] += mtp.mean(1).double().sum()
                    total[3] += mtp.shape[0]
    dist.all_reduce(total)
    result = {"loss": (total[0] / total[1]).item(), "tokens": args.batches * args.batch_size * args.seq_len}
    if cfg.mtp_layers:  # the mean over depths; each depth's over the positions that have its target
        result["mtp_loss"] = (total[2] / total[3]).item()
    if owns:
        dist.destroy_process_group()
    return result


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = _parser().parse_args(argv)
    result = evaluate(args)
    if os.environ.get("RANK", "0") == "0":
        text = json.dumps(result)
        if args.json == "-":
            print(text, flush=True)
        elif args.json:
            Path(args.json).write_text(text + "\n")
        else:
            mtp = f", MTP loss {result['mtp_loss']:.6f}" if "mtp_loss" in result else ""
            print(f"loss {result['loss']:.6f}{mtp} over {result['tokens']} tokens", flush=True)
    return result


def cli() -> None:
    run_command(main)


if __name__ == "__main__":
    cli()

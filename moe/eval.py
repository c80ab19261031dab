"""``python -m moe.eval``: the mean next-token loss of a model on a token file, forward only, through the pipeline.

    python -m moe.eval --model runs/ckpt --data tokens.npy --seq-len 512 --global-batch-size 8 --batches 4 --json -
    torchrun --nproc-per-node 4 -m moe.eval --model runs/ckpt --pp 2 --ep 2 --data PREFIX ...

Windows: window i is ``tokens[i*S : i*S + S + 1]`` (input its first S tokens, target its last S: stride S from
offset 0, so each target is predicted once); batch b holds windows ``b*B .. b*B + B - 1``. The loss is the mean
cross-entropy of the main head over every target (fp32 by default); a model with multi-token prediction also
reports ``mtp_loss``, the mean over its depths of each depth's cross-entropy (depth k predicts token i+k+2 at
position i, so a window's last k+1 positions have no target for it).

``--model`` is any form the trainer writes: the checkpoint directory (its ``latest``, or the newest intact
``step_*`` when that is missing or damaged), a ``step_*`` directory, or a Hugging Face directory (config.json +
safetensors, as ``--save-hf`` and ``moe.convert`` write it). ``--ema-weights`` evaluates the moving average of the
weights one of our checkpoints holds (trained with ``--ema``) instead of its weights.

Under torchrun: world = pp x dp, stage r on pipeline rank r, run forward only (1F1B's order: no pairing rule, so
any batch size runs on any layout). Each data-parallel rank takes the next ceil(B / dp) windows of a batch, one
sequence per micro-batch; a rank left short runs copies of a window to keep its expert-parallel peers in step,
and their losses are not counted: every window once, every target token weighted alike, the loss equal to one
process's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from moe.command import CommandParser, run_command
from moe.data import DataError, open_data
from moe.models.config import MoEConfig
from moe.models.model import lm_loss
from moe.parallel import ParallelConfig, build_stages, init_layout
from moe.train.checkpoint import CheckpointError, ModelSource, has_ema, load_checkpoint, model_source

__all__ = ["main", "my_windows", "windows"]


class EvalError(SystemExit):
    """A mistake in the arguments, the model or the data: one line on rank 0."""


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp32": torch.float32, "bf16": torch.bfloat16}
"""``--dtype``: the project's names, and the short ones as aliases."""


def _parser() -> CommandParser:
    p = CommandParser(
        prog="python -m moe.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", required=True, help="our checkpoint directory, a step_* one, or a Hugging Face one")
    p.add_argument("--data", required=True, help="a token file or prefix (.npy, raw .bin, Megatron indexed)")
    p.add_argument("--data-dtype", default=None, choices=("uint16", "uint32"), help="raw .bin without a sidecar")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per window's input (S)")
    p.add_argument(
        "--global-batch-size", "--batch-size", dest="batch_size", type=int, required=True, help="windows per batch (B)"
    )
    p.add_argument("--batches", type=int, required=True, help="batches to evaluate (N)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON to FILE (- for stdout)")
    p.add_argument("--dtype", default="float32", choices=tuple(_DTYPES), help="compute dtype (fp32, bf16: aliases)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel ranks")
    p.add_argument("--dp", type=int, default=None, help="data-parallel ranks (default: world / pp)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel ranks; divides --dp")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any rank waits for a peer")
    p.add_argument(
        "--ema-weights", action="store_true", help="the checkpoint's moving average of the weights (trained with --ema)"
    )
    return p


def windows(tokens_N: np.ndarray, seq_len: int, batch_size: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch ``batch``: ``(ids [B, S], labels [B, S])`` int64 from windows ``batch*B .. batch*B + B - 1``."""
    first = batch * batch_size
    rows = [
        np.asarray(tokens_N[(first + i) * seq_len : (first + i) * seq_len + seq_len + 1]) for i in range(batch_size)
    ]
    w_BS1 = torch.from_numpy(np.stack(rows).astype(np.int64))
    return w_BS1[:, :-1].contiguous(), w_BS1[:, 1:].contiguous()


def _model_source(path: str, ema_weights: bool = False) -> tuple[ModelSource, MoEConfig]:
    """``--model``'s weights and config, decided alike on every rank before any communication (with
    ``ema_weights``: that it holds a moving average of the weights)."""
    try:
        # sizes only: every rank resolves it, and checksumming would read the checkpoint once per rank
        source = model_source(path, checksums=False)
        config = source.config()
    except CheckpointError as exc:
        raise EvalError(f"error: --model {path}: {exc}") from None
    if ema_weights and (source.kind == "hf" or not has_ema(source.path)):
        what = "a Hugging Face directory" if source.kind == "hf" else f"checkpoint {source.path}"
        raise EvalError(
            f"error: --ema-weights: {what} holds no moving average of the weights (one of ours trained with --ema does)"
        )
    return source, config


def _check(args: argparse.Namespace, world: int, tokens: int) -> tuple[ParallelConfig, int]:
    """The layout and micro-batches per data-parallel rank (ceil(B / dp)), or one line saying what to change."""
    for name in ("seq_len", "batch_size", "batches"):
        if getattr(args, name) < 1:
            raise EvalError(f"error: --{name.replace('_', '-')} must be positive")
    need = (args.batches * args.batch_size) * args.seq_len + 1
    if tokens < need:
        raise EvalError(
            f"error: --data {args.data}: {tokens} tokens, {need} needed for --batches x --global-batch-size windows"
        )
    dp = args.dp or world // args.pp
    if args.pp * dp != world:
        raise EvalError(f"error: --pp {args.pp} x --dp {dp} != the world size {world}")
    chunks = -(-args.batch_size // dp)
    try:  # forward only: 1F1B takes any number of micro-batches, and there is nothing to overlap
        pc = ParallelConfig(pp=args.pp, dp=dp, ep=args.ep, schedule="1f1b", num_chunks=chunks, overlap=False)
    except ValueError as exc:
        raise EvalError(f"error: {exc}") from None
    return pc, chunks


def my_windows(batch_size: int, dp: int, dp_rank: int) -> tuple[np.ndarray, int]:
    """A data-parallel rank's windows of a batch (indices into it) and how many of them count: the next
    ceil(B / dp), the short rank's list padded with copies of window 0 (run, not counted)."""
    per_rank = -(-batch_size // dp)
    mine = np.arange(dp_rank * per_rank, min((dp_rank + 1) * per_rank, batch_size))
    return np.concatenate([mine, np.zeros(per_rank - len(mine), dtype=mine.dtype)]), len(mine)


def evaluate(args: argparse.Namespace) -> dict[str, float]:
    from moe.train.ranks import init_process_group, make_pipeline, pick_device

    source, cfg = _model_source(args.model, args.ema_weights)
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
    if os.environ.get("RANK", "0") == "0":
        for line in source.warnings:
            print(f"warning: {line}", file=sys.stderr, flush=True)
    dtype = _DTYPES[args.dtype]
    layout = init_layout(pc, device.type)
    stages = build_stages(cfg, layout, dtype=dtype, device=device)
    if source.kind == "hf":
        from moe.hf import HFCheckpointError, load_hf_weights

        try:
            load_hf_weights(stages, source.path)
        except HFCheckpointError as exc:  # the same files on every rank: all stop alike
            raise EvalError(f"error: --model {args.model}: {exc}") from None
    else:
        load_checkpoint(source.path, stages, None, ema_weights=args.ema_weights)
    pipe = make_pipeline(stages, layout, micro_batch=1, seq_len=args.seq_len, dtype=dtype, timeout_s=args.timeout)
    pipe.eval()
    total = torch.zeros(4, dtype=torch.float64, device=device)  # loss sum, micro-batches; the same for MTP
    rows, counted = my_windows(args.batch_size, pc.dp, layout.dp_rank)
    with torch.no_grad():
        for b in range(args.batches):
            ids, labels = windows(tokens_N, args.seq_len, args.batch_size, b)
            inputs, targets = pipe.split_batch((ids[rows].to(device),), (labels[rows].to(device),))
            loss, _ = pipe.step(*inputs, num_chunks=chunks, criterion=lm_loss, labels=targets)
            if loss is not None:  # micro-batch means over equal token counts: their sum weighs every token alike
                total[0] += loss[:counted].double().sum()
                total[1] += counted
            for stage in stages:
                mtp = stage.pop_mtp_losses()  # [micro-batches, depths], in micro-batch order
                if mtp is not None:
                    total[2] += mtp[:counted].mean(1).double().sum()
                    total[3] += counted
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

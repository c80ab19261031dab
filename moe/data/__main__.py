"""``python -m moe.data``: ``prepare`` (tokenize into the indexed format) and ``inspect`` (describe a data path)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from moe.command import CommandParser
from moe.data.errors import DataError
from moe.data.sources import RAW_DTYPES

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="python -m moe.data", description="Data tools: prepare (tokenize into the indexed format), inspect."
    )
    sub = parser.add_subparsers(dest="command")

    p = sub.add_parser(
        "prepare",
        help="tokenize JSONL / text files into PREFIX.bin + PREFIX.idx (Megatron indexed format)",
        description="Tokenize JSONL files (one document per line) or text files (one document per file), or the "
        "JSONL and text files of a directory, with a HuggingFace tokenizer.json, append the end-of-document token, "
        "and write Megatron's indexed format.",
    )
    p.add_argument("--tokenizer", required=True, help="path of a HuggingFace tokenizer.json")
    p.add_argument(
        "--input",
        required=True,
        nargs="+",
        metavar="FILE_OR_DIR",
        help=".jsonl[.gz] / .json / text files, or directories of them (as the trainer's --data DIR)",
    )
    p.add_argument("--output", required=True, metavar="PREFIX", help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--json-key", default="text", help="JSONL field holding the text (default: text)")
    p.add_argument(
        "--workers",
        type=int,
        default=min(os.cpu_count() or 1, 8),
        help="tokenizer processes (default: min(cpus, 8))",
    )
    eod = p.add_mutually_exclusive_group()
    eod.add_argument("--eod-token", metavar="TOKEN", help="end-of-document token (default: <|endoftext|>, </s>, ...)")
    eod.add_argument("--eod-id", type=int, metavar="N", help="end-of-document token id")
    p.add_argument(
        "--append-eod",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="append the end-of-document token to every document (default: on)",
    )

    i = sub.add_parser(
        "inspect",
        help="describe data paths: tokens, documents, max token id",
        description="Describe each PATH in turn, or, when the first argument is a number, the one blend of WEIGHT "
        "PATH pairs (as the trainer's --data 0.7 web 0.3 code).",
    )
    i.add_argument("path", nargs="+", metavar="PATH", help="data paths, or WEIGHT PATH pairs")
    i.add_argument(
        "--data-dtype",
        "--dtype",
        choices=RAW_DTYPES,
        help="dtype of a raw .bin without a sidecar (the trainer's --data-dtype)",
    )
    return parser


def _prepare(args: argparse.Namespace) -> int:
    from moe.data.prepare import PrepareOptions, prepare

    opts = PrepareOptions(
        tokenizer=args.tokenizer,
        inputs=args.input,
        output=args.output,
        json_key=args.json_key,
        workers=args.workers,
        eod_token=args.eod_token,
        eod_id=args.eod_id,
        append_eod=args.append_eod,
    )
    prepare(opts)
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from moe.data import open_data

    blend = _is_number(args.path[0])  # WEIGHT PATH pairs are one data path; else each path is one
    for n, items in enumerate([args.path] if blend else [[path] for path in args.path]):
        data = open_data(items, dtype=args.data_dtype, val_fraction=0.0)
        print(("\n" if n else "") + data.description)
        for weight, source in zip(data.weights, data.sources):
            docs = "no document boundaries" if source.num_documents is None else f"{source.num_documents} documents"
            print(f"  {source.path}: weight {weight:.4g}, {source.num_tokens} tokens, {docs}, {source.tokens_N.dtype}")
        print(f"tokens: {data.num_tokens}")
        print(f"documents: {'-' if data.num_documents is None else data.num_documents}")
        print(f"max token id: {data.max_token_id()}")
    return 0


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return _prepare(args) if args.command == "prepare" else _inspect(args)
    except DataError as exc:
        print(f"python -m moe.data {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

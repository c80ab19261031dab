"""``python -m moe.plan``: the best layout for a model on a cluster, before the cluster is booked.

    python -m moe.plan --model deepseek-v3 --gpus 2048 --gpus-per-node 8 --gpu h800 --seq-len 4096 \\
        --global-batch-size 15360 --micro-batch-size 1 --deepseek-v3 --json plan.json --png plan.png
    python -m moe.plan --model path/to/hf_checkpoint --gpus 64 --gpu h100 --recompute selective
    python -m moe.plan --config my_model.json --gpus 64 --gpu h100 --costs measured.json --json plan.json

``--model`` takes a preset name (:data:`moe.models.config.PRESETS`; ``--preset`` is the same flag) or a Hugging Face
checkpoint directory (its config.json, :func:`moe.hf.read_hf_config`). Prints the number of candidates and
how many fit, the best fitting plan (step time, tokens/s per GPU, MFU, bubble, exposed all-to-all, memory per
GPU by kind and the memory options it uses), and a table of the top ``--top`` with why each loses.
``--deepseek-v3`` adds the DeepSeek-V3 report's layout with the report's memory options and precision (FP8
GEMMs and dispatch), each figure beside the report's (in the JSON as ``deepseek_v3``), its memory with the
stages balanced by cost (``auto``) and at :data:`moe.plan.report.V3_LAYOUT`. ``--pipeline-layout`` places the
stages' contents as the trainer's flag does; ``--fp8``, ``--fp8-dispatch`` and ``--fp8-activations`` are the
trainer's flags of the same names (:class:`moe.plan.costs.Precision`). ``--compare-schedules --pp P --ep E``
prints, instead of the search, every registered schedule at that one layout with and without overlap
(:mod:`moe.plan.compare`). ``--published`` prints, instead of the search, every published training run the
planner can express at its own layout beside the published figures (:mod:`moe.plan.reruns`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from dualpipe.schedule import SCHEDULES
from moe.command import CommandParser
from moe.models.config import PRESETS, MoEConfig, preset
from moe.plan.costs import RECOMPUTE, STATE_DTYPES, MemoryOptions, Precision
from moe.plan.hardware import GPUS, Cluster, gpu, with_overrides
from moe.plan.measured import device_of, gpu_of, load_costs
from moe.plan.report import RunShape, plan, plan_table, v3_comparison, v3_side_by_side

__all__ = ["JSON_SCHEMA_VERSION", "TOKENS_PER_GPU", "default_global_batch", "global_batch", "main", "parse_args"]

JSON_SCHEMA_VERSION = 2
"""2: a row's ``recompute`` is a granularity and it has ``memory_options``; ``inputs.model_source``; the
``deepseek_v3`` side-by-side with ``--deepseek-v3``. Added since, without a new number (nothing removed or
renamed): a row's and the inputs' ``pipeline_layout``, ``deepseek_v3.memory_gib_layout``, ``inputs.precision``
and ``deepseek_v3.precision``, a row's ``memory_bytes.host`` (not in its ``total``); with ``--published`` a document of
its own (``published``: one row per run, ``skipped``); ``num_skipped`` and ``num_untimed`` (the search's
candidates neither sized nor timed, and sized and fitting but not timed)."""

TOKENS_PER_GPU = 16384
"""The default batch per GPU per optimizer step: 4 sequences of 4,096 tokens, so that every pipeline rank sees 4 x pp
micro-batches (a bubble of a few percent at most for the bidirectional schedules) while the global batch grows with
the cluster: 1M tokens on 64 GPUs, 32M on 2,048 (DeepSeek-V3's report used 15,360 x 4,096 = 63M, 30,720 per GPU)."""

V3_GLOBAL_BATCH = 15360
"""DeepSeek-V3's global batch in sequences (report, 4.2: the batch size ramps to 15,360)."""


def default_global_batch(gpus: int, seq_len: int, micro_batch: int, tokens_per_gpu: int = TOKENS_PER_GPU) -> int:
    """Sequences per step with ``tokens_per_gpu`` tokens on every GPU, rounded to whole micro-batches per GPU (at
    least one): a multiple of ``gpus x micro_batch``, so every dp = gpus / pp splits it evenly."""
    per_gpu = max(1, round(tokens_per_gpu / (seq_len * micro_batch)))
    return per_gpu * micro_batch * gpus


def global_batch(args: argparse.Namespace) -> int:
    """The run's global batch: the flag's, the report's with ``--deepseek-v3``, else :func:`default_global_batch`."""
    if args.global_batch_size is not None:
        return args.global_batch_size
    if args.deepseek_v3:
        return V3_GLOBAL_BATCH
    return default_global_batch(args.gpus, args.seq_len, args.micro_batch_size, args.tokens_per_gpu)


_RECOMPUTE_FLAG = {"on": ("full",), "off": ("none",), "both": ("none", "full"), "all": RECOMPUTE}
_RECOMPUTE_FLAG.update({name: (name,) for name in RECOMPUTE})


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = CommandParser(prog="python -m moe.plan", description=__doc__.split("\n")[0])
    model = p.add_mutually_exclusive_group()
    model.add_argument(
        "--model",
        "--preset",
        dest="model",
        metavar="NAME_OR_DIR",
        help=f"a preset ({', '.join(sorted(PRESETS))}) or a Hugging Face checkpoint directory "
        "(default: v3, or the model --costs measured)",
    )
    model.add_argument("--config", metavar="FILE", help="a JSON file of MoEConfig fields")
    p.add_argument("--gpus", type=int, default=2048, help="GPUs in the cluster")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument(
        "--gpu",
        choices=sorted(GPUS),
        help="device profile (moe/plan/hardware.py); default h800, or with --costs the measured machine itself",
    )
    p.add_argument(
        "--gemm-efficiency",
        type=float,
        help="override the achieved fraction of peak for every GEMM (default: the cited table's, by precision and "
        "shape; --explain shows them)",
    )
    p.add_argument("--nvlink-gbps", type=float, help="override NVLink GB/s per GPU, one direction")
    p.add_argument("--internode-gbps", type=float, help="override inter-node GB/s per GPU, one direction")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument(
        "--global-batch-size",
        "--global-batch",
        type=int,
        metavar="N",
        help="sequences per optimizer step (default: --tokens-per-gpu's worth on every GPU; with --deepseek-v3 the "
        "report's 15,360)",
    )
    p.add_argument(
        "--tokens-per-gpu",
        type=int,
        default=TOKENS_PER_GPU,
        metavar="N",
        help=f"without --global-batch-size: tokens per GPU per optimizer step, rounded to whole micro-batches "
        f"(default {TOKENS_PER_GPU:,})",
    )
    p.add_argument(
        "--micro-batch-size", "--micro-batch", type=int, default=1, metavar="N", help="sequences per micro-batch"
    )
    p.add_argument("--schedules", nargs="+", choices=sorted(SCHEDULES), help="default: every registered one")
    p.add_argument("--comm-sms", type=int, nargs="+", default=[20], help="SMs for communication to try (ep > 1)")
    p.add_argument(
        "--recompute",
        choices=sorted(_RECOMPUTE_FLAG),
        help="granularities to try: none, selective, full, all of them (default); on = full, off = none, "
        "both = none and full; --compare-schedules takes one",
    )
    p.add_argument(
        "--state-dtype", choices=STATE_DTYPES, default="float32", help="optimizer moments' dtype (bfloat16: V3's)"
    )
    p.add_argument(
        "--ema",
        action="store_true",
        help="a moving average of the weights as the trainer's --ema keeps it: on the host, reported as host memory, "
        "no GPU bytes",
    )
    p.add_argument(
        "--fp8",
        action="store_true",
        help="FP8 GEMMs as the trainer's --fp8 (DeepSeek-V3's recipe): every linear but the head and the router's "
        "gate at the device's FP8 peak; turns on --fp8-dispatch",
    )
    p.add_argument(
        "--fp8-dispatch",
        action=argparse.BooleanOptionalAction,
        help="FP8 rows in the dispatch direction (1 byte + one fp32 scale per 128 elements; the combine stays in "
        "the activation dtype); default: on exactly with --fp8",
    )
    p.add_argument(
        "--fp8-activations",
        action="store_true",
        help="with --fp8: the routed experts keep the up-projection's and the SwiGLU's inputs for backward in FP8 "
        "with their scales (the trainer's flag)",
    )
    p.add_argument(
        "--mtp-own-copies",
        action="store_true",
        help="MTP modules hold their own embedding and head instead of sharing the main model's",
    )
    p.add_argument(
        "--pipeline-layout",
        metavar="STR",
        default="auto",
        help="what each stage holds, in Megatron-Core's syntax as the trainer's --pipeline-layout (E embedding, t "
        "layer, m MTP module, L head, | between stages, *n repeats; e.g. Et*3|(t*4|)*14t*2mL); only the "
        "candidates whose schedule has as many stages as it lists are searched (default auto: stages "
        "balanced by cost, every candidate)",
    )
    p.add_argument(
        "--expert-imbalance",
        type=float,
        default=1.0,
        metavar="X",
        help="routed rows of the busiest expert-parallel rank over the group's mean (default 1: balanced); its "
        "experts and all-to-alls set the group's pace. The per-expert max over mean the trainer logs as "
        "'imbalance' bounds it from above",
    )
    p.add_argument(
        "--compare-schedules",
        action="store_true",
        help="instead of the search: every registered schedule at --pp x --ep, with and without overlap "
        "(moe.plan.compare)",
    )
    p.add_argument("--pp", type=int, help="with --compare-schedules: pipeline ranks (dp = gpus / pp)")
    p.add_argument("--ep", type=int, default=1, help="with --compare-schedules: expert-parallel ranks (default 1)")
    p.add_argument("--costs", metavar="FILE", help="measured sub-stage costs (bench.overlap --calibrate)")
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    p.add_argument("--deepseek-v3", action="store_true", help="also set the V3 report's layout beside its figures")
    p.add_argument(
        "--published",
        action="store_true",
        help="instead of the search: every published training run the planner can express (moe.plan.published), "
        "each at its own layout, precision and device, beside its published tokens/s/GPU and memory, with its "
        "sources and, past 20%%, the gap in terms (moe.plan.reruns); takes no model or cluster flags",
    )
    p.add_argument(
        "--explain",
        action="store_true",
        help="print the efficiency-table entries the best plan used (moe/plan/efficiency.py): value and source, or "
        "the override or costs file that replaced it",
    )
    p.add_argument("--json", metavar="FILE", help="write the result as JSON ('-' for stdout)")
    p.add_argument("--png", metavar="FILE", help="draw the best plan's pipeline timeline")
    p.add_argument(
        "--emit-config",
        metavar="FILE",
        help="write the best plan as the trainer's job file (TOML: examples/train.py --config FILE runs it), with "
        "every option it was sized under (moe.plan.job)",
    )
    args = p.parse_args(argv)
    for name in ("gpus", "gpus_per_node", "seq_len", "global_batch_size", "micro_batch_size", "tokens_per_gpu", "top"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.gpus % args.gpus_per_node and args.gpus > args.gpus_per_node:
        p.error(f"--gpus {args.gpus} is not a whole number of {args.gpus_per_node}-GPU nodes")
    if args.fp8_activations and not args.fp8:
        p.error("--fp8-activations needs --fp8 (the FP8 experts keep their inputs in FP8)")
    if args.compare_schedules:
        if args.pp is None:
            p.error("--compare-schedules needs --pp (and --ep: the layout every schedule runs at)")
        if len(_RECOMPUTE_FLAG[args.recompute or "all"]) > 1 or len(args.comm_sms) > 1:
            p.error(
                "--compare-schedules takes one --recompute granularity (none, selective or full) and one --comm-sms"
            )
        if args.deepseek_v3 or args.png or args.emit_config:
            p.error("--compare-schedules prints its own table: drop --deepseek-v3, --png and --emit-config")
    elif args.pp is not None:
        p.error("--pp is --compare-schedules's layout (the search tries every pp)")
    if args.published and (args.compare_schedules or args.deepseek_v3 or args.png or args.emit_config or args.costs):
        p.error("--published reruns the published runs at their own layouts: drop --compare-schedules, --deepseek-v3, "
                "--png, --emit-config and --costs")  # fmt: skip
    for name in ("pp", "ep"):
        if (getattr(args, name) or 1) < 1:
            p.error(f"--{name} must be positive")
    if not args.expert_imbalance >= 1.0:
        p.error(f"--expert-imbalance {args.expert_imbalance}: the busiest rank over the mean is at least 1")
    return args


class Progress:
    """One line on stderr, rewritten in place while the search runs: shown only once it has taken
    :attr:`DELAY` seconds (a quick answer prints none), at most every :attr:`EVERY` seconds, and erased at the
    end."""

    DELAY = 2.0
    EVERY = 0.25

    def __init__(self, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.start = self.last = time.monotonic()
        self.shown = False

    def __call__(self, text: str) -> None:
        now = time.monotonic()
        if not self.enabled or now - self.start < self.DELAY or (self.shown and now - self.last < self.EVERY):
            return
        self.last, self.shown = now, True
        sys.stderr.write(f"\r{text} ({now - self.start:.0f} s)\033[K")
        sys.stderr.flush()

    def done(self) -> None:
        if self.shown:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


def assumptions(args: argparse.Namespace, run: RunShape) -> str:
    """The defaults and choices every candidate was sized and timed under, in one line."""
    tokens = run.global_batch * run.seq_len
    if args.global_batch_size is not None:
        batch = f"global batch {run.global_batch:,} sequences (--global-batch-size)"
    elif args.deepseek_v3:
        batch = f"global batch {run.global_batch:,} sequences (the DeepSeek-V3 report's)"
    else:
        per_gpu = f"{args.tokens_per_gpu:,} tokens per GPU: --tokens-per-gpu"
        batch = f"global batch {run.global_batch:,} sequences ({per_gpu})"
    recompute = ", ".join(_RECOMPUTE_FLAG[args.recompute or "all"])
    return (
        f"assumed: {batch} = {tokens:,} tokens of {run.seq_len:,}-token sequences, micro-batch {run.micro_batch}, "
        f"ZeRO-1 (optimizer state sharded over the data-parallel ranks: the trainer's --zero 1), bf16 weights with "
        f"fp32 masters and gradients, recompute tried: {recompute}, comm SMs tried: "
        f"{', '.join(map(str, args.comm_sms))}, schedules: {', '.join(args.schedules or sorted(SCHEDULES))}"
    )


def _named_model(name: str) -> tuple[MoEConfig, str]:
    """A preset by name, or a Hugging Face checkpoint directory's config; (config, ``"preset"`` or ``"hf"``)."""
    if name in PRESETS:
        return preset(name), "preset"
    path = Path(name)
    if not path.exists():
        raise SystemExit(
            f"error: --model {name}: neither a preset ({', '.join(sorted(PRESETS))}) nor a checkpoint directory"
        )
    from moe.hf import HFConfigError, read_hf_config

    try:
        return read_hf_config(path), "hf"
    except (HFConfigError, ValueError) as exc:
        raise SystemExit(f"error: --model {name}: {exc}") from None


def _config(args: argparse.Namespace, measured) -> tuple[MoEConfig, str]:
    """The model and where it came from (``preset``, ``hf``, ``config``, ``costs``)."""
    if args.config is None:
        if args.model is None and measured is not None:
            if not (measured.moe or measured.dense):  # bench.kernels: single ops of a benchmarked layer shape
                raise SystemExit(f"error: --costs {args.costs} holds single ops only: pass --model or --config")
            return measured.config, "costs"
        return _named_model(args.model or "v3")
    try:
        fields = json.loads(Path(args.config).read_text())
        return MoEConfig(**fields), "config"
    except (OSError, json.JSONDecodeError, TypeError, ValueError) as exc:
        raise SystemExit(f"error: --config {args.config}: {exc}") from None


def _cluster(args: argparse.Namespace, measured) -> Cluster:
    if args.gpu is None and measured is not None:
        # The machine the costs were measured on (CPU ranks on the emulated cluster: no datasheet describes
        # it): its achieved rates and its links, from the file; memory per rank is this machine's share.
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / args.gpus
        try:
            device = device_of(measured, memory_bytes=memory)
        except ValueError as exc:
            raise SystemExit(f"error: --costs {args.costs}: {exc}") from None
        device = with_overrides(device, gemm_efficiency=args.gemm_efficiency)
        return Cluster(device, args.gpus, min(args.gpus_per_node, args.gpus))
    device = with_overrides(
        gpu(args.gpu or "h800"),
        gemm_efficiency=args.gemm_efficiency,
        nvlink_bytes_per_s=None if args.nvlink_gbps is None else args.nvlink_gbps * 1e9,
        internode_bytes_per_s=None if args.internode_gbps is None else args.internode_gbps * 1e9,
    )
    if measured is not None:
        device = gpu_of(measured, device)  # the links the measured all-to-alls ran on
    return Cluster(device, args.gpus, min(args.gpus_per_node, args.gpus))


def _compare(args: argparse.Namespace, cfg: MoEConfig, cluster: Cluster, run: RunShape, measured, options) -> int:
    """``--compare-schedules``: the table of :mod:`moe.plan.compare`, and its rows with ``--json``."""
    from moe.plan.compare import compare_schedules, compare_schedules_table, layout_candidate

    try:
        (recompute,) = _RECOMPUTE_FLAG[args.recompute]
        layout = layout_candidate(
            cfg, cluster, run, pp=args.pp, ep=args.ep, recompute=recompute, comm_sms=args.comm_sms[0]
        )
        rows = compare_schedules(cfg, cluster, run, layout, measured=measured, options=options)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    if args.json != "-":
        print(compare_schedules_table(rows, layout, cluster))
    if args.json:
        doc = {"schema": JSON_SCHEMA_VERSION, "layout": dataclasses.asdict(layout), "rows": rows}
        _write_json(args.json, doc)
    return 0


def _write_json(target: str, doc: dict) -> None:
    """``doc`` as JSON to the file ``target``, or to stdout where it is ``-``."""
    out = json.dumps(doc, indent=1)
    if target == "-":
        print(out)
    else:
        Path(target).write_text(out + "\n")


def _published(args: argparse.Namespace) -> int:
    """``--published``: the table of :mod:`moe.plan.reruns`, and its rows with ``--json``."""
    from moe.plan.published import SKIPPED
    from moe.plan.reruns import published_side_by_side, published_table

    rows = published_side_by_side()
    if args.json != "-":
        print(published_table(rows))
    if args.json:
        doc = {"schema": JSON_SCHEMA_VERSION, "published": rows,
               "skipped": [{"run": name, "why": why} for name, why in SKIPPED]}  # fmt: skip
        _write_json(args.json, doc)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.published:
        return _published(args)
    try:
        measured = load_costs(args.costs) if args.costs else None
    except ValueError as exc:
        raise SystemExit(f"error: --costs: {exc}") from None
    cfg, source = _config(args, measured)
    cluster = _cluster(args, measured)
    precision = Precision(fp8=args.fp8, fp8_dispatch=args.fp8_dispatch)
    run = RunShape(args.seq_len, global_batch(args), args.micro_batch_size, precision, args.expert_imbalance)
    options = MemoryOptions(
        state_dtype=args.state_dtype,
        fp8_activations=args.fp8_activations,
        mtp_shared=not args.mtp_own_copies,
        ema=args.ema,
    )
    if args.compare_schedules:
        return _compare(args, cfg, cluster, run, measured, options)
    progress = Progress(enabled=args.json != "-" and sys.stderr.isatty())  # a terminal's line, not a log's
    try:
        result = plan(
            cfg, cluster, run, schedules=args.schedules, comm_sms=args.comm_sms,
            recompute=_RECOMPUTE_FLAG[args.recompute or "all"], measured=measured, top=args.top, options=options,
            pipeline_layout=args.pipeline_layout, progress=progress,
        )  # fmt: skip
        if args.deepseek_v3:
            progress("setting DeepSeek-V3's layout beside the report")
        v3 = v3_side_by_side(cfg, cluster, run, measured) if args.deepseek_v3 else None
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    finally:
        progress.done()
    text = assumptions(args, run) + "\n" + plan_table(result, args.top)
    if args.deepseek_v3:
        text += "\n\n" + v3_comparison(cfg, cluster, run, measured, side=v3)
    if args.explain:
        from moe.plan.explain import explain

        c = result.best.candidate
        text += "\n\n" + explain(
            cfg, cluster, pp=c.pp, dp=c.dp, ep=c.ep, tokens=run.seq_len * run.micro_batch, seq_len=run.seq_len,
            fp8=precision.fp8, measured=measured,
        )  # fmt: skip
    if args.json != "-":
        print(text)
    if args.json:
        doc = {
            "schema": JSON_SCHEMA_VERSION,
            "inputs": {
                "config": args.config,
                "preset": args.model if source == "preset" else None,
                "model_source": {"kind": source, "name": args.model if source in ("preset", "hf") else None},
                "model": dataclasses.asdict(cfg),
                "gpus": cluster.num_gpus,
                "gpus_per_node": cluster.gpus_per_node,
                "gpu": cluster.gpu.to_dict(),
                "seq_len": run.seq_len,
                "global_batch": run.global_batch,
                "micro_batch": run.micro_batch,
                "costs": args.costs,
                "pipeline_layout": args.pipeline_layout,
                "precision": run.precision.to_dict(),
                "expert_imbalance": run.expert_imbalance,
            },
            "num_candidates": result.num_candidates,
            "num_fitting": result.num_fitting,
            "num_skipped": result.skipped,
            "num_untimed": result.untimed,
            "best": result.best.to_dict(),
            "top": [p.to_dict() for p in result.ranked[: args.top]],
        }
        if v3 is not None:
            doc["deepseek_v3"] = v3
        _write_json(args.json, doc)
    if args.emit_config:
        from moe.plan.job import job_toml

        job = job_toml(
            result.best, model=(args.model or "v3") if source in ("preset", "hf") else None, cfg=cfg,
            cluster=cluster, seq_len=run.seq_len, global_batch=run.global_batch, micro_batch=run.micro_batch,
            precision=run.precision, options=options,
            command="python -m moe.plan " + " ".join(sys.argv[1:] if argv is None else argv),
        )  # fmt: skip
        Path(args.emit_config).write_text(job)
        if args.json != "-":
            print(f"\nwrote {args.emit_config}: examples/train.py --config {args.emit_config} runs this plan")
    if args.png:
        from dualpipe.simulate import render_png

        render_png(result.best.sim, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())

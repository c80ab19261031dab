"""The best plan as a trainer job: ``python -m moe.plan ... --emit-config job.toml`` writes the TOML file that
``examples/train.py --config job.toml`` runs (the schema of :mod:`moe.train.config`), with every option the
plan was sized and timed under, so that what the trainer runs is what the planner predicted:

- ``[parallel]``: the schedule, pp, dp, ep, micro-batches per step, communication SMs, recompute granularity,
  pipeline layout, extra warm-up forwards, overlap (written only when off: unset, the trainer overlaps wherever
  the schedule pairs, as the planner times it) and activation offloading;
- ``[optimizer]``: ZeRO-1 (``zero = 1``: the planner sizes the optimizer state sharded over the data-parallel
  ranks; the trainer's default is 0) and the optimizer-state dtype;
- ``[training]``: sequence length, micro-batch and global batch, bf16 compute (the planner's activation
  bytes) and the FP8 options.

The planner writes text, not a :class:`moe.train.config.TrainConfig` (the planner sits below the trainer and
never imports it); the tests read every preset's file back through the trainer's own loader.
"""

from __future__ import annotations

import dataclasses
import json

from moe.models.config import MoEConfig
from moe.pipeline_layout import AUTO
from moe.plan.costs import MemoryOptions, Precision
from moe.plan.hardware import Cluster
from moe.plan.params import auto_layout
from moe.plan.search import Prediction, seconds

__all__ = ["job_toml"]

GIB = 2**30


def _value(value: object) -> str:
    """A TOML literal (JSON's strings, numbers, booleans and arrays are TOML's)."""
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value)


def job_toml(
    best: Prediction,
    *,
    model: str | None,
    cfg: MoEConfig,
    cluster: Cluster,
    seq_len: int,
    global_batch: int,
    micro_batch: int,
    precision: Precision,
    options: MemoryOptions,
    command: str,
) -> str:
    """The trainer's job file for ``best`` (``model``: the preset name or checkpoint directory the trainer's
    ``[model] name`` takes; None writes every field of ``cfg`` over the ``tiny`` preset)."""
    c = best.candidate
    nodes = max(1, cluster.num_gpus // cluster.gpus_per_node)
    per_node = min(cluster.gpus_per_node, cluster.num_gpus)
    head = [
        f"# The planner's best plan: {c.describe()}",
        f"# predicted step {seconds(best.step_time)}, {best.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, "
        f"{best.memory.total / GIB:.1f} GiB per GPU on {cluster.num_gpus} x {cluster.gpu.name}"
        + ("" if best.fits else " (does NOT fit)"),
        f"# written by: {command}",
        f"#   torchrun --nnodes {nodes} --nproc-per-node {per_node} examples/train.py --config THIS.toml --data PREFIX",
        "",
        "[model]",
    ]
    if model is not None:
        head.append(f"name = {_value(model)}")
    else:
        head.append('name = "tiny"')
        head += [f"{k} = {_value(v)}" for k, v in dataclasses.asdict(cfg).items() if v is not None]
    parallel = {
        "pp": c.pp,
        "dp": c.dp,
        "ep": c.ep,
        "schedule": c.schedule,
        "num_chunks": c.num_chunks,
        "comm_sms": c.comm_sms,
        "recompute": c.recompute,
        "pipeline_layout": c.pipeline_layout,
        "extra_warmup": c.extra_warmup,
    }
    if not c.overlap:
        parallel["overlap"] = False
    if c.offload:
        parallel["offload"] = c.offload
    optimizer = {"zero": 1, "state_dtype": options.state_dtype}
    training = {
        "seq_len": seq_len,
        "micro_batch_size": micro_batch,
        "global_batch_size": global_batch,
        "dtype": "bfloat16",
        "fp8": precision.fp8,
        "fp8_dispatch": precision.dispatch_fp8,
        "fp8_activations": options.fp8_activations,
    }
    lines = head
    for name, table in (("parallel", parallel), ("optimizer", optimizer), ("training", training)):
        lines += ["", f"[{name}]", *(f"{k} = {_value(v)}" for k, v in table.items())]
        if name == "parallel" and c.pipeline_layout == AUTO:  # what auto resolves to, as --print-config says
            lines.append(f"# auto = {auto_layout(cfg, c.pp, c.schedule)!r}")
    return "\n".join(lines) + "\n"

"""``moe.plan --published``: every run of :data:`moe.plan.published.RUNS` rerun by the planner at its own
layout, precision and device, beside the published tokens/s/GPU and memory, and the gap broken into terms.

Each run is timed and sized by the planner's own evaluation (:func:`moe.plan.report.evaluate` at the run's
stage layout; where the source states none, the planner's layout as ``--deepseek-v3`` picks it,
:func:`moe.plan.report._best_layout`): no search, nothing tuned. Where the planner is more than
:data:`GAP_SHOWN` away from the published figure, :func:`gap` sets the published step (tokens per step / the
published tokens/s/GPU / GPUs) beside the planner's and breaks the difference down:

- the planner's step in parts, on its busiest pipeline rank: compute by piece kind (attention with the router,
  shared experts, routed experts, embedding and head), the rest of that rank's busy time (the all-to-all its
  pieces leave exposed), its idle time (bubble), and the data-parallel reduction after the pipeline;
- terms the planner leaves out, each sized from a cited number: kernel launches and host time per op
  (the device table's ``launch`` and ``host`` entries, :mod:`moe.plan.efficiency`, times the ops the rank
  issues), and the data-parallel reduction where the source says it overlaps the backward (minus it);
- what a source says the run did that no cited number sizes (the run's ``notes``), listed without a size;
- the residual: the gap less the sized terms, what stays unexplained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dualpipe.schedule import schedule_spec
from moe.models.config import preset
from moe.pipeline_layout import AUTO
from moe.plan.costs import layer_ops
from moe.plan.flops import model_flops_per_token
from moe.plan.hardware import Cluster, gpu
from moe.plan.model import LayerCostModel
from moe.plan.params import stage_plans
from moe.plan.published import RUNS, SKIPPED, PublishedRun
from moe.plan.report import GIB, RunShape, _best_layout, _model, _predict, _table, describe_precision
from moe.plan.search import Prediction, seconds

__all__ = ["GAP_SHOWN", "Gap", "Rerun", "gap", "published_side_by_side", "published_table", "rerun"]

GAP_SHOWN = 0.20
"""How far the planner's tokens/s may be from the published figure before the gap is broken down."""

_KINDS = {
    "attn": "attention and router",
    "shared": "shared experts",
    "mlp": "routed experts",
    "ends": "embedding and head",
}


@dataclass(frozen=True, slots=True)
class Rerun:
    """One published run as the planner predicts it."""

    run: PublishedRun
    prediction: Prediction
    model: LayerCostModel
    """The cost model of the layout the prediction is of."""

    @property
    def ratio(self) -> float:
        """Planner over published tokens/s/GPU."""
        return self.prediction.tokens_per_s_per_gpu / self.run.tokens_per_s_per_gpu


@dataclass(frozen=True, slots=True)
class Gap:
    """The published step against the planner's, in seconds: the planner's parts, the sized terms, the residual."""

    published_step: float
    planner_step: float
    rank: int
    """The pipeline rank whose busy time the parts are of (the busiest)."""
    parts: dict[str, float]
    """The planner's step by part; they sum to :attr:`planner_step`."""
    terms: list[tuple[str, float, str]]
    """(term, seconds, source) the planner leaves out, sized from a cited number."""
    unsized: tuple[str, ...]
    """What a source says the run did that no cited number sizes."""

    @property
    def total(self) -> float:
        """Published step less the planner's (positive: the run is slower than predicted)."""
        return self.published_step - self.planner_step

    @property
    def residual(self) -> float:
        """The gap the sized terms leave unexplained."""
        return self.total - sum(t for _, t, _ in self.terms)


def _run_shape(r: PublishedRun) -> RunShape:
    return RunShape(r.seq_len, r.global_batch, r.micro_batch, r.precision)


def rerun(r: PublishedRun) -> Rerun:
    """The planner's prediction of ``r`` at its layout (the planner's layout where the source states none)."""
    cfg, cluster, run = preset(r.model), Cluster(gpu(r.gpu), r.gpus, r.gpus_per_node), _run_shape(r)
    if r.layout.pipeline_layout == AUTO:
        p, tried = _best_layout(cfg, cluster, run, r.layout, None, r.options)
        return Rerun(r, p, tried[p.candidate])
    model = _model(cfg, cluster, run, r.layout, None, r.options)
    return Rerun(r, _predict(model), model)


def _rank_work(model: LayerCostModel, rank: int) -> tuple[dict[str, float], int]:
    """Seconds of compute on pipeline rank ``rank`` per step by piece kind, and the ops it issues (an op's forward,
    input-gradient and weight-gradient each one, where they have work): every micro-batch of each of its modules'
    paths runs forward and backward once (recompute inside the backward, as the costs count it)."""
    c, cfg = model.candidate, model.cfg
    layout = schedule_spec(c.schedule).stage_layout(c.pp)
    plans = stage_plans(cfg, c.pp, c.schedule, None, c.pipeline_layout)
    per_path = c.num_chunks // len(layout.paths)
    num_layers = sum(len(p.layers) for p in plans)
    work = dict.fromkeys(_KINDS, 0.0)
    ops = 0
    tokens = model.seq_len * model.micro_batch
    for module in range(layout.modules_per_rank):
        plan = plans[layout.stage_of(rank, module)]
        for i in (*plan.layers, *range(num_layers, num_layers + plan.mtp)):
            s = model.layer(i)
            work["attn"] += per_path * (s.attn_F + s.attn_dX + s.attn_dW)
            work["shared"] += per_path * (s.shared_F + s.shared_dX + s.shared_dW)
            work["mlp"] += per_path * (s.mlp_F + s.mlp_dX + s.mlp_dW)
            subs = layer_ops(cfg, tokens, model.seq_len, ep=c.ep, moe=s.moe, fp8=model.precision.fp8)
            ops += per_path * _op_count([*subs["attn"], *subs["shared"], *subs["mlp"]])
        (ef, eb), (hf, hb) = model.embed(), model.head()
        work["ends"] += per_path * ((ef + eb) * plan.first + (hf + hb) * plan.last)
        subs = layer_ops(cfg, tokens, model.seq_len, ep=c.ep, fp8=model.precision.fp8)
        ops += per_path * (_op_count(subs["embed"]) * plan.first + _op_count(subs["head"]) * plan.last)
    return work, ops


def _op_count(ops: list) -> int:
    return sum(
        1 for op in ops for ph in ("fwd", "dx", "dw") if getattr(op, f"{ph}_flops") or getattr(op, f"{ph}_bytes")
    )


def gap(x: Rerun) -> Gap:
    """The published step beside the planner's, broken down (see the module docstring)."""
    r, p, model = x.run, x.prediction, x.model
    sim = p.sim
    rank = max(range(len(sim.busy)), key=lambda i: sim.busy[i])
    work, ops = _rank_work(model, rank)
    compute = sum(work.values())
    parts = {f"compute: {_KINDS[k]}": v for k, v in work.items() if v}
    parts["exposed all-to-all (busy time beyond compute)"] = sim.busy[rank] - compute
    parts["bubble (idle on that rank)"] = sim.idle[rank]
    parts["data-parallel reduction"] = p.dp_reduce_time
    device = model.cluster.gpu
    (launch, launch_src), (host, host_src) = device.entry("launch"), device.entry("host")
    terms = [
        (f"kernel launch + host time, {ops:,} ops on rank {rank} x ({launch * 1e6:.0f} + {host * 1e6:.0f} us)",
         ops * (launch + host), f"moe/plan/efficiency.py {device.name} 'launch': {launch_src}; 'host': {host_src}"),
    ]  # fmt: skip
    if r.dp_overlapped is not None:
        terms.append(
            ("data-parallel reduction overlapped with the backward in the run", -p.dp_reduce_time,
             f"{r.dp_overlapped.where}: {r.dp_overlapped.quote}"),
        )  # fmt: skip
    published_step = r.tokens_per_step / (r.tokens_per_s_per_gpu * r.gpus)
    return Gap(published_step, p.step_time, rank, parts, terms, r.notes)


def published_side_by_side(runs: tuple[PublishedRun, ...] = RUNS) -> list[dict[str, Any]]:
    """Every run's prediction beside its published figures, as JSON-ready rows (``gap`` where it exceeds
    :data:`GAP_SHOWN`)."""
    out = []
    for r in runs:
        x = rerun(r)
        p, c = x.prediction, x.prediction.candidate
        cfg = x.model.cfg
        row: dict[str, Any] = {
            "name": r.name,
            "model": r.model,
            "gpu": r.gpu,
            "gpus": r.gpus,
            "gpus_per_node": r.gpus_per_node,
            "layout": p.to_dict(),
            "seq_len": r.seq_len,
            "global_batch": r.global_batch,
            "micro_batch": r.micro_batch,
            "precision": r.precision.to_dict(),
            "tokens_per_s_per_gpu": {"planner": p.tokens_per_s_per_gpu, "published": r.tokens_per_s_per_gpu},
            "ratio": x.ratio,
            "memory_gib": {"planner": p.memory.total / GIB, "fits": p.fits,
                           "published": None if r.memory_gb is None else r.memory_gb * 1e9 / GIB,
                           "published_note": r.memory_note},
            "model_gflops_per_token": {
                "planner": model_flops_per_token(cfg, r.seq_len) / 1e9,
                "published": None if r.model_tflops_per_gpu is None
                else r.model_tflops_per_gpu * 1e3 / r.tokens_per_s_per_gpu,
            },
            "sources": [{"where": s.where, "quote": s.quote} for s in r.sources],
            "notes": list(r.notes),
            "stage_layout": c.pipeline_layout,
        }  # fmt: skip
        if abs(x.ratio - 1) > GAP_SHOWN:
            g = gap(x)
            row["gap"] = {
                "published_step_s": g.published_step,
                "planner_step_s": g.planner_step,
                "gap_s": g.total,
                "rank": g.rank,
                "planner_parts_s": g.parts,
                "terms": [{"term": t, "seconds": s, "source": src} for t, s, src in g.terms],
                "unsized": list(g.unsized),
                "residual_s": g.residual,
            }
        out.append(row)
    return out


def _layout_words(row: dict[str, Any]) -> str:
    lay = row["layout"]
    words = f"{lay['schedule']} pp{lay['pp']} dp{lay['dp']} ep{lay['ep']} x{lay['num_chunks']}"
    if lay["recompute"] != "none":
        words += f" rc={lay['recompute']}"
    return words if lay["overlap"] else words + " no-overlap"


def published_table(rows: list[dict[str, Any]]) -> str:
    """:func:`published_side_by_side`'s rows as a table, then each run's sources and, past :data:`GAP_SHOWN`, its
    gap in terms; then the runs skipped and why."""
    table = []
    for row in rows:
        tok, mem = row["tokens_per_s_per_gpu"], row["memory_gib"]
        published_mem = "not stated" if mem["published"] is None else f"<= {mem['published']:.1f}"
        table.append([
            row["name"], f"{row['gpus']:,} x {row['gpu'].upper()}", _layout_words(row),
            describe_precision(row["precision"], short=True), f"{tok['planner']:,.0f}", f"{tok['published']:,.0f}",
            f"{row['ratio']:.2f}", f"{mem['planner']:.1f}{'' if mem['fits'] else ' (NO fit)'}", published_mem,
        ])  # fmt: skip
    header = ["run", "device x GPUs", "layout", "precision", "planner tok/s/GPU", "published", "ratio",
              "planner GiB/GPU", "published GiB/GPU"]  # fmt: skip
    lines = [_table(table, header), ""]
    for row in rows:
        lines.append(f"{row['name']}: seq {row['seq_len']:,}, global batch {row['global_batch']:,}, micro-batch "
                     f"{row['micro_batch']}, stage layout {row['stage_layout']}")  # fmt: skip
        lines += [f"  source: {s['where']}: {s['quote']}" for s in row["sources"]]
        lines.append(f"  memory: {row['memory_gib']['published_note']}")
        flops = row["model_gflops_per_token"]
        if flops["published"] is not None:
            lines.append(f"  model FLOPs per token: planner {flops['planner']:.1f} GFLOP, published "
                         f"{flops['published']:.1f} (TFLOP/s/GPU over tokens/s/GPU)")  # fmt: skip
        if "gap" in row:
            lines += _gap_lines(row["gap"])
        else:
            lines += [f"  within {GAP_SHOWN:.0%}; not sized: {n}" for n in row["notes"]]
        lines.append("")
    lines.append("skipped (not expressible):")
    lines += [f"  {name}: {why}" for name, why in SKIPPED]
    return "\n".join(lines)


def _gap_lines(g: dict[str, Any]) -> list[str]:
    out = [
        f"  gap: published step {seconds(g['published_step_s'])} (tokens per step / published tokens/s/GPU / GPUs) "
        f"against the planner's {seconds(g['planner_step_s'])}: {g['gap_s']:+.2f} s",
        f"  the planner's step on rank {g['rank']} (its busiest): "
        + ", ".join(f"{k} {seconds(v)}" for k, v in g["planner_parts_s"].items()),
    ]
    for t in g["terms"]:
        out.append(f"  term {t['seconds']:+.3f} s: {t['term']} [{t['source']}]")
    out += [f"  not sized: {n}" for n in g["unsized"]]
    out.append(f"  residual {g['residual_s']:+.2f} s ({g['residual_s'] / g['published_step_s']:.0%} of the published "
               "step): not explained by the terms above")  # fmt: skip
    return out

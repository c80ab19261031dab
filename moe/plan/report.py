"""The planner's search over a cluster and what it prints: the best plan, the runners-up with why each loses,
and the DeepSeek-V3 report set beside our numbers.

:func:`plan` sizes every candidate first (memory is cheap) and times the ones that fit; when fewer than
``top`` fit, the smallest of the rest are timed too, so the table can say by how much they miss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from moe.config import MoEConfig
from moe.plan.hardware import Cluster
from moe.plan.measured import MeasuredCosts
from moe.plan.model import LayerCostModel
from moe.plan.search import Candidate, Prediction, StageTimes, candidates, predict, rank_predictions, seconds, why_worse

__all__ = ["V3_REPORT", "Plan", "RunShape", "plan", "plan_table", "v3_comparison"]

GIB = 2**30


@dataclass(frozen=True, slots=True)
class RunShape:
    """The training run: sequence length, global batch in sequences, sequences per micro-batch."""

    seq_len: int
    global_batch: int
    micro_batch: int

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch


@dataclass(frozen=True, slots=True)
class Plan:
    """Every timed prediction, best first, and how many candidates there were."""

    ranked: list[Prediction]
    num_candidates: int
    num_fitting: int

    @property
    def best(self) -> Prediction:
        return self.ranked[0]


def _model(cfg: MoEConfig, cluster: Cluster, run: RunShape, c: Candidate, measured: MeasuredCosts | None):
    return LayerCostModel(cfg, cluster, c, run.seq_len, run.micro_batch, run.tokens_per_step, measured=measured)


def _predict(model: LayerCostModel) -> Prediction:
    """Time and size ``model``'s candidate on its cluster."""
    return predict(
        model.candidate,
        model,
        num_layers=model.cfg.num_layers,
        tokens_per_step=model.tokens_per_step,
        num_gpus=model.cluster.num_gpus,
        peak_flops=model.cluster.gpu.bf16_flops,
    )


def evaluate(
    cfg: MoEConfig, cluster: Cluster, run: RunShape, candidate: Candidate, measured: MeasuredCosts | None = None
) -> Prediction:
    """Time and size one candidate."""
    return _predict(_model(cfg, cluster, run, candidate, measured))


def plan(
    cfg: MoEConfig,
    cluster: Cluster,
    run: RunShape,
    *,
    schedules: Sequence[str] | None = None,
    comm_sms: Sequence[int] = (20,),
    recompute: Sequence[bool] = (False, True),
    measured: MeasuredCosts | None = None,
    top: int = 10,
) -> Plan:
    """Search every candidate (:func:`moe.plan.search.candidates`) and rank them. SM counts the device
    cannot spare are dropped (a measured CPU "device" has one: its communication runs on a thread)."""
    comm_sms = [s for s in comm_sms if s < cluster.gpu.sms] or [0]
    found = list(
        candidates(
            num_gpus=cluster.num_gpus,
            num_layers=cfg.num_layers,
            num_experts=cfg.num_experts,
            global_batch=run.global_batch,
            micro_batch=run.micro_batch,
            schedules=schedules,
            comm_sms=comm_sms,
            recompute=recompute,
        )
    )
    if not found:
        raise ValueError(
            f"no layout runs a global batch of {run.global_batch} x {run.micro_batch}-sequence micro-batches on "
            f"{cluster.num_gpus} GPUs: make --global-batch a multiple of --micro-batch x (GPUs / pp) for some pp"
        )
    models = {c: _model(cfg, cluster, run, c, measured) for c in found}
    fitting = [c for c in found if models[c].fits()]
    rest = sorted((c for c in found if not models[c].fits()), key=lambda c: models[c].memory().total)
    timed = fitting + rest[: max(0, top - len(fitting))]
    return Plan(rank_predictions([_predict(models[c]) for c in timed]), len(found), len(fitting))


def _row(p: Prediction) -> list[str]:
    c = p.candidate
    return [
        c.schedule,
        str(c.pp),
        str(c.dp),
        str(c.ep),
        str(c.num_chunks),
        str(c.comm_sms),
        "yes" if c.recompute else "no",
        seconds(p.step_time),
        f"{p.tokens_per_s_per_gpu:,.0f}",
        f"{p.mfu:.1%}",
        f"{p.bubble_fraction:.1%}",
        f"{p.exposed_a2a_fraction:.1%}",
        f"{p.memory.total / GIB:.1f}",
        "yes" if p.fits else "NO",
    ]


_HEADER = ["schedule", "pp", "dp", "ep", "chunks", "comm SMs", "recompute", "step", "tok/s/GPU", "MFU",
           "bubble", "exposed a2a", "GiB/GPU", "fits"]  # fmt: skip


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def plan_table(result: Plan, top: int = 10) -> str:
    """The best plan in words, then the top ``top`` with why each loses to it."""
    best = result.best
    c, m = best.candidate, best.memory
    verdict = "best fitting plan" if best.fits else "NOTHING FITS; the closest plan"
    lines = [
        f"{result.num_candidates} candidates, {result.num_fitting} fit in memory.",
        f"{verdict}: {c.describe()}",
        f"  step {seconds(best.step_time)} (pipeline {seconds(best.pipeline_time)} + dp reduction "
        f"{seconds(best.dp_reduce_time)}), {best.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {best.mfu:.1%}",
        f"  bubble {best.bubble_fraction:.1%}, all-to-all exposed {best.exposed_a2a_fraction:.1%}",
        f"  memory per GPU {m.total / GIB:.1f} GiB: parameters {m.params / GIB:.1f}, gradients {m.grads / GIB:.1f}, "
        f"optimizer {m.optimizer / GIB:.1f}, activations {m.activations / GIB:.1f}, all-to-all buffers "
        f"{m.all_to_all_buffers / GIB:.1f}",
        "",
    ]
    shown = result.ranked[:top]
    rows = [[*_row(p), "best" if p is best else why_worse(p, best)] for p in shown]
    lines.append(_table(rows, [*_HEADER, "why it loses"]))
    return "\n".join(lines)


# DeepSeek-V3 technical report (arXiv 2412.19437): the numbers the planner is set beside, never fitted to.
V3_REPORT = {
    "layout": Candidate("dualpipe", 16, 128, 64, 120, 20, False),
    # 3.2.2: "the computation-to-communication ratio is approximately 1:1" for cross-node EP.
    "compute_to_a2a": 1.0,
    # Table 1: 180K H800 GPU hours per trillion tokens -> 1e12 / (180e3 x 3600 s) tokens/s per GPU.
    "tokens_per_s_per_gpu": 1e12 / (180e3 * 3600),
    "hbm_gb": 80,
}


def v3_comparison(cfg: MoEConfig, cluster: Cluster, run: RunShape, measured: MeasuredCosts | None = None) -> str:
    """The report's layout (DualPipe, PP16 x EP64 x ZeRO-1 DP128, 20 communication SMs) predicted for
    ``cfg`` on ``cluster``, each figure beside the report's."""
    layout = V3_REPORT["layout"]
    chunks = run.global_batch // (layout.dp * run.micro_batch)
    cand = Candidate(layout.schedule, layout.pp, layout.dp, layout.ep, chunks, layout.comm_sms, layout.recompute)
    model = _model(cfg, cluster, run, cand, measured)
    p = _predict(model)
    moe = model.layer(cfg.moe_layers[0])
    # The report's bubble formula with this model's per-chunk costs (a middle stage's chunk, paired with itself).
    times = StageTimes(model, cfg.num_layers, layout.pp).alone(layout.pp // 2)
    formula = (layout.pp / 2 - 1) * (times.FB + times.B - 3 * times.W)
    with_rc = evaluate(cfg, cluster, run, dataclasses.replace(cand, recompute=True), measured)
    rows = [
        ["bubble per step (s)", f"{max(p.sim.idle):.2f} (largest rank idle)",
         f"{formula:.2f} = (PP/2-1)(F&B+B-3W) with our F, B, W, F&B"],
        ["compute : all-to-all, one MoE layer forward",
         f"{moe.F / moe.comm:.2f} : 1 (experts alone {moe.mlp_F / moe.comm:.2f} : 1)" if moe.comm else "no a2a",
         "about 1 : 1 (3.2.2)"],
        ["memory per GPU (GiB)", f"{p.memory.total / GIB:.0f}; {with_rc.memory.total / GIB:.0f} with recompute",
         f"fits in {V3_REPORT['hbm_gb']} GB (FP8 activations, recompute of norms and MLA up-projections)"],
        ["tokens/s per GPU", f"{p.tokens_per_s_per_gpu:,.0f} (bf16 GEMMs, GQA)",
         f"{V3_REPORT['tokens_per_s_per_gpu']:,.0f} (180K H800 GPU-hours per trillion tokens; FP8 GEMMs, MLA)"],
        ["MFU (bf16 peak)", f"{p.mfu:.1%}", "not stated"],
        ["all-to-all exposed", f"{p.exposed_a2a_fraction:.1%}", "fully overlapped (claimed, 3.2.1)"],
    ]  # fmt: skip
    head = (
        f"DeepSeek-V3's layout: {cand.describe()} on {cluster.num_gpus} x {cluster.gpu.name}, "
        f"{cluster.gpus_per_node} per node; seq {run.seq_len}, global batch {run.global_batch}"
    )
    return head + "\n" + _table(rows, ["", "this planner", "DeepSeek-V3 report"])

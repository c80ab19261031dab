"""The planner's search over a cluster and what it prints: the best plan, the runners-up with why each loses,
and the DeepSeek-V3 report set beside our numbers.

:func:`plan` sizes and times the candidates in the order of a lower bound on their step
(:func:`moe.plan.search.step_bound`) and stops where no candidate left can enter the top ``top``; when fewer
than ``top`` fit, the smallest of the rest are timed too, so the table can say by how much they miss.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dualpipe.schedule import SCHEDULES, schedule_spec
from moe.models.config import MoEConfig
from moe.pipeline_layout import AUTO, StagePlan, expand
from moe.plan.costs import NO_FP8, RECOMPUTE, TRAINER_DEFAULTS, MemoryOptions, Precision
from moe.plan.footprint import HEADROOM, Footprint, layer_activations
from moe.plan.hardware import Cluster
from moe.plan.layouts import memory_descent, shifts
from moe.plan.measured import MeasuredCosts
from moe.plan.model import LayerCostModel
from moe.plan.params import auto_layout, stage_plans
from moe.plan.published import DEEPSEEK_V3_REPORT
from moe.plan.search import (
    LOSS_CLASSES,
    OFFLOAD_TRIES,
    Candidate,
    Prediction,
    StageTimes,
    Timed,
    busy_bound,
    candidates,
    loss_class,
    predict,
    rank_predictions,
    seconds,
    step_bound,
    time_actions,
    why_worse,
)

__all__ = [
    "V3_LAYOUT",
    "V3_REPORT",
    "Plan",
    "RunShape",
    "describe_precision",
    "evaluate",
    "evaluate_both",
    "plan",
    "plan_table",
    "v3_comparison",
    "v3_side_by_side",
]

GIB = 2**30


@dataclass(frozen=True, slots=True)
class RunShape:
    """The training run: sequence length, global batch in sequences, sequences per micro-batch, and what its
    GEMMs and all-to-alls compute and carry."""

    seq_len: int
    global_batch: int
    micro_batch: int
    precision: Precision = NO_FP8
    expert_imbalance: float = 1.0
    """The busiest expert-parallel rank's routed rows over the mean (1: balanced routing)."""

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch


@dataclass(frozen=True, slots=True)
class Plan:
    """Every timed prediction, best first, and how many candidates there were."""

    ranked: list[Prediction]
    num_candidates: int
    num_fitting: int
    closest_misfit: tuple[Candidate, float] | None = None
    """The candidate that misses memory by least and its bytes per GPU (None when every candidate fits)."""
    precision: Precision = NO_FP8
    """What every candidate was timed with (the run's)."""
    mtp_layers: int = 0
    """The model's MTP modules (the memory line names how they share the embedding and head only when it has
    some)."""
    skipped: int = 0
    """Candidates neither sized nor timed: their bound (:func:`moe.plan.search.step_bound`) is slower than ``top``
    fitting plans already timed, so none of them could enter the table."""
    untimed: int = 0
    """Candidates sized and fitting (counted in ``num_fitting``) but not timed: their busiest rank's work alone
    (:func:`moe.plan.search.busy_bound`) is slower than ``top`` fitting plans already timed."""

    @property
    def best(self) -> Prediction:
        return self.ranked[0]


def _model(
    cfg: MoEConfig,
    cluster: Cluster,
    run: RunShape,
    c: Candidate,
    measured: MeasuredCosts | None,
    options: MemoryOptions = TRAINER_DEFAULTS,
) -> LayerCostModel:
    return LayerCostModel(
        cfg,
        cluster,
        c,
        run.seq_len,
        run.micro_batch,
        run.tokens_per_step,
        measured=measured,
        memory_options=options,
        precision=run.precision,
        expert_imbalance=run.expert_imbalance,
    )


def _offloaded(c: Candidate, model: Callable[[Candidate], LayerCostModel], cluster: Cluster) -> Candidate | None:
    """``c`` with the first policy of :data:`moe.plan.search.OFFLOAD_TRIES` that makes it fit, None if none
    does (or if it is over by more than its activations: offloading moves only those)."""
    memory = model(c).memory()
    if memory.total - (1 - HEADROOM) * cluster.gpu.hbm_bytes >= memory.activations:
        return None
    for policy in OFFLOAD_TRIES:
        v = dataclasses.replace(c, offload=policy)
        if model(v).fits():
            return v
    return None


def _sizer(
    cfg: MoEConfig,
    cluster: Cluster,
    run: RunShape,
    measured: MeasuredCosts | None,
    options: MemoryOptions,
    cache: dict[Candidate, LayerCostModel],
) -> Callable[[Candidate], LayerCostModel]:
    """A candidate's cost model, built once into ``cache`` (what :func:`moe.plan.layouts.memory_descent` asks)."""

    def model(c: Candidate) -> LayerCostModel:
        if c not in cache:
            cache[c] = _model(cfg, cluster, run, c, measured, options)
        return cache[c]

    return model


def _plans(model: LayerCostModel) -> list[StagePlan]:
    """The stages of ``model``'s candidate (:func:`moe.plan.params.stage_plans` of its layout)."""
    c = model.candidate
    return stage_plans(model.cfg, c.pp, c.schedule, None, c.pipeline_layout)


def _predict(model: LayerCostModel, overlap: bool | None = None, timed: Timed | None = None) -> Prediction:
    """Time and size ``model``'s candidate on its cluster (``overlap``, ``timed``: :func:`moe.plan.search.predict`'s
    arguments)."""
    return predict(
        model.candidate,
        model,
        plans=_plans(model),
        tokens_per_step=model.tokens_per_step,
        num_gpus=model.cluster.num_gpus,
        peak_flops=model.cluster.gpu.bf16_flops,
        overlap=overlap,
        timed=timed,
    )


def evaluate(
    cfg: MoEConfig,
    cluster: Cluster,
    run: RunShape,
    candidate: Candidate,
    measured: MeasuredCosts | None = None,
    options: MemoryOptions = TRAINER_DEFAULTS,
    *,
    overlap: bool | None = None,
) -> Prediction:
    """Time and size one candidate (without ``overlap``, default the candidate's: each pair as its forward,
    then its backward, the V family unpaired)."""
    return _predict(_model(cfg, cluster, run, candidate, measured, options), overlap)


def evaluate_both(
    cfg: MoEConfig,
    cluster: Cluster,
    run: RunShape,
    candidate: Candidate,
    measured: MeasuredCosts | None = None,
    options: MemoryOptions = TRAINER_DEFAULTS,
) -> tuple[Prediction, Prediction]:
    """:func:`evaluate` with overlap and without, on one cost model: the sub-stage costs and the footprint, the
    same for both, are computed once."""
    model = _model(cfg, cluster, run, candidate, measured, options)
    return _predict(model, True), _predict(model, False)


DESCENTS = 3
"""Leading candidates that still do not fit at any shift whose layout :func:`plan` refines for memory."""


def plan(
    cfg: MoEConfig,
    cluster: Cluster,
    run: RunShape,
    *,
    schedules: Sequence[str] | None = None,
    comm_sms: Sequence[int] = (20,),
    recompute: Sequence[str | bool] = RECOMPUTE,
    measured: MeasuredCosts | None = None,
    top: int = 10,
    options: MemoryOptions = TRAINER_DEFAULTS,
    pipeline_layout: str = AUTO,
    progress: Callable[[str], None] | None = None,
    prune: bool = True,
) -> Plan:
    """Search every candidate (:func:`moe.plan.search.candidates`: each recompute granularity of
    ``recompute``) with the memory ``options`` and rank them. SM counts the device cannot spare are dropped
    (a measured CPU "device" has one: its communication runs on a thread). A ``pipeline_layout`` other than
    ``auto`` is searched only where the schedule has its number of stages. Candidates are sized and timed in the
    order of a lower bound from compute alone, and those that cannot enter the top ``top`` are skipped
    (:attr:`Plan.skipped`; ``prune=False`` times them all). ``progress`` is told what the search is doing, a
    few words at a time."""
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
            pipeline_layout=pipeline_layout,
        )
    )
    if not found and pipeline_layout != AUTO:
        raise ValueError(
            f"--pipeline-layout {pipeline_layout!r}: no schedule of {cluster.num_gpus} GPUs with a global batch of "
            f"{run.global_batch} has its {len(expand(pipeline_layout).split('|'))} stages"
        )
    if not found:
        raise ValueError(
            f"no layout runs a global batch of {run.global_batch} x {run.micro_batch}-sequence micro-batches on "
            f"{cluster.num_gpus} GPUs: make --global-batch-size a multiple of --micro-batch-size x (GPUs / pp) for "
            "some pp"
        )
    say = progress or (lambda text: None)
    models: dict[Candidate, LayerCostModel] = {}
    model = _sizer(cfg, cluster, run, measured, options, models)
    predictions, fitting, misses, skipped, untimed = _search_leading(
        found, model, cluster, top if prune else len(found), say
    )
    rest = sorted(misses, key=lambda c: models[c].memory().total)
    predictions += [_predict(models[c]) for c in rest[: max(0, top - len(fitting))]]
    ranked = rank_predictions(predictions)

    # The layout dimension, where it can change the answer (moe.plan.layouts): the leading candidates with
    # lighter first stages, and for the first few that still do not fit, layers moved off their fullest rank.
    variants = [v for p in ranked[:top] for v in shifts(cfg, p.candidate)]
    misses = [p.candidate for p in ranked[:top] if not p.fits][:DESCENTS]
    variants += [d for c in misses if (d := memory_descent(cfg, c, model)) != c and d not in variants]
    for v in variants:
        model(v)
    more = [_predict(models[v]) for v in variants if models[v].fits() or not fitting]
    fits = len(fitting) + untimed + sum(models[v].fits() for v in variants)
    best: dict[Candidate, Prediction] = {}  # each candidate once, at its best layout
    for p in rank_predictions([*ranked, *more]):
        best.setdefault(dataclasses.replace(p.candidate, pipeline_layout=AUTO), p)
    misfit = (rest[0], models[rest[0]].memory().total) if rest else None
    out = list(best.values())
    out[0] = _predict(models[out[0].candidate])  # the best keeps its timeline (the others' were dropped)
    return Plan(out, len(found) + len(variants), fits, misfit, run.precision, cfg.mtp_layers, skipped, untimed)


def _search_leading(
    found: Sequence[Candidate],
    model: Callable[[Candidate], LayerCostModel],
    cluster: Cluster,
    top: int,
    say: Callable[[str], None],
) -> tuple[list[Prediction], list[Candidate], list[Candidate], int, int]:
    """Size and time the candidates in the order of their lower bound (:func:`moe.plan.search.step_bound`,
    cheap: no schedule is built), stopping once the next bound exceeds the ``top``-th step timed: every
    candidate left is slower than ``top`` fitting ones, so the top ``top`` are those of searching them all. A
    candidate that does not fit is tried with offloading (:func:`_offloaded`; its copies only add to the
    bound). Returns the predictions (their timelines dropped: only the best's is drawn, and a search holds
    many), the fitting candidates timed (offloaded ones as run), the sized ones that do not fit even so, how
    many were left neither sized nor timed, and how many fit but were not timed: their busiest rank's work alone
    (:func:`moe.plan.search.busy_bound`, before the schedule is simulated) is slower than the ``top``-th step."""
    bounds = {c: _bound(model(c)) for c in found}
    order = sorted(found, key=lambda c: (bounds[c], c))
    steps: list[float] = []  # the fastest ``top`` steps so far, sorted
    out, fitting, misses = [], [], []
    late = 0
    for i, c in enumerate(order):
        if len(steps) >= top and bounds[c] > steps[top - 1]:
            return out, fitting, misses, len(order) - i, late
        say(f"sizing and timing {i + 1}/{len(order)} candidates, best bound first")
        v: Candidate | None = c
        if not model(c).fits():
            v = _offloaded(c, model, cluster)
            if v is None:
                misses.append(c)
                continue
        m = model(v)
        plans = _plans(m)
        timed = time_actions(v, m, plans=plans)  # once for the bound and the timing
        if len(steps) >= top and busy_bound(v, m, plans=plans, timed=timed) > steps[top - 1]:
            late += 1  # sized, but its busiest rank's work alone is slower than the top's: not timed
            continue
        fitting.append(v)
        p = dataclasses.replace(_predict(m, timed=timed), sim=None)
        out.append(p)
        bisect.insort(steps, p.step_time)
        del steps[top:]
    return out, fitting, misses, 0, late


def _bound(model: LayerCostModel) -> float:
    return step_bound(model.candidate, model, plans=_plans(model))


def _row(p: Prediction) -> list[str]:
    c = p.candidate
    return [
        c.label,
        str(c.pp),
        str(c.dp),
        str(c.ep),
        str(c.num_chunks),
        str(c.comm_sms),
        c.recompute,
        c.pipeline_layout,
        seconds(p.step_time),
        f"{p.tokens_per_s_per_gpu:,.0f}",
        f"{p.mfu:.1%}",
        f"{p.bubble_fraction:.1%}",
        f"{p.exposed_a2a_fraction:.1%}",
        f"{p.memory.total / GIB:.1f}",
        "yes" if p.fits else "NO",
    ]


_HEADER = ["schedule", "pp", "dp", "ep", "chunks", "comm SMs", "recompute", "layout", "step", "tok/s/GPU", "MFU",
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
        f"{result.num_candidates} candidates, {result.num_fitting} fit in memory."
        if not result.skipped
        else f"{result.num_candidates} candidates, {result.num_fitting} of the {result.num_candidates - result.skipped}"
        f" sized fit in memory ({result.skipped} skipped by their bound, below).",
        f"{verdict}: {c.describe()}",
        f"  step {seconds(best.step_time)} (pipeline {seconds(best.pipeline_time)} + dp reduction "
        f"{seconds(best.dp_reduce_time)}), {best.tokens_per_s_per_gpu:,.0f} tokens/s per GPU, MFU {best.mfu:.1%}",
        f"  bubble {best.bubble_fraction:.1%}, all-to-all exposed {best.exposed_a2a_fraction:.1%}",
        f"  memory per GPU {m.total / GIB:.1f} GiB: parameters {m.params / GIB:.1f}, gradients {m.grads / GIB:.1f}, "
        f"optimizer {m.optimizer / GIB:.1f}, activations {m.activations / GIB:.1f}, all-to-all buffers "
        f"{m.all_to_all_buffers / GIB:.1f}",
        *_host_line(m),
        f"  memory options: {describe_options(m.options, mtp=result.mtp_layers > 0, offload=c.offload)}",
        f"  precision: {describe_precision(result.precision.to_dict())}",
        "",
    ]
    shown = result.ranked[:top]
    rows = [[*_row(p), "best" if p is best else why_worse(p, best)] for p in shown]
    lines.append(_table(rows, [*_HEADER, "why it loses"]))
    lines += ["", *why_not(result)]
    if result.skipped:
        lines.append(
            f"skipped: {result.skipped} candidates neither sized nor timed (their compute and pipeline fill alone, "
            f"without the rest of the bubble or exposed all-to-all, are slower than the {top} plans above: "
            "moe.plan.search.step_bound); the counts above are of the others"
        )
    if result.untimed:
        lines.append(
            f"not timed: {result.untimed} candidates that fit (their busiest rank's work alone, without waiting for "
            f"a pipeline message, is slower than the {top} plans above: moe.plan.search.busy_bound)"
        )
    return "\n".join(lines)


def _host_line(m: Footprint) -> list[str]:
    """The host memory a rank needs besides the GPU's (the moving average of the weights), if any."""
    if not m.host:
        return []
    return [f"  host memory per rank {m.host / GIB:.1f} GiB: the moving average of the weights (no GPU memory)"]


def why_not(result: Plan) -> list[str]:
    """One line per class of candidates that lose to the best (:data:`moe.plan.search.LOSS_CLASSES`): how many,
    and the closest of them."""
    best = result.best
    out = []
    misses = result.num_candidates - result.num_fitting - result.skipped  # of those sized
    if misses and result.closest_misfit is not None:
        c, need = result.closest_misfit
        sized = " of those sized" if result.skipped else ""
        out.append(f"memory: {misses} candidates {LOSS_CLASSES['memory']} (the closest{sized}, {c.describe()}, "
                   f"needs {need / GIB:.1f} GiB per GPU)")  # fmt: skip
    timed = [p for p in result.ranked[1:] if p.fits and best.fits]
    for kind in ("bubble", "comm", "dp", "close"):
        group = [p for p in timed if loss_class(p, best) == kind]
        if group:
            p = group[0]
            out.append(f"{kind}: {len(group)} fitting candidates {LOSS_CLASSES[kind]} (the closest, "
                       f"{p.candidate.describe()}: {why_worse(p, best)})")  # fmt: skip
    return out


def describe_options(options: dict, *, mtp: bool = True, offload: str = "") -> str:
    """The memory options of a footprint in words, as the trainer's job names them (``mtp``: the model has MTP
    modules, whose sharing of the embedding and head is then named; ``offload``: the candidate's policy)."""
    shared = "MTP shares the embedding and head" if options.get("mtp_shares_embedding_and_head") else "MTP own copies"
    return (
        f"ZeRO-1 (--zero 1: optimizer state sharded over the data-parallel ranks), recompute "
        f"{options.get('recompute')}, optimizer state {options.get('optimizer_state_dtype')}, "
        + (f"{shared}, " if mtp else "")
        + f"FP8 activations {'on' if options.get('fp8_activations') else 'off'}"
        + (f", --offload {offload}" if offload else "")
        + (", EMA on the host" if options.get("ema_on_host") else "")
    )


def describe_precision(precision: dict, *, short: bool = False) -> str:
    """A run's precision (:meth:`moe.plan.costs.Precision.to_dict`) in words (``short``: a few)."""
    if short:
        words = {k: "FP8" if on else "no FP8" for k, on in precision.items()}
        return f"{words['fp8_gemms']} GEMMs, {words['fp8_dispatch']} dispatch"
    gemms = "GEMMs in the activation dtype"
    if precision["fp8_gemms"]:
        gemms = "FP8 GEMMs (every linear but the head and the router's gate)"
    if precision["fp8_dispatch"]:
        return f"{gemms}, FP8 dispatch (1 byte + 4/128 an element), combine in the activation dtype"
    return f"{gemms}, dispatch and combine in the activation dtype"


V3_REPORT = {
    "layout": DEEPSEEK_V3_REPORT.layout,
    "options": DEEPSEEK_V3_REPORT.options,
    "precision": DEEPSEEK_V3_REPORT.precision,
    "compute_to_a2a": DEEPSEEK_V3_REPORT.figures["compute_to_a2a"],
    "tokens_per_s_per_gpu": DEEPSEEK_V3_REPORT.tokens_per_s_per_gpu,
    "hbm_gb": DEEPSEEK_V3_REPORT.memory_gb,
}
"""The DeepSeek-V3 report's figures the side-by-side sets the planner beside, never fitted to: the record of
:data:`moe.plan.published.DEEPSEEK_V3_REPORT` (with its sources), by the names :func:`v3_side_by_side` reads."""

V3_LAYOUT = "Et*3|(t*4|)*14t*2mL"
"""The report's 16 DualPipe stages with lighter ends, set beside the even split: Megatron-Core's published
DeepSeek-V3 layout for 32 stages (``Et*3|(tt|)*29m|L``: the embedding stage holds the three dense layers, the
MTP module and the head come last) taken to 16: the embedding with the 3 dense layers, 14 stages of 4 layers,
the remaining 2 layers with the MTP module and the head (our layouts keep MTP on the head's stage). Derived
from that example, not tuned to fit."""


def v3_side_by_side(
    cfg: MoEConfig, cluster: Cluster, run: RunShape, measured: MeasuredCosts | None = None
) -> dict[str, Any]:
    """The report's layout (DualPipe, PP16 x EP64 x ZeRO-1 DP128, 20 communication SMs) with the report's
    memory options, predicted for ``cfg`` on ``cluster``: each figure as ``{"planner": ours, "report":
    theirs}`` (``None`` where the report states none), plus the layout, the options and the same layout
    without the options for contrast. The report's precision (FP8 GEMMs, FP8 dispatch) replaces ``run``'s."""
    layout, options = V3_REPORT["layout"], V3_REPORT["options"]
    run = dataclasses.replace(run, precision=V3_REPORT["precision"])
    chunks = run.global_batch // (layout.dp * run.micro_batch)
    auto = dataclasses.replace(layout, num_chunks=chunks)
    p, tried = _best_layout(cfg, cluster, run, auto, measured, options)
    cand, model = p.candidate, tried[p.candidate]
    moe = model.layer(cfg.moe_layers[0])
    # The report's bubble formula with this model's per-chunk costs (a middle stage's chunk, paired with itself).
    times = StageTimes(model, _plans(model)).alone(layout.pp // 2)
    formula = (layout.pp / 2 - 1) * (times.FB + times.B - 3 * times.W)
    plain = evaluate(cfg, cluster, run, dataclasses.replace(cand, recompute="none"), measured)
    auto_memory = tried[auto].memory()
    least = min(tried, key=lambda v: tried[v].memory().total)  # the least memory of the layouts tried
    least_memory = tried[least].memory()
    hbm = V3_REPORT["hbm_gb"] * 1e9
    m = p.memory
    # What one MoE layer keeps per micro-batch at these options, largest first: where the gap to the report is.
    kept = layer_activations(
        cfg, cfg.moe_layers[0], run.seq_len * run.micro_batch, run.seq_len, model.workload.act_bytes, layout.ep,
        recompute=layout.recompute, fp8=options.fp8_activations,
    )  # fmt: skip
    largest = dict(sorted(((k, v / 2**20) for k, v in kept.items()), key=lambda kv: -kv[1])[:6])
    laid = _model(cfg, cluster, run, dataclasses.replace(cand, pipeline_layout=V3_LAYOUT), measured, options)
    sizer = _sizer(cfg, cluster, run, measured, options, tried)
    offload = {
        rc: _offload_figures(dataclasses.replace(cand, recompute=rc), sizer, cluster) for rc in (cand.recompute, "none")
    }
    return {
        "layout": {**p.to_dict(), "num_gpus": cluster.num_gpus, "gpus_per_node": cluster.gpus_per_node},
        "options": dict(m.options),
        "precision": run.precision.to_dict(),
        "memory_gib": {
            "planner": m.total / GIB,
            "report": hbm / GIB,
            "fits": p.fits,
            "within_hbm": m.total <= hbm,
            "by_kind": _by_kind(m),
            "pp_rank": m.pp_rank,
            "pipeline_layout": cand.pipeline_layout,
            "auto_layout": auto_layout(cfg, layout.pp, layout.schedule),
            "auto": auto_memory.total / GIB,
            "least": {
                "pipeline_layout": least.pipeline_layout,
                "planner": least_memory.total / GIB,
                "pp_rank": least_memory.pp_rank,
                "fits": tried[least].fits(),
                "within_hbm": least_memory.total <= hbm,
                "layouts_tried": len(tried),
            },
            "per_rank": _per_rank(model),
            "peak_live_modules": m.peak_modules,
            "moe_layer_mib": sum(kept.values()) / 2**20,
            "moe_layer_largest_mib": largest,
            "without_options": plain.memory.total / GIB,
            "note": f"the report: fits in {V3_REPORT['hbm_gb']} GB with these options; ours: the fullest rank, "
            f"which fits when it leaves {HEADROOM_NOTE}; at the planner's layout (auto's, or another that "
            "moe.plan.layouts tries), auto's beside it",
        },
        "memory_gib_layout": _layout_memory(laid, hbm),
        "offload": offload,
        "tokens_per_s_per_gpu": {
            "planner": p.tokens_per_s_per_gpu,
            "report": V3_REPORT["tokens_per_s_per_gpu"],
            "note": "report: 14.8T tokens / 2,664K H800 GPU hours (FP8 GEMMs, FP8 dispatch); planner: the same "
            "precision, FP8 GEMMs at the device's FP8 peak",
        },
        "bubble_s": {
            "planner": max(p.sim.idle),
            "report": None,
            "report_formula_with_our_costs": formula,
            "note": "planner: the largest rank idle time per step; the report states (PP/2-1)(F&B+B-3W)",
        },
        "compute_to_a2a": {
            "planner": moe.F / moe.comm if moe.comm else None,
            "experts_alone": moe.mlp_F / moe.comm if moe.comm else None,
            "report": V3_REPORT["compute_to_a2a"],
        },
        "mfu": {"planner": p.mfu, "report": None},
        "schedules": _beside(cfg, cluster, run, auto, measured, options),
        "exposed_a2a_fraction": {
            "planner": p.exposed_a2a_fraction, "report": 0.0, "note": "report: fully overlapped (claimed, 3.2.1)",
        },
    }  # fmt: skip


def _best_layout(
    cfg: MoEConfig,
    cluster: Cluster,
    run: RunShape,
    c: Candidate,
    measured: MeasuredCosts | None,
    options: MemoryOptions,
) -> tuple[Prediction, dict[Candidate, LayerCostModel]]:
    """``c`` at the planner's layout (auto's, or another of :mod:`moe.plan.layouts`, as :func:`plan` searches):
    the best prediction and every model tried."""
    tried: dict[Candidate, LayerCostModel] = {}
    model = _sizer(cfg, cluster, run, measured, options, tried)
    for v in [c, *shifts(cfg, c)]:
        model(v)
    if not any(m.fits() for m in tried.values()):  # every layout the descent sizes lands in tried
        memory_descent(cfg, min(tried, key=lambda v: tried[v].memory().total), model)
    return rank_predictions([_predict(m) for m in tried.values()])[0], tried


def _beside(
    cfg: MoEConfig,
    cluster: Cluster,
    run: RunShape,
    report: Candidate,
    measured: MeasuredCosts | None,
    options: MemoryOptions,
) -> list[dict[str, Any]]:
    """Every other registered schedule (the V family among them) at the report's pp, dp, ep, micro-batches and
    options, each at its best layout: what a user limited by memory rather than bubble would weigh."""
    out = []
    for name in SCHEDULES:
        if name == report.schedule:
            continue
        c = dataclasses.replace(report, schedule=name)
        try:
            schedule_spec(name).validate(c.pp, c.num_chunks)
        except ValueError as exc:
            out.append({"schedule": name, "note": f"does not run here: {exc}"})
            continue
        p, _ = _best_layout(cfg, cluster, run, c, measured, options)
        out.append({
            "schedule": name, "pipeline_layout": p.candidate.pipeline_layout, "memory_gib": p.memory.total / GIB,
            "fits": p.fits, "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu, "bubble_fraction": p.bubble_fraction,
        })  # fmt: skip
    return out


HEADROOM_NOTE = "10% of HBM left free (moe.plan.footprint.HEADROOM)"
_KINDS = ("params", "grads", "optimizer", "activations", "all_to_all_buffers")


def _by_kind(m: Footprint) -> dict[str, float]:
    return {k: getattr(m, k) / GIB for k in _KINDS}


def _per_rank(model: LayerCostModel) -> list[dict[str, float]]:
    """Every pipeline rank's footprint (GiB by kind and total) under the model's candidate and layout."""
    out = []
    for r in range(model.candidate.pp):
        m = model.memory(r)
        out.append({**_by_kind(m), "total": m.total / GIB})
    return out


def _layout_memory(model: LayerCostModel, hbm: float) -> dict[str, Any]:
    """The side-by-side's memory at :data:`V3_LAYOUT`; ``planner`` is None (and ``note`` says why) for a
    model the layout does not describe (it lists DeepSeek-V3's 61 layers and 1 MTP module)."""
    out: dict[str, Any] = {"pipeline_layout": V3_LAYOUT}
    try:
        m = model.memory()
    except ValueError as exc:
        return {**out, "planner": None, "note": f"does not apply: {exc}"}
    return {
        **out,
        "planner": m.total / GIB,
        "fits": model.fits(),
        "within_hbm": m.total <= hbm,
        "by_kind": _by_kind(m),
        "pp_rank": m.pp_rank,
        "per_rank": _per_rank(model),
        "note": "the same run with the embedding stage holding the 3 dense layers and the head stage 2 layers, the "
        "MTP module and the head: Megatron-Core's published DeepSeek-V3 layout (Et*3|(tt|)*29m|L, 32 stages) "
        "taken to 16 stages, not tuned to fit",
    }


def _offload_figures(
    c: Candidate, model: Callable[[Candidate], LayerCostModel], cluster: Cluster
) -> dict[str, Any] | None:
    """``c`` with the first activation-offload policy the search would give it (:func:`_offloaded`): the policy,
    memory and speed; ``{"policy": ""}`` and its own figures where it fits without, None where none fits."""
    v = c if model(c).fits() else _offloaded(c, model, cluster)
    if v is None:
        return None
    p = _predict(model(v))
    return {
        "policy": v.offload, "recompute": v.recompute, "memory_gib": p.memory.total / GIB, "fits": p.fits,
        "activations_gib": p.memory.activations / GIB, "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu,
        "step_time_s": p.step_time,
    }  # fmt: skip


def _offload_words(o: dict[str, Any] | None) -> str:
    if o is None:
        return "does NOT fit with any policy tried (moe.plan.search.OFFLOAD_TRIES)"
    how = f"--offload {o['policy']}" if o["policy"] else "fits without offloading"
    return f"{o['memory_gib']:.1f} ({how}), {o['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU"


def _fit_words(mem: dict[str, Any]) -> str:
    """Whether a side-by-side memory figure fits: with the planner's headroom, or only within the HBM."""
    if mem["fits"]:
        return "fits"
    hbm = V3_REPORT["hbm_gb"]
    if mem["within_hbm"]:
        return f"within {hbm} GB, not within the planner's {1 - HEADROOM:.0%} of it"
    return "does NOT fit"


def v3_comparison(
    cfg: MoEConfig,
    cluster: Cluster,
    run: RunShape,
    measured: MeasuredCosts | None = None,
    *,
    side: dict[str, Any] | None = None,
) -> str:
    """:func:`v3_side_by_side` (or ``side``, what it returned) as a table: each figure beside the report's."""
    v3 = side if side is not None else v3_side_by_side(cfg, cluster, run, measured)
    mem, tok, bub, ratio = v3["memory_gib"], v3["tokens_per_s_per_gpu"], v3["bubble_s"], v3["compute_to_a2a"]
    layout = v3["layout"]
    lay = v3["memory_gib_layout"]
    top3 = ", ".join(f"{k} {v:.0f}" for k, v in list(mem["moe_layer_largest_mib"].items())[:3])
    rows = [
        ["bubble per step (s)", f"{bub['planner']:.2f} (largest rank idle)",
         f"{bub['report_formula_with_our_costs']:.2f} = (PP/2-1)(F&B+B-3W) with our F, B, W, F&B"],
        ["compute : all-to-all, one MoE layer forward",
         f"{ratio['planner']:.2f} : 1 (experts alone {ratio['experts_alone']:.2f} : 1)" if ratio["planner"]
         else "no a2a", "about 1 : 1 (3.2.2)"],
        [f"memory per GPU (GiB), the planner's layout {mem['pipeline_layout']}",
         f"{mem['planner']:.1f} ({_fit_words(mem)}, rank {mem['pp_rank']}); "
         f"{mem['without_options']:.0f} without the options",
         f"fits in {V3_REPORT['hbm_gb']} GB ({mem['report']:.1f} GiB)"],
        [f"memory per GPU (GiB), layout auto = {mem['auto_layout']}", f"{mem['auto']:.1f}", ""],
        [f"memory per GPU (GiB), the least of {mem['least']['layouts_tried']} layouts tried",
         f"{mem['least']['planner']:.1f} ({_fit_words(mem['least'])}, rank {mem['least']['pp_rank']}) at "
         f"{mem['least']['pipeline_layout']}", ""],
        [f"memory per GPU (GiB), layout {lay['pipeline_layout']}",
         lay["note"] if lay["planner"] is None else
         f"{lay['planner']:.1f} ({_fit_words(lay)}, rank {lay['pp_rank']}); Megatron-Core's V3 example at 16 stages",
         "layout not stated"],
        [f"memory per GPU (GiB) with activation offloading, recompute {layout['recompute']}",
         _offload_words(v3["offload"][layout["recompute"]]), "no offloading (3.2.3)"],
        ["the same with recompute none", _offload_words(v3["offload"]["none"]), ""],
        ["one MoE layer, one micro-batch (MiB)", f"{mem['moe_layer_mib']:.0f}: {top3}", "not stated"],
        ["tokens/s per GPU", f"{tok['planner']:,.0f} ({describe_precision(v3['precision'], short=True)})",
         f"{tok['report']:,.0f} (14.8T tokens / 2,664K H800 GPU hours; FP8 GEMMs, FP8 dispatch)"],
        ["MFU (bf16 peak)", f"{v3['mfu']['planner']:.1%}", "not stated"],
        ["all-to-all exposed", f"{v3['exposed_a2a_fraction']['planner']:.1%}", "fully overlapped (claimed, 3.2.1)"],
    ]  # fmt: skip
    for o in v3["schedules"]:  # the other schedules at the same parallelism
        rows.append(
            [
                f"{o['schedule']} instead, same pp/dp/ep",
                o["note"]
                if "note" in o
                else f"{o['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, {o['memory_gib']:.1f} GiB "
                f"({'fits' if o['fits'] else 'does NOT fit'}), bubble {o['bubble_fraction']:.1%}",
                "",
            ]
        )
    head = (
        f"DeepSeek-V3's layout: {layout['schedule']} pp={layout['pp']} dp={layout['dp']} ep={layout['ep']} "
        f"chunks={layout['num_chunks']} comm_sms={layout['comm_sms']} on {cluster.num_gpus} x {cluster.gpu.name}, "
        f"{cluster.gpus_per_node} per node; seq {run.seq_len}, global batch {run.global_batch}\n"
        f"memory options (the report's): {describe_options(v3['options'], mtp=cfg.mtp_layers > 0)}\n"
        f"precision (the report's, 3.3): {describe_precision(v3['precision'])}"
    )
    return head + "\n" + _table(rows, ["", "this planner", "DeepSeek-V3 report"])

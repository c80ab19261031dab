"""Which pieces of the model each pipeline stage holds: Megatron-Core's pipeline-layout strings.

A layout lists the stages in pipeline order (the order the schedule's layout numbers them: DualPipeV's
stage s is the s-th), separated by ``|``; a stage is a run of ``E`` (the embedding), ``t`` (one transformer
layer), ``m`` (one multi-token-prediction module) and ``L`` (the final norm, the head and the loss).
``X*n`` repeats the element before it n times, ``(...)*n`` a group, which may hold stage boundaries::

    Et*3|(tt|)*29m|L     DeepSeek-V3 on 32 stages: the embedding and the 3 dense layers, 29 stages of two
                         layers, the MTP module alone, the head alone (Megatron-Core's example)

The MTP modules come together after the last layer, on the head's stage or on the stage just before a last
stage that holds only the head: that stage takes the labels in forward and hands the main hidden state on
with the MTP loss attached to it (:func:`moe.models.block.attach_loss`).

Layers are numbered in order over the whole string. ``auto`` (the default) balances the stages by cost
(:func:`balance`): each piece weighs its matmul FLOPs per token (:class:`Costs`, from the planner's parameter
model, :func:`moe.plan.params.layout_costs`), so a dense layer, an MoE layer, the head and an MTP module each
count for what they compute, and the embedding (a lookup) for nothing. The trainer
(:meth:`moe.parallel.ParallelConfig.stage_plans`) and the planner both ask :func:`plan_stages`, so the planner
sizes the stages the trainer builds.
"""

from __future__ import annotations

import functools
import itertools
import re
from dataclasses import dataclass

__all__ = ["AUTO", "Costs", "StagePlan", "balance", "expand", "fold", "plan_stages", "shift_to_last"]

AUTO = "auto"
"""The layout that balances the stages' costs (the default; :func:`balance`)."""

# Stage costs within this relative distance of the optimum's largest count as equal (sums of equal layers in
# different orders differ in the last bits).
_TIE = 1e-9

_TOKEN = re.compile(r"\s*(?:(?P<atom>[EtmL|])|(?P<open>\()|(?P<close>\))|(?P<star>\*\s*(?P<n>\d+)))")


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One stage: the embedding (``first``), global layers ``layers``, its MTP modules, the head (``last``)."""

    first: bool
    layers: range
    mtp: int
    last: bool


@dataclass(frozen=True, slots=True)
class Costs:
    """What each piece of a layout costs, in any one unit (:func:`moe.plan.params.layout_costs`: matmul FLOPs
    per token)."""

    embed: float
    layers: tuple[float, ...]
    """One per transformer layer, in order."""
    mtp: float
    """All the MTP modules together: they sit on the stage of the head, after the last layer."""
    head: float
    """The final norm, the head and the loss."""


def expand(text: str) -> str:
    """The layout with every repetition written out (``Et*2|(t|)*2L`` -> ``Ett|t|t|L``); ``ValueError`` naming
    the position of a character it cannot read."""
    return _seq(text, 0, top=True)[0]


def _seq(text: str, pos: int, *, top: bool) -> tuple[str, int]:
    parts: list[str] = []
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            if text[pos:].strip() == "":
                return "".join(parts), len(text)
            raise ValueError(f"pipeline_layout = {text!r}: cannot read {text[pos]!r} at position {pos}")
        if m["close"]:
            if top:
                raise ValueError(f"pipeline_layout = {text!r}: ')' at position {m.start('close')} closes nothing")
            return "".join(parts), m.end()
        if m["star"]:
            if not parts:
                raise ValueError(f"pipeline_layout = {text!r}: '*' at position {m.start('star')} repeats nothing")
            parts[-1] = parts[-1] * int(m["n"])
            pos = m.end()
            continue
        if m["open"]:
            inner, pos = _seq(text, m.end(), top=False)
            parts.append(inner)
            continue
        parts.append(m["atom"])
        pos = m.end()
    if not top:
        raise ValueError(f"pipeline_layout = {text!r}: '(' is never closed")
    return "".join(parts), pos


@functools.lru_cache(maxsize=64)
def balance(costs: Costs, num_stages: int, mtp_layers: int = 0) -> str:
    """The layout (spelled out, repeated stages folded as ``(tt|)*n``) whose costliest stage costs least, and
    among those the one whose stage costs are most even (least sum of squares). Contiguous stages; the
    embedding first with at least one layer; the MTP modules (``mtp_layers`` of them, costing ``costs.mtp``
    together) and the head last and on one stage, which holds a layer too unless it holds MTP modules (every
    stage runs a block; a layout string can still give the embedding or the head a stage of its own). Exact
    (dynamic programming over the split points), deterministic."""
    layers = len(costs.layers)
    if layers < 1 or not 1 <= num_stages <= layers + (mtp_layers > 0):
        raise ValueError(f"{layers} layers cannot fill {num_stages} pipeline stages")
    # Indivisible units: the embedding with the first layer, each layer, the head with the last layer or with
    # the MTP modules.
    names = ["t"] * layers
    units = list(costs.layers)
    names[0], units[0] = "Et", costs.embed + units[0]
    if mtp_layers:
        names.append("m" * mtp_layers + "L")
        units.append(costs.mtp + costs.head)
    else:
        names[-1] += "L"
        units[-1] += costs.head
    prefix = [0.0]
    for c in units:
        prefix.append(prefix[-1] + c)
    n = len(units)

    def cost(k: int, i: int) -> float:  # units k..i-1 on one stage
        return prefix[i] - prefix[k]

    inf = float("inf")
    best = [0.0] + [inf] * n  # best[i]: the least costliest stage over splits of units[:i] into j stages
    for j in range(1, num_stages + 1):
        best = [inf] * j + [min(max(best[k], cost(k, i)) for k in range(j - 1, i)) for i in range(j, n + 1)]
    limit = best[n] * (1 + _TIE) + _TIE
    sq = [0.0] + [inf] * n  # under that limit, the least sum of squares; cuts[j][i]: where the j-th stage starts
    cuts: list[list[int]] = []
    for j in range(1, num_stages + 1):
        nxt, cut = [inf] * (n + 1), [0] * (n + 1)
        for i in range(j, n + 1):
            for k in range(j - 1, i):
                c = cost(k, i)
                if c <= limit and sq[k] + c * c < nxt[i]:
                    nxt[i], cut[i] = sq[k] + c * c, k
        sq = nxt
        cuts.append(cut)
    bounds, i = [n], n
    for j in range(num_stages, 0, -1):
        i = cuts[j - 1][i]
        bounds.append(i)
    bounds.reverse()
    return fold(["".join(names[a:b]) for a, b in itertools.pairwise(bounds)])


def shift_to_last(text: str, layers: int) -> str | None:
    """``text`` with ``layers`` of the first stage's layers moved to the front of the last stage (a lighter first
    stage, which keeps the most micro-batches in flight); None when the first stage would keep no layer or the
    layout has one stage."""
    stages = expand(text).split("|")
    first = stages[0]
    if len(stages) < 2 or first.count("t") <= layers or not first.endswith("t" * layers):
        return None
    stages[0], stages[-1] = first[: len(first) - layers], "t" * layers + stages[-1]
    return fold(stages)


def fold(stages: list[str]) -> str:
    """``|``-joined stages, each run of two or more equal stages before the last written ``(s|)*n``."""
    out, i = [], 0
    while i < len(stages) - 1:
        j = i
        while j + 1 < len(stages) - 1 and stages[j + 1] == stages[i]:
            j += 1
        run = j - i + 1
        out.append(f"({stages[i]}|)*{run}" if run > 1 else f"{stages[i]}|")
        i = j + 1
    return "".join(out) + stages[-1]


def plan_stages(
    text: str,
    *,
    num_stages: int,
    num_layers: int,
    mtp_layers: int,
    costs: Costs | None = None,
) -> list[StagePlan]:
    """The stages a layout string describes, checked against the model and the schedule's stage count: one
    line naming what does not match (``ValueError``). :data:`AUTO` is :func:`balance`'s layout for the model's
    ``costs`` (required with it)."""
    if text == AUTO:
        if costs is None:
            raise TypeError("pipeline_layout 'auto' balances the model's costs: pass costs=")
        text = balance(costs, num_stages, mtp_layers)
    where = f"pipeline_layout = {text!r}"
    stages = expand(text).split("|")
    if len(stages) != num_stages:
        raise ValueError(f"{where}: {len(stages)} stages, the schedule has {num_stages}")
    counts = {c: sum(s.count(c) for s in stages) for c in "EtmL"}
    if counts["t"] != num_layers:
        raise ValueError(f"{where}: {counts['t']} layers (t), the model has {num_layers}")
    if counts["m"] != mtp_layers:
        raise ValueError(f"{where}: {counts['m']} MTP modules (m), the model has {mtp_layers} (model.mtp_layers)")
    if counts["E"] != 1 or not stages[0].startswith("E"):
        raise ValueError(f"{where}: the embedding (E) comes once, first in the first stage")
    if counts["L"] != 1 or not stages[-1].endswith("L"):
        raise ValueError(f"{where}: the head (L) comes once, last in the last stage")
    plans, layer = [], 0
    for i, stage in enumerate(stages):
        body = stage.removeprefix("E") if i == 0 else stage
        body = body.removesuffix("L") if i == len(stages) - 1 else body
        if not stage:
            raise ValueError(f"{where}: stage {i} is empty")
        mtp = body.count("m")
        own = i == len(stages) - 2 and stages[-1] == "L"  # Megatron-Core's "...m|L": the head alone after them
        if mtp and (mtp != counts["m"] or "t" in body[body.index("m") :] or not (own or i == len(stages) - 1)):
            raise ValueError(
                f"{where}: the MTP modules (m) go together after the last layer, on the stage of the head (L) or "
                "on the stage before a last stage of the head alone ('m|L')"
            )
        n = body.count("t")
        plans.append(StagePlan(first=i == 0, layers=range(layer, layer + n), mtp=mtp, last=i == len(stages) - 1))
        layer += n
    return plans

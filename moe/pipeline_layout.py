"""Which pieces of the model each pipeline stage holds: Megatron-Core's pipeline-layout strings.

A layout lists the stages in pipeline order (the order the schedule's layout numbers them: DualPipeV's
stage s is the s-th), separated by ``|``; a stage is a run of ``E`` (the embedding), ``t`` (one transformer
layer), ``m`` (one multi-token-prediction module) and ``L`` (the final norm, the head and the loss).
``X*n`` repeats the element before it n times, ``(...)*n`` a group, which may hold stage boundaries::

    Et*3|(tt|)*29m|L     DeepSeek-V3 on 32 stages: the embedding and the 3 dense layers, 29 stages of two
                         layers, the MTP module alone, the head alone (Megatron-Core's example)

Layers are numbered in order over the whole string. ``auto`` (the default) splits the layers evenly, the
embedding with the first layers and the head (and MTP) with the last (:func:`split_layers`). The trainer
(:meth:`moe.parallel.ParallelConfig.stage_plans`) and the planner both ask :func:`plan_stages`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["AUTO", "StagePlan", "expand", "plan_stages", "split_layers"]

AUTO = "auto"
"""The layout that balances layer counts (the default)."""

_TOKEN = re.compile(r"\s*(?:(?P<atom>[EtmL|])|(?P<open>\()|(?P<close>\))|(?P<star>\*\s*(?P<n>\d+)))")


@dataclass(frozen=True, slots=True)
class StagePlan:
    """One stage: the embedding (``first``), global layers ``layers``, its MTP modules, the head (``last``)."""

    first: bool
    layers: range
    mtp: int
    last: bool


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


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous, balanced layer ranges; the first ``num_layers % num_stages`` stages get one more."""
    if num_layers < num_stages:
        raise ValueError(f"{num_layers} layers cannot fill {num_stages} pipeline stages")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        ranges.append(range(start, start + n))
        start += n
    return ranges


def plan_stages(text: str, *, num_stages: int, num_layers: int, mtp_layers: int) -> list[StagePlan]:
    """The stages a layout string (or :data:`AUTO`: the even split, MTP with the head) describes, checked
    against the model and the schedule's stage count: one line naming what does not match (``ValueError``)."""
    if text == AUTO:
        last = num_stages - 1
        ranges = split_layers(num_layers, num_stages)
        return [
            StagePlan(first=s == 0, layers=r, mtp=mtp_layers * (s == last), last=s == last)
            for s, r in enumerate(ranges)
        ]
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
        if mtp and (i != len(stages) - 1 or "t" in body[body.index("m") :]):
            raise ValueError(
                f"{where}: the MTP modules (m) go after the last layer, on the stage of the head (L) (an MTP stage "
                "of its own is not built yet)"
            )
        n = body.count("t")
        plans.append(StagePlan(first=i == 0, layers=range(layer, layer + n), mtp=mtp, last=i == len(stages) - 1))
        layer += n
    return plans

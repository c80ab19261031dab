"""The planner's layout dimension: which pipeline layouts (:mod:`moe.pipeline_layout`) it tries for a candidate.

``auto`` balances compute across stages (:func:`moe.pipeline_layout.balance`), but the schedule decides where
the memory goes: a stage keeps about as many micro-batches in flight as there are stages after it, and
DualPipe's middle ranks keep the most of both directions. So beside ``auto`` the planner tries

- :func:`shifts`: ``auto`` with :data:`LAYOUT_SHIFTS` layers moved from its first stage to its last (for
  DeepSeek-V3 on 16 DualPipe stages, two layers give Megatron-Core's own example);
- :func:`memory_descent`: where no layout tried fits, one layer at a time moved from a stage of the fullest
  rank to a stage of the emptiest (the stages between hand a layer on), the move that leaves the fullest rank
  least full first, while that falls (at most :data:`MAX_MOVES` moves).

Both give layout strings the trainer takes as ``--pipeline-layout``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from moe.models.config import MoEConfig
from moe.pipeline_layout import AUTO, expand, fold, shift_to_last
from moe.plan.model import LayerCostModel
from moe.plan.params import auto_layout, rank_stages
from moe.plan.search import Candidate

__all__ = ["LAYOUT_SHIFTS", "MAX_MOVES", "memory_descent", "shifts"]

LAYOUT_SHIFTS = (1, 2, 3)
"""Layers :func:`shifts` moves from ``auto``'s first stage to its last."""
MAX_MOVES = 16
"""Layers :func:`memory_descent` moves at most."""


def shifts(cfg: MoEConfig, c: Candidate) -> list[Candidate]:
    """``c`` under ``auto``'s layout with each of :data:`LAYOUT_SHIFTS` layers moved off its first stage
    (:func:`moe.pipeline_layout.shift_to_last`); none for a candidate with a layout of its own."""
    if c.pipeline_layout != AUTO:
        return []
    base = auto_layout(cfg, c.pp, c.schedule)
    shifted = (shift_to_last(base, k) for k in LAYOUT_SHIFTS)
    return [dataclasses.replace(c, pipeline_layout=text) for text in shifted if text is not None]


def _move(stages: list[str], src: int, dst: int) -> list[str] | None:
    """One layer fewer on stage ``src`` and one more on ``dst`` (the layers stay in order, so the stages between
    hand one on); None when ``src`` would be left with nothing to run."""
    if stages[src].count("t") == 0 or len(stages[src]) == 1:
        return None
    out = list(stages)
    out[src] = out[src].replace("t", "", 1)
    i = out[dst].rfind("t") + 1 or (1 if out[dst].startswith("E") else 0)
    out[dst] = out[dst][:i] + "t" + out[dst][i:]
    return out


def memory_descent(cfg: MoEConfig, c: Candidate, model: Callable[[Candidate], LayerCostModel]) -> Candidate:
    """``c`` (its layout, ``auto``'s if it has none) with layers moved from the fullest rank's stages to the
    emptiest rank's while the fullest rank's memory falls, until it fits or :data:`MAX_MOVES` moves;
    ``model(candidate)`` sizes a candidate. Returns ``c`` itself when no move helps."""
    text = auto_layout(cfg, c.pp, c.schedule) if c.pipeline_layout == AUTO else c.pipeline_layout
    stages = expand(text).split("|")
    best = c
    for _ in range(MAX_MOVES):
        m = model(best)
        if m.fits():
            break
        per_rank = [m.memory(r).total for r in range(c.pp)]
        full, empty = max(range(c.pp), key=per_rank.__getitem__), min(range(c.pp), key=per_rank.__getitem__)
        held = {r: [sid for sid, _ in rank_stages(cfg, c.pp, c.schedule, r, pipeline_layout="|".join(stages))]
                for r in (full, empty)}  # fmt: skip
        tries = []
        for src in sorted(set(held[full])):
            for dst in sorted(set(held[empty]) - {src}):
                moved = _move(stages, src, dst)
                if moved is not None:
                    cand = dataclasses.replace(c, pipeline_layout=fold(moved))
                    tries.append((model(cand).memory().total, moved, cand))
        if not tries:
            break
        total, moved, cand = min(tries, key=lambda t: t[0])
        if total >= max(per_rank) - 2**20:  # less than a MiB: no move helps
            break
        stages, best = moved, cand
    return best

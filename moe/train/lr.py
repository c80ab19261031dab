"""Learning-rate schedules by name: a pure function of (step, total steps) per schedule, one registry.

Steps count from 1 (the first optimizer step). Adding a schedule is one :func:`register_lr_schedule` call;
``lr_schedule.name`` (``--lr-schedule``) accepts it from then on.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from dualpipe.registry import Registry

__all__ = ["LR_SCHEDULES", "LRSchedule", "LRScheduleSpec", "lr_at", "register_lr_schedule"]


class LRSchedule(Protocol):
    """The fields a schedule reads (:class:`moe.train.config.LRScheduleConfig`)."""

    name: str
    warmup: int
    min_ratio: float
    decay_fraction: float


@dataclass(frozen=True, kw_only=True, slots=True)
class LRScheduleSpec:
    name: str
    summary: str
    factor: Callable[[LRSchedule, int, int], float]
    """``factor(config, step, total_steps)``: the multiplier on the peak learning rate at ``step``."""


LR_SCHEDULES: Registry[LRScheduleSpec] = Registry("learning-rate schedule")


def register_lr_schedule(spec: LRScheduleSpec) -> LRScheduleSpec:
    return LR_SCHEDULES.register(spec)


def _warmup(cfg: LRSchedule, step: int) -> float | None:
    """The warm-up factor ``step / warmup`` while warming up, else None."""
    if step <= cfg.warmup:
        return step / max(cfg.warmup, 1)
    return None


def _cosine(cfg: LRSchedule, step: int, total: int) -> float:
    warm = _warmup(cfg, step)
    if warm is not None:
        return warm
    progress = min((step - cfg.warmup) / max(total - cfg.warmup, 1), 1.0)
    return cfg.min_ratio + (1 - cfg.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def _wsd(cfg: LRSchedule, step: int, total: int) -> float:
    """Warm-up, stable, decay (MiniCPM's WSD): the stable phase does not depend on ``total``, so a run that is
    later extended agrees with the longer run's learning rates until its decay starts."""
    warm = _warmup(cfg, step)
    if warm is not None:
        return warm
    decay_steps = round(cfg.decay_fraction * total)
    start = max(total - decay_steps, cfg.warmup)
    if step <= start or decay_steps == 0:
        return 1.0
    progress = min((step - start) / max(total - start, 1), 1.0)
    return 1.0 - (1.0 - cfg.min_ratio) * progress


register_lr_schedule(
    LRScheduleSpec(
        name="warmup-cosine",
        summary="linear warm-up, cosine decay to min_ratio x lr at the last step",
        factor=_cosine,
    )
)
register_lr_schedule(
    LRScheduleSpec(
        name="wsd",
        summary="linear warm-up, constant, linear decay to min_ratio x lr over the last decay_fraction of the steps",
        factor=_wsd,
    )
)


def lr_at(cfg: LRSchedule, peak_lr: float, step: int, total_steps: int) -> float:
    """The learning rate of ``step`` (1-based) in a run of ``total_steps``."""
    return peak_lr * LR_SCHEDULES.lookup(cfg.name).factor(cfg, step, total_steps)

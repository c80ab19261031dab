"""What an optimizer keeps and where, read by the trainer's optimizer and by the planner alike: the update rules
(:data:`OPTIMIZERS`, one :class:`OptimizerSpec` each: hyper-parameters and per-parameter state), the dtypes
their moments may be stored in (:data:`STATE_DTYPES`), and ZeRO-1's split of a tensor's rows over a group
(:func:`shard_rows`). The optimizer itself is :class:`moe.train.optimizer.DistributedOptimizer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dualpipe.registry import Registry

STATE_DTYPES = ("float32", "bfloat16")
"""Dtypes the optimizer moments of fp32 masters can be stored in (``state_dtype``)."""
EMA_HOST_BYTES = 8
"""Host bytes per element of the moving average of the weights a rank holds (``--ema``, moe.train.ema): the fp32
average and the fp32 buffer the device copies the weights into. No GPU bytes."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSpec:
    """One update rule: the torch optimizer that runs it over the masters, and what the rest of the stack
    must know of it (its hyper-parameters, its per-parameter state)."""

    name: str
    """Registry key: the trainer's ``optimizer.name`` (``--optimizer``)."""
    summary: str
    """One line for ``--help``."""
    torch_class: type[torch.optim.Optimizer]
    hyper: tuple[str, ...]
    """Its param-group keys (``lr`` first), the constructor keywords :class:`DistributedOptimizer` takes and
    copies into the inner optimizer before each step (the trainer moves ``lr``)."""
    state: tuple[str, ...]
    """Per-parameter state keys as the torch optimizer names them; checkpoints save them under these."""
    scalar_state: tuple[str, ...] = ()
    """The 0-d entries of ``state`` (a step counter), the rest have the parameter's shape."""

    @property
    def moments(self) -> int:
        """State tensors the size of the parameter (the planner's optimizer-state bytes)."""
        return len(self.state) - len(self.scalar_state)

    def check(self, hyper: dict[str, Any]) -> None:
        """``ValueError`` naming the first out-of-range hyper-parameter (before any rank builds state)."""
        unknown = sorted(set(hyper) - set(self.hyper))
        if unknown:
            raise ValueError(f"optimizer {self.name} takes {', '.join(self.hyper)}; not {', '.join(unknown)}")
        for key in ("lr", "eps", "weight_decay", "momentum"):
            if key in hyper and hyper[key] < 0:
                raise ValueError(f"{key} must be >= 0, got {hyper[key]}")
        if "betas" in hyper and not all(0.0 <= b < 1.0 for b in hyper["betas"]):
            raise ValueError(f"betas must lie in [0, 1), got {tuple(hyper['betas'])}")

    def init_state(self, master: torch.Tensor, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The state the torch optimizer would create on its first step, made up front so that checkpoints can
        load into it and :meth:`DistributedOptimizer.state_bytes` counts it from the start (a zero momentum
        buffer steps exactly as SGD's first-step clone of the gradient does). ``dtype``: of the tensors the size
        of ``master`` (None: the master's)."""
        # torch keeps a non-capturable step on the CPU in the default float dtype's width (_get_scalar_dtype).
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        return {
            k: torch.tensor(0.0, dtype=scalar)
            if k in self.scalar_state
            else torch.zeros_like(master, dtype=dtype, memory_format=torch.preserve_format)
            for k in self.state
        }

    @property
    def moment_keys(self) -> tuple[str, ...]:
        """The state keys of tensors the size of the parameter (AdamW: ``exp_avg``, ``exp_avg_sq``)."""
        return tuple(k for k in self.state if k not in self.scalar_state)


OPTIMIZERS: Registry[OptimizerSpec] = Registry("optimizer")
"""Every update rule by name; :func:`register_optimizer` adds one."""


def register_optimizer(spec: OptimizerSpec) -> OptimizerSpec:
    return OPTIMIZERS.register(spec)


register_optimizer(
    OptimizerSpec(
        name="adamw",
        summary="AdamW (decoupled weight decay), torch's, over fp32 masters",
        torch_class=torch.optim.AdamW,
        hyper=("lr", "betas", "eps", "weight_decay"),
        state=("step", "exp_avg", "exp_avg_sq"),
        scalar_state=("step",),
    )
)
register_optimizer(
    OptimizerSpec(
        name="sgd",
        summary="SGD with momentum (L2 weight decay), torch's, over fp32 masters",
        torch_class=torch.optim.SGD,
        hyper=("lr", "momentum", "weight_decay"),
        state=("momentum_buffer",),
    )
)


def state_dtype_of(value: str | torch.dtype) -> torch.dtype:
    name = str(value).removeprefix("torch.")
    if name not in STATE_DTYPES:
        raise ValueError(f"state_dtype {value!r} is not one of {', '.join(STATE_DTYPES)}")
    return getattr(torch, name)


def shard_rows(rows: int, size: int, rank: int) -> tuple[int, int]:
    """``(start, stop)``: the rows that rank ``rank`` of a group of ``size`` holds of a tensor with ``rows`` rows
    along its split dimension. The one definition of ZeRO-1's split (the optimizer's, the planner's, the
    checkpoint's): torch.chunk's rule, which FSDP2 and DTensor's ``Shard(0)`` follow, so DCP records these very
    chunks. Chunks of ``ceil(rows / size)`` in rank order, the last short and those after it empty (at
    ``rows``); rank 0 holds the largest."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not a rank of a group of size {size}")
    chunk = -(-rows // size)
    start = min(rows, chunk * rank)
    return start, min(rows, start + chunk)

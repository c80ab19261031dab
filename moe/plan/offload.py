"""Activation-offload policies: which saved tensors go to host memory, at which pipeline ranks.

The trainer's ``--offload POLICY`` (``parallel.offload``) is parsed here, once; the runtime that moves the
tensors is :mod:`dualpipe.offload`, the naming of saved tensors at run time :mod:`moe.train.offload`. A tensor
is named as the planner's per-layer table names it (:func:`moe.plan.footprint.saved_tensors`:
``attn.sdpa_out``, ``mlp.experts_input_fp8``...).

Syntax: clauses joined by ``;``, each ``SELECT[@OPTION]...``:

- ``SELECT``: ``all`` (every saved tensor, named or not), or names joined by ``,``, each a planner name or a
  prefix ending in ``*`` (``attn.*``); or ``fraction=F`` alone, short for ``all@fraction=F``;
- ``@ranks=R``: the pipeline ranks it applies at (``0``, ``0-3``, ``0,2``; default every rank);
- ``@fraction=F``: only the saved tensors of each stage's first ``round(F x blocks)`` blocks (0 < F <= 1): their
  backward comes last, so they stay away longest.

A storage is offloaded when any clause picks it. Examples: ``attn.sdpa_out,mlp.experts_input*``,
``all@ranks=0-1``, ``fraction=0.5``, ``mlp.*@fraction=0.5@ranks=1``. :func:`moe.plan.footprint.offload_bytes`
is what a policy moves for one micro-batch of one stage (the planner's figure of the bytes saved), and
:func:`with_copies` the time its copies add to a step.
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dualpipe.offload import reload_points
from dualpipe.schedule import Op, Schedule

__all__ = [
    "NAMED",
    "OffloadClause",
    "OffloadPolicy",
    "parse_offload",
    "with_copies",
]

NAMED = frozenset(
    {
        *(f"{p}norm_{t}" for p in ("attn.", "attn.mlp_", "head.") for t in ("fp32_input", "rsqrt", "fp32_output")),
        *(f"{p}norm_fp32_weight" for p in ("attn.", "attn.mlp_", "head.")),
        "attn.norm_output",
        "attn.q_a_norm_output",
        "attn.kv_a_norm_output",
        "attn.rotary_tables",
        "attn.sdpa_qkv",
        "attn.sdpa_out",
        "attn.sdpa_lse",
        "attn.mlp_norm_output",
        "attn.router_scores_fp32",
        "attn.router_topk",
        "mlp.swiglu_input",
        "mlp.down_input",
        "mlp.shared_swiglu_input",
        "mlp.shared_down_input",
        "mlp.row_ids",
        "mlp.row_weights",
        "mlp.experts_input",
        "mlp.experts_gate_up_output",
        "mlp.experts_input_fp8",
        "mlp.experts_gate_up_output_fp8",
        "head.norm_output",
        "embed.ids",
    }
)
"""The planner names :mod:`moe.train.offload` gives saved tensors at run time (the others, such as MLA's SDPA
inputs and the MTP modules' extras, are offloaded by ``all`` or ``fraction`` only)."""


@dataclass(frozen=True, slots=True)
class OffloadClause:
    """One clause: ``names`` (patterns; empty: every saved tensor), at ``ranks`` (None: all), of the first
    ``fraction`` of each stage's blocks (1.0: all of them)."""

    names: tuple[str, ...] = ()
    ranks: frozenset[int] | None = None
    fraction: float = 1.0

    def picks(self, rank: int, name: str | None, block: int | None, blocks: int) -> bool:
        """Whether this clause offloads a storage named ``name`` saved in the stage's ``block``-th block (None:
        outside the blocks, the embedding or the head) of ``blocks``, at pipeline rank ``rank``."""
        if self.ranks is not None and rank not in self.ranks:
            return False
        if self.fraction < 1.0 and (block is None or block >= round(self.fraction * blocks)):
            return False
        return not self.names or (name is not None and any(fnmatch.fnmatchcase(name, p) for p in self.names))


@dataclass(frozen=True, slots=True)
class OffloadPolicy:
    """A parsed ``--offload`` (:func:`parse_offload`); ``text`` as given. Empty: nothing moves."""

    text: str = ""
    clauses: tuple[OffloadClause, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.clauses)

    def picks(self, rank: int, name: str | None, block: int | None, blocks: int) -> bool:
        return any(c.picks(rank, name, block, blocks) for c in self.clauses)

    def at_rank(self, rank: int) -> bool:
        """Whether anything can move at pipeline rank ``rank``."""
        return any(c.ranks is None or rank in c.ranks for c in self.clauses)


def parse_offload(text: str, pp: int | None = None, names: Iterable[str] | None = None) -> OffloadPolicy:
    """``text`` as a policy (the module docstring); ``ValueError`` with a one-line message for bad syntax, a rank
    outside ``0..pp-1`` or a name outside ``names`` (which it lists). ``""`` and ``none``: nothing."""
    text = text.strip()
    if text in ("", "none"):
        return OffloadPolicy(text)
    valid = None if names is None else sorted(names)
    return OffloadPolicy(text, tuple(_clause(c.strip(), text, pp, valid) for c in text.split(";")))


def _clause(clause: str, text: str, pp: int | None, valid: Sequence[str] | None) -> OffloadClause:
    select, *options = clause.split("@")
    select = select.strip()
    if select.startswith("fraction="):
        select, options = "all", [select, *options]
    if not select:
        raise ValueError(f"offload = {text!r}: a clause names no tensors (say 'all' or a name, e.g. attn.sdpa_out)")
    names = () if select == "all" else tuple(n.strip() for n in select.split(","))
    for n in names:
        if not n or (valid is not None and not any(fnmatch.fnmatchcase(v, n) for v in valid)):
            choices = ", ".join(["all", *(valid or ())])
            raise ValueError(f"offload = {text!r}: no saved tensor is named {n!r}; choose from {choices}")
    ranks, fraction = None, 1.0
    for opt in options:
        key, _, value = opt.partition("=")
        key, value = key.strip(), value.strip()
        if key == "ranks":
            ranks = None if value == "all" else _ranks(value, text, pp)
        elif key == "fraction":
            try:
                fraction = float(value)
            except ValueError:
                fraction = -1.0
            if not 0.0 < fraction <= 1.0:
                raise ValueError(f"offload = {text!r}: fraction={value!r} must be a number in (0, 1]")
        else:
            raise ValueError(f"offload = {text!r}: unknown option {opt!r}; use @ranks=R or @fraction=F")
    return OffloadClause(names, ranks, fraction)


def _ranks(value: str, text: str, pp: int | None) -> frozenset[int]:
    out: set[int] = set()
    for part in value.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"offload = {text!r}: ranks={value!r} is not a list of ranks or ranges (0-3,5)") from None
        if first > last or first < 0 or (pp is not None and last >= pp):
            raise ValueError(f"offload = {text!r}: ranks={value!r} is outside the pipeline ranks 0..{(pp or 1) - 1}")
        out.update(range(first, last + 1))
    return frozenset(out)


def with_copies(
    schedule: Schedule, durations: Sequence[Sequence[float]], seconds: Sequence[Sequence[float]]
) -> list[list[float]]:
    """Each compute action's duration (``durations``, per rank in the order of ``schedule``'s compute actions)
    with the offload copies that run beside it: the executor's copy stream moves a forward's chosen tensors
    out during the compute action after it and a backward's back during the one before it
    (:func:`dualpipe.offload.reload_points`), one copy after another; what they take beyond the action's own
    time is exposed and lengthens it. ``seconds[rank][module]``: one direction's copy time of one micro-batch
    of that local module (its moved bytes over the host link)."""
    out = []
    for rank, plan in enumerate(_copy_plan(schedule)):
        mine, leaving = [], 0.0  # the copy out of the last forward, which runs beside the next action
        for duration, (back, away) in zip(durations[rank], plan, strict=True):
            mine.append(max(duration, leaving + sum(seconds[rank][module] for module in back)))
            leaving = seconds[rank][away] if away >= 0 else 0.0
        out.append(mine)
    return out


@functools.lru_cache(maxsize=64)
def _copy_plan(schedule: Schedule) -> tuple[tuple[tuple[tuple[int, ...], int], ...], ...]:
    """Per rank and compute action: the local modules of the micro-batches reloaded beside it, and the module
    whose forward's tensors leave beside the next one (-1: none). Once per schedule: a search times it often."""
    out = []
    for actions in schedule.ranks:
        reloads, kept = reload_points(actions)
        plan = []
        for i, a in enumerate(actions):
            if not a.op.is_compute:
                continue
            made = a.op in (Op.F, Op.FB) and (a.module, a.chunk) not in kept
            plan.append((tuple(module for module, _ in reloads.get(i, ())), a.module if made else -1))
        out.append(tuple(plan))
    return tuple(out)

"""Parameter shapes of the model, per layer and per pipeline rank, without building it.

The shapes follow the modules exactly (moe/block.py, moe/layers.py, moe/experts.py, moe/router.py,
moe/stage.py): the planner's parameter, gradient and optimizer figures are sums over these lists, and
the footprint test checks them against the real stages' bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dualpipe.schedule import Layout, schedule_spec
from moe.config import MoEConfig
from moe.parallel import split_layers

__all__ = ["ParamSpec", "active_params", "layer_params", "rank_params", "rank_stages", "stage_params", "total_params"]


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter tensor: its name (as in :class:`moe.stage.MoEStage`), element count, whether it is an
    expert weight (sharded over ep, its optimizer state over the edp replicas)."""

    name: str
    numel: int
    expert: bool = False


def layer_params(cfg: MoEConfig, layer: int, ep: int = 1) -> list[ParamSpec]:
    """The parameters of block ``layer`` on one rank of an ``ep``-way expert-parallel group."""
    if cfg.num_experts % ep:
        raise ValueError(f"num_experts={cfg.num_experts} is not divisible by ep={ep}")
    d, c = cfg.hidden_size, cfg.attn_head_dim
    q, kv = cfg.num_heads * c, cfg.num_kv_heads * c
    p = f"blocks.{layer}."
    out = [
        ParamSpec(p + "attn_norm.weight", d),
        ParamSpec(p + "attn.wq.weight", q * d),
        ParamSpec(p + "attn.wk.weight", kv * d),
        ParamSpec(p + "attn.wv.weight", kv * d),
        ParamSpec(p + "attn.wo.weight", d * q),
        ParamSpec(p + "mlp_norm.weight", d),
    ]
    if not cfg.is_moe_layer(layer):
        f = cfg.dense_intermediate_size
        return [*out, ParamSpec(p + "mlp.gate_up.weight", 2 * f * d), ParamSpec(p + "mlp.down.weight", d * f)]
    e_local, f = cfg.num_experts // ep, cfg.moe_intermediate_size
    out += [
        ParamSpec(p + "router.gate.weight", cfg.num_experts * d),
        ParamSpec(p + "experts.w1", e_local * d * 2 * f, expert=True),
        ParamSpec(p + "experts.w2", e_local * f * d, expert=True),
    ]
    if cfg.num_shared_experts:
        fs = cfg.num_shared_experts * f
        out += [ParamSpec(p + "shared.gate_up.weight", 2 * fs * d), ParamSpec(p + "shared.down.weight", d * fs)]
    return out


def stage_params(cfg: MoEConfig, layers: Sequence[int], *, first: bool, last: bool, ep: int = 1) -> list[ParamSpec]:
    """A stage's parameters: embedding (first), its blocks, final norm and head (last)."""
    out = [ParamSpec("embed.weight", cfg.vocab_size * cfg.hidden_size)] if first else []
    for layer in layers:
        out += layer_params(cfg, layer, ep)
    if last:
        out += [ParamSpec("norm.weight", cfg.hidden_size), ParamSpec("head.weight", cfg.vocab_size * cfg.hidden_size)]
    return out


def rank_stages(
    cfg: MoEConfig, pp: int, schedule: str, pp_rank: int, modules_per_rank: int | None = None
) -> list[tuple[int, range, bool, bool]]:
    """``(stage index, layers, first, last)`` of each local module of pipeline rank ``pp_rank``, placed as
    :func:`moe.parallel.build_stages` places them (the schedule's layout, :func:`moe.parallel.split_layers`)."""
    layout: Layout = schedule_spec(schedule).stage_layout(pp, modules_per_rank)
    ranges = split_layers(cfg.num_layers, layout.num_stages)
    out = []
    for m in range(layout.modules_per_rank):
        sid = layout.stage_of(pp_rank, m)
        out.append((sid, ranges[sid], sid == 0, sid == layout.num_stages - 1))
    return out


def rank_params(
    cfg: MoEConfig, pp: int, ep: int, schedule: str, pp_rank: int, modules_per_rank: int | None = None
) -> list[ParamSpec]:
    """Every parameter tensor pipeline rank ``pp_rank`` holds (DualPipe: both mirrored copies)."""
    out = []
    for _, layers, first, last in rank_stages(cfg, pp, schedule, pp_rank, modules_per_rank):
        out += stage_params(cfg, layers, first=first, last=last, ep=ep)
    return out


def total_params(cfg: MoEConfig) -> int:
    """Parameters of the whole model (all experts)."""
    return sum(p.numel for p in stage_params(cfg, range(cfg.num_layers), first=True, last=True))


def active_params(cfg: MoEConfig, *, embedding: bool = False) -> int:
    """Parameters one token's forward multiplies with: every dense weight, ``top_k`` of the routed experts.

    ``embedding=False`` leaves the embedding table out (a lookup, not a matmul); the head is counted. Norm
    weights are counted (they are tiny)."""
    e, k = cfg.num_experts, cfg.top_k
    total = 0
    for p in stage_params(cfg, range(cfg.num_layers), first=embedding, last=True):
        total += p.numel * k // e if p.expert else p.numel
    return total

"""Parameter shapes of the model, per layer and per pipeline rank, without building it.

The shapes follow the modules exactly (moe/models/block.py, moe/models/layers.py, moe/models/, moe/models/experts.py,
moe/models/router.py, moe/models/stage.py): the planner's parameter, gradient and optimizer figures are sums over these
lists, and the tests check them against the real modules' ``numel``. Every attention of
:data:`moe.models.ATTENTIONS` has its own list: ``gqa`` (:class:`moe.models.layers.Attention`), ``gqa-qk-norm``
(:class:`moe.models.qwen3_moe.Qwen3Attention`) and ``mla`` (:class:`moe.models.mla.MLAttention`).

Multi-token prediction (``MoEConfig.mtp_layers``, DeepSeek-V3 report 2.2; :mod:`moe.models.mtp`): each
module holds two RMSNorms (``enorm`` over the next token's embedding, ``hnorm`` over the previous hidden
state), ``eh_proj`` (``Linear(2D -> D)``), one transformer block (global layer ``num_layers + k``, an MoE
block where the main model's later layers are) and a final RMSNorm (``head_norm``); it shares the embedding
and the output head with the main model and sits on the stage that holds the head. Where that pipeline rank
does not hold the embedding too (any schedule but DualPipe and DualPipeV, which put the first and the last
stage on one rank), it keeps a copy of the embedding, kept equal by the gradient synchronisation;
``mtp_shared=False`` models modules that hold their own embedding and head (as the published checkpoint
stores them).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from dualpipe.schedule import Layout, schedule_spec
from moe.models.config import MoEConfig
from moe.pipeline_layout import AUTO, Costs, StagePlan, balance, plan_stages

__all__ = [
    "ParamSpec",
    "active_params",
    "attention_params",
    "auto_layout",
    "layer_params",
    "layout_costs",
    "mtp_params",
    "rank_params",
    "rank_stages",
    "stage_params",
    "stage_plans",
    "total_params",
]


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """One parameter tensor: its name (as in :class:`moe.models.stage.MoEStage`), element count, whether it is an
    expert weight (sharded over ep, its optimizer state over the edp replicas), and the rows ZeRO-1 splits."""

    name: str
    numel: int
    expert: bool = False
    rows: int = 0
    """Rows of each checkpoint entry, the dimension ZeRO-1 splits (:func:`moe.optim_state.shard_rows`): a weight's
    dim 0 (output features), an expert tensor's dim 1 (each expert's rows); 0 for a vector (its elements)."""

    @property
    def entry_rows(self) -> int:
        return self.rows or self.numel


def attention_params(cfg: MoEConfig, prefix: str = "attn.") -> list[ParamSpec]:
    """The attention module's parameters (``prefix`` + its attribute names, the checkpoint's for the
    published architectures)."""
    d, h = cfg.hidden_size, cfg.num_heads
    if cfg.attention == "mla":
        c = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        out = []
        if cfg.q_lora_rank is None:
            out.append(ParamSpec(prefix + "q_proj.weight", h * c * d, rows=h * c))
        else:
            q = cfg.q_lora_rank
            out += [
                ParamSpec(prefix + "q_a_proj.weight", q * d, rows=q),
                ParamSpec(prefix + "q_a_layernorm.weight", q),
                ParamSpec(prefix + "q_b_proj.weight", h * c * q, rows=h * c),
            ]
        lat = cfg.kv_lora_rank
        kv_a, kv_b = lat + cfg.qk_rope_head_dim, h * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # their output rows
        return [
            *out,
            ParamSpec(prefix + "kv_a_proj_with_mqa.weight", kv_a * d, rows=kv_a),
            ParamSpec(prefix + "kv_a_layernorm.weight", lat),
            ParamSpec(prefix + "kv_b_proj.weight", kv_b * lat, rows=kv_b),
            ParamSpec(prefix + "o_proj.weight", d * h * cfg.v_head_dim, rows=d),
        ]
    c, g = cfg.attn_head_dim, cfg.num_kv_heads
    if cfg.attention == "gqa-qk-norm":
        return [
            ParamSpec(prefix + "q_proj.weight", h * c * d, rows=h * c),
            ParamSpec(prefix + "k_proj.weight", g * c * d, rows=g * c),
            ParamSpec(prefix + "v_proj.weight", g * c * d, rows=g * c),
            ParamSpec(prefix + "o_proj.weight", d * h * c, rows=d),
            ParamSpec(prefix + "q_norm.weight", c),
            ParamSpec(prefix + "k_norm.weight", c),
        ]
    if cfg.attention != "gqa":
        raise ValueError(f"the planner has no parameter list for attention={cfg.attention!r}")
    return [
        ParamSpec(prefix + "wq.weight", h * c * d, rows=h * c),
        ParamSpec(prefix + "wk.weight", g * c * d, rows=g * c),
        ParamSpec(prefix + "wv.weight", g * c * d, rows=g * c),
        ParamSpec(prefix + "wo.weight", d * h * c, rows=d),
    ]


def layer_params(cfg: MoEConfig, layer: int, ep: int = 1, prefix: str | None = None) -> list[ParamSpec]:
    """The parameters of block ``layer`` on one rank of an ``ep``-way expert-parallel group (names under
    ``prefix``, default ``blocks.<layer>.``). ``layer`` may be an MTP block's index (``num_layers + k``)."""
    if cfg.num_experts % ep:
        raise ValueError(f"num_experts={cfg.num_experts} is not divisible by ep={ep}")
    d = cfg.hidden_size
    p = f"blocks.{layer}." if prefix is None else prefix
    out = [
        ParamSpec(p + "attn_norm.weight", d),
        *attention_params(cfg, p + "attn."),
        ParamSpec(p + "mlp_norm.weight", d),
    ]
    if not cfg.is_moe_layer(layer):
        f = cfg.dense_intermediate_size
        return [
            *out,
            ParamSpec(p + "mlp.gate_up.weight", 2 * f * d, rows=2 * f),
            ParamSpec(p + "mlp.down.weight", d * f, rows=d),
        ]
    e_local, f = cfg.num_experts // ep, cfg.moe_intermediate_size
    out += [
        ParamSpec(p + "router.gate.weight", cfg.num_experts * d, rows=cfg.num_experts),
        ParamSpec(p + "experts.w1", e_local * d * 2 * f, expert=True, rows=d),  # [E, D, 2F]
        ParamSpec(p + "experts.w2", e_local * f * d, expert=True, rows=f),  # [E, F, D]
    ]
    if cfg.num_shared_experts:
        fs = cfg.num_shared_experts * f
        out += [
            ParamSpec(p + "shared.gate_up.weight", 2 * fs * d, rows=2 * fs),
            ParamSpec(p + "shared.down.weight", d * fs, rows=d),
        ]
    return out


def mtp_params(cfg: MoEConfig, k: int, ep: int = 1) -> list[ParamSpec]:
    """MTP module ``k`` (0-based; :class:`moe.models.mtp.MTPBlock` at layer ``num_layers + k``) without the
    embedding and head it shares: its block, ``enorm``, ``hnorm``, ``eh_proj`` ``[D, 2D]`` and ``head_norm``."""
    layer = cfg.num_layers + k
    d, p = cfg.hidden_size, f"blocks.{layer}."
    return [
        *layer_params(cfg, layer, ep),
        ParamSpec(p + "enorm.weight", d),
        ParamSpec(p + "hnorm.weight", d),
        ParamSpec(p + "eh_proj.weight", d * 2 * d, rows=d),
        ParamSpec(p + "head_norm.weight", d),
    ]


def stage_params(
    cfg: MoEConfig,
    layers: Sequence[int],
    *,
    first: bool,
    last: bool,
    ep: int = 1,
    mtp_shared: bool = True,
    mtp: int | None = None,
) -> list[ParamSpec]:
    """A stage's parameters, as :class:`moe.models.stage.MoEStage` names them: the embedding (first stage, and a
    stage with MTP modules: the main one where the rank holds both, :func:`rank_params` counts it once), its
    blocks, final norm and head (last), its ``mtp`` MTP modules (``None``: all of them on the last stage;
    a layout puts them there, :func:`moe.pipeline_layout.plan_stages`). ``mtp_shared=False``: each MTP
    module holds its own embedding and head as well (``blocks.<layer>.embed.weight``, ``.head.weight``)."""
    v, d = cfg.vocab_size, cfg.hidden_size
    mtp = cfg.mtp_layers * last if mtp is None else mtp
    out = [ParamSpec("embed.weight", v * d, rows=v)] if first or mtp else []
    for layer in layers:
        out += layer_params(cfg, layer, ep)
    if last or mtp:  # an MTP stage of its own (m|L) holds copies of the final norm and the head
        out += [ParamSpec("norm.weight", d), ParamSpec("head.weight", v * d, rows=v)]
    if mtp:
        for k in range(mtp):
            out += mtp_params(cfg, k, ep)
            if not mtp_shared:
                p = f"blocks.{cfg.num_layers + k}."
                out += [ParamSpec(p + "embed.weight", v * d, rows=v), ParamSpec(p + "head.weight", v * d, rows=v)]
    return out


@dataclass(frozen=True, slots=True, eq=False)
class ConfigKey:
    """A model config compared and hashed by value (:class:`MoEConfig` is mutable, so unhashable): what the
    planner's caches are keyed on, so that a search sizes each shape once, not once per candidate."""

    cfg: MoEConfig
    text: str

    @classmethod
    def of(cls, cfg: MoEConfig) -> ConfigKey:
        return cls(cfg, repr(cfg))

    def __hash__(self) -> int:
        return hash(self.text)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConfigKey) and self.text == other.text


def layout_costs(cfg: MoEConfig) -> Costs:
    """What a ``pipeline_layout`` of ``auto`` balances (:func:`moe.pipeline_layout.balance`): each piece's matmul
    FLOPs per token, forward and backward (6 x the parameters a token meets, as :func:`active_params` counts
    them: the top-k of the routed experts, the head once more for every MTP module). The embedding is a lookup
    and costs nothing. Attention's score and value products are left out: every layer and MTP block has the
    same, so they change no balance between layers (they weigh the head a little less than the layers at long
    sequences). Cached by the config's value (a search asks once per candidate and rank)."""
    return _layout_costs(ConfigKey.of(cfg))


@functools.lru_cache(maxsize=64)
def _layout_costs(key: ConfigKey) -> Costs:
    cfg = key.cfg

    def flops(specs: Sequence[ParamSpec]) -> float:
        return 6.0 * sum(p.numel * cfg.top_k / cfg.num_experts if p.expert else p.numel for p in specs)

    head = flops(
        [ParamSpec("norm.weight", cfg.hidden_size), ParamSpec("head.weight", cfg.vocab_size * cfg.hidden_size)]
    )
    mtp = sum(flops(mtp_params(cfg, k)) + head for k in range(cfg.mtp_layers))
    return Costs(
        embed=0.0, layers=tuple(flops(layer_params(cfg, i)) for i in range(cfg.num_layers)), mtp=mtp, head=head
    )


def auto_layout(cfg: MoEConfig, pp: int, schedule: str, modules_per_rank: int | None = None) -> str:
    """The layout string ``auto`` stands for: :func:`moe.pipeline_layout.balance` of :func:`layout_costs` over
    the schedule's stages (what ``--print-config`` and the planner show)."""
    num_stages = schedule_spec(schedule).stage_layout(pp, modules_per_rank).num_stages
    return balance(layout_costs(cfg), num_stages, cfg.mtp_layers)


def stage_plans(
    cfg: MoEConfig,
    pp: int,
    schedule: str,
    modules_per_rank: int | None = None,
    pipeline_layout: str = AUTO,
) -> tuple[StagePlan, ...]:
    """What each stage holds (by stage index) under ``pipeline_layout`` (Megatron-Core's syntax, or ``auto``:
    balanced by :func:`layout_costs`), by the trainer's own rule (:func:`moe.pipeline_layout.plan_stages`,
    which :func:`moe.parallel.build_stages` follows): the one place the planner learns where layers, the MTP
    modules, the embedding and the head sit. ``ValueError`` in one line when the layout does not fit the model
    or the schedule's stages."""
    num_stages = schedule_spec(schedule).stage_layout(pp, modules_per_rank).num_stages
    return _plans(pipeline_layout, num_stages, cfg.num_layers, cfg.mtp_layers, layout_costs(cfg))


@functools.lru_cache(maxsize=256)
def _plans(text: str, num_stages: int, num_layers: int, mtp_layers: int, costs: Costs) -> tuple[StagePlan, ...]:
    # Cached: a search asks for the same shape once per candidate and rank.
    kw = dict(num_stages=num_stages, num_layers=num_layers, mtp_layers=mtp_layers, costs=costs)
    return tuple(plan_stages(text, **kw))


def rank_stages(
    cfg: MoEConfig,
    pp: int,
    schedule: str,
    pp_rank: int,
    modules_per_rank: int | None = None,
    *,
    pipeline_layout: str = AUTO,
) -> list[tuple[int, StagePlan]]:
    """``(stage index, plan)`` of each local module of pipeline rank ``pp_rank``, placed as
    :func:`moe.parallel.build_stages` places them (the schedule's layout; :func:`stage_plans`)."""
    layout: Layout = schedule_spec(schedule).stage_layout(pp, modules_per_rank)
    plans = stage_plans(cfg, pp, schedule, modules_per_rank, pipeline_layout)
    sids = [layout.stage_of(pp_rank, m) for m in range(layout.modules_per_rank)]
    return [(sid, plans[sid]) for sid in sids]


def rank_params(
    cfg: MoEConfig,
    pp: int,
    ep: int,
    schedule: str,
    pp_rank: int,
    modules_per_rank: int | None = None,
    *,
    mtp_shared: bool = True,
    pipeline_layout: str = AUTO,
) -> list[ParamSpec]:
    """Every parameter tensor pipeline rank ``pp_rank`` holds (DualPipe: both mirrored copies) under
    ``pipeline_layout``. The embedding that a rank's first and last stage (with MTP) both use is one tensor
    (the pipeline ties them)."""
    out: list[ParamSpec] = []
    for _, sp in rank_stages(cfg, pp, schedule, pp_rank, modules_per_rank, pipeline_layout=pipeline_layout):
        specs = stage_params(cfg, sp.layers, first=sp.first, last=sp.last, ep=ep, mtp_shared=mtp_shared, mtp=sp.mtp)
        if any(p.name == "embed.weight" for p in out):
            specs = [p for p in specs if p.name != "embed.weight"]
        out += specs
    return out


def total_params(cfg: MoEConfig, *, mtp: bool = False) -> int:
    """Parameters of the whole model (all experts); ``mtp``: with the MTP modules (sharing the embedding
    and head). The DeepSeek-V3 report's 671B is the main model, without its 14B MTP module."""
    main = cfg if mtp else cfg.replace(mtp_layers=0)
    return sum(p.numel for p in stage_params(main, range(cfg.num_layers), first=True, last=True))


def active_params(cfg: MoEConfig, *, embedding: bool = False, mtp: bool = False) -> int:
    """Parameters one token's forward multiplies with: every dense weight, ``top_k`` of the routed experts.

    ``embedding=False`` leaves the embedding table out (a lookup, not a matmul); the head is counted. Norm
    weights are counted (they are tiny). ``mtp``: also each MTP module's, whose token meets the shared head
    once more (the DeepSeek-V3 report's 37B activated is the main model's, without the embedding)."""
    e, k = cfg.num_experts, cfg.top_k
    main = cfg.replace(mtp_layers=0)
    specs = stage_params(main, range(cfg.num_layers), first=embedding, last=True)
    if mtp:
        for m in range(cfg.mtp_layers):
            specs += [*mtp_params(cfg, m), ParamSpec("head.weight", cfg.vocab_size * cfg.hidden_size)]
    return sum(p.numel * k // e if p.expert else p.numel for p in specs)

"""Checkpoint names: ours <-> the Hugging Face hub layout, as one table read in both directions.

Each :class:`Rule` pairs one of our state-dict keys (``{i}``: a global layer) with its hub key(s) and says how
the tensors relate:

- ``same``: one tensor (or buffer: the router's selection bias) under another name;
- ``cat``: ours is the hub tensors concatenated along dim 0 (our fused SwiGLU ``gate_up`` = gate rows, then
  up rows);
- ``experts_gate_up`` / ``experts_down``: ours is ``[E, D, 2F]`` / ``[E, F, D]`` (the grouped GEMM's layout),
  the hub holds one ``[F, D]`` / ``[D, F]`` matrix per expert ``{e}``, or, as transformers fuses them in
  memory, one ``gate_up_proj [E, 2F, D]`` / ``down_proj [E, D, F]``.

One table holds both published layouts (Qwen3-MoE, DeepSeek-V3): a model uses the rules its keys match.
:func:`checkpoint_shapes` names what a checkpoint of a model holds, :func:`to_ours` builds our tensors from hub
tensors (either expert layout), :func:`to_hub` the hub layout (one tensor per expert, what ``save_pretrained``
writes) from ours. A missing hub tensor, one left over or a wrong shape is a :class:`HFCheckpointError`
naming it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["RULES", "HFCheckpointError", "Rule", "checkpoint_shapes", "to_hub", "to_ours"]


class HFCheckpointError(ValueError):
    """A hub tensor is missing, unexpected or of the wrong shape; the message names it."""


@dataclass(frozen=True, slots=True)
class Rule:
    ours: str
    hub: tuple[str, ...]
    kind: str = "same"


_LAYER = "model.layers.{i}"
RULES: tuple[Rule, ...] = (
    Rule("embed.weight", ("model.embed_tokens.weight",)),
    Rule("norm.weight", ("model.norm.weight",)),
    Rule("head.weight", ("lm_head.weight",)),
    Rule("blocks.{i}.attn_norm.weight", (f"{_LAYER}.input_layernorm.weight",)),
    Rule("blocks.{i}.mlp_norm.weight", (f"{_LAYER}.post_attention_layernorm.weight",)),
    # Our attention modules carry the checkpoint's names: GQA (q/k/v/o), Qwen3's q/k norms, DeepSeek-V3's MLA.
    *(
        Rule(f"blocks.{{i}}.attn.{name}.weight", (f"{_LAYER}.self_attn.{name}.weight",))
        for name in (
            *("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"),
            *("q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj"),
        )
    ),
    Rule("blocks.{i}.router.gate.weight", (f"{_LAYER}.mlp.gate.weight",)),
    # A buffer: DeepSeek-V3's selection bias (checkpoint_shapes says when a checkpoint holds it).
    Rule("blocks.{i}.router.expert_bias", (f"{_LAYER}.mlp.gate.e_score_correction_bias",)),
    Rule("blocks.{i}.mlp.gate_up.weight", (f"{_LAYER}.mlp.gate_proj.weight", f"{_LAYER}.mlp.up_proj.weight"), "cat"),
    Rule("blocks.{i}.mlp.down.weight", (f"{_LAYER}.mlp.down_proj.weight",)),
    # DeepSeek-V3's shared experts: one SwiGLU MLP of n_shared_experts * moe_intermediate_size, fused like ours.
    Rule(
        "blocks.{i}.shared.gate_up.weight",
        (f"{_LAYER}.mlp.shared_experts.gate_proj.weight", f"{_LAYER}.mlp.shared_experts.up_proj.weight"),
        "cat",
    ),
    Rule("blocks.{i}.shared.down.weight", (f"{_LAYER}.mlp.shared_experts.down_proj.weight",)),
    Rule(
        "blocks.{i}.experts.w1",
        (f"{_LAYER}.mlp.experts.{{e}}.gate_proj.weight", f"{_LAYER}.mlp.experts.{{e}}.up_proj.weight"),
        "experts_gate_up",
    ),
    Rule("blocks.{i}.experts.w2", (f"{_LAYER}.mlp.experts.{{e}}.down_proj.weight",), "experts_down"),
    # DeepSeek-V3's multi-token-prediction modules (moe.models.mtp), at layers num_hidden_layers ..
    *(Rule(f"blocks.{{i}}.{name}.weight", (f"{_LAYER}.{name}.weight",)) for name in ("enorm", "hnorm", "eh_proj")),
    Rule("blocks.{i}.head_norm.weight", (f"{_LAYER}.shared_head.norm.weight",)),
)
"""Every tensor of the Qwen3-MoE and DeepSeek-V3 layouts; a model's state dict uses the rules its keys match."""

# transformers' in-memory fused experts, accepted on load beside the per-expert hub keys
_FUSED = {"experts_gate_up": f"{_LAYER}.mlp.experts.gate_up_proj", "experts_down": f"{_LAYER}.mlp.experts.down_proj"}


# The published DeepSeek-V3 checkpoint repeats the shared embedding and head inside each MTP layer: read past
# on load (the model shares the main ones), written on save (as published: inference engines read them there).
_MTP_COPIES = {"embed.weight": f"{_LAYER}.embed_tokens.weight", "head.weight": f"{_LAYER}.shared_head.head.weight"}
_MTP_LAYER = re.compile(r"^blocks\.(?P<i>\d+)\.eh_proj\.weight$")


def _pattern(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)") + "$")


_COMPILED = [(rule, _pattern(rule.ours)) for rule in RULES]


def _rule_for(key: str) -> tuple[Rule, str | None]:
    for rule, pattern in _COMPILED:
        m = pattern.match(key)
        if m:
            return rule, m.groupdict().get("i")
    raise HFCheckpointError(f"our tensor {key!r} has no hub name (no rule in moe.hf.keys.RULES)")


def _take(hub: Mapping[str, torch.Tensor], key: str, used: set[str]) -> torch.Tensor:
    if key not in hub:
        raise HFCheckpointError(f"the checkpoint lacks {key}")
    used.add(key)
    return hub[key]


def _experts(hub: Mapping[str, torch.Tensor], rule: Rule, layer: str, experts: range, used: set[str]) -> torch.Tensor:
    fused = _FUSED[rule.kind].format(i=layer)
    if fused in hub:  # [E, 2F, D] / [E, D, F]
        return _take(hub, fused, used)[experts.start : experts.stop].transpose(1, 2)
    per_expert = []
    for e in experts:
        parts = [_take(hub, name.format(i=layer, e=e), used) for name in rule.hub]
        per_expert.append(torch.cat(parts, dim=0).t())  # [2F, D] -> [D, 2F]; [D, F] -> [F, D]
    return torch.stack(per_expert)


def checkpoint_shapes(model: nn.Module) -> dict[str, torch.Size]:
    """The shapes of what a checkpoint of ``model`` (a whole :class:`moe.models.model.MoEModel`, every expert) holds:
    every parameter, and the routers' selection bias where the published router stores it (DeepSeek-V3's
    sigmoid router, ``e_score_correction_bias``; Qwen3-MoE's softmax router has none, so ours keeps its own)."""
    shapes = {key: p.shape for key, p in model.named_parameters()}
    if model.cfg.router_scoring == "sigmoid":
        shapes.update({key: b.shape for key, b in model.named_buffers() if key.endswith(".router.expert_bias")})
    return shapes


def to_ours(
    hub: Mapping[str, torch.Tensor],
    shapes: Mapping[str, torch.Size],
    *,
    first_expert: int = 0,
    whole: bool = True,
) -> dict[str, torch.Tensor]:
    """Our tensors for the keys and shapes of ``shapes`` from hub tensors: a model's parameters, and any buffer
    with a rule, such as the router's selection bias (:func:`checkpoint_shapes`); a buffer left out keeps its
    own value. Expert tensors hold the experts ``first_expert ..`` (their first dim says how many: a stage on
    an expert-parallel rank holds its own slice). With ``whole`` (a whole model) every hub tensor must be used:
    one left over is an error naming it (a layout this table does not know would otherwise load silently as a
    partial model); a stage reads only its share (``whole=False``)."""
    used: set[str] = set()
    out: dict[str, torch.Tensor] = {}
    for key, shape in shapes.items():
        rule, layer = _rule_for(key)
        if rule.kind.startswith("experts"):
            value = _experts(hub, rule, layer or "", range(first_expert, first_expert + shape[0]), used)
        else:
            parts = [_take(hub, name.format(i=layer), used) for name in rule.hub]
            value = torch.cat(parts, dim=0) if rule.kind == "cat" else parts[0]
        if value.shape != shape:
            names = ", ".join(name.format(i=layer, e="*") for name in rule.hub)
            raise HFCheckpointError(f"{names}: shape {tuple(value.shape)} for our {key} of shape {tuple(shape)}")
        out[key] = value
    copies = {name.format(i=m["i"]) for m in map(_MTP_LAYER.match, shapes) if m for name in _MTP_COPIES.values()}
    unused = sorted(set(hub) - used - copies) if whole else []
    if unused:
        raise HFCheckpointError(f"the checkpoint holds {len(unused)} tensor(s) with no place here: {unused[0]}")
    return out


def to_hub(ours: Mapping[str, torch.Tensor], *, first_expert: int = 0) -> dict[str, torch.Tensor]:
    """The hub layout (per-expert matrices, as ``save_pretrained`` writes) of our tensors: those
    :func:`checkpoint_shapes` names. Expert tensors hold the experts ``first_expert ..`` (every expert by
    default; an expert-parallel rank's slice keeps its global expert indices)."""
    out: dict[str, torch.Tensor] = {}
    for key, value in ours.items():
        rule, layer = _rule_for(key)
        if rule.kind.startswith("experts"):
            for e in range(value.shape[0]):
                mats = value[e].t().split(value.shape[-1] // len(rule.hub), dim=0)
                for name, mat in zip(rule.hub, mats):
                    out[name.format(i=layer, e=first_expert + e)] = mat.contiguous()
        elif rule.kind == "cat":
            for name, part in zip(rule.hub, value.chunk(len(rule.hub), dim=0)):
                out[name.format(i=layer)] = part.contiguous()
        else:
            out[rule.hub[0].format(i=layer)] = value
    for m in filter(None, map(_MTP_LAYER.match, ours)):
        out.update({hub.format(i=m["i"]): ours[key] for key, hub in _MTP_COPIES.items() if key in ours})
    return out

"""Activation offloading in the trainer: names for the saved tensors, and the offloader a policy builds.

:class:`SavedNames` names each tensor autograd saves in a stage forward as the planner's per-layer table does
(:func:`moe.plan.footprint.saved_tensors`), from the module saving it: forward hooks on every submodule keep the
innermost one running, and a rule per module role picks the name (a linear's input is what it reads, an RMSNorm's
fp32 copies are told apart by shape, the routed experts' sorted rows and SwiGLU input by order). A storage
saved by several modules takes the last name given (SDPA's output is the output projection's input:
``attn.sdpa_out``). Storages no rule names (MLA's SDPA inputs, the MTP modules' extras) are offloaded by
``all`` and ``fraction`` only. :func:`build_offloader` turns a policy (:mod:`moe.plan.offload`) into a
:class:`dualpipe.offload.Offloader` for this rank's stages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from dualpipe.memory import SavedTensorTracker
from dualpipe.offload import Offloader, Saved
from moe.models.layers import Attention, Linear, RMSNorm
from moe.models.router import Router
from moe.plan.offload import OffloadPolicy

__all__ = ["Label", "SavedNames", "build_offloader"]


class Label(NamedTuple):
    """A saved tensor's planner name (None: no rule names it) and its stage block (None: outside the blocks)."""

    name: str | None
    block: int | None


_LINEAR_INPUTS = {
    **dict.fromkeys(("attn.wq", "attn.wk", "attn.wv", "attn.q_proj", "attn.q_a_proj"), "attn.norm_output"),
    "attn.kv_a_proj_with_mqa": "attn.norm_output",
    "attn.wo": "attn.sdpa_out",
    "attn.o_proj": "attn.sdpa_out",
    "attn.q_b_proj": "attn.q_a_norm_output",
    "attn.kv_b_proj": "attn.kv_a_norm_output",
    **dict.fromkeys(("router.gate", "shared.gate_up", "mlp.gate_up"), "attn.mlp_norm_output"),
    "shared.down": "mlp.shared_down_input",
    "mlp.down": "mlp.down_input",
    "head": "head.norm_output",
}
"""What a linear saves, its input, by the linear's place in a block (or the stage: the head)."""

_NORMS = {"attn_norm": "attn.", "mlp_norm": "attn.mlp_", "norm": "head."}
_EXPERTS = ("mlp.experts_input", "mlp.experts_gate_up_output")


class _Call:
    """One module call on the stack: its place, and the storages saved so far in it, by kind, in order."""

    __slots__ = ("block", "module", "place", "seen")

    def __init__(self, module: nn.Module, place: str, block: int | None) -> None:
        self.module, self.place, self.block = module, place, block
        self.seen: dict[str, list[int]] = {}

    def ordinal(self, kind: str, t: torch.Tensor) -> int:
        """Position of ``t``'s storage among the distinct storages of ``kind`` saved in this call."""
        ptrs = self.seen.setdefault(kind, [])
        ptr = t.untyped_storage().data_ptr()
        if ptr not in ptrs:
            ptrs.append(ptr)
        return ptrs.index(ptr)


class SavedNames:
    """Names the tensors saved in the forwards of ``stages`` (this rank's stage modules, in local order).

    Hooks every submodule (:meth:`remove` takes them off); :meth:`label` is the offloader's ``label``."""

    def __init__(self, stages: Sequence[nn.Module]) -> None:
        self._stack: list[_Call] = []
        self._handles = []
        self.blocks: list[int] = []
        for stage in stages:
            blocks = getattr(stage, "blocks", {})
            index = {name: i for i, name in enumerate(blocks)}
            self.blocks.append(len(index))
            for path, module in stage.named_modules():
                parts = path.split(".")
                block = index.get(parts[1]) if parts[0] == "blocks" and len(parts) > 1 else None
                place = ".".join(parts[2:]) if block is not None else path
                self._handles.append(module.register_forward_pre_hook(self._enter(module, place, block)))
                self._handles.append(module.register_forward_hook(self._leave, always_call=True))

    def _enter(self, module: nn.Module, place: str, block: int | None):
        def hook(*_: Any) -> None:
            self._stack.append(_Call(module, place, block))

        return hook

    def _leave(self, *_: Any) -> None:
        self._stack.pop()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def label(self, module: int, t: torch.Tensor) -> Label:
        if not self._stack:
            return Label(None, None)
        call = self._stack[-1]
        return Label(_name(call, t), call.block)


def _name(call: _Call, t: torch.Tensor) -> str | None:
    """The planner's name of ``t``, saved in ``call`` (the module docstring)."""
    module, place = call.module, call.place
    if isinstance(module, Linear):
        return _LINEAR_INPUTS.get(place)
    if isinstance(module, RMSNorm):
        prefix = _NORMS.get(place)
        if prefix is None:
            return None
        if t.dim() == 1:
            return prefix + "norm_fp32_weight"
        if t.shape[-1] == 1:
            return prefix + "norm_rsqrt"
        return prefix + ("norm_fp32_input", "norm_fp32_output")[min(call.ordinal("full", t), 1)]
    if isinstance(module, nn.Embedding):
        return "embed.ids"
    if place == "attn" and type(module) is Attention:  # the GQA attention: rotary tables, then SDPA's
        if t.dtype == torch.float32:
            return "attn.sdpa_lse" if t.dim() == 3 else "attn.rotary_tables"
        return "attn.sdpa_qkv"  # its output, which the output projection saves too, is named there
    if isinstance(module, Router):
        # its first fp32 save is the scores (sigmoid's or softmax's output); the rest is the top-k's
        first = t.dtype == torch.float32 and call.ordinal("fp32", t) == 0
        return "attn.router_scores_fp32" if first else "attn.router_topk"
    if place in ("shared", "mlp"):  # a SwiGLU MLP's own save: the gate/up output
        return "mlp.shared_swiglu_input" if place == "shared" else "mlp.swiglu_input"
    if place == "experts":
        return _experts_name(call, t)
    return None


def _experts_name(call: _Call, t: torch.Tensor) -> str | None:
    """The routed experts save the row ids (permute), tokens per expert, one weight per row, then the sorted rows
    and the gate/up output: in the activation dtype, or in FP8 each followed by its fp32 scales."""
    if t.dtype == torch.int64:
        return "mlp.row_ids" if call.ordinal("ids", t) == 0 else None
    if t.dtype == torch.float32 and t.dim() == 1:
        return "mlp.row_weights"
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return _EXPERTS[min(call.ordinal("fp8", t), 1)] + "_fp8"
    if t.dtype == torch.float32 and call.seen.get("fp8"):  # the scales of the FP8 tensor before them
        return _EXPERTS[min(len(call.seen["fp8"]) - 1, 1)] + "_fp8"
    return _EXPERTS[min(call.ordinal("rows", t), 1)]


def build_offloader(
    policy: OffloadPolicy, stages: Sequence[nn.Module], pp_rank: int, tracker: SavedTensorTracker | None = None
) -> Offloader | None:
    """The offloader of ``policy`` at pipeline rank ``pp_rank`` (None when it moves nothing here). ``tracker``: the
    memory meter's, when it counts saved tensors (the offloader counts for it inside forwards)."""
    if not policy or not policy.at_rank(pp_rank):
        return None
    names = SavedNames(stages)

    def choose(module: int, entry: Saved) -> bool:
        block = next((lab.block for lab in entry.labels if lab is not None), None)
        return policy.picks(pp_rank, entry.name, block, names.blocks[module])

    return Offloader(choose, names.label, tracker=tracker)

"""DeepSeek-V3's multi-token prediction (report section 2.2), as pieces of the last pipeline stage.

Legend for shape suffixes: B batch, S sequence, D hidden, V vocabulary.

Module k (0-based, global layer ``num_layers + k``, the published checkpoint's place) predicts token
``i + k + 2`` at position ``i``. Its input combines the previous depth's hidden state (the main model's final
normed output for k = 0) with the embedding of token ``i + k + 1``::

    x   = eh_proj(cat(enorm(embed(t[i+k+1])), hnorm(h_prev)))      # [B, S, D]
    h_k = head_norm(block_k(x))                                    # published: shared_head.norm
    L_k = mean cross-entropy of head(h_k) against t[i+k+2]         # positions with a target only

The embedding and the output head are the main model's (:class:`MTPBlock` holds no copy of either). The
training objective adds ``mtp_loss_weight * mean_k L_k`` (the report's lambda / D * sum_k L_k); the main loss
and the MTP losses are reported apart.

Tokens come from the labels (``labels[:, i] = t[i+1]``): depth k reads ``labels`` shifted left by k and is
trained against ``labels`` shifted left by k + 1, so the last k + 1 positions of a sequence have no target.
The stage therefore takes its micro-batch's labels in forward
(:attr:`dualpipe.overlap.OverlapStage.forward_takes_labels`).

:func:`mtp_pieces` declares every depth as one block of the overlap runtime: each depth's attention,
dispatch, experts and combine are the pieces of an MoE :class:`moe.models.block.Block` (so the depths overlap like
any block), followed by its head and loss; a last piece attaches the weighted losses to the main hidden
state, which flows on to the main head.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from dualpipe.pieces import Compute, Context, Pieces
from moe.dispatch.base import TokenDispatcher
from moe.models.block import Block, attach_loss
from moe.models.config import MoEConfig
from moe.models.layers import Linear, RMSNorm
from moe.models.loss import chunked_cross_entropy

if TYPE_CHECKING:
    from moe.models.stage import MoEStage

__all__ = ["IGNORE_INDEX", "MTPBlock", "mtp_graph", "mtp_inputs", "mtp_pieces", "mtp_targets"]

IGNORE_INDEX = -100
"""Target id of the positions a depth has no token to predict for (the loss skips them)."""


class MTPBlock(Block):
    """One multi-token-prediction module: ``enorm``, ``hnorm``, ``eh_proj``, an MoE block and ``head_norm``."""

    def __init__(self, cfg: MoEConfig, layer: int, dispatcher: TokenDispatcher | None, comm_sms: int = 0) -> None:
        if layer < cfg.num_layers:
            raise ValueError(f"an MTP module sits after the {cfg.num_layers} blocks, not at layer {layer}")
        super().__init__(cfg, layer, dispatcher, comm_sms)
        self.depth = layer - cfg.num_layers
        self.enorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.head_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def entry(self, embed_BSD: torch.Tensor, h_prev_BSD: torch.Tensor) -> torch.Tensor:
        """The block input: ``eh_proj(cat(enorm(embedding), hnorm(previous hidden)))``."""
        return self.eh_proj(torch.cat([self.enorm(embed_BSD), self.hnorm(h_prev_BSD)], dim=-1))


def _shift(labels_BS: torch.Tensor, by: int, fill: int) -> torch.Tensor:
    return F.pad(labels_BS[:, by:], (0, by), value=fill) if by else labels_BS


def mtp_inputs(labels_BS: torch.Tensor, depth: int) -> torch.Tensor:
    """Depth ``depth``'s input tokens ``t[i + depth + 1]``: the labels shifted left by ``depth`` (0 past the
    end, where there is no target either)."""
    return _shift(labels_BS, depth, 0)


def mtp_targets(labels_BS: torch.Tensor, depth: int) -> torch.Tensor:
    """Depth ``depth``'s targets ``t[i + depth + 2]``: the labels shifted left by ``depth + 1``,
    :data:`IGNORE_INDEX` past the end."""
    return _shift(labels_BS, depth + 1, IGNORE_INDEX)


def _depth_loss(stage: MoEStage, block: MTPBlock, h_BSD: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    assert stage.head is not None
    logits_BSV = stage.head(h_BSD)
    return chunked_cross_entropy(logits_BSV.flatten(0, 1), mtp_targets(labels_BS, block.depth).flatten())


def _weighted(stage: MoEStage, losses: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.stack(list(losses)).mean() * stage.mtp_loss_weight


def mtp_graph(
    stage: MoEStage, blocks: Sequence[MTPBlock], h_BSD: torch.Tensor, labels_BS: torch.Tensor
) -> torch.Tensor:
    """The depths as one ordinary autograd graph (blocking all-to-alls): ``h`` with the weighted MTP losses
    attached to its backward (the oracle of :func:`mtp_pieces`)."""
    assert stage.embed is not None and stage.norm is not None
    prev, losses = stage.norm(h_BSD), []
    for block in blocks:
        x = block.entry(stage.embed(mtp_inputs(labels_BS, block.depth)), prev)
        prev = block.head_norm(block(x, stage.aux_loss_scale, stage.recorder))
        losses.append(_depth_loss(stage, block, prev, labels_BS))
    stage.record_mtp([loss.detach() for loss in losses])
    return attach_loss(h_BSD, _weighted(stage, losses), stage.aux_loss_scale)


class _DepthContext(Context):
    """A depth's own scratch space inside the one MTP block (each depth's MoE pieces stash their routing)."""

    def __init__(self, parent: Context) -> None:
        self._parent = parent

    @property
    def recomputing(self) -> bool:  # type: ignore[override]
        return self._parent.recomputing

    @property
    def side(self) -> tuple[Any, ...]:  # type: ignore[override]
        return self._parent.side


def _in_depth(depth: int, fn):
    key = f"depth{depth}"

    def run(ctx: Context, *args):
        sub = ctx.__dict__.get(key)
        if sub is None:
            sub = ctx.__dict__[key] = _DepthContext(ctx)
        return fn(sub, *args)

    return run


def _prefixed(piece, prefix: str, depth: int, renames: dict[str, str]):
    """A piece of a depth's MoE block, renamed into the MTP block's namespace and run in the depth's context."""

    def name(n: str) -> str:
        return renames.get(n, prefix + n)

    fields = {"name": prefix + piece.name, "inputs": tuple(map(name, piece.inputs))}
    fields["no_grad"] = tuple(map(name, piece.no_grad))
    fields["outputs"] = tuple(map(name, piece.outputs))
    if isinstance(piece, Compute):
        fields["fn"] = _in_depth(depth, piece.fn)
    else:
        fields["forward"] = _in_depth(depth, piece.forward)
        fields["backward"] = _in_depth(depth, piece.backward)
        if piece.prepare is not None:
            fields["prepare"] = _in_depth(depth, piece.prepare)
    return dataclasses.replace(piece, **fields)


def mtp_pieces(stage: MoEStage, blocks: Sequence[MTPBlock]) -> Pieces:
    """Every depth as one block of pieces (input ``h``, the main model's last hidden state; output ``h`` with
    the weighted MTP losses attached). Per depth ``k``: ``mtp{k}.attn`` (embedding, projection and the
    block's attention and router), ``dispatch``, ``mlp``, ``combine`` (the MoE block's own pieces), then
    ``mtp{k}.head`` (``head_norm``, the shared head and the loss); last ``mtp.loss``."""
    pieces: list[Any] = []
    losses: list[str] = []
    prev = "h"
    for block in blocks:
        p, k = f"mtp{block.depth}.", block.depth
        moe = block.pieces(stage.aux_loss_scale)
        attn, *rest = moe.pieces
        entry = functools.partial(_entry, stage, block, attn.fn, first=prev == "h")
        pieces.append(Compute(p + "attn", _in_depth(k, entry), prev, tuple(p + n for n in attn.outputs)))
        pieces.extend(_prefixed(piece, p, k, {}) for piece in rest)
        summed = tuple(p + n for n in moe.output)
        head = functools.partial(_head, stage, block)
        pieces.append(Compute(p + "head", _in_depth(k, head), summed, (p + "out", p + "loss")))
        prev = p + "out"
        losses.append(p + "loss")
    pieces.append(Compute("mtp.loss", functools.partial(_attach, stage), ("h", *losses), "h_out"))
    return Pieces(tuple(pieces), input="h", output="h_out", layer=blocks[0].layer)


def _entry(stage: MoEStage, block: MTPBlock, attn, ctx: Context, h_prev_BSD: torch.Tensor, *, first: bool):
    assert stage.embed is not None and stage.norm is not None
    if first:  # the main model's hidden state, normed as its head sees it
        h_prev_BSD = stage.norm(h_prev_BSD)
    if not ctx.side:
        raise ValueError("multi-token prediction needs the micro-batch's labels: pass labels to the pipeline step")
    (labels_BS,) = ctx.side
    x_BSD = block.entry(stage.embed(mtp_inputs(labels_BS, block.depth)), h_prev_BSD)
    return attn(ctx, x_BSD)


def _head(stage: MoEStage, block: MTPBlock, ctx: Context, *summed: torch.Tensor):
    h_BSD = summed[0]
    for part in summed[1:]:
        h_BSD = h_BSD + part
    h_BSD = block.head_norm(h_BSD)
    (labels_BS,) = ctx.side
    loss = _depth_loss(stage, block, h_BSD, labels_BS)
    return h_BSD, loss


def _attach(stage: MoEStage, ctx: Context, h_BSD: torch.Tensor, *losses: torch.Tensor) -> torch.Tensor:
    if not ctx.recomputing:
        stage.record_mtp([loss.detach() for loss in losses])
    return attach_loss(h_BSD, _weighted(stage, losses), stage.aux_loss_scale)

"""A pipeline stage of the MoE transformer: a client of the overlap runtime (:mod:`dualpipe.overlap`).

Legend for shape suffixes: B batch, S sequence, D hidden, V vocabulary.

:meth:`MoEStage.pieces` declares the stage: the embedding (first stage), each block's pieces
(:meth:`moe.models.block.Block.pieces`), then norm and head (last stage). The runtime gives it the piecewise
forward, the plain backward through one autograd node per stage, and ``overlapped_forward_backward``.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
from torch import nn

from dualpipe.events import EventRecorder
from dualpipe.overlap import OverlapStage
from dualpipe.pieces import Compute, Context, Pieces
from moe.dispatch.base import TokenDispatcher
from moe.dispatch.local import LocalDispatcher
from moe.models.block import Block
from moe.models.config import MoEConfig
from moe.models.layers import Linear, RMSNorm
from moe.models.mtp import MTPBlock, mtp_graph, mtp_pieces

__all__ = ["MoEStage"]


def _stable_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


class MoEStage(OverlapStage):
    """Consecutive blocks ``layers`` of the model, plus the embedding (``first``) and norm + head (``last``).

    Input: token ids ``[B, S]`` (first stage) or hidden states ``[B, S, D]``. Output: hidden states, or
    logits ``[B, S, V]`` on the last stage (loss: :func:`moe.models.model.lm_loss`). Parameters are named by
    global layer index, so any partition of the model carries the same names.

    ``piecewise=False`` builds one ordinary autograd graph instead: in one process the oracle the piecewise
    path is tested against; with expert parallelism each all-to-all is a blocking autograd node, as in a
    model without overlap (the graph ``torch.distributed.pipelining`` schedules take apart). Such stages
    run in a pipeline with ``overlap=False`` only: ``overlapped_forward_backward`` needs the piecewise path.
    ``recorder`` (an :class:`EventRecorder`) records sub-stage events (only the all-to-alls when not
    piecewise).
    ``stage_index`` is the stage's position in the pipeline (set by :func:`moe.parallel.build_stages`).
    ``aux_loss_scale`` weights the sequence-wise balance loss's gradient per micro-batch: keep 1.0 when the
    pipeline sums micro-batch losses (DualPipe's default), set ``1 / num_chunks`` with
    ``loss_reduction="mean"`` so the balance loss is averaged like the language-model loss.

    With ``cfg.mtp_layers`` the last stage also holds the multi-token-prediction modules
    (:mod:`moe.models.mtp`, layers ``num_layers ..``), or the stage a layout puts them on (``mtp_layers``: all of
    them or none; before a last stage of the head alone, Megatron-Core's ``m|L``), and an embedding (the main
    one: the pipeline ties it to the first stage's where both are on one rank; on a stage of their own also the
    final norm and the head, tied to the last stage's alike). It then takes its
    micro-batch's labels in forward,
    ``stage(h, labels)``; ``mtp_loss_weight`` (lambda) weights the mean MTP loss in the objective and
    :meth:`pop_mtp_losses` returns each depth's loss of each micro-batch run since the last call.
    """

    def __init__(
        self,
        cfg: MoEConfig,
        layers: Sequence[int],
        *,
        first: bool,
        last: bool,
        dispatcher: TokenDispatcher | None = None,
        recompute: bool = False,
        comm_sms: int = 0,
        piecewise: bool = True,
        stage_index: int | None = None,
        mtp_layers: int | None = None,
    ) -> None:
        super().__init__()
        layers = list(layers)
        if any(not 0 <= i < cfg.num_layers for i in layers):
            raise ValueError(f"layers {layers} outside [0, {cfg.num_layers})")
        self.cfg = cfg
        self.first, self.last = first, last
        dispatcher = dispatcher if dispatcher is not None else LocalDispatcher(cfg.num_experts)
        self.dispatcher = dispatcher
        self.recompute = recompute
        self.piecewise = piecewise
        self.recorder: EventRecorder | None = None
        self.stage_index = stage_index
        self.aux_loss_scale = 1.0
        self.mtp_loss_weight = 0.3  # the DeepSeek-V3 report's lambda for its first 10T tokens
        if mtp_layers is None:  # the model's MTP modules sit with the head unless a layout says otherwise
            mtp_layers = cfg.mtp_layers if last else 0
        if mtp_layers not in (0, cfg.mtp_layers):
            raise ValueError(f"a stage holds all {cfg.mtp_layers} MTP modules or none, not {mtp_layers}")
        mtp = range(cfg.num_layers, cfg.num_layers + mtp_layers)
        self.forward_takes_labels = bool(mtp)
        self._mtp_losses: list[list[torch.Tensor]] = []
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size) if first or mtp else None
        self.blocks = nn.ModuleDict({str(i): Block(cfg, i, dispatcher, comm_sms) for i in layers})
        self.blocks.update({str(i): MTPBlock(cfg, i, dispatcher, comm_sms) for i in mtp})
        # MTP shares the final norm and the head too: a stage of its own (``m|L``) holds a copy of each
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps) if last or mtp else None
        self.head = Linear(cfg.hidden_size, cfg.vocab_size, keep_precision=True) if last or mtp else None

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Deterministic init from (seed, parameter name): every partition and EP rank gets the same model.

        Expert weights are drawn for all experts and sliced to this rank's block.
        """
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            gen = torch.Generator().manual_seed(_stable_seed(seed, name))
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif ".experts." in name:
                block = self.blocks[name.split(".")[1]]
                assert isinstance(block, Block) and block.dispatcher is not None
                full = torch.randn((self.cfg.num_experts, *p.shape[1:]), generator=gen) * std
                local = block.dispatcher.local_experts
                p.copy_(full[local.start : local.stop])
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        for block in self.blocks.values():
            if isinstance(block, Block) and block.is_moe:
                block.router.expert_bias.zero_()
                block.router.expert_load.zero_()

    def expert_parameters(self) -> list[nn.Parameter]:
        """Parameters sharded over the expert-parallel group (the rest are replicated)."""
        return [p for n, p in self.named_parameters() if ".experts." in n]

    @property
    def mtp_blocks(self) -> list[MTPBlock]:
        """The multi-token-prediction modules, by depth (none unless the model has MTP and this stage is last)."""
        return [b for b in self.blocks.values() if isinstance(b, MTPBlock)]

    def record_mtp(self, losses: Sequence[torch.Tensor]) -> None:
        """Keep one micro-batch's per-depth MTP losses (detached) for :meth:`pop_mtp_losses`."""
        self._mtp_losses.append(list(losses))

    def pop_mtp_losses(self) -> torch.Tensor | None:
        """The MTP losses of the micro-batches run since the last call, ``[micro-batches, depths]`` fp32 (None:
        none ran)."""
        runs, self._mtp_losses = self._mtp_losses, []
        if not runs:
            return None
        return torch.stack([torch.stack(r) for r in runs]).float()

    def _main_blocks(self) -> list[Block]:
        return [b for b in self.blocks.values() if isinstance(b, Block) and not isinstance(b, MTPBlock)]

    def pieces(self) -> list[Pieces]:
        blocks = [block.pieces(self.aux_loss_scale) for block in self._main_blocks()]
        if self.mtp_blocks:
            blocks.append(mtp_pieces(self, self.mtp_blocks))
        if self.first:
            embed = Compute("embed", self._embed, "ids", "h", recompute=False)
            blocks.insert(0, Pieces((embed,), "ids", "h", paired=False))
        if self.last:
            head = Compute("head", self._head, "h", "logits", recompute=False)
            blocks.append(Pieces((head,), "h", "logits", paired=False))
        return blocks

    def _embed(self, ctx: Context, ids: torch.Tensor) -> torch.Tensor:
        assert self.embed is not None
        return self.embed(ids)

    def _head(self, ctx: Context, h_BSD: torch.Tensor) -> torch.Tensor:
        assert self.head is not None and self.norm is not None
        return self.head(self.norm(h_BSD))

    def forward(self, x: torch.Tensor, *labels: torch.Tensor) -> torch.Tensor:
        if self.forward_takes_labels != bool(labels):
            raise ValueError(
                "this stage holds multi-token-prediction modules: call it with the labels, stage(x, labels)"
                if self.forward_takes_labels
                else "this stage takes one input (labels only reach the stage with multi-token prediction)"
            )
        if not self.piecewise:
            return self._graph_forward(x, *labels)
        return super().forward(x, *labels)

    def _graph_forward(self, x: torch.Tensor, *labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) if self.first else x
        for block in self._main_blocks():
            h = block(h, self.aux_loss_scale, self.recorder)
        if self.mtp_blocks:
            h = mtp_graph(self, self.mtp_blocks, h, *labels)
        if self.last:
            assert self.norm is not None and self.head is not None
            h = self.head(self.norm(h))
        return h

    @classmethod
    def overlapped_forward_backward(
        cls, module0: MoEStage, inputs0, criterion0, labels0, module1: MoEStage, *backward
    ) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """The runtime's hook (:func:`dualpipe.overlap.overlapped_forward_backward`) for piecewise stages."""
        if not (module0.piecewise and module1.piecewise):
            raise ValueError(
                "overlapped_forward_backward needs piecewise=True stages; run piecewise=False ones with overlap=False"
            )
        return super().overlapped_forward_backward(module0, inputs0, criterion0, labels0, module1, *backward)

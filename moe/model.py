"""The whole model in one process (the oracle for the distributed runs) and the causal LM loss.

Legend for shape suffixes: B batch, S sequence, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moe.config import MoEConfig
from moe.stage import MoEStage

__all__ = ["MoEModel", "lm_loss", "next_token_batch"]


class MoEModel(MoEStage):
    """Every layer, embedding and head, all experts local: ``model(ids_BS) -> logits_BSV``.

    ``piecewise=False`` (default) is one ordinary autograd graph; ``piecewise=True`` runs the same
    sub-stage decomposition the pipeline stages use.
    """

    def __init__(self, cfg: MoEConfig, *, seed: int = 0, piecewise: bool = False, recompute: bool = False) -> None:
        super().__init__(cfg, range(cfg.num_layers), first=True, last=True, piecewise=piecewise, recompute=recompute)
        self.reset_parameters(seed)


def lm_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32; ``labels`` are the target ids (already shifted)."""
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), labels_BS.flatten())


def next_token_batch(cfg: MoEConfig, batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random token batch ``(ids [B, S], labels [B, S])`` with labels the ids shifted left by one."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

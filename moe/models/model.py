"""The whole model in one process (the oracle for the distributed runs) and the causal LM loss.

Legend for shape suffixes: B batch, S sequence, V vocabulary.
"""

from __future__ import annotations

import torch

from moe.models.config import MoEConfig
from moe.models.loss import chunked_cross_entropy
from moe.models.stage import MoEStage

__all__ = ["MoEModel", "lm_loss", "next_token_batch"]


class MoEModel(MoEStage):
    """Every layer, embedding and head, all experts local: ``model(ids_BS) -> logits_BSV``; with multi-token
    prediction (``cfg.mtp_layers``) ``model(ids_BS, labels_BS)``, the MTP losses weighted into the backward and
    reported by :meth:`pop_mtp_losses`.

    ``piecewise=False`` (default) is one ordinary autograd graph; ``piecewise=True`` runs the same
    sub-stage decomposition the pipeline stages use.
    """

    def __init__(self, cfg: MoEConfig, *, seed: int = 0, piecewise: bool = False, recompute: bool = False) -> None:
        super().__init__(cfg, range(cfg.num_layers), first=True, last=True, piecewise=piecewise, recompute=recompute)
        self.reset_parameters(seed)


def lm_loss(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32; ``labels`` are the target ids (already shifted), int64 ``[B, S]``.

    ``logits_BSV`` may be bf16: the loss is computed in fp32 chunks of tokens
    (:func:`moe.models.loss.chunked_cross_entropy`), so no fp32 copy of the whole ``[B*S, V]`` logits exists in
    forward or backward: the peak beyond the logits and their gradient is a few ``[chunk, V]`` fp32
    temporaries (128 MiB each by default) plus ``[B*S]`` fp32 log-sum-exps, instead of the ``8 B S V`` bytes
    of an fp32 copy plus its saved log-softmax.
    """
    return chunked_cross_entropy(logits_BSV.flatten(0, 1), labels_BS.flatten())


def next_token_batch(cfg: MoEConfig, batch: int, seq: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A random token batch ``(ids [B, S], labels [B, S])`` with labels the ids shifted left by one."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=gen)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

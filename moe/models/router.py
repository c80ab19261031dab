"""The MoE router: DeepSeek-V3's (sigmoid scores, group-limited top-k) or Qwen3-MoE's (softmax, top-k), with
the auxiliary-loss-free bias, DeepSeek's sequence-wise aux loss and Qwen3-MoE's load-balancing loss.

Legend for shape suffixes: B batch, S sequence, T tokens (B*S), D hidden, E experts, K top-k.

Sigmoid selection runs in the ``router_topk`` kernel (not differentiable); softmax selection is a torch top-k.
Either way the weights of the chosen experts are recomputed here in torch from the same logits so that the
gate gets its gradient. Both are checked against transformers (tests/moe/models/test_routing.py,
tests/moe/models/test_qwen3_moe.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from kernels import ops
from moe.models.config import MoEConfig
from moe.models.layers import Kept, Linear

__all__ = ["Router", "Routing", "bias_rate_at", "load_balancing_loss", "routing_imbalance"]


@dataclass(slots=True)
class Routing:
    """What the router decided for one micro-batch of one layer."""

    topk_idx_TK: torch.Tensor
    """Chosen global expert ids, int64, in descending biased-score order."""
    topk_weights_TK: torch.Tensor
    """Routing weights: chosen sigmoid scores, normalised when ``norm_topk_prob``, times ``route_scale`` (fp32,
    differentiable w.r.t. the gate and its input)."""
    aux_loss: torch.Tensor | None
    """The balance losses of this layer, each already multiplied by its coefficient (DeepSeek's sequence-wise
    loss, Qwen3-MoE's load-balancing loss), or None when both are disabled."""


class Router(nn.Module):
    """Gate projection plus the balancing state of one MoE layer.

    ``expert_bias`` only steers selection (it never enters the weights); :meth:`update_bias` nudges it from
    the load counted in ``expert_load`` since the last update.
    """

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.n_group, self.topk_group, self.route_scale = cfg.n_group, cfg.topk_group, cfg.route_scale
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scoring = cfg.router_scoring
        self.aux_coef = cfg.seq_aux_loss_coef
        # Qwen3-MoE's balance loss, per layer, weighted so the layers' losses average (MoEConfig's docstring).
        self.lb_coef = cfg.router_aux_loss_coef / max(len(cfg.moe_layers), 1)
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, keep_precision=True)
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))
        self.register_buffer("expert_load", torch.zeros(cfg.num_experts, dtype=torch.float32), persistent=False)
        self.last_load: torch.Tensor | None = None
        """fp32 ``[E]`` load the last :meth:`update_bias` acted on (over every replica it was summed over)."""

    def _apply(self, fn, recurse: bool = True):
        # Keep the balancing state in fp32 when the model is cast to bf16: bias steps of 1e-3 would
        # vanish below bf16's spacing (2**-8 near 0.5), and token counts would round.
        super()._apply(fn, recurse)
        self.expert_bias = self.expert_bias.float()
        self.expert_load = self.expert_load.float()
        return self

    def forward(
        self,
        z_BSD: torch.Tensor,
        topk_idx_TK: torch.Tensor | None = None,
        kept: Kept | None = None,
    ) -> Routing:
        """Route ``z``; pass ``topk_idx_TK`` to replay an earlier decision (activation recomputation). ``kept``: z
        as the block keeps it for backward (FP8 caching), which the gate saves instead of z for its weight
        gradient; the gate's GEMMs themselves stay in z's dtype.

        A fresh decision in training mode adds its per-expert counts to ``expert_load``.
        """
        b, s, d = z_BSD.shape
        kept_TD = None if kept is None else kept.view(lambda z: z.reshape(b * s, d))
        logits_TE = self.gate(z_BSD.reshape(b * s, d), kept=kept_TD)
        softmax = self.scoring == "softmax"
        scores_TE = torch.softmax(logits_TE.float(), dim=-1) if softmax else torch.sigmoid(logits_TE.float())
        if topk_idx_TK is None:
            if softmax:  # Qwen3-MoE: top-k of the softmax (the bias, zero unless balancing, steers it)
                topk_idx_TK = torch.topk(scores_TE.detach() + self.expert_bias, self.top_k, dim=-1).indices
            else:
                _, topk_idx_TK, _ = ops.router_topk(
                    logits_TE.detach(), self.expert_bias, self.top_k, self.n_group, self.topk_group, self.route_scale
                )
            topk_idx_TK = topk_idx_TK.long()
            if self.training:
                with torch.no_grad():
                    # index_add_ on the device: bincount would read max(idx) and its output size on the host.
                    flat = topk_idx_TK.reshape(-1)
                    self.expert_load.index_add_(0, flat, torch.ones_like(flat, dtype=self.expert_load.dtype))
        weights_TK = scores_TE.gather(1, topk_idx_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / weights_TK.sum(-1, keepdim=True)
        weights_TK = weights_TK * self.route_scale
        aux = self._seq_aux_loss(scores_TE.view(b, s, -1), topk_idx_TK.view(b, s, -1)) if self.aux_coef else None
        if self.lb_coef:
            balance = load_balancing_loss(logits_TE, self.top_k, coef=self.lb_coef, topk_idx_per_layer=topk_idx_TK)
            aux = balance if aux is None else aux + balance
        return Routing(topk_idx_TK, weights_TK, aux)

    def _seq_aux_loss(self, scores_BSE: torch.Tensor, topk_idx_BSK: torch.Tensor) -> torch.Tensor:
        # L = coef * sum_i f_i * P_i per sequence, averaged over the sequences of the micro-batch, with
        # f_i = E / (K * S) * #tokens choosing i and P_i = mean over tokens of the normalised score of i.
        b, s, e = scores_BSE.shape
        counts_BE = torch.zeros(b, e, device=scores_BSE.device, dtype=torch.float32)
        counts_BE.scatter_add_(
            1, topk_idx_BSK.reshape(b, -1), torch.ones_like(topk_idx_BSK.reshape(b, -1), dtype=torch.float32)
        )
        f_BE = counts_BE * (e / (self.top_k * s))
        p_BE = (scores_BSE / scores_BSE.sum(-1, keepdim=True)).mean(1)
        return self.aux_coef * (f_BE * p_BE).sum(-1).mean()

    def imbalance(self) -> torch.Tensor:
        """max / mean expert load of the last balancing step (:attr:`last_load`) as a 0-d fp32 tensor on the
        router's device (no host sync); 1.0 before any step, or with no load counted."""
        one = torch.ones((), dtype=torch.float32, device=self.expert_bias.device)
        load = self.last_load
        if load is None:
            return one
        return torch.where(load.sum() > 0, load.max() / load.mean(), one)

    @torch.no_grad()
    def update_bias(self, rate: float, group: dist.ProcessGroup | None = None) -> None:
        """Auxiliary-loss-free balancing step: ``bias += rate * sign(mean_load - load)``; resets the count.

        ``group`` sums the counts over the data-parallel ranks first so every replica takes the same step
        (DeepSeek-V3 counts the load over the whole batch of a step). The load acted on stays in
        :attr:`last_load`.

        The sign rule moves every expert by ``rate`` each step, so it settles only when ``rate`` is small
        next to how much the routing scores of different tokens differ (a larger step moves all the tokens
        near the top-k boundary at once and the load swings from step to step), yet it must be large enough
        to follow the scores as training moves them. :func:`bias_rate_at` scales it with the learning rate.
        """
        load_E = self.expert_load.clone()
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(load_E, group=group)
        self.expert_bias += rate * torch.sign(load_E.mean() - load_E)
        self.last_load = load_E
        self.expert_load.zero_()


def bias_rate_at(rate: float, lr: float, peak_lr: float) -> float:
    """The balancing step for a step trained at ``lr``: ``rate * lr / peak_lr``.

    Routing scores drift at a speed proportional to the learning rate (AdamW moves each weight by about
    ``lr`` a step), so the bias must move fast while the learning rate is high and finely once it has
    decayed. On the README's CPU demo (tiny preset, lr 3e-3 with warm-up and cosine decay, 80 steps) a
    constant rate of 0.01 leaves the reported max / mean expert load at 2.7 on average over the last 20
    steps; this schedule with ``rate`` 0.02 brings it to 1.9. A bias converged on a frozen model reads 1.36
    there: what the step-to-step variation of the batches alone leaves.
    """
    if peak_lr <= 0:
        raise ValueError(f"peak_lr must be positive, got {peak_lr}")
    return rate * lr / peak_lr


def routing_imbalance(routers: Iterable[Router]) -> float:
    """max / mean expert load of the last balancing step, the worst of ``routers`` (1.0: perfectly even).
    1.0 when no update ran yet."""
    return max((r.imbalance().item() for r in routers), default=1.0)


def load_balancing_loss(
    logits_per_layer: torch.Tensor | Sequence[torch.Tensor],
    top_k: int,
    *,
    coef: float = 1.0,
    mask_BS: torch.Tensor | None = None,
    topk_idx_per_layer: torch.Tensor | Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Switch-Transformer balance loss as Qwen3-MoE trains with it: ``coef * E * sum_e f_e * P_e``.

    logits_per_layer: the router logits ``[T, E]`` of every MoE layer (one tensor: one layer). The layers
    are pooled *before* the product: ``f_e`` = top-k picks of expert e over all layers / (layers * T) (so
    ``sum_e f_e = K``), ``P_e`` = its softmax probability summed over all layers / (layers * T).
    ``mask_BS`` (1 for real tokens, 0 for padding; T = B*S) leaves padding out of both sums and the count.
    ``topk_idx_per_layer``: the experts each layer chose ``[T, K]`` (default: the top-k of the softmax, as
    transformers counts them; a router whose selection bias steers the choice passes what it chose).
    ``coef`` = ``router_aux_loss_coef`` gives what ``Qwen3MoeForCausalLM`` adds to the LM loss; 1 gives its
    ``aux_loss`` output. Returns an fp32 scalar, differentiable through the probabilities (not the picks).
    Training takes it per layer (:class:`Router`, ``MoEConfig.router_aux_loss_coef``).
    """
    if isinstance(logits_per_layer, torch.Tensor):
        logits_per_layer = (logits_per_layer,)
    if isinstance(topk_idx_per_layer, torch.Tensor):
        topk_idx_per_layer = (topk_idx_per_layer,)
    if topk_idx_per_layer is not None and len(topk_idx_per_layer) != len(logits_per_layer):
        raise ValueError(f"{len(topk_idx_per_layer)} layers of picks for {len(logits_per_layer)} layers of logits")
    num_experts = logits_per_layer[0].shape[-1]
    device = logits_per_layer[0].device
    mask_T = None if mask_BS is None else mask_BS.reshape(-1, 1).to(device, torch.float32)
    picks_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs_E = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows = torch.zeros((), dtype=torch.float32, device=device)
    for i, logits_TE in enumerate(logits_per_layer):
        probs_TE = torch.softmax(logits_TE.float(), dim=-1)
        if topk_idx_per_layer is None:
            idx_TK = probs_TE.detach().topk(top_k, dim=-1).indices
        else:
            idx_TK = topk_idx_per_layer[i]
        weight_TK = torch.ones_like(idx_TK, dtype=torch.float32) if mask_T is None else mask_T.expand_as(idx_TK)
        picks_E = picks_E.index_add(0, idx_TK.reshape(-1), weight_TK.reshape(-1))
        probs_E = probs_E + (probs_TE if mask_T is None else probs_TE * mask_T).sum(0)
        rows = rows + (len(probs_TE) if mask_T is None else mask_T.sum())
    return coef * num_experts * ((picks_E / rows) * (probs_E / rows)).sum()

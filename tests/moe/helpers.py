"""Shared pieces of the moe tests: the tiny config, the single-process oracle and comparisons."""

from __future__ import annotations

import torch

from moe import MoEConfig, MoEModel, lm_loss, next_token_batch
from moe.train.memory import MemoryMeter

SEED = 3


def tiny_config(**changes) -> MoEConfig:
    """4 layers (the first dense), 8 experts in 2 groups with 1 group per token, an aux loss."""
    base = dict(
        vocab_size=64,
        hidden_size=32,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        num_dense_layers=1,
        dense_intermediate_size=48,
        num_experts=8,
        moe_intermediate_size=16,
        top_k=2,
        n_group=2,
        topk_group=1,
        route_scale=1.5,
        seq_aux_loss_coef=0.01,
    )
    base.update(changes)
    return MoEConfig(**base)


def batch(cfg: MoEConfig, size: int = 4, seq: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return next_token_batch(cfg, size, seq, seed)


def tracked_peak_bytes(model: MoEModel, cfg: MoEConfig, *, size: int, seq: int, mtp: bool = False) -> int:
    """moe.train.memory's tracker: the peak of saved-for-backward bytes over one micro-batch of ``size x seq`` tokens
    through the whole model, forward and backward (``mtp``: the MTP modules too, given the labels)."""
    ids, labels = batch(cfg, size=size, seq=seq)
    meter = MemoryMeter(model)
    meter.start_step()
    lm_loss(model(ids, labels) if mtp else model(ids), labels).backward()
    return meter.stop_step()["peak_activation_bytes"]


def single_process_grads(
    cfg: MoEConfig, micro_batches: list[tuple[torch.Tensor, torch.Tensor]], bias: dict[int, torch.Tensor] | None = None
) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The oracle: one ordinary autograd graph per micro-batch, gradients summed over micro-batches.

    Returns (losses, grads by name, expert loads by layer name).
    """
    model = MoEModel(cfg, seed=SEED)
    for layer, b in (bias or {}).items():
        model.blocks[str(layer)].router.expert_bias.copy_(b)
    losses = []
    for ids, labels in micro_batches:
        loss = lm_loss(model(ids, *([labels] if model.forward_takes_labels else [])), labels)  # MTP: labels
        loss.backward()
        losses.append(loss.item())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    loads = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_load")}
    return losses, grads, loads


def assert_rel_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5, what: str = "") -> None:
    """max |got - want| <= rel * max |want| (and the reference is not all zero)."""
    scale = want.abs().max().item()
    assert scale > 0, f"{what}: reference gradient is all zero"
    err = (got - want).abs().max().item()
    assert err <= rel * scale, f"{what}: max abs error {err:.3e} > {rel:g} x {scale:.3e}"

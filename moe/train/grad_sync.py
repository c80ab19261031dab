"""Gradient reduction over the (pp, edp, ep) layout, and the router balancing step that shares its groups.

After a pipeline step every rank holds the gradients of its own micro-batches' loss. :func:`reduce_gradients`
turns them into the gradient of the mean loss over the global batch:

- DualPipe's two copies of a stage (pipeline ranks r and N-1-r) saw different micro-batches: their
  gradients are summed over the two-rank mirror group first;
- the embedding, when a last stage with multi-token prediction holds a copy of it on another pipeline rank
  than the first stage's (1F1B, ZB1P, interleaved at pp > 1): the two copies' gradients are summed over the
  embedding group, so both take the same step;
- dense parameters are replicated over the dp ranks of a stage: all-reduced over dp and scaled by 1/dp;
- expert parameters are sharded over ep: the all-to-all already brought every ep rank's tokens to them, so
  each replica's gradient is the sum over its own ep group; they are summed over the edp replicas and
  scaled by 1/dp (at edp == 1 only the scale remains).

A parameter's gradient is its fp32 ``main_grad`` when mixed precision gave it one (:mod:`moe.train.optimizer`), else
``.grad``. Reductions run in buckets of ``bucket_bytes``: each bucket is flattened, its all-reduce started
asynchronously, and the next bucket packed while it runs, so no flat copy of every gradient exists at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from moe.models.block import Block
from moe.models.stage import MoEStage
from moe.parallel import ParallelConfig, ParallelLayout
from moe.train.optimizer import DistributedOptimizer, ShardGroup, grad_of

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "all_reduce_buckets",
    "balance_routers",
    "make_optimizer",
    "reduce_gradients",
    "split_params",
]

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""Bytes per all-reduce bucket: large enough that NCCL runs near bandwidth, small enough that the flat copy
stays a small fraction of the gradients (DDP's default, for the same reasons)."""


def _by_stage(modules: Sequence[MoEStage]) -> list[MoEStage]:
    return sorted(modules, key=lambda m: m.stage_index if m.stage_index is not None else 0)


def split_params(modules: Sequence[MoEStage]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(dense, expert)`` trainable parameters of ``modules``, each once, in stage order (the same order on
    every rank of a group, which bucketed collectives rely on)."""
    modules = _by_stage(modules)
    expert_ids = {id(p) for m in modules for p in m.expert_parameters()}
    seen: set[int] = set()
    dense: list[nn.Parameter] = []
    expert: list[nn.Parameter] = []
    for m in modules:
        for p in m.parameters():
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            (expert if id(p) in expert_ids else dense).append(p)
    return dense, expert


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of same-dtype tensors of at most ``bucket_bytes`` (a larger tensor is its own)."""
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > bucket_bytes or t.dtype != bucket[0].dtype or t.device != bucket[0].device):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def all_reduce_buckets(
    tensors: Sequence[torch.Tensor],
    group: dist.ProcessGroup | None,
    *,
    scale: float = 1.0,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> None:
    """Sum ``tensors`` in place over ``group`` and multiply by ``scale``, one asynchronous all-reduce per bucket
    (at most two buckets' flat copies alive: the one in flight and the one being packed)."""
    in_flight: tuple[dist.Work, torch.Tensor, list[torch.Tensor]] | None = None

    def finish(work: dist.Work, flat: torch.Tensor, bucket: list[torch.Tensor]) -> None:
        work.wait()
        if scale != 1.0:
            flat.mul_(scale)
        for t, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(reduced)

    for bucket in _buckets(tensors, bucket_bytes):
        flat = _flatten_dense_tensors(bucket)
        work = dist.all_reduce(flat, group=group, async_op=True)
        if in_flight is not None:
            finish(*in_flight)
        in_flight = (work, flat, bucket)
    if in_flight is not None:
        finish(*in_flight)


def make_optimizer(
    modules: Sequence[MoEStage],
    layout: ParallelLayout,
    optimizer: str = "adamw",
    *,
    zero: bool = False,
    master_weights: bool = True,
    state_dtype: str = "float32",
    **hyper,
) -> DistributedOptimizer:
    """``optimizer`` (a name of :data:`moe.optim_state.OPTIMIZERS`) over ``modules``, sharded the way
    :func:`reduce_gradients` reduces: dense parameters over the dp group, expert parameters over their edp
    replicas (ZeRO-1 with ``zero``: each rank its rows of every tensor, an expert tensor's rows per expert). The
    gradient norm counts each element once in the world: each rank of a group its rows, and never on the
    DualPipe mirror copy or the MTP stage's copy of the embedding.
    ``state_dtype``: the moments' dtype (:data:`moe.train.optimizer.STATE_DTYPES`). ``hyper``: the optimizer's
    hyper-parameters (AdamW:
    ``lr``, ``betas``, ``eps``, ``weight_decay``). Collective; build it after the modules are on their device
    and in their dtype (bf16 parameters get fp32 masters unless ``master_weights=False``)."""
    dense, expert = split_params(modules)
    groups = [ShardGroup(dense, layout.dp_group), ShardGroup(expert, layout.edp_group, stacked=True)]
    _, copies = shared_with_mtp(modules, layout.config)
    return DistributedOptimizer(
        groups,
        optimizer,
        zero=zero,
        master_weights=master_weights,
        counts_in_norm=not layout.is_mirror_copy,
        copies=copies if layout.holds_embedding_copy else [],
        state_dtype=state_dtype,
        **hyper,
    )


def shared_with_mtp(
    modules: Sequence[MoEStage], config: ParallelConfig
) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the parameters this rank shares with the multi-token-prediction stage, in the order every rank of an
    embedding group lists them: embeddings, final norms, heads; those of them that are the MTP stage's own
    copies, not the first or last stage's). The embedding always; the final norm and the head when the MTP
    modules sit on a stage of their own (``m|L``)."""
    own_stage = config.mtp_stage != config.num_stages - 1
    kinds: list[list[nn.Parameter]] = [[], [], []]
    real: set[int] = set()
    for m in modules:
        if m.embed is not None and (m.first or m.mtp_blocks):
            kinds[0].append(m.embed.weight)
            real |= {id(m.embed.weight)} if m.first else set()
        if own_stage and m.norm is not None and m.head is not None and (m.last or m.mtp_blocks):
            kinds[1].append(m.norm.weight)
            kinds[2].append(m.head.weight)
            real |= {id(m.norm.weight), id(m.head.weight)} if m.last else set()
    shared = list({id(p): p for kind in kinds for p in kind}.values())
    return shared, [p for p in shared if id(p) not in real]


@torch.no_grad()
def reduce_gradients(
    modules: Sequence[MoEStage], layout: ParallelLayout, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> None:
    """Make every gradient that of the mean loss over the global batch, on every rank (see the module doc).

    Call after the pipeline step, before clipping and the optimizer. DualPipe mirror copies are summed here,
    so do not also call ``dualpipe.sum_mirrored_grads`` (that would add them twice).
    """
    dense, expert = split_params(modules)
    config = layout.config
    if layout.embed_group is not None and any(m.cfg.mtp_layers for m in modules):
        # the first stage's embedding and the MTP stage's copy of it, on two pipeline ranks: one gradient (and the
        # last stage's final norm and head with the copies of an MTP stage of its own, m|L)
        shared, _ = shared_with_mtp(modules, layout.config)
        all_reduce_buckets([grad_of(p) for p in shared], layout.embed_group, bucket_bytes=bucket_bytes)
    if layout.mirror_group is not None:
        all_reduce_buckets([grad_of(p) for p in dense + expert], layout.mirror_group, bucket_bytes=bucket_bytes)
    dp = config.dp
    assert dp is not None
    if dp > 1:
        all_reduce_buckets([grad_of(p) for p in dense], layout.dp_group, scale=1.0 / dp, bucket_bytes=bucket_bytes)
    if config.edp > 1:
        all_reduce_buckets([grad_of(p) for p in expert], layout.edp_group, scale=1.0 / dp, bucket_bytes=bucket_bytes)
    elif dp > 1:
        for p in expert:
            grad_of(p).mul_(1.0 / dp)


@torch.no_grad()
def balance_routers(modules: Sequence[MoEStage], layout: ParallelLayout | None, rate: float | None = None) -> None:
    """Auxiliary-loss-free balancing step on every MoE layer of ``modules`` (after the optimizer step).

    Loads are summed over the DualPipe mirror and the data-parallel group (the whole global batch), so all
    replicas move their bias alike. ``rate`` defaults to the config's ``bias_update_rate``.
    """
    blocks = [(m, b) for m in _by_stage(modules) for b in m.blocks.values() if isinstance(b, Block) and b.is_moe]
    if not blocks:
        return
    loads = [b.router.expert_load for _, b in blocks]
    if layout is not None and layout.mirror_group is not None:
        all_reduce_buckets(loads, layout.mirror_group)
    if layout is not None and (layout.config.dp or 1) > 1:
        all_reduce_buckets(loads, layout.dp_group)
    for m, b in blocks:
        b.router.update_bias(m.cfg.bias_update_rate if rate is None else rate)

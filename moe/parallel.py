"""Parallel layout: a (pp, ep) device mesh, stage partitioning for DualPipe/DualPipeV, gradient reduction.

Rank ``pp_rank * ep + ep_rank``: the expert-parallel ranks of a stage are contiguous, so with 8 GPUs per
node an EP group of 8 stays on NVLink (what DeepEP's intranode kernels need). The ep group is also the
data-parallel group: non-expert gradients are averaged over it; expert gradients stay local (each rank's
experts already saw every rank's tokens through the all-to-all) and are only scaled by ``1/ep`` so that all
gradients are those of the mean loss over the data-parallel ranks.

DualPipe keeps stages r and N-1-r on pipeline rank r: each stage lives on two ranks, and the two copies'
gradients (and expert-load counts) are summed over a two-rank "mirror" group before anything else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dualpipe.schedule import SCHEDULES as PIPELINE_SCHEDULES
from dualpipe.schedule import Layout
from moe.block import Block
from moe.config import MoEConfig
from moe.dispatch import DEFAULT_COMM_SMS, DISPATCHERS, make_dispatcher
from moe.stage import MoEStage

__all__ = [
    "SCHEDULES",
    "ParallelConfig",
    "ParallelLayout",
    "balance_routers",
    "build_stages",
    "init_layout",
    "reduce_gradients",
    "split_layers",
]

SCHEDULES = tuple(PIPELINE_SCHEDULES)  # the pipeline's schedule names; their layouts place the stages


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How the model is spread over the ranks."""

    pp: int = 1
    """Pipeline-parallel ranks."""
    ep: int = 1
    """Expert-parallel ranks (also the data-parallel ranks of the non-expert weights)."""
    schedule: str = "dualpipev"
    """``dualpipev`` (2*pp stages, two per rank), ``dualpipe`` (pp stages, two mirrored copies per rank), or
    the single-module baselines ``1f1b`` / ``zb1p`` (pp stages, one per rank)."""
    dispatcher: str = "alltoall"
    """Token dispatcher for ep > 1: ``alltoall`` or ``deepep`` (``local`` is forced at ep == 1)."""
    comm_sms: int = DEFAULT_COMM_SMS
    """SMs reserved for communication: DeepEP's ``Buffer.set_num_sms`` and NCCL's CTA cap on the ep group.
    20 is the DeepSeek-V3 figure (enough to saturate IB and NVLink on H800); the grouped GEMM launches on
    the remaining SMs."""
    recompute: bool = False
    """Recompute attention and MLP sub-stages in backward instead of keeping their activations."""

    def __post_init__(self) -> None:
        if self.pp < 1 or self.ep < 1:
            raise ValueError(f"pp and ep must be >= 1, got pp={self.pp} ep={self.ep}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of {SCHEDULES}")
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"unknown dispatcher {self.dispatcher!r}; choose one of {DISPATCHERS}")
        if self.schedule == "dualpipe" and self.pp % 2:
            raise ValueError(f"DualPipe needs an even number of pipeline ranks, got pp={self.pp}")
        if self.comm_sms < 0:
            raise ValueError(f"comm_sms must be >= 0, got {self.comm_sms}")

    @property
    def stage_layout(self) -> Layout:
        """Where the schedule puts each stage: ``stage_layout.locate(pp_rank, module)[1]`` is its index."""
        return PIPELINE_SCHEDULES[self.schedule].layout(self.pp)

    @property
    def num_stages(self) -> int:
        return len(self.stage_layout.paths[0])

    @property
    def modules_per_rank(self) -> int:
        return self.stage_layout.modules_per_rank


@dataclass(kw_only=True, slots=True)
class ParallelLayout:
    """This rank's place in the (pp, ep) mesh and the process groups it talks over."""

    config: ParallelConfig
    pp_rank: int
    ep_rank: int
    pp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    mirror_group: dist.ProcessGroup | None
    """DualPipe only: this rank and pipeline rank pp-1-pp_rank (same ep rank)."""
    mesh: object | None
    """A ``DeviceMesh`` over (pp, ep) when torch can build one from the groups, else None."""


def _nccl_options(comm_sms: int) -> object | None:
    # Cap the CTAs NCCL uses on the ep group so communication leaves the other SMs to the grouped GEMM.
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None or comm_sms <= 0:
        return None
    opts = nccl.Options()
    opts.config.max_ctas = comm_sms
    return opts


def init_layout(config: ParallelConfig, device_type: str = "cpu") -> ParallelLayout:
    """Create the pp, ep (and DualPipe mirror) groups; every rank of the default group must call it."""
    if not dist.is_initialized():
        raise RuntimeError("init_layout needs torch.distributed initialised (torchrun / init_process_group)")
    world, rank = dist.get_world_size(), dist.get_rank()
    pp, ep = config.pp, config.ep
    if pp * ep != world:
        raise ValueError(f"pp x ep = {pp} x {ep} = {pp * ep} does not equal the world size {world}")
    ep_options = _nccl_options(config.comm_sms) if "nccl" in str(dist.get_backend()) else None
    grid = torch.arange(world).view(pp, ep)
    pp_group = ep_group = mirror_group = None
    # new_group is collective over the default group: every rank creates every group, in the same order.
    for e in range(ep):
        g = dist.new_group(grid[:, e].tolist())
        if rank in grid[:, e].tolist():
            pp_group = g
    for p in range(pp):
        g = dist.new_group(grid[p].tolist(), pg_options=ep_options)
        if rank in grid[p].tolist():
            ep_group = g
    if config.schedule == "dualpipe":
        for e in range(ep):
            for p in range(pp // 2):
                members = [int(grid[p, e]), int(grid[pp - 1 - p, e])]
                g = dist.new_group(members)
                if rank in members:
                    mirror_group = g
    assert pp_group is not None and ep_group is not None
    pp_rank, ep_rank = divmod(rank, ep)
    return ParallelLayout(
        config=config,
        pp_rank=pp_rank,
        ep_rank=ep_rank,
        pp_group=pp_group,
        ep_group=ep_group,
        mirror_group=mirror_group,
        mesh=_device_mesh(device_type, grid, pp_group, ep_group),
    )


def _device_mesh(device_type: str, grid: torch.Tensor, pp_group, ep_group) -> object | None:
    try:
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group([pp_group, ep_group], device_type, mesh=grid, mesh_dim_names=("pp", "ep"))
    except (ImportError, RuntimeError, ValueError, TypeError):
        return None


def split_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous, balanced layer ranges; the first ``num_layers % num_stages`` stages get one more."""
    if num_layers < num_stages:
        raise ValueError(f"{num_layers} layers cannot fill {num_stages} pipeline stages")
    base, extra = divmod(num_layers, num_stages)
    ranges, start = [], 0
    for s in range(num_stages):
        n = base + (1 if s < extra else 0)
        ranges.append(range(start, start + n))
        start += n
    return ranges


def build_stages(
    cfg: MoEConfig,
    layout: ParallelLayout,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[MoEStage, ...]:
    """The stage modules of this pipeline rank, ready for ``DualPipeV``/``DualPipe((a, b), ...)``.

    DualPipeV: stages ``pp_rank`` and ``2*pp - 1 - pp_rank`` of 2*pp. DualPipe: stages ``pp_rank`` and
    ``pp - 1 - pp_rank`` of pp (each stage then exists on two ranks; see :func:`reduce_gradients`).
    1F1B / ZB1P: the single stage ``pp_rank`` of pp.
    Weights come from :meth:`MoEStage.reset_parameters` (``seed``), so they equal :class:`MoEModel`'s.
    """
    pc = layout.config
    if cfg.num_experts % pc.ep:
        raise ValueError(f"num_experts={cfg.num_experts} is not divisible by the expert-parallel size ep={pc.ep}")
    kind = "local" if pc.ep == 1 else pc.dispatcher
    dispatcher = make_dispatcher(
        kind, cfg.num_experts, layout.ep_group, hidden_size=cfg.hidden_size, dtype=dtype, comm_sms=pc.comm_sms
    )
    ranges = split_layers(cfg.num_layers, pc.num_stages)
    stage_layout = pc.stage_layout
    ids = [stage_layout.locate(layout.pp_rank, m)[1] for m in range(stage_layout.modules_per_rank)]
    stages = []
    for sid in ids:
        stage = MoEStage(
            cfg,
            ranges[sid],
            first=sid == 0,
            last=sid == pc.num_stages - 1,
            dispatcher=dispatcher,
            recompute=pc.recompute,
            comm_sms=pc.comm_sms if torch.device(device).type == "cuda" else 0,
            stage_index=sid,
        )
        stage.reset_parameters(seed)
        stages.append(stage.to(device=device, dtype=dtype))
    return tuple(stages)


def _by_stage(modules: Sequence[MoEStage]) -> list[MoEStage]:
    return sorted(modules, key=lambda m: m.stage_index if m.stage_index is not None else 0)


def _all_reduce_(tensors: list[torch.Tensor], group: dist.ProcessGroup, scale: float = 1.0) -> None:
    if not tensors:
        return
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    if scale != 1.0:
        flat.mul_(scale)
    for t, reduced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(reduced)


def _grads(params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params]  # type: ignore[misc]


@torch.no_grad()
def reduce_gradients(modules: Sequence[MoEStage], layout: ParallelLayout) -> None:
    """Make ``.grad`` the gradient of the mean loss over the ep (data-parallel) ranks, on every rank.

    Call after the pipeline step, before the optimizer. DualPipe mirror copies are summed first (their
    gradients come from different micro-batches of one step), so do not also call
    ``dualpipe.sum_mirrored_grads`` (that would add them twice).
    """
    modules = _by_stage(modules)
    if layout.mirror_group is not None:
        params = [p for m in modules for p in m.parameters()]
        _all_reduce_(_grads(params), layout.mirror_group)
    ep = layout.config.ep
    if ep == 1:
        return
    expert = {id(p) for m in modules for p in m.expert_parameters()}
    seen: set[int] = set()
    dense = []
    for m in modules:
        for p in m.parameters():
            if id(p) not in expert and id(p) not in seen:
                seen.add(id(p))
                dense.append(p)
    _all_reduce_(_grads(dense), layout.ep_group, scale=1.0 / ep)
    for m in modules:
        for p in m.expert_parameters():
            if p.grad is not None:
                p.grad.mul_(1.0 / ep)


@torch.no_grad()
def balance_routers(modules: Sequence[MoEStage], layout: ParallelLayout | None, rate: float | None = None) -> None:
    """Auxiliary-loss-free balancing step on every MoE layer of ``modules`` (after the optimizer step).

    Loads are summed over the DualPipe mirror and the ep group, so all replicas move their bias alike.
    ``rate`` defaults to the config's ``bias_update_rate``.
    """
    modules = _by_stage(modules)
    routers = [b.router for m in modules for b in m.blocks.values() if isinstance(b, Block) and b.is_moe]
    if not routers:
        return
    loads = [r.expert_load for r in routers]
    if layout is not None and layout.mirror_group is not None:
        _all_reduce_(loads, layout.mirror_group)
    if layout is not None and layout.config.ep > 1:
        _all_reduce_(loads, layout.ep_group)
    for m in modules:
        step = m.cfg.bias_update_rate if rate is None else rate
        for b in m.blocks.values():
            if isinstance(b, Block) and b.is_moe:
                b.router.update_bias(step)

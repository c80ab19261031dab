"""Parallel layout: a (pp, ep) device mesh, stage partitioning for any registered schedule, gradient reduction.

Rank order: by default pp is the outer dimension, rank ``pp_rank * ep + ep_rank``: the expert-parallel ranks
of a stage are contiguous, so with 8 GPUs per node an EP group of 8 stays on NVLink (what DeepEP's intranode
kernels need). ``ParallelConfig.rank_order = ("ep", "pp")`` puts ep outside instead (rank
``ep_rank * pp + pp_rank``: a pipeline stays on one node, every expert group spans nodes). The ep group is
also the data-parallel group: non-expert gradients are averaged over it; expert gradients stay local (each
rank's experts already saw every rank's tokens through the all-to-all) and are only scaled by ``1/ep`` so
that all gradients are those of the mean loss over the data-parallel ranks.

The schedule's layout places the stages. Where it holds a stage twice (DualPipe: stages r and N-1-r on
pipeline rank r), the two copies' gradients (and expert-load counts) are summed over a two-rank "mirror"
group before anything else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dualpipe.schedule import DEFAULT_SCHEDULE, Layout, schedule_spec
from moe.block import Block
from moe.config import MoEConfig
from moe.dispatch import DEFAULT_COMM_SMS, DISPATCHERS, make_dispatcher
from moe.stage import MoEStage

__all__ = [
    "ParallelConfig",
    "ParallelLayout",
    "balance_routers",
    "build_stages",
    "init_layout",
    "mirror_pairs",
    "rank_grid",
    "reduce_gradients",
    "split_layers",
    "with_schedule",
]


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How the model is spread over the ranks."""

    pp: int = 1
    """Pipeline-parallel ranks."""
    ep: int = 1
    """Expert-parallel ranks (also the data-parallel ranks of the non-expert weights)."""
    schedule: str = DEFAULT_SCHEDULE
    """A schedule of :data:`dualpipe.schedule.SCHEDULES`; its layout says how many stages there are and where
    each lives (``dualpipev``: 2*pp stages, two per rank; ``dualpipe``: pp stages, two mirrored copies per
    rank; ``1f1b`` / ``zb1p``: pp stages, one per rank)."""
    modules_per_rank: int | None = None
    """Stage modules per pipeline rank, for schedules that take any number (``interleaved-1f1b``'s virtual
    stages); ``None`` takes the schedule's own. Resolved to a number in ``__post_init__``."""
    rank_order: tuple[str, str] = ("pp", "ep")
    """Mesh dimensions, outermost first: ``("pp", "ep")`` keeps each ep group on consecutive ranks (one
    node), ``("ep", "pp")`` each pipeline."""
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
        spec = schedule_spec(self.schedule)
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"unknown dispatcher {self.dispatcher!r}; choose one of {DISPATCHERS}")
        spec.check_ranks(self.pp)
        self.modules_per_rank = spec.resolve_modules(self.modules_per_rank)
        if sorted(self.rank_order) != ["ep", "pp"]:
            raise ValueError(f"rank_order must order the dimensions 'pp' and 'ep', got {self.rank_order}")
        if self.comm_sms < 0:
            raise ValueError(f"comm_sms must be >= 0, got {self.comm_sms}")

    @property
    def stage_layout(self) -> Layout:
        """Where the schedule puts each stage: ``stage_layout.stage_of(pp_rank, module)`` is its index."""
        return schedule_spec(self.schedule).stage_layout(self.pp, self.modules_per_rank)

    @property
    def num_stages(self) -> int:
        return self.stage_layout.num_stages


@dataclass(kw_only=True, slots=True)
class ParallelLayout:
    """This rank's place in the (pp, ep) mesh and the process groups it talks over."""

    config: ParallelConfig
    pp_rank: int
    ep_rank: int
    pp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    mirror_group: dist.ProcessGroup | None
    """Layouts that hold each stage twice (DualPipe): this rank and the pipeline rank holding the same stages
    (same ep rank)."""
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


def rank_grid(config: ParallelConfig, world: int) -> torch.Tensor:
    """``grid[pp_rank, ep_rank]`` is the global rank, laid out in ``config.rank_order``."""
    pp, ep = config.pp, config.ep
    if pp * ep != world:
        raise ValueError(f"pp x ep = {pp} x {ep} = {pp * ep} does not equal the world size {world}")
    sizes = {"pp": pp, "ep": ep}
    grid = torch.arange(world).view(*(sizes[d] for d in config.rank_order))
    return grid if config.rank_order == ("pp", "ep") else grid.t()


def mirror_pairs(layout: Layout) -> list[tuple[int, int]]:
    """Pairs of pipeline ranks holding the same stages (DualPipe: r and N-1-r); empty if each stage is held
    once."""
    if not layout.mirrored:
        return []
    return sorted({tuple(sorted((r, layout.mirror(r, 0)[0]))) for r in range(layout.num_ranks)})


def init_layout(config: ParallelConfig, device_type: str = "cpu") -> ParallelLayout:
    """Create the pp, ep (and mirror) groups; every rank of the default group must call it."""
    if not dist.is_initialized():
        raise RuntimeError("init_layout needs torch.distributed initialised (torchrun / init_process_group)")
    world, rank = dist.get_world_size(), dist.get_rank()
    grid = rank_grid(config, world)
    pp, ep = config.pp, config.ep
    ep_options = _nccl_options(config.comm_sms) if "nccl" in str(dist.get_backend()) else None
    pp_group = ep_group = None
    # new_group is collective over the default group: every rank creates every group, in the same order.
    for e in range(ep):
        g = dist.new_group(grid[:, e].tolist())
        if rank in grid[:, e].tolist():
            pp_group = g
    for p in range(pp):
        g = dist.new_group(grid[p].tolist(), pg_options=ep_options)
        if rank in grid[p].tolist():
            ep_group = g
    mirror_group = _mirror_group(config, grid)
    assert pp_group is not None and ep_group is not None
    pp_rank, ep_rank = (int(i) for i in (grid == rank).nonzero()[0])
    return ParallelLayout(
        config=config,
        pp_rank=pp_rank,
        ep_rank=ep_rank,
        pp_group=pp_group,
        ep_group=ep_group,
        mirror_group=mirror_group,
        mesh=_device_mesh(device_type, grid, pp_group, ep_group),
    )


def _mirror_group(config: ParallelConfig, grid: torch.Tensor) -> dist.ProcessGroup | None:
    """Create every mirror group of ``config``'s layout (collective); return this rank's, if any."""
    rank, mine = dist.get_rank(), None
    for e in range(config.ep):
        for a, b in mirror_pairs(config.stage_layout):
            members = [int(grid[a, e]), int(grid[b, e])]
            g = dist.new_group(members)
            if rank in members:
                mine = g
    return mine


def with_schedule(base: ParallelLayout, schedule: str) -> ParallelLayout:
    """``base``'s groups configured for another schedule (one set of groups, several pipelines: the overlap
    benchmark). Creates the mirror groups if the new schedule needs them: collective, like
    :func:`init_layout`."""
    config = dataclasses.replace(base.config, schedule=schedule, modules_per_rank=None)
    mirror_group = None
    if config.stage_layout.mirrored:
        mirror_group = base.mirror_group or _mirror_group(config, rank_grid(config, dist.get_world_size()))
    return dataclasses.replace(base, config=config, mirror_group=mirror_group)


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
    piecewise: bool = True,
) -> tuple[MoEStage, ...]:
    """The stage modules of this pipeline rank, in local module order, ready for the schedule's pipeline.

    The schedule's layout says which stages they are (``Layout.stage_of``): DualPipeV stages ``pp_rank``
    and ``2*pp - 1 - pp_rank`` of 2*pp; DualPipe stages ``pp_rank`` and ``pp - 1 - pp_rank`` of pp (each
    stage then exists on two ranks; see :func:`reduce_gradients`); 1F1B / ZB1P the single stage
    ``pp_rank`` of pp; interleaved 1F1B stages ``pp_rank + m * pp``.
    Weights come from :meth:`MoEStage.reset_parameters` (``seed``), so they equal :class:`MoEModel`'s.
    ``piecewise=False`` builds plain-graph stages (blocking all-to-all autograd nodes) for baselines that
    schedule an ordinary graph.
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
    ids = [stage_layout.stage_of(layout.pp_rank, m) for m in range(stage_layout.modules_per_rank)]
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
            piecewise=piecewise,
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

"""Parallel layout: a (pp, edp, ep) device mesh, stage partitioning for any registered schedule.

The world is pp x dp ranks. Each data-parallel group (the dp ranks of one pipeline stage) is split into
``edp = dp / ep`` expert-data-parallel replicas of ``ep`` ranks: dense parameters are replicated over dp,
expert parameters are sharded over ep and replicated over the edp replicas (DeepSeek-V3's PP16 x EP64 x
DP layout, EP a subgroup of DP). ``dp == ep`` (one replica) is the plain (pp, ep) layout.

Rank order: the mesh dimensions are named (pp, edp, ep); ``ParallelConfig.rank_order`` lists them outermost
first. The default ``("pp", "edp", "ep")`` puts ep innermost: an expert group spans as few nodes as possible
and each node's ranks are contiguous inside it (NVLink inside a node; DeepEP's intranode kernels need the
group on one node, its internode kernels each node's 8 ranks consecutive). ``("edp", "ep", "pp")`` keeps a
pipeline on consecutive ranks instead.

The schedule's layout places the stages. Where it holds a stage twice (DualPipe: stages r and N-1-r on
pipeline rank r), the two copies' gradients (and expert-load counts) are summed over a two-rank "mirror"
group before anything else. Gradient reduction and the router balancing step live in :mod:`moe.train.grad_sync`.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dualpipe.schedule import DEFAULT_SCHEDULE, Layout, Op, ScheduleSpec, build_schedule, schedule_spec
from kernels.fp8 import FP8Recipe
from moe.dispatch import DEFAULT_COMM_SMS, DISPATCHERS, DispatchOptions, make_dispatcher
from moe.groups import group_timeout, new_groups, with_timeout
from moe.models.config import MoEConfig
from moe.models.layers import RECOMPUTE, recompute_granularity, selective_recompute, use_fp8
from moe.models.stage import MoEStage
from moe.pipeline_layout import AUTO, StagePlan, expand, plan_stages
from moe.plan.footprint import offload_names
from moe.plan.offload import OffloadPolicy, parse_offload
from moe.plan.params import layout_costs

__all__ = [
    "MESH_DIMS",
    "RECOMPUTE",
    "ParallelConfig",
    "ParallelLayout",
    "build_stages",
    "embedding_pairs",
    "init_layout",
    "mirror_pairs",
    "nccl_options",
    "rank_grid",
    "recompute_granularity",
    "tie_embeddings",
    "with_schedule",
]

MESH_DIMS = ("pp", "edp", "ep")
"""The device mesh's dimensions, in the order of :func:`rank_grid`'s axes."""


def _full_order(order: tuple[str, ...]) -> tuple[str, ...]:
    # (pp, ep) orders from before the expert-data-parallel dimension existed: edp sits just outside ep.
    if sorted(order) == ["ep", "pp"]:
        i = order.index("ep")
        return (*order[:i], "edp", *order[i:])
    return order


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """How the model is spread over the ranks."""

    pp: int = 1
    """Pipeline-parallel ranks."""
    ep: int = 1
    """Expert-parallel ranks: the experts are sharded over them. Must divide ``dp``."""
    dp: int | None = None
    """Data-parallel ranks per pipeline stage (dense weights are replicated over them, and each takes its
    slice of the global batch); ``None`` means ``ep`` (one expert replica; the trainer makes it world / pp).
    ``dp / ep`` is the number of expert-data-parallel replicas (``edp``)."""
    schedule: str = DEFAULT_SCHEDULE
    """A schedule of :data:`dualpipe.schedule.SCHEDULES`; its layout says how many stages there are and where
    each lives (``dualpipev``: 2*pp stages, two per rank; ``dualpipe``: pp stages, two mirrored copies per
    rank; ``1f1b`` / ``zb1p``: pp stages, one per rank)."""
    modules_per_rank: int | None = None
    """Stage modules per pipeline rank, for schedules that take any number (``interleaved-1f1b``'s virtual
    stages); ``None`` takes the schedule's own. Resolved to a number in ``__post_init__``."""
    rank_order: tuple[str, ...] = MESH_DIMS
    """Mesh dimensions ``pp``, ``edp``, ``ep``, outermost first: the default keeps each ep group on
    consecutive ranks (one node where it fits), ``("edp", "ep", "pp")`` each pipeline. A two-name order
    (``("ep", "pp")``) places ``edp`` just outside ``ep``."""
    dispatcher: str = "alltoall"
    """Token dispatcher for ep > 1, a name of :data:`moe.dispatch.DISPATCHERS` (``alltoall``, ``deepep``,
    ``deepep-v2``); ``local`` is forced at ep == 1."""
    comm_sms: int = DEFAULT_COMM_SMS
    """SMs reserved for communication while experts compute: DeepEP's ``Buffer.set_num_sms`` and NCCL's CTA
    cap on every group the step uses (pipeline P2P, data-parallel reductions and all-to-all alike, so no
    communicator takes SMs the grouped GEMM counts as free). 20 is the DeepSeek-V3 figure (enough to
    saturate IB and NVLink on H800). Nothing is reserved at ep == 1: there is no all-to-all to hide."""
    recompute: bool | str = "none"
    """Activation recompute in backward: ``none`` keeps every activation;
    ``selective`` (the DeepSeek-V3 report's) keeps only the inputs of the RMSNorms and of MLA's up-projections
    and runs those again in backward (:func:`moe.models.layers.selective_recompute`); ``full`` keeps only each
    attention and MLP sub-stage's inputs and runs the sub-stage again before its backward. ``true`` and
    ``false`` (a bare ``--recompute``, ``--no-recompute``, earlier job files) mean ``full`` and ``none``."""
    sync_free: bool = False
    """Worst-case receive buffers, so a layer's routing and dispatch never wait on the host for row counts
    (DeepEP's ``num_worst_tokens``; a padded capacity for ``alltoall``). Costs ep x the all-to-all bytes and
    expert rows, and needs the same token count on every rank."""
    deterministic_dispatch: bool = False
    """Received rows in source order (rank, then token) however they arrive, so a run repeats bit for bit:
    ``deepep-v2`` then sorts them after every dispatch (across nodes with a host sync); ``alltoall`` and
    ``deepep`` always give that order. Off: ``deepep-v2`` keeps arrival order (the same sums, in another
    order)."""
    num_chunks: int | None = None
    """Micro-batches per pipeline step; ``None`` takes the fewest the schedule accepts that is at least
    ``2 x pp`` (resolved in ``__post_init__``, checked against the schedule's rules)."""
    overlap: bool | None = None
    """Run the schedule's paired forward/backward chunks through ``overlapped_forward_backward``: DualPipe(V)'s,
    the V family's, interleaved 1F1B's steady steps, 1F1B's and ZB1P's on the last rank given an extra warm-up
    (docs/pipeline.md). Unset: wherever the schedule pairs, at this pp and micro-batch count; ``--overlap``
    where it pairs nothing is an error; ``--no-overlap`` runs each pair's halves one after the other."""
    extra_warmup: int = 0
    """Warm-up forwards added on every pipeline rank of the 1F1B family (``1f1b``, ``zb1p``,
    ``interleaved-1f1b``; Kimi K2's extra warm-up micro-batches): with one, each steady step's forward and
    backward are of different micro-batches, so the last rank's steps pair too (Megatron-Core's combined 1F1B
    adds one). Costs that many micro-batches' activations per rank; rank 0 must keep a steady step."""
    offload: str = ""
    """Saved activations moved to host memory between each forward and its backward (:mod:`moe.plan.offload`):
    ``all``, planner names of saved tensors (``attn.sdpa_out,mlp.experts_input``; ``attn.*``), or
    ``fraction=F`` (every saved tensor of each stage's first F of its blocks), each with optional ``@ranks=0-3``
    and ``@fraction=F``; clauses joined by ``;``. Empty: nothing moves. The copies run on a stream of their own,
    planned from the schedule's action lists; losses and gradients are unchanged bit for bit."""
    pipeline_layout: str = AUTO
    """What each stage holds, in Megatron-Core's syntax (:mod:`moe.pipeline_layout`): ``E`` embedding, ``t``
    a layer, ``m`` an MTP module, ``L`` the head, ``|`` between stages, ``*n`` repeats, e.g. ``Et|ttt|tt|tL``;
    stages in the order the schedule numbers them. ``auto``: stages balanced by cost
    (:func:`moe.pipeline_layout.balance`)."""

    def __post_init__(self) -> None:
        if self.dp is None:
            self.dp = self.ep
        if self.pp < 1 or self.ep < 1 or self.dp < 1:
            raise ValueError(f"pp, dp and ep must be >= 1, got pp={self.pp} dp={self.dp} ep={self.ep}")
        if self.dp % self.ep:
            raise ValueError(
                f"ep={self.ep} must divide dp={self.dp} (each data-parallel group holds dp/ep expert replicas)"
            )
        spec = schedule_spec(self.schedule)
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"unknown dispatcher {self.dispatcher!r}; choose one of {DISPATCHERS}")
        spec.check_ranks(self.pp)
        self.modules_per_rank = spec.resolve_modules(self.modules_per_rank)
        if self.num_chunks is None:
            self.num_chunks = spec.default_chunks(self.pp)
        spec.validate(self.pp, self.num_chunks, self.modules_per_rank, self.extra_warmup)
        self.overlap = self._resolve_overlap(spec)
        order = _full_order(tuple(self.rank_order))
        if sorted(order) != sorted(MESH_DIMS):
            raise ValueError(f"rank_order must order the dimensions {MESH_DIMS}, got {self.rank_order}")
        self.rank_order = order
        if self.comm_sms < 0:
            raise ValueError(f"comm_sms must be >= 0, got {self.comm_sms}")
        self.recompute = recompute_granularity(self.recompute)
        self.offload_policy()  # the syntax and the ranks (the names are checked against the model: check_model)

    def _resolve_overlap(self, spec: ScheduleSpec) -> bool:
        """``overlap`` as a bool: unset is whether the schedule pairs anything at these numbers; asked for where
        no rank pairs, a ``ValueError`` saying what would pair."""
        schedule = build_schedule(
            self.schedule, self.pp, self.num_chunks, False, self.modules_per_rank, self.extra_warmup
        )
        pairs = any(a.op is Op.FB for actions in schedule.ranks for a in actions)
        if self.overlap is None or not self.overlap or pairs:
            return bool(self.overlap if self.overlap is not None else pairs)
        if spec.warmup is not None and not self.extra_warmup:
            hint = "; pass --extra-warmup 1 (its last rank then pairs) or --no-overlap"
        else:
            hint = "; use --no-overlap, or a schedule that pairs (dualpipev, interleaved-1f1b)"
        raise ValueError(
            f"overlap: {spec.title} at pp={self.pp} with {self.num_chunks} micro-batches and extra_warmup="
            f"{self.extra_warmup} pairs no forward with a backward{hint}"
        )

    @property
    def edp(self) -> int:
        """Expert-data-parallel replicas: how many ranks of a data-parallel group hold each expert."""
        return self.dp // self.ep  # type: ignore[operator]

    @property
    def world_size(self) -> int:
        return self.pp * self.dp  # type: ignore[operator]

    @property
    def reserved_sms(self) -> int:
        """SMs kept for communication: ``comm_sms``, or 0 when there is no all-to-all (ep == 1)."""
        return self.comm_sms if self.ep > 1 else 0

    @property
    def stage_layout(self) -> Layout:
        """Where the schedule puts each stage: ``stage_layout.stage_of(pp_rank, module)`` is its index."""
        return schedule_spec(self.schedule).stage_layout(self.pp, self.modules_per_rank)

    @property
    def num_stages(self) -> int:
        return self.stage_layout.num_stages

    def _check_mtp_stage(self) -> None:
        """An MTP stage of its own shares the embedding with the first stage and the head with the last: one
        group per direction keeps its copies equal, so every rank that runs a first stage runs a last one."""
        layout = self.stage_layout
        ends = [(bool(layout.entries(r)), bool(layout.exits(r))) for r in range(layout.num_ranks)]
        if self.mtp_stage != layout.num_stages - 1 and any(first != last for first, last in ends):
            raise ValueError(
                f"pipeline_layout = {self.pipeline_layout!r}: an MTP stage of its own ('m|L') needs a schedule that "
                "runs the first and the last stage on one rank (DualPipe, DualPipeV)"
            )

    @property
    def mtp_stage(self) -> int:
        """The stage that holds a model's multi-token-prediction modules: the one :attr:`pipeline_layout` marks
        ``m``, else the last (``auto`` keeps them with the head)."""
        if self.pipeline_layout != AUTO:
            marked = [i for i, s in enumerate(expand(self.pipeline_layout).split("|")) if "m" in s]
            if marked:
                return marked[0]
        return self.num_stages - 1

    def offload_policy(self, cfg: MoEConfig | None = None, fp8_activations: bool = False) -> OffloadPolicy:
        """:attr:`offload` parsed (``ValueError``, one line, for bad syntax or ranks outside the pipeline); with
        ``cfg``, its names checked against the saved tensors of that model (:func:`moe.plan.footprint.offload_names`;
        ``fp8_activations``: the routed experts' FP8 copies)."""
        names = None if cfg is None else offload_names(cfg, fp8_activations)
        return parse_offload(self.offload, self.pp, names)

    def check_model(self, cfg: MoEConfig) -> None:
        """``ValueError`` (naming the fields) unless ``cfg`` spreads over this layout: its experts over ``ep``,
        its layers over the schedule's stages. The one place these rules live (the trainer's config and
        :func:`build_stages` both ask it)."""
        if cfg.num_experts % self.ep:
            raise ValueError(
                f"parallel.ep = {self.ep}: must divide the model's {cfg.num_experts} experts (model.num_experts)"
            )
        self.stage_plans(cfg)

    def stage_plans(self, cfg: MoEConfig) -> list[StagePlan]:
        """What each stage of ``cfg`` holds under :attr:`pipeline_layout`, by stage index (``ValueError`` naming
        the field when the layout and the model or the schedule disagree)."""
        if self.pipeline_layout == AUTO and cfg.num_layers < self.num_stages:
            raise ValueError(
                f"model.num_layers = {cfg.num_layers}: {self.schedule} at pp={self.pp} has {self.num_stages} "
                f"stages; pass --layers {self.num_stages} or more"
            )
        try:
            plans = plan_stages(
                self.pipeline_layout,
                num_stages=self.num_stages,
                num_layers=cfg.num_layers,
                mtp_layers=cfg.mtp_layers,
                costs=layout_costs(cfg),
            )
            self._check_mtp_stage()
            return plans
        except ValueError as exc:
            raise ValueError(f"parallel.{exc} ({self.schedule} at pp={self.pp})") from None


@dataclass(kw_only=True, slots=True)
class ParallelLayout:
    """This rank's place in the (pp, edp, ep) mesh and the process groups it talks over."""

    config: ParallelConfig
    pp_rank: int
    edp_rank: int
    ep_rank: int
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    """The stage's data-parallel ranks (edp x ep): dense gradients are averaged over it."""
    edp_group: dist.ProcessGroup
    """The ranks holding the same experts (one per replica): expert gradients are summed over it."""
    ep_group: dist.ProcessGroup
    mirror_group: dist.ProcessGroup | None
    """Layouts that hold each stage twice (DualPipe): this rank and the pipeline rank holding the same stages
    (same dp coordinates)."""
    embed_group: dist.ProcessGroup | None = None
    """Layouts that put the first stage and the head on different pipeline ranks (1F1B, ZB1P, interleaved at
    pp > 1): this rank and the other end (same dp coordinates), when it is one of the two. A last stage with
    multi-token prediction holds its own copy of the embedding; the copies' gradients are summed over this
    group (Megatron's embedding group), so the two stay equal."""
    mesh: object
    """The ``DeviceMesh`` over (pp, edp, ep)."""
    timeout: datetime.timedelta | None = None
    """How long a collective of any of these groups waits (:func:`with_schedule`'s new groups get it too)."""
    counts_group: dist.ProcessGroup | None = None
    """A duplicate of :attr:`ep_group` (same ranks, its own communicator and stream) for the row-count exchange
    of a dispatcher that has one (``alltoall`` outside sync-free mode): on the expert group the counts of one
    micro-batch would queue behind the other's all-to-all, and the host reading them would wait for it."""

    @property
    def dp_rank(self) -> int:
        """Position in the data-parallel group: which slice of the global batch this rank feeds."""
        return self.edp_rank * self.config.ep + self.ep_rank

    @property
    def is_mirror_copy(self) -> bool:
        """True on the higher pipeline rank of a DualPipe mirror pair: its stages duplicate the partner's, so
        quantities counted once per model (the gradient norm) skip them here."""
        if self.mirror_group is None:
            return False
        partner = self.config.stage_layout.mirror(self.pp_rank, 0)[0]
        return self.pp_rank > partner

    @property
    def holds_embedding_copy(self) -> bool:
        """True on a rank whose last stage would copy the first stage's embedding (:attr:`embed_group`): that
        copy is left out of what is counted once per model (the gradient norm)."""
        return self.embed_group is not None and not self.config.stage_layout.entries(self.pp_rank)


def nccl_options(comm_sms: int, *, high_priority: bool = False) -> object | None:
    """``ProcessGroupNCCL.Options`` capping the group at ``comm_sms`` CTAs (None without NCCL or a cap).

    ncclConfig_t.maxCTAs, through ``Options.config.max_ctas``: every group the step uses gets it, so no
    communication spreads over the SMs the grouped GEMM was launched on. ``high_priority`` puts the group's
    internal stream at the device's highest priority (``Options(is_high_priority_stream=True)``): the
    expert all-to-all, whose latency the overlap hides, gets SMs ahead of queued compute kernels.
    """
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None or comm_sms <= 0:
        return None
    opts = nccl.Options(is_high_priority_stream=high_priority)
    opts.config.max_ctas = comm_sms
    return opts


def group_options(config: ParallelConfig, dim: str | None = None) -> object | None:
    """Process-group options for a group of the layout (``dim`` a mesh dimension, None for the others): the
    NCCL CTA cap on NCCL, with a high-priority stream for ``ep``; None on other backends."""
    if "nccl" not in str(dist.get_backend()):
        return None
    return nccl_options(config.reserved_sms, high_priority=dim == "ep")


def rank_grid(config: ParallelConfig, world: int) -> torch.Tensor:
    """``grid[pp_rank, edp_rank, ep_rank]`` is the global rank, laid out in ``config.rank_order``."""
    if config.world_size != world:
        raise ValueError(
            f"pp x dp = {config.pp} x {config.dp} = {config.world_size} does not equal the world size {world}"
        )
    sizes = {"pp": config.pp, "edp": config.edp, "ep": config.ep}
    grid = torch.arange(world).view(*(sizes[d] for d in config.rank_order))
    return grid.permute(*(config.rank_order.index(d) for d in MESH_DIMS))


def mirror_pairs(layout: Layout) -> list[tuple[int, int]]:
    """Pairs of pipeline ranks holding the same stages (DualPipe: r and N-1-r); empty if each stage is held
    once."""
    if not layout.mirrored:
        return []
    return sorted({tuple(sorted((r, layout.mirror(r, 0)[0]))) for r in range(layout.num_ranks)})


def init_layout(
    config: ParallelConfig, device_type: str = "cpu", *, timeout: datetime.timedelta | None = None
) -> ParallelLayout:
    """Build the (pp, edp, ep) ``DeviceMesh``, the dp group (its (edp, ep) plane) and the mirror and embedding
    groups; every rank of the default group must call it (collective).

    Every group waits at most ``timeout`` (None: as long as the default group, e.g. the trainer's
    ``--timeout``). The groups are created here, each with the timeout, and handed to ``DeviceMesh``:
    ``new_group`` and ``DeviceMesh`` would give them the backend's default instead (NCCL 10 minutes).
    """
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        raise RuntimeError("init_layout needs torch.distributed initialised (torchrun / init_process_group)")
    timeout = timeout or group_timeout()
    grid = rank_grid(config, dist.get_world_size())
    lines = {dim: grid.movedim(i, -1).reshape(-1, grid.shape[i]).tolist() for i, dim in enumerate(MESH_DIMS)}
    dims = [new_groups(lines[dim], timeout=timeout, options=group_options(config, dim)) for dim in MESH_DIMS]
    dp_group = new_groups(grid.reshape(config.pp, -1).tolist(), timeout=timeout, options=group_options(config))
    counts_group = None
    if config.ep > 1 and DISPATCHERS.lookup(config.dispatcher).exchanges_counts and not config.sync_free:
        counts_group = new_groups(lines["ep"], timeout=timeout, options=group_options(config, "ep"))
    mesh = DeviceMesh.from_group(dims, device_type, mesh=grid.contiguous(), mesh_dim_names=MESH_DIMS)
    pp_rank, edp_rank, ep_rank = mesh.get_coordinate()
    return ParallelLayout(
        config=config,
        pp_rank=pp_rank,
        edp_rank=edp_rank,
        ep_rank=ep_rank,
        pp_group=dims[0],
        dp_group=dp_group,
        edp_group=dims[1],
        ep_group=dims[2],
        mirror_group=_mirror_group(config, grid, timeout),
        embed_group=_embed_group(config, grid, timeout),
        mesh=mesh,
        timeout=timeout,
        counts_group=counts_group,
    )


def embedding_pairs(layout: Layout, mtp_stage: int) -> list[tuple[int, int]]:
    """Per path of ``layout``, (the pipeline rank of its first stage, that of stage ``mtp_stage``, which holds
    the multi-token-prediction modules and a copy of the embedding) where the MTP stage's rank runs no first
    stage: the ranks whose embeddings :attr:`ParallelLayout.embed_group` keeps one parameter. A rank that runs
    a first stage too ties the two (:func:`tie_embeddings`; DualPipe's mirrored copies are then summed as every
    mirrored parameter is), so DualPipe and the V schedules with MTP beside the head need no group."""
    return sorted({(p[0][0], p[mtp_stage][0]) for p in layout.paths if not layout.entries(p[mtp_stage][0])})


def _embed_group(
    config: ParallelConfig, grid: torch.Tensor, timeout: datetime.timedelta | None
) -> dist.ProcessGroup | None:
    """Create every embedding group of ``config``'s layout (collective); return this rank's, if any."""
    rank, mine = dist.get_rank(), None
    for a, b in embedding_pairs(config.stage_layout, config.mtp_stage):
        for ranks in torch.stack([grid[a], grid[b]], dim=-1).reshape(-1, 2).tolist():
            g = dist.new_group(ranks, timeout=timeout, pg_options=with_timeout(group_options(config), timeout))
            if rank in ranks:
                mine = g
    return mine


def _mirror_group(
    config: ParallelConfig, grid: torch.Tensor, timeout: datetime.timedelta | None
) -> dist.ProcessGroup | None:
    """Create every mirror group of ``config``'s layout (collective); return this rank's, if any."""
    rank, mine = dist.get_rank(), None
    opts = with_timeout(group_options(config), timeout)
    for a, b in mirror_pairs(config.stage_layout):
        for ranks in torch.stack([grid[a], grid[b]], dim=-1).reshape(-1, 2).tolist():
            g = dist.new_group(ranks, timeout=timeout, pg_options=opts)
            if rank in ranks:
                mine = g
    return mine


def with_schedule(base: ParallelLayout, schedule: str) -> ParallelLayout:
    """``base``'s groups configured for another schedule (one set of groups, several pipelines: the overlap
    benchmark). Creates the mirror and embedding groups if the new schedule needs them: collective, like
    :func:`init_layout`."""
    config = dataclasses.replace(
        base.config, schedule=schedule, modules_per_rank=None, num_chunks=None, overlap=None, extra_warmup=0
    )
    mirror_group = None
    if config.stage_layout.mirrored:
        mirror_group = base.mirror_group or _mirror_group(
            config, rank_grid(config, dist.get_world_size()), base.timeout
        )
    embed_group = None
    if embedding_pairs(config.stage_layout, config.mtp_stage):
        embed_group = base.embed_group or _embed_group(config, rank_grid(config, dist.get_world_size()), base.timeout)
    return dataclasses.replace(base, config=config, mirror_group=mirror_group, embed_group=embed_group)


def build_stages(
    cfg: MoEConfig,
    layout: ParallelLayout,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    piecewise: bool = True,
    fp8: FP8Recipe | None = None,
    fp8_dispatch: bool = False,
) -> tuple[MoEStage, ...]:
    """The stage modules of this pipeline rank, in local module order, ready for the schedule's pipeline.

    The schedule's layout says which stages they are (``Layout.stage_of``): DualPipeV stages ``pp_rank``
    and ``2*pp - 1 - pp_rank`` of 2*pp; DualPipe stages ``pp_rank`` and ``pp - 1 - pp_rank`` of pp (each
    stage then exists on two ranks; see :func:`reduce_gradients`); 1F1B / ZB1P the single stage
    ``pp_rank`` of pp; interleaved 1F1B stages ``pp_rank + m * pp``.
    Weights come from :meth:`MoEStage.reset_parameters` (``seed``), so they equal :class:`MoEModel`'s.
    ``piecewise=False`` builds plain-graph stages (blocking all-to-all autograd nodes) for baselines that
    schedule an ordinary graph. ``fp8``: the recipe every FP8-capable layer's GEMMs follow
    (:func:`moe.models.layers.use_fp8`); None runs them in ``dtype``. ``fp8_dispatch``: the dispatch-direction
    all-to-alls move FP8 rows with their scales (:mod:`moe.dispatch.fp8`; with ep=1 the same round trip, so one
    process computes what the expert-parallel run does).
    """
    pc = layout.config
    pc.check_model(cfg)
    kind = "local" if pc.ep == 1 else pc.dispatcher
    options = DispatchOptions(
        hidden_size=cfg.hidden_size,
        dtype=dtype,
        comm_sms=pc.comm_sms,
        sync_free=pc.sync_free,
        deterministic=pc.deterministic_dispatch,
        fp8=fp8_dispatch,
        counts_group=layout.counts_group,
    )
    dispatcher = make_dispatcher(kind, cfg.num_experts, layout.ep_group, options)
    plans = pc.stage_plans(cfg)
    stage_layout = pc.stage_layout
    ids = [stage_layout.stage_of(layout.pp_rank, m) for m in range(stage_layout.modules_per_rank)]
    stages = []
    for sid in ids:
        stage = MoEStage(
            cfg,
            plans[sid].layers,
            first=plans[sid].first,
            last=plans[sid].last,
            dispatcher=dispatcher,
            recompute=pc.recompute == "full",
            comm_sms=pc.reserved_sms if torch.device(device).type == "cuda" else 0,
            stage_index=sid,
            piecewise=piecewise,
            mtp_layers=plans[sid].mtp,
        )
        selective_recompute(stage, pc.recompute == "selective")
        use_fp8(stage, fp8)
        stage.reset_parameters(seed)
        stages.append(stage.to(device=device, dtype=dtype))
    tie_embeddings(stages)
    return tuple(stages)


def tie_embeddings(stages: Sequence[MoEStage]) -> None:
    """The stage with multi-token prediction uses the embedding of the first stage on the same rank, and (on a
    stage of its own, ``m|L``) the final norm and head of the last stage on the same rank: one parameter each,
    whose gradient gathers both uses. Where those stages are on another rank, it keeps its own copies,
    initialised alike (by name) and kept equal by :func:`moe.train.grad_sync.reduce_gradients` over
    :attr:`ParallelLayout.embed_group`."""
    first = next((s for s in stages if s.first), None)
    last = next((s for s in stages if s.last), None)
    for stage in stages:
        if stage.mtp_blocks and not stage.first and first is not None:
            stage.embed = first.embed
        if stage.mtp_blocks and not stage.last and last is not None:
            stage.norm, stage.head = last.norm, last.head

"""The pipeline's optimizer: fp32 gradient buffers, fp32 master weights, ZeRO-1 sharding, global clipping.

The update rule is a torch optimizer picked by name from :data:`OPTIMIZERS` (``adamw``, ``sgd``); adding one
is one :class:`OptimizerSpec` registered there: the trainer's ``optimizer.name`` choices, the checkpoint's
state keys and the planner's optimizer-state bytes all read the spec.

Parameters come in :class:`ShardGroup` s, each with the process group its gradient is reduced over and its
optimizer state is sharded over (dense parameters over the data-parallel group, expert parameters over the
expert-data-parallel replicas). One :class:`DistributedOptimizer` serves every configuration the trainer has:

- fp32 model: the gradient buffer ``p.main_grad`` *is* ``p.grad`` and the master weight is the parameter;
  with ``zero=False`` this is exactly the torch optimizer (``torch.optim.AdamW``) over the parameters.
- bf16 model (``master_weights=True``, the default): ``p.main_grad`` is an fp32 buffer that collects every
  micro-batch's gradient (``kernels.functional.accumulate_grad`` adds deferred weight gradients into it; a
  post-accumulate-grad hook moves what autograd accumulates there and frees ``p.grad``); AdamW steps fp32
  masters with fp32 moments, then the masters are copied into the bf16 parameters.
- pure bf16 (``master_weights=False``, only when asked): gradients, moments and weights all in bf16.
- ZeRO-1 (``zero=True``): in each group every parameter has one owner (a size-balanced partition, the same
  on every rank); only the owner holds its master and state and steps it, then each owner broadcasts its
  updated parameters to the group in one flat message per dtype.
- bf16 moments (``state_dtype="bfloat16"``; the DeepSeek-V3 report, section 3.3.3, tracks AdamW's first and
  second moments in BF16): the state tensors the size of a parameter are kept in bf16 between steps while the
  masters stay fp32. torch's optimizers want their state in the parameter's dtype, so each step upcasts a
  bounded bucket of moments to fp32, runs the torch update on that bucket, and rounds the moments back to bf16
  in place: the update rule is torch's, and the fp32 copies live for one bucket only.

Why not torch's own (torch 2.13):

- ``ZeroRedundancyOptimizer`` builds its local optimizer over the model parameters themselves
  (``_init_local_optimizer``) and steps them with ``p.grad``: a bf16 parameter gets bf16 moments and no
  fp32 master, and ``p.grad`` cannot hold an fp32 gradient for a bf16 parameter. It takes one process
  group, where dense and expert parameters shard over different ones. Its checkpoint is
  ``consolidate_state_dict``: the whole state gathered onto one rank, keyed by parameter index, where our
  checkpoints store each rank's shard under global parameter names through DCP and reshard on load.
- FSDP2 (``fully_shard``) reduce-scatters in its post-backward (``FSDPParamGroup.post_backward``, run when
  the module's autograd backward finishes, or by the root's final callback queued on the autograd
  engine): a weight gradient that ``WeightGradStore`` computes later, outside autograd (a zero-bubble
  ``W`` slot, the overlapped runtime's dW), is added after that reduction has read ``.grad`` (with
  ``set_requires_gradient_sync(False)`` on earlier micro-batches, the last one's deferred dW still comes
  too late). It also replaces the parameters with ``Shard(0)`` DTensors all-gathered before each forward
  (ZeRO-3, or ZeRO-2 with ``reshard_after_forward=False``): more traffic than ZeRO-1, and not what the
  stages' raw-tensor kernels take.

What this class does not do: reduce gradients. The caller reduces the buffers of :meth:`grads` over each
group (in buckets) between the backward and :meth:`clip_grad_norm_` / :meth:`step`. A step::

    opt = DistributedOptimizer([ShardGroup(dense, dp_group), ShardGroup(experts, edp_group)], "adamw",
                               lr=lr, zero=True, counts_in_norm=not mirror_duplicate)
    opt.zero_grad()
    pipe.step(...)                              # backward and deferred dW add into every p.main_grad
    for i, sg in enumerate(opt.shard_groups):   # the caller's bucketed reduction, in place
        reduce(opt.grad_buffers(i), sg.group)   # (DualPipe: the mirror sum first)
    norm = opt.clip_grad_norm_(max_norm)        # collective over the world
    opt.step()                                  # collective over each group with zero=True
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from dualpipe.registry import Registry

__all__ = [
    "OPTIMIZERS",
    "STATE_DTYPES",
    "DistributedAdamW",
    "DistributedOptimizer",
    "OptimizerSpec",
    "ShardGroup",
    "grad_of",
    "partition",
    "register_optimizer",
]
# Parameter broadcasts in flight at once: each message is a flat copy of an owner's parameters, so this
# bounds the temporary memory (a large group's messages together are a second copy of its parameters).
_MAX_IN_FLIGHT_BYTES = 256 << 20
# Moments upcast to fp32 at once when they are stored in bf16: bounds the step's temporary memory (all of them
# at once would be the fp32 moments the bf16 storage saves).
_MAX_UPCAST_BYTES = 256 << 20

STATE_DTYPES = ("float32", "bfloat16")
"""Dtypes the optimizer moments of fp32 masters can be stored in (``state_dtype``)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerSpec:
    """One update rule: the torch optimizer that runs it over the masters, and what the rest of the stack
    must know of it (its hyper-parameters, its per-parameter state)."""

    name: str
    """Registry key: the trainer's ``optimizer.name`` (``--optimizer``)."""
    summary: str
    """One line for ``--help``."""
    torch_class: type[torch.optim.Optimizer]
    hyper: tuple[str, ...]
    """Its param-group keys (``lr`` first), the constructor keywords :class:`DistributedOptimizer` takes and
    copies into the inner optimizer before each step (the trainer moves ``lr``)."""
    state: tuple[str, ...]
    """Per-parameter state keys as the torch optimizer names them; checkpoints save them under these."""
    scalar_state: tuple[str, ...] = ()
    """The 0-d entries of ``state`` (a step counter), the rest have the parameter's shape."""

    @property
    def moments(self) -> int:
        """State tensors the size of the parameter (the planner's optimizer-state bytes)."""
        return len(self.state) - len(self.scalar_state)

    def check(self, hyper: dict[str, Any]) -> None:
        """``ValueError`` naming the first out-of-range hyper-parameter (before any rank builds state)."""
        unknown = sorted(set(hyper) - set(self.hyper))
        if unknown:
            raise ValueError(f"optimizer {self.name} takes {', '.join(self.hyper)}; not {', '.join(unknown)}")
        for key in ("lr", "eps", "weight_decay", "momentum"):
            if key in hyper and hyper[key] < 0:
                raise ValueError(f"{key} must be >= 0, got {hyper[key]}")
        if "betas" in hyper and not all(0.0 <= b < 1.0 for b in hyper["betas"]):
            raise ValueError(f"betas must lie in [0, 1), got {tuple(hyper['betas'])}")

    def init_state(self, master: torch.Tensor, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The state the torch optimizer would create on its first step, made up front so that checkpoints can
        load into it and :meth:`DistributedOptimizer.state_bytes` counts it from the start (a zero momentum
        buffer steps exactly as SGD's first-step clone of the gradient does). ``dtype``: of the tensors the size
        of ``master`` (None: the master's)."""
        # torch keeps a non-capturable step on the CPU in the default float dtype's width (_get_scalar_dtype).
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        return {
            k: torch.tensor(0.0, dtype=scalar)
            if k in self.scalar_state
            else torch.zeros_like(master, dtype=dtype, memory_format=torch.preserve_format)
            for k in self.state
        }

    @property
    def moment_keys(self) -> tuple[str, ...]:
        """The state keys of tensors the size of the parameter (AdamW: ``exp_avg``, ``exp_avg_sq``)."""
        return tuple(k for k in self.state if k not in self.scalar_state)


OPTIMIZERS: Registry[OptimizerSpec] = Registry("optimizer")
"""Every update rule by name; :func:`register_optimizer` adds one."""


def register_optimizer(spec: OptimizerSpec) -> OptimizerSpec:
    return OPTIMIZERS.register(spec)


register_optimizer(
    OptimizerSpec(
        name="adamw",
        summary="AdamW (decoupled weight decay), torch's, over fp32 masters",
        torch_class=torch.optim.AdamW,
        hyper=("lr", "betas", "eps", "weight_decay"),
        state=("step", "exp_avg", "exp_avg_sq"),
        scalar_state=("step",),
    )
)
register_optimizer(
    OptimizerSpec(
        name="sgd",
        summary="SGD with momentum (L2 weight decay), torch's, over fp32 masters",
        torch_class=torch.optim.SGD,
        hyper=("lr", "momentum", "weight_decay"),
        state=("momentum_buffer",),
    )
)


def grad_of(p: nn.Parameter) -> torch.Tensor:
    """The tensor holding ``p``'s gradient (fp32 ``main_grad`` under mixed precision), zeros if none yet."""
    main = getattr(p, "main_grad", None)
    if main is not None:
        return main
    if p.grad is None:
        p.grad = torch.zeros_like(p)
    return p.grad


@dataclass(frozen=True, slots=True)
class ShardGroup:
    """Parameters whose gradient is reduced over ``group`` and whose optimizer state is sharded over it."""

    params: list[nn.Parameter]
    """The same parameters (shapes, order) on every rank of ``group``."""
    group: dist.ProcessGroup | None = None
    """None: this rank alone (no replica to share the state with)."""


def partition(numels: Sequence[int], size: int) -> list[int]:
    """Owner (rank in the group, 0..size-1) of each parameter: largest first, each to the least-loaded rank
    (ties to the lower rank, equal sizes in list order). Deterministic, so every rank computes the same."""
    if size < 1:
        raise ValueError(f"group size must be >= 1, got {size}")
    load = [0] * size
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        r = min(range(size), key=lambda r: (load[r], r))
        owners[i] = r
        load[r] += numels[i]
    return owners


@dataclass(slots=True)
class _Slot:
    param: nn.Parameter
    owner: int
    """Rank in the group that steps this parameter (the one that counts it in the gradient norm)."""
    group_index: int
    """Index of its ShardGroup."""
    master: torch.Tensor | None
    """What AdamW steps, on the owner (with ``zero=False``, on every rank): the parameter itself, or its
    separate fp32 copy for a low-precision parameter."""


def _group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _comm_device(group: dist.ProcessGroup | None, params: Sequence[torch.Tensor]) -> torch.device:
    if params:
        return params[0].device
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class DistributedOptimizer:
    """A torch optimizer (:data:`OPTIMIZERS`) over fp32 masters, with fp32 gradient buffers, optional ZeRO-1
    and global clipping.

    groups: the parameters, each :class:`ShardGroup` once; no parameter in two groups. Construction is
    collective over every group (it checks that the group's ranks passed the same shapes).
    optimizer: a name of :data:`OPTIMIZERS` (``adamw``).
    hyper: that optimizer's hyper-parameters (``lr``, ``betas``, ``eps``, ``weight_decay`` for AdamW; torch's
    defaults for those not given). ``param_groups`` holds one dict per ShardGroup with these keys; the
    trainer may set ``g["lr"]`` before each :meth:`step`.
    zero: shard masters and state over each group (ZeRO-1).
    master_weights: fp32 masters, gradient buffers and state for parameters of a lower precision. False
    keeps everything in the parameter's dtype (pure bf16).
    counts_in_norm: False on a rank whose parameters duplicate another rank's (the DualPipe mirror): its
    gradients are left out of :meth:`clip_grad_norm_`'s sum.
    copies: single parameters that duplicate one on another rank (a multi-token-prediction stage's copy of the
    embedding): left out of that sum too.
    state_dtype: a name of :data:`STATE_DTYPES` (or the torch dtype): what the moments of fp32 masters are
    stored in between steps (``bfloat16``: half their bytes, updated in fp32; see the module docstring).
    Masters of a lower precision (pure bf16) keep their moments in their own dtype.
    """

    def __init__(
        self,
        groups: Sequence[ShardGroup],
        optimizer: str = "adamw",
        *,
        zero: bool = False,
        master_weights: bool = True,
        counts_in_norm: bool = True,
        copies: Sequence[nn.Parameter] = (),
        foreach: bool | None = None,
        state_dtype: str | torch.dtype = "float32",
        **hyper: Any,
    ) -> None:
        self.spec = OPTIMIZERS.lookup(optimizer)
        self.spec.check(hyper)  # on every rank: one that owns nothing builds no torch optimizer to object
        self.state_dtype = _state_dtype(state_dtype)
        seen: set[int] = set()
        for g in groups:
            for p in g.params:
                if not isinstance(p, nn.Parameter) or not p.requires_grad:
                    raise ValueError("every parameter must be an nn.Parameter that requires grad")
                if id(p) in seen:
                    raise ValueError("a parameter appears twice in the shard groups")
                if hasattr(p, "main_grad"):
                    raise ValueError("a parameter already has a main_grad (another DistributedOptimizer owns it)")
                if not p.dtype.is_floating_point:
                    raise ValueError(f"parameters must be floating point, got {p.dtype}")
                seen.add(id(p))
        hyper = {**_torch_defaults(self.spec), **hyper}
        self.shard_groups = list(groups)
        self.zero = zero
        self.master_weights = master_weights
        self.counts_in_norm = counts_in_norm
        self._copies = {id(p) for p in copies}
        self.steps = 0
        """Optimizer steps taken (the trainer may set it when it resumes)."""
        self.param_groups = [{"params": list(g.params), **hyper} for g in groups]
        self._slots: dict[int, _Slot] = {}
        self._group_slots: list[list[_Slot]] = []
        self._inner: list[torch.optim.Optimizer | None] = []
        self._grad_buffers: list[list[torch.Tensor]] = []
        self._buckets: list[list[tuple[int, list[torch.Tensor], bool]]] = []
        self._hooks = []
        for g in self.shard_groups:  # all checks before any parameter gets a buffer or a hook
            self._check_same_params(g)
        for g in self.shard_groups:
            self._group_slots.append(self._make_slots(g))
            self._grad_buffers.append(self._make_grad_buffers(g.params))
            owned = [s.master for s in self._group_slots[-1] if s.master is not None]
            inner = None
            if owned:
                inner = self.spec.torch_class(owned, **hyper, foreach=foreach)
                for m in owned:
                    inner.state[m] = self.spec.init_state(m, self._moment_dtype(m))
            self._inner.append(inner)
            self._buckets.append(self._broadcast_buckets(len(self._buckets)) if zero else [])
        for p in self.params():
            self._hooks.append(p.register_post_accumulate_grad_hook(self._move_grad))
        self.zero_grad()

    # construction

    def _check_same_params(self, g: ShardGroup) -> None:
        size, _ = _group_size_rank(g.group)
        if size == 1:
            return
        shapes = [tuple(p.shape) for p in g.params]
        # A fingerprint of the shapes in order: ranks that disagree would partition differently.
        mix = sum((i + 1) * (hash(s) % 1_000_003) for i, s in enumerate(shapes)) % 2_147_483_647
        mine = torch.tensor([len(shapes), sum(p.numel() for p in g.params), mix], dtype=torch.int64)
        mine = mine.to(_comm_device(g.group, g.params))
        every = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(every, mine, group=g.group)
        if any(not torch.equal(e, mine) for e in every):
            ranks = dist.get_process_group_ranks(g.group)
            raise ValueError(f"the ranks {ranks} of a shard group passed different parameters (count or shapes)")

    def _make_slots(self, g: ShardGroup) -> list[_Slot]:
        size, rank = _group_size_rank(g.group)
        owners = partition([p.numel() for p in g.params], size)
        slots = []
        for p, owner in zip(g.params, owners):
            master = None
            if owner == rank or not self.zero:
                separate = self.master_weights and p.dtype != torch.float32
                master = p.detach().float().clone() if separate else p
            slot = _Slot(param=p, owner=owner, group_index=len(self._group_slots), master=master)
            self._slots[id(p)] = slot
            slots.append(slot)
        return slots

    def _moment_dtype(self, master: torch.Tensor) -> torch.dtype:
        """The moments' storage dtype: ``state_dtype`` for an fp32 master, the master's own otherwise."""
        return self.state_dtype if master.dtype == torch.float32 else master.dtype

    def _grad_dtype(self, p: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.master_weights else p.dtype

    def _make_grad_buffers(self, params: Sequence[nn.Parameter]) -> list[torch.Tensor]:
        # One flat buffer per (dtype, device) in parameter order; each main_grad is a view of it, so a caller
        # may reduce a contiguous run of parameters with no copy.
        keys: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
        for p in params:
            keys.setdefault((self._grad_dtype(p), p.device), []).append(p)
        flats = []
        for (dtype, device), ps in keys.items():
            flat = torch.zeros(sum(p.numel() for p in ps), dtype=dtype, device=device)
            offset = 0
            for p in ps:
                p.main_grad = flat[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            flats.append(flat)
        return flats

    # gradients

    def _aliased(self, p: nn.Parameter) -> bool:
        """``p.grad`` is the buffer itself (same dtype): autograd accumulates into it in place."""
        return p.main_grad.dtype == p.dtype

    @torch.no_grad()
    def _move_grad(self, p: nn.Parameter) -> None:
        # After autograd accumulated into p.grad: add it to the buffer unless it already is the buffer.
        g = p.grad
        if g is None or g is p.main_grad:
            return
        p.main_grad.add_(g)
        p.grad = p.main_grad if self._aliased(p) else None

    def params(self) -> Iterator[nn.Parameter]:
        for g in self.shard_groups:
            yield from g.params

    def grads(self, group_index: int | None = None) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, its gradient buffer ``main_grad``: fp32 unless pure bf16, the parameter's shape), for
        every parameter or those of ``shard_groups[group_index]``. Reduce and scale them in place."""
        groups = self.shard_groups if group_index is None else [self.shard_groups[group_index]]
        for g in groups:
            for p in g.params:
                yield p, p.main_grad

    def grad_buffers(self, group_index: int) -> list[torch.Tensor]:
        """The flat buffers the ``main_grad`` s of ``shard_groups[group_index]`` are views of (one per dtype and
        device, parameters in order): a bucket of consecutive parameters is a slice of one."""
        return list(self._grad_buffers[group_index])

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Zero the gradient buffers (kept allocated: the reduction and the next step reuse them).
        ``set_to_none`` is accepted for torch.optim compatibility and changes nothing."""
        del set_to_none
        for flats in self._grad_buffers:
            for flat in flats:
                flat.zero_()
        for p in self.params():
            p.grad = p.main_grad if self._aliased(p) else None

    # step

    def _owned(self, group_index: int) -> list[_Slot]:
        return [s for s in self._group_slots[group_index] if s.master is not None]

    @torch.no_grad()
    def step(self) -> None:
        """One optimizer step on the masters this rank holds, then masters -> parameters, then (ZeRO) every owner
        broadcasts its parameters to its group."""
        for gi, inner in enumerate(self._inner):
            if inner is not None:
                hyper = self.param_groups[gi]
                for key in self.spec.hyper:
                    inner.param_groups[0][key] = hyper[key]
                slots = self._owned(gi)
                for bucket in self._step_buckets(slots):
                    chosen = {id(s) for s in bucket}
                    for s in slots:  # torch steps the masters that have a gradient: this bucket's
                        s.master.grad = s.param.main_grad if id(s) in chosen else None  # type: ignore[union-attr]
                    self._step_bucket(inner, bucket)
                for s in slots:
                    s.master.grad = s.param.main_grad  # type: ignore[union-attr]
                separate = [s for s in slots if s.master is not s.param]
                if separate:  # masters -> parameters (rounded to their dtype), one grouped copy
                    torch._foreach_copy_([s.param for s in separate], [s.master for s in separate])
                    for s in separate:
                        s.master.grad = None  # type: ignore[union-attr]
            if self.zero:
                self._broadcast(gi)
        self.steps += 1

    def _step_buckets(self, slots: list[_Slot]) -> list[list[_Slot]]:
        """``[slots]`` when every moment is in its master's dtype (one torch step); else consecutive buckets whose
        fp32 moments take at most ``_MAX_UPCAST_BYTES`` (each parameter in one bucket)."""
        if all(self._moment_dtype(s.master) == s.master.dtype for s in slots):  # type: ignore[union-attr]
            return [slots]
        per_elem = len(self.spec.moment_keys) * 4
        buckets: list[list[_Slot]] = [[]]
        size = 0
        for s in slots:
            nbytes = s.master.numel() * per_elem  # type: ignore[union-attr]
            if buckets[-1] and size + nbytes > _MAX_UPCAST_BYTES:
                buckets.append([])
                size = 0
            buckets[-1].append(s)
            size += nbytes
        return buckets

    def _step_bucket(self, inner: torch.optim.Optimizer, bucket: list[_Slot]) -> None:
        """One torch step over ``bucket``'s masters; moments stored in a lower precision are upcast to the master's
        dtype around it and rounded back into the same tensors (checkpoints hold those)."""
        stored: list[torch.Tensor] = []
        states: list[tuple[dict[str, Any], str]] = []
        for s in bucket:
            state = inner.state[s.master]
            for k in self.spec.moment_keys:
                if state[k].dtype != s.master.dtype:  # type: ignore[union-attr]
                    stored.append(state[k])
                    states.append((state, k))
                    state[k] = state[k].to(s.master.dtype)  # type: ignore[union-attr]
        try:
            inner.step()
        finally:
            if stored:
                torch._foreach_copy_(stored, [state[k] for state, k in states])
                for (state, k), t in zip(states, stored):
                    state[k] = t

    def _broadcast_buckets(self, group_index: int) -> list[tuple[int, list[torch.Tensor], bool]]:
        """(global source rank, the parameters it owns of one dtype, whether it is this rank) per message."""
        g = self.shard_groups[group_index]
        size, rank = _group_size_rank(g.group)
        buckets = []
        for owner in range(size if size > 1 else 0):
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for s in self._group_slots[group_index]:
                if s.owner == owner:
                    by_dtype.setdefault(s.param.dtype, []).append(s.param.data)
            src = dist.get_global_rank(g.group, owner)
            buckets += [(src, tensors, owner == rank) for tensors in by_dtype.values()]
        return buckets

    def _broadcast(self, group_index: int) -> None:
        group = self.shard_groups[group_index].group
        pending: list[tuple[dist.Work, torch.Tensor, list[torch.Tensor], bool]] = []
        in_flight = 0

        def drain() -> None:
            for work, flat, tensors, mine in pending:
                work.wait()
                if not mine:
                    for t, new in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
                        t.copy_(new)
            pending.clear()

        for src, tensors, mine in self._buckets[group_index]:
            if mine:
                flat = _flatten_dense_tensors(tensors)
            else:
                n = sum(t.numel() for t in tensors)
                flat = torch.empty(n, dtype=tensors[0].dtype, device=tensors[0].device)
            pending.append((dist.broadcast(flat, src=src, group=group, async_op=True), flat, tensors, mine))
            in_flight += flat.numel() * flat.element_size()
            if in_flight > _MAX_IN_FLIGHT_BYTES:
                drain()
                in_flight = 0
        drain()

    # clipping

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every gradient buffer so the global L2 norm is at most ``max_norm``; return the norm before.

        The norm counts each parameter once in the world: its owner in its group counts it, a rank with
        ``counts_in_norm=False`` counts nothing, ``copies`` are not counted; one all-reduce over the default
        group. Call it after the gradients are reduced and before :meth:`step`. Same coefficient as
        torch.nn.utils.clip_grad_norm_: ``min(1, max_norm / (norm + 1e-6))``.
        """
        if max_norm <= 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        counted = []
        if self.counts_in_norm:
            for gi, g in enumerate(self.shard_groups):
                _, rank = _group_size_rank(g.group)
                slots = self._group_slots[gi]
                counted += [s.param.main_grad for s in slots if s.owner == rank and id(s.param) not in self._copies]
        all_grads = [p.main_grad for p in self.params()]
        device = all_grads[0].device if all_grads else _comm_device(None, [])
        # fp64 for the sum of squares: the partial sums of many ranks must add up without losing digits.
        sq = torch.zeros((), dtype=torch.float64, device=device)
        if counted:
            norms = torch._foreach_norm(counted, 2, dtype=torch.float32)  # fp32 even for pure-bf16 buffers
            sq = torch.stack([n.to(device=device, dtype=torch.float64) for n in norms]).pow(2).sum()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sq)
        total = sq.sqrt().float()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        by_device: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in all_grads:
            by_device.setdefault((t.device, t.dtype), []).append(t)
        for (dev, _), ts in by_device.items():
            torch._foreach_mul_(ts, coef.to(dev))
        return total.item()

    # state, for checkpoints and metrics

    def _slot(self, p: nn.Parameter) -> _Slot:
        slot = self._slots.get(id(p))
        if slot is None or slot.param is not p:
            raise KeyError("parameter is not managed by this optimizer")
        return slot

    def owns(self, p: nn.Parameter) -> bool:
        """This rank holds ``p``'s optimizer state (always, with ``zero=False``)."""
        return self._slot(p).master is not None

    def state_for(self, p: nn.Parameter) -> dict[str, torch.Tensor] | None:
        """``p``'s optimizer state (the live tensors, so a checkpoint loader may fill them in place), keyed by
        :attr:`OptimizerSpec.state` (AdamW: ``step`` 0-d fp32, ``exp_avg`` and ``exp_avg_sq`` of ``p``'s shape,
        in ``state_dtype``, or bf16 under pure bf16). None if another rank of its group owns ``p``."""
        slot = self._slot(p)
        if slot.master is None:
            return None
        inner = self._inner[slot.group_index]
        assert inner is not None  # a group with a master on this rank has an AdamW
        state = inner.state[slot.master]
        return {k: state[k] for k in self.spec.state}

    @torch.no_grad()
    def load_state_for(self, p: nn.Parameter, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` (keys of :meth:`state_for`, ``p``'s shape) into ``p``'s optimizer state on its owner."""
        live = self.state_for(p)
        if live is None:
            raise ValueError("this rank does not own the parameter; load its state on the owner (see owns)")
        missing = [k for k in self.spec.state if k not in state]
        if missing:
            raise ValueError(f"optimizer state lacks {missing}")
        for k in self.spec.state:
            if state[k].shape != live[k].shape:
                raise ValueError(f"state {k!r} has shape {tuple(state[k].shape)}, expected {tuple(live[k].shape)}")
            live[k].copy_(state[k])

    def master_for(self, p: nn.Parameter) -> torch.Tensor | None:
        """The fp32 weight the optimizer steps for ``p`` (``p`` itself when it is fp32 or without masters), None if
        another rank owns ``p``. Checkpoints save it as the weight."""
        return self._slot(p).master

    @torch.no_grad()
    def load_weight_(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Set ``p`` (cast to its dtype) and its master, if this rank holds one, from ``value`` (fp32 from a
        checkpoint), so the master keeps the digits the bf16 parameter cannot."""
        slot = self._slot(p)
        if value.shape != p.shape:
            raise ValueError(f"weight has shape {tuple(value.shape)}, expected {tuple(p.shape)}")
        p.copy_(value)
        if slot.master is not None and slot.master is not p:
            slot.master.copy_(value)

    def grad_bytes(self) -> int:
        """Bytes of this rank's gradient buffers (every parameter's ``main_grad``: ZeRO-1 does not shard them)."""
        return sum(flat.numel() * flat.element_size() for flats in self._grad_buffers for flat in flats)

    def state_bytes(self) -> int:
        """Optimizer-state bytes on this rank: the state tensors of the parameters' size (AdamW's two moments)
        plus masters where separate from the parameters (the 0-d step counters are left out)."""
        total = 0
        for gi, inner in enumerate(self._inner):
            if inner is None:
                continue
            for s in self._owned(gi):
                state = inner.state[s.master]
                sized = (k for k in self.spec.state if k not in self.spec.scalar_state)
                total += sum(state[k].numel() * state[k].element_size() for k in sized)
                if s.master is not s.param:
                    total += s.master.numel() * s.master.element_size()  # type: ignore[union-attr]
        return total


def _state_dtype(value: str | torch.dtype) -> torch.dtype:
    name = str(value).removeprefix("torch.")
    if name not in STATE_DTYPES:
        raise ValueError(f"state_dtype {value!r} is not one of {', '.join(STATE_DTYPES)}")
    return getattr(torch, name)


def _torch_defaults(spec: OptimizerSpec) -> dict[str, Any]:
    """The torch optimizer's own defaults for the hyper-parameters the spec names."""
    params = inspect.signature(spec.torch_class.__init__).parameters
    return {k: params[k].default for k in spec.hyper if params[k].default is not inspect.Parameter.empty}


DistributedAdamW = DistributedOptimizer
"""The name from before the registry: ``optimizer`` defaults to ``"adamw"``."""

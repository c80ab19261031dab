"""The pipeline's optimizer: fp32 gradient buffers, fp32 master weights, ZeRO-1 sharding, global clipping.

The update rule is a torch optimizer picked by name from :data:`moe.optim_state.OPTIMIZERS` (``adamw``,
``sgd``); adding one is one :class:`OptimizerSpec` registered there: the trainer's ``optimizer.name`` choices,
the checkpoint's state keys and the planner's optimizer-state bytes all read the spec.

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
- ZeRO-1 (``zero=True``): in each group every rank holds the masters and state of its rows of EVERY parameter,
  split along dim 0 by :func:`shard_rows` (torch.chunk's rule: chunks of ``ceil(rows / size)``, the last ones
  short or empty), and steps them with the same rows of ``p.main_grad`` (the gradients stay whole: the caller
  all-reduces them). AdamW and SGD are elementwise, so the shards step exactly as the whole parameters would.
  Then one all-gather per bucket of parameters of one dtype (each rank's rows, padded to a whole chunk) rebuilds
  every parameter on every rank. A tensor that stacks checkpoint entries (expert weights ``[E_local, ...]``,
  saved one expert per key: ``ShardGroup(stacked=True)``) is split along each entry's dim 0, the tensor's dim 1,
  so a rank holds part of every expert and a checkpoint stores each key's chunks as DTensor ``Shard(0)``. The
  worst rank holds about ``1 / size`` of each tensor's state, not a whole embedding.
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
  stages' raw-tensor kernels take. Its split is the one used here: ``FSDPParam`` chunks each parameter along
  dim 0 with ``torch.chunk`` (``_chunk_with_empty``: empty chunks for the last ranks) and pads every chunk to
  the first one's size for the all-gather; DTensor's ``Shard(0)`` (``Shard.local_shard_size_and_offset``) and
  so DCP's chunk metadata follow the same rule.

What this class does not do: reduce gradients. The caller reduces the buffers of :meth:`grads` over each
group (in buckets) between the backward and :meth:`clip_grad_norm_` / :meth:`step`. A step::

    opt = DistributedOptimizer([ShardGroup(dense, dp_group), ShardGroup(experts, edp_group, stacked=True)], "adamw",
                               lr=lr, zero=True, counts_in_norm=not mirror_duplicate)
    opt.zero_grad()
    pipe.step(...)                              # backward and deferred dW add into every p.main_grad
    for i, sg in enumerate(opt.shard_groups):   # the caller's bucketed reduction, in place
        reduce(opt.grad_buffers(i), sg.group)   # (DualPipe: the mirror sum first)
    norm = opt.clip_grad_norm_(max_norm)        # collective over the world
    opt.step()                                  # all-gathers over each group with zero=True
"""

from __future__ import annotations

import inspect
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from moe.optim_state import OPTIMIZERS, STATE_DTYPES, OptimizerSpec, register_optimizer, shard_rows, state_dtype_of

__all__ = [
    "OPTIMIZERS",
    "STATE_DTYPES",
    "DistributedAdamW",
    "DistributedOptimizer",
    "OptimizerSpec",
    "ParamShard",
    "ShardGroup",
    "grad_of",
    "register_optimizer",
    "shard_rows",
]
# ZeRO-1's all-gather outputs alive at once: each is a flat copy of the group's rows of some parameters (a
# large chunk is cut into windows of rows), so this bounds the step's temporary memory, which would otherwise be
# a second copy of the parameters.
_MAX_IN_FLIGHT_BYTES = 256 << 20
# Moments upcast to fp32 at once when they are stored in bf16: bounds the step's temporary memory (all of them
# at once would be the fp32 moments the bf16 storage saves).
_MAX_UPCAST_BYTES = 256 << 20


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
    stacked: bool = False
    """Each parameter stacks checkpoint entries along dim 0 (expert weights ``[E_local, ...]``, saved one expert
    per key, :func:`moe.train.checkpoint.checkpoint_entries`): ZeRO-1 splits every entry along its own dim 0, the
    tensor's dim 1, so each rank holds part of every expert."""


@dataclass(frozen=True, slots=True)
class ParamShard:
    """The rows of a parameter whose master and optimizer state this rank holds: ``[start, stop)`` along ``dim``."""

    dim: int
    """0, or 1 for a stacked group's tensor (each checkpoint entry's dim 0)."""
    start: int
    stop: int
    rows: int
    """The parameter's size along ``dim``."""
    group: dist.ProcessGroup | None
    """The group the rows are split over (None when they are not)."""
    size: int
    """Ranks the rows are split over: 1 without ZeRO-1 or without replicas (this rank holds them all)."""

    @property
    def sharded(self) -> bool:
        return self.size > 1


@dataclass(slots=True)
class _Slot:
    param: nn.Parameter
    group_index: int
    shard: ParamShard
    """What this rank's master and state cover (every row without ZeRO-1)."""
    counted: tuple[int, int]
    """The rows whose gradient this rank counts in the norm (:func:`shard_rows` of its group, ZeRO-1 or not)."""
    view: torch.Tensor
    """This rank's rows of the parameter (the parameter itself when they are all of it)."""
    master: torch.Tensor
    """What the torch optimizer steps: ``view`` (fp32, or without masters) or its fp32 copy."""


@dataclass(frozen=True, slots=True)
class _Window:
    """Rows ``[lo, hi)`` of every rank's chunk of one parameter, at ``offset`` elements into each rank's part of
    a gather."""

    slot: _Slot
    lo: int
    hi: int
    offset: int


@dataclass(slots=True)
class _Gather:
    """One all-gather: each rank contributes ``numel`` elements, its rows of every window padded to whole ones."""

    dtype: torch.dtype
    device: torch.device
    windows: list[_Window]
    numel: int = 0


def _group_size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_gather_single(out: torch.Tensor, mine: torch.Tensor, group: dist.ProcessGroup) -> dist.Work:
    """Post the all-gather of every rank's ``mine`` into ``out`` (``[size * numel]``, rank order); async.

    torch 2.13 renamed ``all_gather_into_tensor`` to ``all_gather_single`` and the old name warns from then on;
    the floor (pyproject.toml) has only the old one, so the name is looked up per call.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, mine, group=group, async_op=True)


def _comm_device(group: dist.ProcessGroup | None, params: Sequence[torch.Tensor]) -> torch.device:
    if params:
        return params[0].device
    if torch.cuda.is_available() and "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _rows_view(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` as ``[entries, rows, row elements]`` (entries: 1, or the stacked dim 0), a view."""
    shape = (1, *t.shape) if dim == 0 else tuple(t.shape)
    return t.view(shape[0], shape[1], -1)


class DistributedOptimizer:
    """A torch optimizer (:data:`OPTIMIZERS`) over fp32 masters, with fp32 gradient buffers, optional ZeRO-1
    and global clipping.

    groups: the parameters, each :class:`ShardGroup` once; no parameter in two groups. Construction is
    collective over every group (it checks that the group's ranks passed the same shapes).
    optimizer: a name of :data:`OPTIMIZERS` (``adamw``).
    hyper: that optimizer's hyper-parameters (``lr``, ``betas``, ``eps``, ``weight_decay`` for AdamW; torch's
    defaults for those not given). ``param_groups`` holds one dict per ShardGroup with these keys; the
    trainer may set ``g["lr"]`` before each :meth:`step`.
    zero: shard masters and state over each group (ZeRO-1): each rank holds :func:`shard_rows` of every
    parameter (:meth:`shard_of`).
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
        self.spec.check(hyper)  # on every rank before any state is built
        self.state_dtype = state_dtype_of(state_dtype)
        seen: set[int] = set()
        for g in groups:
            split = zero and _group_size_rank(g.group)[0] > 1
            for p in g.params:
                if not isinstance(p, nn.Parameter) or not p.requires_grad:
                    raise ValueError("every parameter must be an nn.Parameter that requires grad")
                if id(p) in seen:
                    raise ValueError("a parameter appears twice in the shard groups")
                if hasattr(p, "main_grad"):
                    raise ValueError("a parameter already has a main_grad (another DistributedOptimizer owns it)")
                if not p.dtype.is_floating_point:
                    raise ValueError(f"parameters must be floating point, got {p.dtype}")
                if g.stacked and p.dim() < 2:
                    raise ValueError(f"a stacked group's parameters are [entries, rows, ...], got {tuple(p.shape)}")
                if split and p.dim() == 0:
                    raise ValueError("ZeRO-1 splits parameters along dim 0: a 0-d parameter has none")
                if split and not p.is_contiguous():
                    raise ValueError(
                        f"ZeRO-1 gathers whole rows: parameter of shape {tuple(p.shape)} is not contiguous"
                    )
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
        self._gathers: list[list[_Gather]] = []
        self._hooks = []
        for g in self.shard_groups:  # all checks before any parameter gets a buffer or a hook
            self._check_same_params(g)
        for g in self.shard_groups:
            slots = self._make_slots(g)
            self._group_slots.append(slots)
            self._grad_buffers.append(self._make_grad_buffers(g.params))
            inner = None
            if slots:  # every rank has a master per parameter, empty where its rows are (torch steps those too)
                inner = self.spec.torch_class([s.master for s in slots], **hyper, foreach=foreach)
                for s in slots:
                    inner.state[s.master] = self.spec.init_state(s.master, self._moment_dtype(s.master))
            self._inner.append(inner)
            self._gathers.append(self._plan_gathers(g, slots) if zero else [])
        for p in self.params():
            self._hooks.append(p.register_post_accumulate_grad_hook(self._move_grad))
        self.zero_grad()

    # construction

    def _check_same_params(self, g: ShardGroup) -> None:
        size, _ = _group_size_rank(g.group)
        if size == 1:
            return
        shapes = [tuple(p.shape) for p in g.params]
        # A fingerprint of the shapes in order: ranks that disagree would split differently.
        mix = sum((i + 1) * (hash(s) % 1_000_003) for i, s in enumerate(shapes)) % 2_147_483_647
        mine = torch.tensor([len(shapes), sum(p.numel() for p in g.params), mix, g.stacked], dtype=torch.int64)
        mine = mine.to(_comm_device(g.group, g.params))
        every = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(every, mine, group=g.group)
        if any(not torch.equal(e, mine) for e in every):
            ranks = dist.get_process_group_ranks(g.group)
            raise ValueError(f"the ranks {ranks} of a shard group passed different parameters (count or shapes)")

    def _make_slots(self, g: ShardGroup) -> list[_Slot]:
        size, rank = _group_size_rank(g.group)
        dim = int(g.stacked)
        slots = []
        for p in g.params:
            rows = p.shape[dim] if p.dim() else 1  # a 0-d parameter (only where it is not split): one row
            counted = shard_rows(rows, size, rank)
            start, stop = counted if self.zero else (0, rows)
            shard = ParamShard(
                dim, start, stop, rows, g.group if self.zero and size > 1 else None, size if self.zero else 1
            )
            view = p if (start, stop) == (0, rows) else p.detach().narrow(dim, start, stop - start)
            separate = self.master_weights and p.dtype != torch.float32
            master = view.detach().float().clone() if separate else view
            slot = _Slot(p, len(self._group_slots), shard, counted, view, master)
            self._slots[id(p)] = slot
            slots.append(slot)
        return slots

    def _plan_gathers(self, g: ShardGroup, slots: list[_Slot]) -> list[_Gather]:
        """The all-gathers that rebuild the group's parameters after a ZeRO-1 step: per dtype, windows of rows
        packed into gathers of at most half ``_MAX_IN_FLIGHT_BYTES`` (a larger chunk is cut into windows of rows),
        so that two in flight bound the temporary memory."""
        size, _ = _group_size_rank(g.group)
        if size == 1:
            return []
        limit = _MAX_IN_FLIGHT_BYTES // 2
        gathers: dict[tuple[torch.dtype, torch.device], list[_Gather]] = {}
        for s in slots:
            p = s.param
            if p.numel() == 0:
                continue
            entries, rows, per_row = _rows_view(p.detach(), s.shard.dim).shape
            chunk = -(-rows // size)
            row_bytes = size * entries * per_row * p.element_size()  # one row of every rank's chunk, gathered
            step = max(1, limit // row_bytes)
            bucket = gathers.setdefault((p.dtype, p.device), [])
            for lo in range(0, chunk, step):
                hi = min(chunk, lo + step)
                numel = entries * (hi - lo) * per_row
                if not bucket or (bucket[-1].windows and (bucket[-1].numel + numel) * size * p.element_size() > limit):
                    bucket.append(_Gather(p.dtype, p.device, []))
                bucket[-1].windows.append(_Window(s, lo, hi, bucket[-1].numel))
                bucket[-1].numel += numel
        return [b for bs in gathers.values() for b in bs]

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

    @staticmethod
    def _grad_rows(s: _Slot, rows: tuple[int, int]) -> torch.Tensor:
        """Rows ``[start, stop)`` of ``s``'s gradient buffer along its split dimension (a view)."""
        start, stop = rows
        if (start, stop) == (0, s.shard.rows):
            return s.param.main_grad
        return s.param.main_grad.narrow(s.shard.dim, start, stop - start)

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

    @torch.no_grad()
    def step(self) -> None:
        """One optimizer step on the masters this rank holds (its rows of every parameter under ZeRO-1), then
        masters -> parameters, then (ZeRO-1) all-gathers that give every rank every parameter's new rows."""
        for gi, inner in enumerate(self._inner):
            if inner is None:
                continue
            hyper = self.param_groups[gi]
            for key in self.spec.hyper:
                inner.param_groups[0][key] = hyper[key]
            slots = self._group_slots[gi]
            for bucket in self._step_buckets(slots):
                chosen = {id(s) for s in bucket}
                for s in slots:  # torch steps the masters that have a gradient: this bucket's
                    s.master.grad = self._grad_rows(s, (s.shard.start, s.shard.stop)) if id(s) in chosen else None
                self._step_bucket(inner, bucket)
            separate = [s for s in slots if s.master is not s.view]
            if separate:  # masters -> parameter rows (rounded to their dtype), one grouped copy
                torch._foreach_copy_([s.view for s in separate], [s.master for s in separate])
            for s in slots:  # a master that is the parameter keeps the buffer as its .grad (zero_grad's alias)
                s.master.grad = s.param.main_grad if s.master is s.param else None
            self._all_gather(gi)
        self.steps += 1

    @torch.no_grad()
    def gather_params(self) -> None:
        """Collective: every rank's rows of every parameter onto every rank (ZeRO-1's all-gathers, as after
        :meth:`step`; nothing without ZeRO-1), for a caller that wrote its rows of the parameters (the moving
        average of the weights, :meth:`moe.train.ema.HostEMA.applied`)."""
        for gi in range(len(self.shard_groups)):
            self._all_gather(gi)

    def _step_buckets(self, slots: list[_Slot]) -> list[list[_Slot]]:
        """``[slots]`` when every moment is in its master's dtype (one torch step); else consecutive buckets whose
        fp32 moments take at most ``_MAX_UPCAST_BYTES`` (each master in one bucket)."""
        if all(self._moment_dtype(s.master) == s.master.dtype for s in slots):
            return [slots]
        per_elem = len(self.spec.moment_keys) * 4
        buckets: list[list[_Slot]] = [[]]
        size = 0
        for s in slots:
            nbytes = s.master.numel() * per_elem
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
                if state[k].dtype != s.master.dtype:
                    stored.append(state[k])
                    states.append((state, k))
                    state[k] = state[k].to(s.master.dtype)
        try:
            inner.step()
        finally:
            if stored:
                torch._foreach_copy_(stored, [state[k] for state, k in states])
                for (state, k), t in zip(states, stored):
                    state[k] = t

    def _all_gather(self, group_index: int) -> None:
        """Every rank's new rows of the group's parameters onto every rank: one all-gather into a tensor per
        :class:`_Gather`, each rank's part of the output being its own input (in place). Gathers stay in flight
        while their outputs take at most ``_MAX_IN_FLIGHT_BYTES`` (each is at most half of it, so the next one is
        posted before the last is unpacked); the oldest is unpacked to make room."""
        group = self.shard_groups[group_index].group
        size, rank = _group_size_rank(group)
        pending: deque[tuple[dist.Work, torch.Tensor, _Gather]] = deque()
        in_flight = 0
        for gather in self._gathers[group_index]:
            nbytes = size * gather.numel * gather.dtype.itemsize
            while pending and in_flight + nbytes > _MAX_IN_FLIGHT_BYTES:
                in_flight -= _finish(*pending.popleft(), size)
            out = torch.empty(size * gather.numel, dtype=gather.dtype, device=gather.device)
            mine = out[rank * gather.numel : (rank + 1) * gather.numel]
            for w in gather.windows:
                _pack(w, mine)
            pending.append((_all_gather_single(out, mine, group), out, gather))
            in_flight += nbytes
        while pending:
            _finish(*pending.popleft(), size)

    # clipping

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> float:
        """Scale every gradient buffer so the global L2 norm is at most ``max_norm``; return the norm before.

        The norm counts each gradient element once in the world: in each group a rank counts its
        :func:`shard_rows` of every parameter (ZeRO-1 or not; the gradients are the same on every rank of the
        group once reduced), a rank with ``counts_in_norm=False`` counts nothing, ``copies`` are not counted;
        one all-reduce over the default group. Call it after the gradients are reduced and before
        :meth:`step`. Same coefficient as torch.nn.utils.clip_grad_norm_: ``min(1, max_norm / (norm + 1e-6))``.
        """
        if max_norm <= 0:
            raise ValueError(f"max_norm must be > 0, got {max_norm}")
        counted = []
        if self.counts_in_norm:
            for s in self._slots.values():
                if id(s.param) not in self._copies and s.counted[1] > s.counted[0]:
                    counted.append(self._grad_rows(s, s.counted))
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

    def shard_of(self, p: nn.Parameter) -> ParamShard:
        """Which rows of ``p`` this rank's master and state (:meth:`master_for`, :meth:`state_for`) hold: every
        row without ZeRO-1, :func:`shard_rows` of its group with it (possibly none)."""
        return self._slot(p).shard

    def owns(self, p: nn.Parameter) -> bool:
        """This rank holds some of ``p``'s optimizer state: always without ZeRO-1; with it, whether its rows of
        ``p`` are not empty (the last ranks of a group hold none of a tensor with fewer rows than ranks)."""
        shard = self._slot(p).shard
        return shard.stop > shard.start

    def state_for(self, p: nn.Parameter) -> dict[str, torch.Tensor]:
        """``p``'s optimizer state on this rank (the live tensors, so a checkpoint loader may fill them in place),
        keyed by :attr:`OptimizerSpec.state` (AdamW: ``step`` 0-d fp32, ``exp_avg`` and ``exp_avg_sq`` in
        ``state_dtype``, or bf16 under pure bf16): tensors of the shape of this rank's rows of ``p``
        (:meth:`shard_of`; ``p``'s shape without ZeRO-1, possibly empty with it)."""
        slot = self._slot(p)
        inner = self._inner[slot.group_index]
        assert inner is not None  # a group with a parameter has a torch optimizer
        state = inner.state[slot.master]
        return {k: state[k] for k in self.spec.state}

    @torch.no_grad()
    def load_state_for(self, p: nn.Parameter, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` (keys of :meth:`state_for`) into this rank's state of ``p``: tensors of ``p``'s shape
        (this rank's rows are taken) or already of this rank's rows."""
        live = self.state_for(p)
        missing = [k for k in self.spec.state if k not in state]
        if missing:
            raise ValueError(f"optimizer state lacks {missing}")
        for k in self.spec.state:
            live[k].copy_(self._rows_of(p, state[k], live[k].shape, f"state {k!r}"))

    def master_for(self, p: nn.Parameter) -> torch.Tensor:
        """The weight the optimizer steps for this rank's rows of ``p`` (:meth:`shard_of`): fp32 for a parameter of a
        lower precision, else ``p`` itself or a view of its rows. Checkpoints save it as the weight."""
        return self._slot(p).master

    @torch.no_grad()
    def load_weight_(self, p: nn.Parameter, value: torch.Tensor) -> None:
        """Set ``p`` (cast to its dtype) and this rank's master rows from ``value`` (``p``'s shape, fp32 from a
        checkpoint), so the master keeps the digits the bf16 parameter cannot."""
        slot = self._slot(p)
        if value.shape != p.shape:
            raise ValueError(f"weight has shape {tuple(value.shape)}, expected {tuple(p.shape)}")
        p.copy_(value)
        if slot.master is not slot.view:
            slot.master.copy_(self._rows_of(p, value, slot.master.shape, "weight"))

    def _rows_of(self, p: nn.Parameter, t: torch.Tensor, want: torch.Size, what: str) -> torch.Tensor:
        """``t`` if it has this rank's shape ``want``, its rows of ``p`` if it has ``p``'s shape; else an error."""
        if t.shape == want:
            return t
        shard = self._slot(p).shard
        if t.shape == p.shape and t.dim() > shard.dim:
            return t.narrow(shard.dim, shard.start, shard.stop - shard.start)
        raise ValueError(f"{what} has shape {tuple(t.shape)}, expected {tuple(want)} (or {tuple(p.shape)})")

    def grad_bytes(self) -> int:
        """Bytes of this rank's gradient buffers (every parameter's ``main_grad``: ZeRO-1 does not shard them)."""
        return sum(flat.numel() * flat.element_size() for flats in self._grad_buffers for flat in flats)

    def state_bytes(self) -> int:
        """Optimizer-state bytes on this rank: the state tensors of its rows' size (AdamW's two moments) plus
        masters where separate from the parameters (the 0-d step counters are left out)."""
        total = 0
        for s in self._slots.values():
            state = self.state_for(s.param)
            total += sum(state[k].numel() * state[k].element_size() for k in self.spec.moment_keys)
            if s.master is not s.view:
                total += s.master.numel() * s.master.element_size()
        return total


def _pack(w: _Window, mine: torch.Tensor) -> None:
    """This rank's rows of window ``w`` into its part of a gather (rows it does not have are left as they are)."""
    s = w.slot
    start, stop = s.shard.start, s.shard.stop
    n = max(0, min(stop, start + w.hi) - (start + w.lo))
    if n:
        rows = _rows_view(s.param.detach(), s.shard.dim)
        entries, _, per_row = rows.shape
        dst = mine[w.offset : w.offset + entries * (w.hi - w.lo) * per_row].view(entries, w.hi - w.lo, per_row)
        dst[:, :n].copy_(rows[:, start + w.lo : start + w.lo + n])


def _finish(work: dist.Work, out: torch.Tensor, gather: _Gather, size: int) -> int:
    """Wait for one gather and copy every rank's rows into the parameters; returns the output's bytes."""
    work.wait()
    parts = out.view(size, gather.numel)
    for w in gather.windows:
        rows = _rows_view(w.slot.param.detach(), w.slot.shard.dim)
        entries, n_rows, per_row = rows.shape
        chunk = -(-n_rows // size)
        width = w.hi - w.lo
        src = parts[:, w.offset : w.offset + entries * width * per_row].view(size, entries, width, per_row)
        full = min(size, n_rows // chunk)  # ranks holding a whole chunk: one strided copy for all of them
        if full:
            rows[:, : full * chunk].view(entries, full, chunk, per_row)[:, :, w.lo : w.hi].copy_(
                src[:full].transpose(0, 1)
            )
        if full < size:  # the rank with a short chunk (those after it hold nothing)
            n = min(w.hi, n_rows - full * chunk) - w.lo
            if n > 0:
                at = full * chunk + w.lo
                rows[:, at : at + n].copy_(src[full, :, :n])
    return out.numel() * out.element_size()


def _torch_defaults(spec: OptimizerSpec) -> dict[str, Any]:
    """The torch optimizer's own defaults for the hyper-parameters the spec names."""
    params = inspect.signature(spec.torch_class.__init__).parameters
    return {k: params[k].default for k in spec.hyper if params[k].default is not inspect.Parameter.empty}


DistributedAdamW = DistributedOptimizer
"""The name from before the registry: ``optimizer`` defaults to ``"adamw"``."""

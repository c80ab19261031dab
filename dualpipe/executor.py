"""The one executor: runs any schedule of :mod:`dualpipe.schedule` on this rank.

:class:`Pipeline` is an ``nn.Module`` holding this rank's stage modules. ``step`` validates everything it
can before the first message, builds (or fetches, cached) the schedule's action lists and walks this
rank's list: communication actions post sends and receives, compute actions wait only for the receives
they consume. :class:`DualPipe`, :class:`DualPipeV`, :class:`OneFOneB` and :class:`ZeroBubble1P` differ
only in the schedule they name; :data:`PIPELINES` has a class for every registered schedule
(:data:`dualpipe.schedule.SCHEDULES`), and ``Pipeline(modules, schedule=name)`` runs any of them.
Observers (:mod:`dualpipe.observer`) see every span of work the executor runs.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dualpipe import comm
from dualpipe.checks import MessageKey, check_schedule, message_key, needed_receives
from dualpipe.hooks import has_overlap_hook
from dualpipe.observer import PipelineObserver, SpanKind
from dualpipe.offload import Offloader, reload_points
from dualpipe.p2p import P2P, Message, PendingRecv
from dualpipe.schedule import SCHEDULES, Action, Layout, Op, Schedule, ScheduleSpec, build_schedule, schedule_spec
from dualpipe.utils import gather, run_backward, scatter
from dualpipe.weight_grad import GradStore

__all__ = ["PIPELINES", "DualPipe", "DualPipeV", "OneFOneB", "Pipeline", "ZeroBubble1P"]

Key = tuple[int, int]  # (local module, chunk)


@dataclass(slots=True)
class _Loss:
    value: torch.Tensor  # what the criterion returned (reported)
    backward: torch.Tensor  # what backward starts from (value * scale, or value itself)


@dataclass(slots=True)
class _Sent:
    works: list[dist.Work]
    tensors: list[torch.Tensor]  # stage outputs to free once sent (none for gradients: dropping the works frees them)
    key: MessageKey | None  # the message, for the arrival proofs (:func:`_arrival_proofs`); None: not used


@dataclass(slots=True)
class _StepState:
    forward_only: bool
    return_outputs: bool
    loss_scale: float
    criterion: Callable[..., torch.Tensor] | None
    labels: dict[int, list[tuple]] = field(default_factory=dict)  # module -> per-chunk labels
    inputs: dict[Key, list[torch.Tensor | None]] = field(default_factory=dict)
    outputs: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    output_grads: dict[Key, list[torch.Tensor | None]] = field(default_factory=dict)
    input_grads: dict[Key, list[torch.Tensor | None]] = field(default_factory=dict)
    losses: dict[Key, _Loss] = field(default_factory=dict)
    inbox: dict[tuple[str, Key], PendingRecv] = field(default_factory=dict)
    in_flight: list[_Sent] = field(default_factory=list)
    schedule: Schedule | None = None
    recv_keys: dict[tuple[str, Key], MessageKey] = field(default_factory=dict)  # inbox entry -> its message
    arrived: set[MessageKey] = field(default_factory=set)  # sends of this rank known to have arrived
    kept_outputs: dict[Key, list[torch.Tensor]] = field(default_factory=dict)
    action: int = -1  # index of the compute action running, in this rank's list (the offloader's log)
    kept_on_device: frozenset[Key] = frozenset()  # forwards the offloader leaves alone (their backward is next)


class Pipeline(nn.Module):
    """Pipeline-parallel training/inference step over this rank's stage modules.

    Args:
        modules: this rank's stage modules (two for DualPipe/DualPipeV, one for 1F1B/ZB1P; a single module
            is accepted for the latter). All parameters must be on one device.
        batch_dim: dimension along which inputs and labels are split into micro-batches.
        process_group: the pipeline group (default: the whole world).
        rank_mapping: ``rank_mapping[group_rank]`` is the pipeline rank of that group member.
        timeout: upper bound for every wait on a peer (seconds or timedelta); ``None`` uses the process
            group's timeout. A rank whose peer failed raises instead of waiting forever. On gloo only: on
            NCCL a timed wait would block the host, so waits are the stream's and the process group's
            timeout bounds a hang; give the NCCL group the same timeout (``init_process_group(timeout=)``).
        early_receives: post receives one compute earlier so transfers overlap compute. ``None`` picks
            per backend: on for gloo, off for NCCL, whose in-order matching deadlocks with early receives
            (:func:`dualpipe.checks.simulate_progress` shows both).
        overlap: hand paired forward/backward chunks to the stage class's ``overlapped_forward_backward``.
            ``None`` (default) does whenever the hook exists, as the reference; ``False`` runs them one after
            the other (the baseline an overlap benchmark compares against).
        schedule: the registered schedule to run (:data:`dualpipe.schedule.SCHEDULES`); the subclasses name
            theirs. Schedules that let the caller choose the modules per rank (interleaved 1F1B) take
            ``len(modules)``.
        extra_warmup: warm-up forwards added on every rank, for the schedules with a warm-up rule (the 1F1B
            family: :attr:`dualpipe.schedule.ScheduleSpec.warmup`), so more steady steps pair.
    """

    schedule_name: str = ""

    def __init__(
        self,
        modules: nn.Module | Sequence[nn.Module],
        batch_dim: int = 0,
        process_group: dist.ProcessGroup | None = None,
        rank_mapping: list[int] | None = None,
        *,
        timeout: float | datetime.timedelta | None = None,
        early_receives: bool | None = None,
        overlap: bool | None = None,
        schedule: str | None = None,
        extra_warmup: int = 0,
    ) -> None:
        super().__init__()
        if schedule is not None:
            self.schedule_name = schedule
        if not self.schedule_name:
            raise TypeError(f"name a schedule (Pipeline(..., schedule=...)), one of {sorted(SCHEDULES)}")
        self.spec: ScheduleSpec = schedule_spec(self.schedule_name)
        if isinstance(modules, nn.Module) and not isinstance(modules, (nn.ModuleList, nn.Sequential)):
            modules = [modules]
        modules = list(modules)
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialised: call dist.init_process_group first")
        self.group = process_group or dist.group.WORLD
        self.num_ranks = dist.get_world_size(self.group)
        self.layout: Layout = self.spec.stage_layout(self.num_ranks, len(modules))
        self.module = nn.ModuleList(modules)
        self.device = _common_device(modules)
        self.batch_dim = batch_dim
        hook = bool(modules) and all(has_overlap_hook(modules[0], m) for m in modules)
        if overlap and not hook:
            raise ValueError("overlap=True needs every stage module of one class defining overlapped_forward_backward")
        self.overlap = hook if overlap is None else overlap
        self.extra_warmup = extra_warmup
        self._observers: list[PipelineObserver] = []

        if rank_mapping is None:
            rank_mapping = list(range(self.num_ranks))
        if sorted(rank_mapping) != list(range(self.num_ranks)):
            raise ValueError(f"rank_mapping must be a permutation of 0..{self.num_ranks - 1}, got {rank_mapping}")
        to_group_rank = [0] * self.num_ranks
        for group_rank, pp_rank in enumerate(rank_mapping):
            to_group_rank[pp_rank] = group_rank
        self.rank = rank_mapping[dist.get_rank(self.group)]

        backend = dist.get_backend(self.group)
        if backend == dist.Backend.NCCL and self.device.type != "cuda":
            raise ValueError("an NCCL pipeline group needs the stage modules on a CUDA device")
        if isinstance(timeout, (int, float)):
            timeout = datetime.timedelta(seconds=timeout)
        self.p2p = P2P(self.group, to_group_rank, self.device, len(self.layout.paths), timeout, self.layout.num_stages)
        self.early_receives = self.p2p.use_tags if early_receives is None else early_receives
        self.comm_model = "async" if self.p2p.use_tags else "grouped"
        self.grad_store = GradStore()
        self._own_shapes: tuple[list[tuple[int, ...]] | None, list[torch.dtype] | None] | None = None
        self.offloader: Offloader | None = None
        """Moves saved activations to the host between each forward and its backward (:mod:`dualpipe.offload`);
        set it with :meth:`set_offloader`."""

    def set_offloader(self, offloader: Offloader | None) -> None:
        """Offload saved activations with ``offloader`` (None: keep them on the device). Parameters and buffers of
        the stage modules are never held through it."""
        if offloader is not None:
            offloader.exclude([*self.module.parameters(), *self.module.buffers()])
        self.offloader = offloader

    @property
    def first_modules(self) -> list[int]:
        """Local modules of this rank that run a first stage (their inputs come from ``step``)."""
        return self.layout.entries(self.rank)

    @property
    def last_modules(self) -> list[int]:
        """Local modules of this rank that run a last stage (they compute the loss)."""
        return self.layout.exits(self.rank)

    @property
    def label_modules(self) -> list[int]:
        """Local modules that get their micro-batch's labels: the last stages (for the criterion) and any stage
        that computes a loss of its own in forward (``forward_takes_labels``: multi-token prediction on a stage
        of its own)."""
        takes = [m for m, mod in enumerate(self.module) if getattr(mod, "forward_takes_labels", False)]
        return sorted({*self.last_modules, *takes})

    def add_observer(self, observer: PipelineObserver) -> None:
        """Report every span of the executor's work to ``observer`` (see :mod:`dualpipe.observer`)."""
        self._observers.append(observer)

    def remove_observer(self, observer: PipelineObserver) -> None:
        self._observers.remove(observer)

    def _observed(self, kind: SpanKind, subject: Any, fn: Callable[..., Any], *args: Any) -> Any:
        if not self._observers:
            return fn(*args)
        for o in self._observers:
            o.begin(kind, subject)
        try:
            return fn(*args)
        finally:
            for o in reversed(self._observers):
                o.end(kind, subject)

    # -- configuration --------------------------------------------------------------------------------
    def set_p2p_tensor_shapes(self, shapes: Sequence[Sequence[int]] | None) -> None:
        """Declare the shape of every tensor crossing this pipeline's stage boundaries.

        ``None`` drops this pipeline's own declaration: the process-wide one (the reference's
        ``dualpipe.set_p2p_tensor_shapes``) applies if set, else shapes are inferred per message.
        """
        dtypes = self._own_shapes[1] if self._own_shapes else None
        self._own_shapes = (None if shapes is None else [tuple(s) for s in shapes], dtypes)

    def set_p2p_tensor_dtype(self, dtype: torch.dtype | Sequence[torch.dtype]) -> None:
        """Declare the dtype of the boundary tensors: one for all, or one per tensor."""
        shapes = self._own_shapes[0] if self._own_shapes else None
        self._own_shapes = (shapes, [dtype] if isinstance(dtype, torch.dtype) else list(dtype))

    def _declaration(self) -> tuple[list[tuple[int, ...]] | None, list[torch.dtype] | None]:
        if self._own_shapes is not None and self._own_shapes[0] is not None:
            return self._own_shapes
        return comm.declared()

    def schedule(self, num_chunks: int) -> Schedule:
        """The action lists this pipeline runs for ``num_chunks`` micro-batches (validated, cached)."""
        schedule = build_schedule(
            self.schedule_name,
            self.num_ranks,
            num_chunks,
            self.early_receives,
            self.layout.modules_per_rank,
            self.extra_warmup,
            self.overlap,
        )
        _check_once(schedule, self.comm_model)
        return schedule

    # -- the step -------------------------------------------------------------------------------------
    def step(
        self,
        *inputs: torch.Tensor | None,
        num_chunks: int = 0,
        criterion: Callable[..., torch.Tensor] | None = None,
        labels: Sequence[torch.Tensor | None] = (),
        return_outputs: bool = False,
        loss_reduction: str = "sum",
    ) -> tuple[torch.Tensor | None, torch.Tensor | tuple[torch.Tensor | None, ...] | None]:
        """Run one training step (or an inference step under ``torch.no_grad()``).

        Args:
            *inputs: whole-batch inputs, required on ranks that run a first stage (rank 0; DualPipe also
                rank N-1), ignored elsewhere.
            num_chunks: micro-batches per step (DualPipe: in total, half per direction).
            criterion: ``criterion(*outputs, *labels) -> loss`` on ranks that run a last stage.
            labels: whole-batch labels for this rank's last stage (and a stage that takes them in forward).
            return_outputs: also return the last stage's outputs (concatenated along ``batch_dim``).
            loss_reduction: ``"sum"`` (the reference: each micro-batch loss is backpropagated as is) or
                ``"mean"`` (gradients of the mean over all ``num_chunks`` micro-batches).

        Returns ``(loss, outputs)``: per-micro-batch losses stacked, on ranks that run a last stage with a
        criterion; outputs when asked, on ranks that run a last stage; ``None`` elsewhere.
        """
        forward_only = not torch.is_grad_enabled()
        if loss_reduction not in ("sum", "mean"):
            raise ValueError(f"loss_reduction must be 'sum' or 'mean', got {loss_reduction!r}")
        schedule = self.schedule(num_chunks)
        first, last = self.first_modules, self.last_modules
        if last and criterion is None and not forward_only:
            raise ValueError(f"pipeline rank {self.rank} computes the loss (it runs a last stage): pass criterion=...")
        if first and not inputs:
            raise ValueError(f"pipeline rank {self.rank} runs a first stage: pass the batch inputs to step()")
        self.p2p.declare(*self._declaration())

        st = _StepState(
            forward_only=forward_only,
            return_outputs=return_outputs,
            loss_scale=1.0 / num_chunks if loss_reduction == "mean" else 1.0,
            criterion=criterion,
        )
        per_path = schedule.chunks_per_path
        for m in first:
            for k, micro in enumerate(scatter(inputs, per_path, self.batch_dim)):
                st.inputs[(m, k)] = list(micro)
        for m in self.label_modules:
            st.labels[m] = scatter(tuple(labels), per_path, self.batch_dim) if labels else [()] * per_path

        st.schedule = schedule
        self.grad_store.clear()
        try:
            self._run(schedule.ranks[self.rank], st)
        finally:
            self.grad_store.clear()
        return self._results(st, last, per_path)

    def split_batch(
        self, inputs: Sequence[torch.Tensor], labels: Sequence[torch.Tensor] = ()
    ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """``(inputs, labels)`` this rank passes to :meth:`step`, cut from the whole batch every rank holds.

        The batch is split into equal parts along ``batch_dim``, one per path of the layout, in path order:
        DualPipe feeds the first half at rank 0 (labelled at rank N-1) and the second half at rank N-1
        (labelled at rank 0); one-path schedules feed everything at their first stage. Ranks that run no
        first stage (no stage that takes labels) get no inputs (labels).
        """
        num_paths = len(self.layout.paths)

        def part(tensors: Sequence[torch.Tensor], modules: list[int]) -> tuple[torch.Tensor, ...]:
            if not modules:
                return ()
            path = self.layout.path_of(self.rank, modules[0])
            return tuple(t.tensor_split(num_paths, dim=self.batch_dim)[path] for t in tensors)

        return part(inputs, self.first_modules), part(labels, self.label_modules)

    def _run(self, actions: Sequence[Action], st: _StepState) -> None:
        batch: list[Action] = []
        offloader = None if st.forward_only else self.offloader
        reloads, st.kept_on_device = reload_points(actions) if offloader is not None else ({}, frozenset())
        try:
            for i, a in enumerate(actions):
                if a.op.is_comm:
                    batch.append(a)
                    continue
                self._post(batch, st)
                batch = []
                st.action = i
                if offloader is not None:
                    for key in reloads.get(i, ()):  # the next backward's tensors come back under this action
                        offloader.reload(key, i)
                self._compute(a, st)
                self._observed("reap", None, self._reap_sends, st, False)
            self._post(batch, st)
            self._observed("drain", None, self._reap_sends, st, True)
        finally:
            if offloader is not None:
                offloader.end_step()
        # Everything a step holds per micro-batch must have been consumed: anything left is a leak (and a
        # sign that the schedule and the executor disagree).
        leftover = {
            "received messages": list(st.inbox),
            "stage inputs": list(st.inputs),
            "stage outputs": list(st.outputs),
            "output gradients": list(st.output_grads),
            "input gradients": list(st.input_grads),
        }
        leftover = {k: v for k, v in leftover.items() if v}
        if leftover:
            raise RuntimeError(f"pipeline rank {self.rank}: step finished with unconsumed state {leftover}")

    def _compute(self, a: Action, st: _StepState) -> None:
        self._observed("action", a, getattr(self, _HANDLERS[a.op]), a, st)

    def _results(self, st: _StepState, last: list[int], per_path: int):
        loss = outputs = None
        if last:
            (m,) = last  # every layout has at most one last stage per rank
            if st.criterion is not None:
                loss = torch.stack([st.losses[(m, k)].value for k in range(per_path)])
            if st.return_outputs:
                outputs = gather([st.kept_outputs[(m, k)] for k in range(per_path)], self.batch_dim)
                if len(outputs) == 1:
                    outputs = outputs[0]
        return loss, outputs

    # -- communication --------------------------------------------------------------------------------
    def _message(self, a: Action, is_grad: bool) -> Message:
        towards_next = a.op in (Op.SEND_F, Op.RECV_B)
        boundary = self.layout.boundary(self.rank, a.module, towards_next)
        return Message(self.layout.path_of(self.rank, a.module), a.chunk, is_grad, boundary)

    def _post(self, batch: list[Action], st: _StepState) -> None:
        if batch:
            self._observed("post", tuple(batch), self._post_batch, batch, st)

    def _post_batch(self, batch: list[Action], st: _StepState) -> None:
        ops: list[dist.P2POp] = []
        recvs: list[tuple[PendingRecv, slice]] = []
        sends: list[tuple[slice, list[torch.Tensor], MessageKey]] = []
        for a in batch:
            is_grad = a.op in (Op.SEND_B, Op.RECV_B)
            if st.forward_only and is_grad:
                continue
            key = (a.module, a.chunk)
            start = len(ops)
            if a.op is Op.SEND_F:
                # inference never revisits its outputs; training keeps them for the backward graph
                tensors = st.outputs.pop(key) if st.forward_only else st.outputs[key]
                ops += self.p2p.send_ops(a.peer, self._message(a, False), tensors)
                # A sent output's values are never read again (a last stage's outputs, which return_outputs
                # keeps, are never sent): its storage is freed once the send completes.
                freed = [t for t in tensors if t is not None]
                sends.append((slice(start, len(ops)), freed, message_key(st.schedule, self.rank, a)))
            elif a.op is Op.SEND_B:
                ops += self.p2p.send_ops(a.peer, self._message(a, True), st.input_grads.pop(key))
                sends.append((slice(start, len(ops)), [], message_key(st.schedule, self.rank, a)))
            else:
                pending = PendingRecv(self._message(a, is_grad), a.peer)
                ops += self.p2p.recv_ops(pending)
                kind = "B" if is_grad else "F"
                st.inbox[(kind, key)] = pending
                st.recv_keys[(kind, key)] = message_key(st.schedule, self.rank, a)
                recvs.append((pending, slice(start, len(ops))))
        works = self.p2p.issue(ops)
        # gloo returns one work per operation: a receive must wait on its own works only, since a send
        # completes only once the peer posts its receive, maybe much later. NCCL returns one work for the
        # whole group, which is one unit anyway.
        per_op = len(works) == len(ops)
        for pending, ops_slice in recvs:
            pending.works = works[ops_slice] if per_op else works
            if self.p2p.eager_data and pending.tensors is None:
                self.p2p.start_data(pending)
        for ops_slice, freed, key in sends:
            # A grouped (NCCL) work reports its completion; waiting on it would also make the stream wait
            # for the group's receives, so the arrival proofs serve per-operation works (gloo) only.
            st.in_flight.append(_Sent(works[ops_slice], freed, key) if per_op else _Sent(works, freed, None))

    def _take(self, st: _StepState, kind: str, key: Key) -> list[torch.Tensor | None]:
        pending = st.inbox.pop((kind, key))
        tensors = self._observed("recv", (kind, *key), self.p2p.complete, pending)
        assert st.schedule is not None
        st.arrived.update(_arrival_proofs(st.schedule, self.rank).get(st.recv_keys.pop((kind, key)), ()))
        if kind == "F" and not st.forward_only:
            for t in tensors:
                if t is not None and t.is_floating_point():
                    t.requires_grad_()
        return tensors

    def _reap_sends(self, st: _StepState, block: bool) -> None:
        """Release sent activations once their sends completed (their storage is freed, as the reference
        does: the autograd graph, not the output values, is what backward needs).

        A gloo send reports completion only once waited on (``is_completed()`` stays False), and its work
        holds the sent tensor until then: so a send is also taken as complete, and waited on (which then
        returns at once), when a message has arrived that the peer sent after consuming it
        (:func:`_arrival_proofs`). Without that, gloo would keep every sent activation and gradient of the
        step until its end.
        """
        remaining = []
        for entry in st.in_flight:
            if block or (entry.key is not None and entry.key in st.arrived):
                self.p2p.wait(entry.works, "outstanding sends at the end of the step")
            elif not all(w.is_completed() for w in entry.works):
                remaining.append(entry)
                continue
            for t in entry.tensors:
                if t._base is None:  # freeing a view would free its base, which may still be needed
                    t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        st.in_flight = remaining

    # -- compute --------------------------------------------------------------------------------------
    def _stage_inputs(self, st: _StepState, key: Key) -> list[torch.Tensor | None]:
        if key not in st.inputs:  # not local: it was received
            st.inputs[key] = self._take(st, "F", key)
        return st.inputs[key]

    def _forward(self, a: Action, st: _StepState) -> None:
        key = (a.module, a.chunk)
        inputs = self._stage_inputs(st, key)
        if st.forward_only:
            del st.inputs[key]  # no backward will ask for them
        with self.grad_store.activate(enabled=False), self._saving(key, st):
            outputs = self.module[a.module](*self._with_labels(st, key, inputs))
        self._after_forward(a.module, a.chunk, outputs, st)
        self._offload(key, st)

    def _saving(self, key: Key, st: _StepState) -> Any:
        """The offloader's saved-tensor hooks around the forward of ``key`` (nothing without one)."""
        if self.offloader is None or st.forward_only or key in st.kept_on_device:
            return contextlib.nullcontext()
        return self.offloader.saving(key)

    def _offload(self, key: Key, st: _StepState) -> None:
        """The forward of ``key`` has ended: its chosen saved tensors start for the host."""
        if self.offloader is not None and not st.forward_only:
            self.offloader.offload(key, st.action)

    def _with_labels(self, st: _StepState, key: Key, inputs: list[torch.Tensor | None]) -> list[Any]:
        """A stage that computes a loss of its own in forward (``forward_takes_labels``) gets its micro-batch's
        labels after its inputs."""
        m, k = key
        if getattr(self.module[m], "forward_takes_labels", False):
            return [*inputs, *st.labels[m][k]]
        return inputs

    def _after_forward(self, m: int, k: int, outputs: Any, st: _StepState, loss: torch.Tensor | None = None) -> None:
        outputs = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
        if self.layout.is_last(self.rank, m):
            if st.criterion is not None:
                if loss is None:
                    loss = st.criterion(*outputs, *st.labels[m][k])
                scaled = loss if st.loss_scale == 1.0 else loss * st.loss_scale
                st.losses[(m, k)] = _Loss(loss, scaled)
            if st.return_outputs:
                st.kept_outputs[(m, k)] = [o.detach() for o in outputs]
            if st.forward_only or st.criterion is not None:
                return  # backward starts from the loss
        st.outputs[(m, k)] = outputs
        nxt = self.layout.next(self.rank, m)
        if nxt is not None and nxt[0] == self.rank:  # DualPipeV's turn: hand over locally
            st.inputs[(nxt[1], k)] = [
                o.detach().requires_grad_(o.is_floating_point() and not st.forward_only) for o in outputs
            ]
        if st.forward_only and nxt is not None and nxt[0] == self.rank:
            del st.outputs[(m, k)]

    def _backward_sources(self, st: _StepState, key: Key) -> tuple[_Loss | None, tuple, tuple]:
        """What backward of ``key`` starts from: the loss, or (outputs, output gradients)."""
        if key in st.losses:
            return st.losses[key], (), ()
        outputs = st.outputs.pop(key)
        if key in st.output_grads:
            grads = st.output_grads.pop(key)
        else:
            grads = self._take(st, "B", key)
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        return None, tuple(o for o, _ in pairs), tuple(g for _, g in pairs)

    def _backward(self, a: Action, st: _StepState) -> None:
        if st.forward_only:
            return
        key = (a.module, a.chunk)
        defer = a.op is Op.I
        loss, outputs, grads = self._backward_sources(st, key)
        with self.grad_store.activate(enabled=defer):
            if loss is not None:
                loss.backward.backward()
            elif outputs:
                run_backward(outputs, grads)
        if defer:
            self.grad_store.flush()
        self._after_backward(key, loss, st)

    def _after_backward(self, key: Key, loss: _Loss | None, st: _StepState) -> None:
        if loss is not None:
            loss.value.detach_()
            loss.backward.detach_()
        inputs = st.inputs.pop(key)
        grads = [t.grad if t is not None and t.requires_grad else None for t in inputs]
        prev = self.layout.prev(self.rank, key[0])
        if prev is not None and prev[0] == self.rank:  # DualPipeV's turn: local hand-over
            st.output_grads[(prev[1], key[1])] = grads
        elif prev is not None:
            st.input_grads[key] = grads

    def _forward_backward(self, a: Action, st: _StepState) -> None:
        if st.forward_only or not self.overlap:
            self._compute(Action(Op.F, a.module, a.chunk), st)
            self._compute(Action(a.b_op, a.b_module, a.b_chunk), st)
            return
        fkey, bkey = (a.module, a.chunk), (a.b_module, a.b_chunk)
        inputs0 = self._stage_inputs(st, fkey)
        is_last0 = self.layout.is_last(self.rank, a.module) and st.criterion is not None
        criterion0 = st.criterion if is_last0 else None
        labels0 = list(st.labels[a.module][a.chunk]) if is_last0 else []
        loss1, outputs1, grads1 = self._backward_sources(st, bkey)
        module0, module1 = self.module[a.module], self.module[a.b_module]
        # A deferred pair (ZB1P's) runs the hook with the store enabled, as an I runs its backward: layers
        # hand their weight gradients over in backward (the forward half never asks), one batch for the W.
        with self.grad_store.activate(enabled=a.deferred), self._saving(fkey, st):
            outputs0, loss0 = type(module0).overlapped_forward_backward(
                module0,
                self._with_labels(st, fkey, inputs0),
                criterion0,
                labels0,
                module1,
                None if loss1 is None else loss1.backward,
                list(outputs1),
                list(grads1),
            )
        if a.deferred:
            self.grad_store.flush()
        if is_last0 and loss0 is None:
            raise RuntimeError("overlapped_forward_backward returned no loss for a last stage with a criterion")
        self._check_delivered(type(module1), bkey, st)
        self._after_forward(a.module, a.chunk, outputs0, st, loss=loss0)
        self._after_backward(bkey, loss1, st)
        self._offload(fkey, st)

    def _check_delivered(self, cls: type, key: Key, st: _StepState) -> None:
        """The hook must leave the backward micro-batch's input gradient in ``.grad``: fail here, on this
        rank, before that gradient's send leaves a peer waiting for a tensor that never comes."""
        wanting = [t for t in st.inputs[key] if isinstance(t, torch.Tensor) and t.requires_grad]
        if wanting and all(t.grad is None for t in wanting):
            raise RuntimeError(
                f"{cls.__qualname__}.overlapped_forward_backward returned without delivering the input gradient "
                f"of micro-batch {key[1]} of module {key[0]} (pipeline rank {self.rank}): after the backward of "
                "module1, accumulate the gradient into the .grad of that micro-batch's inputs, as a plain "
                "backward would (dualpipe.overlap.deliver_input_grad does it)"
            )

    def _weight(self, a: Action, st: _StepState) -> None:
        if not st.forward_only:
            self.grad_store.pop()


_HANDLERS = {Op.F: "_forward", Op.B: "_backward", Op.I: "_backward", Op.W: "_weight", Op.FB: "_forward_backward"}
"""The executor method that runs each compute op (looked up per action; no table is built per call)."""


@functools.lru_cache(maxsize=256)
def _arrival_proofs(schedule: Schedule, rank: int) -> dict[MessageKey, tuple[MessageKey, ...]]:
    """Which sends of ``rank`` a receive proves arrived: ``{received: (sent, ...)}``.

    The peer's compute that consumes our message waits for it, so any message the peer posts to us after
    that compute can only arrive once ours has: after receiving it, waiting on our send cannot block.
    """
    computes = {
        peer: [(i, a) for i, a in enumerate(actions) if a.op.is_compute] for peer, actions in enumerate(schedule.ranks)
    }
    proofs: dict[MessageKey, list[MessageKey]] = defaultdict(list)
    for a in schedule.ranks[rank]:
        if a.op not in (Op.SEND_F, Op.SEND_B):
            continue
        sent = message_key(schedule, rank, a)
        peer_actions = schedule.ranks[a.peer]
        consumer = next((i for i, c in computes[a.peer] if sent in needed_receives(schedule, a.peer, c)), None)
        if consumer is None:
            continue
        reply = next(
            (b for b in peer_actions[consumer + 1 :] if b.op in (Op.SEND_F, Op.SEND_B) and b.peer == rank), None
        )
        if reply is not None:
            proofs[message_key(schedule, a.peer, reply)].append(sent)
    return {k: tuple(v) for k, v in proofs.items()}


@functools.lru_cache(maxsize=256)
def _check_once(schedule: Schedule, comm_model: str) -> None:
    # Static checks are cheap (milliseconds) but a step runs thousands of times: check each schedule once.
    check_schedule(schedule, (comm_model,))


def _common_device(modules: Sequence[nn.Module]) -> torch.device:
    devices = {t.device for m in modules for t in (*m.parameters(), *m.buffers())}
    if len(devices) > 1:
        raise ValueError(
            f"all stage modules of one rank must live on one device, found {sorted(map(str, devices))}; "
            "move them with .to(device) before building the pipeline"
        )
    return devices.pop() if devices else torch.device("cpu")


class DualPipe(Pipeline):
    """Bidirectional DualPipe: ``modules = (stage r, stage N-1-r)``; inputs enter at ranks 0 and N-1.

    Each stage's weights live on two ranks; sum their gradients after ``step`` with
    :func:`dualpipe.grads.sum_mirrored_grads`.
    """

    schedule_name = "dualpipe"


class DualPipeV(Pipeline):
    """V-shaped DualPipe: ``modules = (stage r, stage 2N-1-r)``; inputs enter at rank 0, which also
    computes the loss."""

    schedule_name = "dualpipev"


class OneFOneB(Pipeline):
    """Classic 1F1B over one module (stage r) per rank; inputs at rank 0, loss at rank N-1."""

    schedule_name = "1f1b"


class ZeroBubble1P(Pipeline):
    """ZB-H1: 1F1B order with weight gradients deferred into the cool-down bubbles."""

    schedule_name = "zb1p"


class _Pipelines(Mapping[str, type[Pipeline]]):
    """The pipeline class of every registered schedule: the named classes above, and for any other
    schedule a subclass named after its spec (``spec.class_name``), made on first use."""

    def __init__(self, named: Sequence[type[Pipeline]]) -> None:
        self._classes = {cls.schedule_name: cls for cls in named}

    def __getitem__(self, name: str) -> type[Pipeline]:
        spec = SCHEDULES[name]  # KeyError for an unknown name, as a dict
        if name not in self._classes:
            self._classes[name] = type(spec.class_name, (Pipeline,), {"schedule_name": name, "__doc__": spec.summary})
        return self._classes[name]

    def __iter__(self) -> Iterator[str]:
        return iter(SCHEDULES)

    def __len__(self) -> int:
        return len(SCHEDULES)


PIPELINES: Mapping[str, type[Pipeline]] = _Pipelines((DualPipe, DualPipeV, OneFOneB, ZeroBubble1P))
"""Schedule name -> :class:`Pipeline` subclass, for every schedule of :data:`dualpipe.schedule.SCHEDULES`."""

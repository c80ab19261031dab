"""Our overlapped forward-and-backward inside ``torch.distributed.pipelining``'s ``ScheduleDualPipeV``.

torch's ScheduleDualPipeV pairs the forward of one micro-batch with the backward of another in
``OVERLAP_F_B`` actions, and runs the two halves one after the other unless a function is registered for
them. :func:`overlap_torch_schedule` registers one that hands each pair to the stage class's
``overlapped_forward_backward`` hook (:class:`dualpipe.hooks.OverlappedForwardBackward`), so the schedule
hides expert all-to-alls as our own :class:`dualpipe.DualPipeV` does::

    stages = [GradStoreStage(m, m.stage_index, num_stages, device, group=pp_group) for m in modules]
    schedule = ScheduleDualPipeV(stages, n_microbatches=16, loss_fn=lm_loss)
    overlap_torch_schedule(schedule)
    schedule.step(ids, target=labels, losses=losses)  # as before

Each pair still goes through torch's own bookkeeping: the bridge waits for the pair's receives, then calls
torch's ``forward_one_chunk`` for the forward stage; where that would call the module, it calls torch's
``backward_one_chunk`` for the backward stage, and where that would run autograd, it calls the hook once for
both. So torch keeps caching inputs and outputs, building the weight-gradient runners, counting backwards and
handing tensors between the two stages of a rank; the hook only replaces the two computations. The private
torch names this needs live in :mod:`dualpipe._torch_pipelining`, checked before anything is registered.

:class:`GradStoreStage` is the ``PipelineStage`` for modules whose layers defer weight gradients through
:class:`dualpipe.WeightGradStore` (our MoE stages): torch's split backward (``I`` then ``W`` actions) then
runs their deferred closures, with or without the bridge.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel

from dualpipe import _torch_pipelining as tp
from dualpipe.observer import PipelineObserver
from dualpipe.schedule import Action, Op
from dualpipe.weight_grad import GradStore, active_store

__all__ = ["TESTED_TORCH", "GradStoreStage", "TorchPipeliningMismatch", "overlap_torch_schedule"]

TESTED_TORCH = tp.TESTED_TORCH
"""The torch (major, minor) versions the bridge was tested with (:data:`dualpipe._torch_pipelining.KNOWN_TORCH`)."""
TorchPipeliningMismatch = tp.TorchPipeliningMismatch


def _close_store_batch() -> Callable[[], None]:
    """torch's ``dw_builder``, called right after each backward: close the store's batch, return its runner."""
    store = active_store()
    store.flush()
    return store.pop


class GradStoreStage(PipelineStage):
    """A ``PipelineStage`` whose weight gradients are the :class:`dualpipe.WeightGradStore` closures of each
    backward (takes ``PipelineStage``'s arguments, except ``dw_builder``, which it brings).

    torch's zero-bubble actions split a backward into ``I`` (input gradients) and ``W`` (weights) by asking
    autograd for the parameters' gradient edges; layers that compute weight gradients in closures (our
    ``moe`` layers, any layer written for the reference DualPipe) have none. Here every backward runs with a
    fresh store enabled, and the ``dw_builder`` torch calls right after it closes that store's batch: torch's
    ``W`` action, or torch at once after a full backward, runs exactly those closures.
    """

    def __init__(
        self, submodule: torch.nn.Module, stage_index: int, num_stages: int, device: torch.device, **kwargs: Any
    ) -> None:
        if "dw_builder" in kwargs:
            raise TypeError("GradStoreStage brings its own dw_builder (the WeightGradStore batch of each backward)")
        super().__init__(submodule, stage_index, num_stages, device, dw_builder=_close_store_batch, **kwargs)

    def backward_one_chunk(self, *args: Any, **kwargs: Any) -> None:
        with GradStore().activate(enabled=True):
            return super().backward_one_chunk(*args, **kwargs)


def _hook_outputs(outputs0: Any) -> Any:
    """The hook's output list as the module's forward returns it (one tensor, or a tuple)."""
    outputs0 = [outputs0] if isinstance(outputs0, torch.Tensor) else list(outputs0)
    return outputs0[0] if len(outputs0) == 1 else tuple(outputs0)


def _run_hook(
    module0: torch.nn.Module,
    inputs0: Sequence[torch.Tensor],
    module1: torch.nn.Module,
    from_loss: bool,
    stage_output: Any,
    output_grads: Sequence[torch.Tensor | None] | None,
) -> Any:
    """One hook call: forward ``module0``, backward ``module1`` from what torch's backward would start at."""
    if from_loss:  # the last stage: torch's backward starts at the loss
        loss1, outputs1, grads1 = stage_output, [], []
    else:  # outputs nothing flows back to are left out, as torch's stage_backward leaves them out
        kept = [
            (o, g)
            for o, g in zip(stage_output, output_grads or ())
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        loss1, outputs1, grads1 = None, [o for o, _ in kept], [g for _, g in kept]
    # Weight gradients are computed inside the pair, where they fill the time the all-to-alls take (our
    # executor does the same); torch's dw_builder then finds an empty batch.
    with active_store().activate(enabled=False):
        outputs0, _ = type(module0).overlapped_forward_backward(
            module0, list(inputs0), None, [], module1, loss1, outputs1, grads1
        )
    return _hook_outputs(outputs0)


class _OverlappedPairs:
    """The function torch runs for every ``OVERLAP_F_B`` action (see the module docstring)."""

    def __init__(self, observer: PipelineObserver | None) -> None:
        self.observer = observer
        # the running step's options, which torch's custom-function context does not carry
        self.return_outputs = True
        self.loss_kwargs: dict[str, Any] | None = None

    def __call__(self, action: Any, ctx: Any) -> None:
        pair = tp.pair_of(action)
        if self.observer is None:
            self._run(pair, ctx)
            return
        subject = Action(Op.FB, pair.forward_stage, pair.forward_chunk, pair.backward_stage, pair.backward_chunk)
        self.observer.begin("action", subject)
        try:
            self._run(pair, ctx)
        finally:
            self.observer.end("action", subject)

    def _run(self, pair: tp.Pair, ctx: Any) -> None:
        step = tp.step_inputs(ctx)
        schedule = step.schedule
        stages = tp.local_stages(schedule)
        f, b = stages[pair.forward_stage], stages[pair.backward_stage]
        if not b.has_backward:
            # torch's own sequential path fails here too (it hands gradients between the local stages)
            raise RuntimeError("overlap_torch_schedule: overlapped pairs need a training step; eval() runs no backward")
        # As torch's runtime: a stage waits for what it received, unless its neighbour is local (the V's turn).
        if not f.is_first and pair.forward_stage - 1 not in stages:
            tp.wait_receives(schedule, "F", pair.forward_stage, pair.forward_chunk)
        if not b.is_last and pair.backward_stage + 1 not in stages:
            tp.wait_receives(schedule, "B", pair.backward_stage, pair.backward_chunk)
        loss1 = tp.stored_loss(schedule, b, pair.backward_chunk)
        last_backward = tp.count_backward(schedule, pair.backward_stage)

        # torch's forward of f computes by running torch's backward of b, which computes by calling the hook
        inputs0: list[Sequence[torch.Tensor]] = []
        outputs0: list[Any] = []

        def forward(*args: torch.Tensor, **kwargs: Any) -> Any:
            if kwargs:
                raise ValueError(f"overlap_torch_schedule: the hook takes no keyword inputs, got {sorted(kwargs)}")
            inputs0.append(args)
            b.backward_one_chunk(pair.backward_chunk, loss=loss1, full_backward=True, last_backward=last_backward)
            if not outputs0:
                raise tp.TorchPipeliningMismatch("torch's backward_one_chunk computed no backward")
            return outputs0[0]

        def backward(stage_output: Any, output_grads: Any, input_values: Sequence[Any]) -> None:
            outputs0.append(_run_hook(f.submod, inputs0[0], b.submod, b.is_last, stage_output, output_grads))

        with tp.intercept_compute(f, forward, b, backward):
            output = f.forward_one_chunk(
                pair.forward_chunk,
                step.arg_mbs[pair.forward_chunk],
                step.kwarg_mbs[pair.forward_chunk],
                save_forward_output=self.return_outputs,
            )
        tp.record_loss(schedule, f, output, step.target_mbs, pair.forward_chunk, self.loss_kwargs)
        if pair.forward_stage + 1 in stages:
            stages[pair.forward_stage + 1].set_local_fwd_input(output, pair.forward_chunk)
        if pair.backward_stage - 1 in stages:
            grads = b.get_local_bwd_output(pair.backward_chunk)
            stages[pair.backward_stage - 1].set_local_bwd_input(grads, pair.backward_chunk)


def _check_stages(stages: Sequence[Any]) -> None:
    classes = {type(s.submod) for s in stages}
    for s in stages:
        if isinstance(s.submod, (FSDPModule, DistributedDataParallel)):
            raise ValueError(
                f"overlap_torch_schedule: stage {s.stage_index}'s module is wrapped in {type(s.submod).__name__}; "
                "the bridge bypasses torch's no-sync handling around backward, so it takes plain modules only"
            )
        if not callable(getattr(type(s.submod), "overlapped_forward_backward", None)):
            raise ValueError(
                f"overlap_torch_schedule: stage {s.stage_index}'s module class {type(s.submod).__name__} defines no "
                "overlapped_forward_backward (dualpipe.hooks.OverlappedForwardBackward); run the schedule without "
                "the bridge, or give the class the hook"
            )
    if len(classes) > 1:
        names = sorted(c.__name__ for c in classes)
        raise ValueError(f"overlap_torch_schedule: the local stages hold modules of several classes {names}; the hook "
                         "is one class's method called with both modules of a pair")  # fmt: skip


def overlap_torch_schedule(
    schedule: Any, *, observer: PipelineObserver | None = None, allow_untested_torch: bool = False
) -> None:
    """Make ``schedule`` (torch's ``ScheduleDualPipeV``) run its ``OVERLAP_F_B`` actions through the stages'
    ``overlapped_forward_backward`` hook. Call once, before the first ``step()``.

    Every local stage's module must be of one class that defines the hook, unwrapped (no DDP/FSDP); stages
    whose layers defer weight gradients through ``WeightGradStore`` should be :class:`GradStoreStage` s.
    Checked here, before any communication: a ``TypeError`` for a schedule that is not a torch
    ``_PipelineScheduleRuntime``, a ``ValueError`` for the stages, and
    :class:`TorchPipeliningMismatch` naming the private torch name or the torch
    version that differs from the ones the bridge was written against (:data:`TESTED_TORCH`;
    ``allow_untested_torch=True`` skips only the version check).

    ``observer`` (a :class:`dualpipe.PipelineObserver`) sees every overlapped pair as an ``"action"`` span
    whose subject is an ``FB`` :class:`dualpipe.Action` holding torch's stage indices and micro-batches.
    ``schedule.step`` is wrapped to pass its ``return_outputs`` and ``loss_kwargs`` on to the pairs (torch's
    context for custom functions does not carry them); everything else is torch's.
    """
    tp.check_torch(allow_untested=allow_untested_torch)
    if not isinstance(schedule, tp.runtime_class()):
        raise TypeError(
            "overlap_torch_schedule takes a torch.distributed.pipelining ScheduleDualPipeV (a "
            f"_PipelineScheduleRuntime, the schedules that run OVERLAP_F_B actions), got {type(schedule).__name__}"
        )
    if not tp.pair_count(schedule):
        raise ValueError(
            f"overlap_torch_schedule: torch's {type(schedule).__name__} runs no OVERLAP_F_B action on this rank, so "
            "no pair would reach the hook (of torch's schedules only ScheduleDualPipeV pairs; for overlap in the "
            "1F1B family use our interleaved-1f1b: docs/pipeline.md)"
        )
    tp.check_schedule(schedule)
    if getattr(schedule.step, "_dualpipe_overlapped_pairs", None) is not None:
        raise ValueError("overlap_torch_schedule: this schedule already runs its pairs through the hook")
    _check_stages(list(tp.local_stages(schedule).values()))
    tp.check_backend(schedule)

    pairs = _OverlappedPairs(observer)
    step = schedule.step

    @functools.wraps(step)
    def step_passing_options(*args: Any, return_outputs: bool = True, **kwargs: Any) -> Any:
        # a torch whose step() takes no loss_kwargs (2.11) hands any such keyword to the model, as without us
        pairs.return_outputs = return_outputs
        pairs.loss_kwargs = kwargs.get("loss_kwargs") if tp.internals().loss_kwargs else None
        return step(*args, return_outputs=return_outputs, **kwargs)

    step_passing_options._dualpipe_overlapped_pairs = pairs  # type: ignore[attr-defined]
    schedule.step = step_passing_options
    tp.register_overlap(schedule, pairs)

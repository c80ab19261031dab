"""The peer: torch.distributed.pipelining's ``ScheduleDualPipeV`` on our model, as users get it, and the
same schedule running our overlapped pairs through :func:`dualpipe.overlap_torch_schedule`.

Same stage split as our DualPipeV (rank r holds stages r and 2N-1-r of 2N), same weights
(:meth:`MoEStage.reset_parameters` with the same seed), same micro-batches. ``torch-dualpipev`` builds the
stages with ``piecewise=False``: one plain autograd graph per stage whose all-to-alls are blocking autograd
nodes (:class:`moe.models.block.Block` with a communicating dispatcher). No ``OVERLAP_F_B`` callback is
registered, so its paired actions run the forward, then the backward, and every all-to-all is exposed.
``torch-dualpipev-overlap`` builds piecewise stages and registers the bridge: each paired action is one
call of :meth:`MoEStage.overlapped_forward_backward`, inside torch's own bookkeeping. ``scale_grads=True``
averages gradients over micro-batches, as our ``loss_reduction="mean"`` does.

Weight gradients: our layers compute them inside their own autograd functions (``moe.models.layers.Linear``,
the grouped experts) and hand them to ``WeightGradStore`` when it is enabled, so torch's default split
backward, which asks autograd for gradient edges to the parameters, finds none. The stages are therefore
:class:`dualpipe.GradStoreStage` s: the ``dw_builder`` that ``PipelineStage`` documents for this case,
running exactly each backward's closures in its ``W`` action (or at once for a full backward). This is
configuration torch asks of any model with custom weight gradients; it overlaps nothing.

Pipeline messages: torch's runtime posts them and waits for them between compute actions. During a step
both are recorded (:func:`dualpipe._torch_pipelining.record_batch_p2p`) as ``"post"`` and ``"p2p"`` spans, as
our executor's are, so both runtimes' bubbles are measured alike.
Compute actions are recorded around the stages' ``forward_one_chunk`` / ``backward_one_chunk`` /
``backward_weight_one_chunk``, and the bridge reports each overlapped pair (``(F0.3&B3.1)``, torch's stage
indices), inside which the stage calls it makes are parts of the pair, not actions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV

from dualpipe._torch_pipelining import record_batch_p2p
from dualpipe.events import EventRecorder
from dualpipe.observer import PipelineObserver, span_label
from dualpipe.torch_bridge import GradStoreStage, overlap_torch_schedule
from moe.models.config import MoEConfig
from moe.models.model import lm_loss
from moe.parallel import ParallelLayout, build_stages

__all__ = ["build_torch_dualpipev"]


def _top_level(actions, fn: Callable, label_of: Callable[..., str]) -> Callable:
    """``fn`` recorded as an action when called between actions; inside an overlapped pair it is a part."""
    recorded = actions.wrap(fn, label_of)

    def call(*args, **kwargs):
        return recorded(*args, **kwargs) if actions.depth == 0 else fn(*args, **kwargs)

    return call


def _instrument(stage: PipelineStage, actions) -> None:
    """Record torch's compute actions with the labels our schedules print (F, B full, I input-only, W)."""
    sid = stage.stage_index

    def backward_label(mb: int, *args, full_backward: bool = True, **kwargs) -> str:
        return f"{'B' if full_backward else 'I'}{sid}.{mb}"

    stage.forward_one_chunk = _top_level(actions, stage.forward_one_chunk, lambda mb, *a, **k: f"F{sid}.{mb}")
    stage.backward_one_chunk = _top_level(actions, stage.backward_one_chunk, backward_label)
    stage.backward_weight_one_chunk = _top_level(actions, stage.backward_weight_one_chunk, lambda mb, *a, **k: "W")


class _Pairs(PipelineObserver):
    """The bridge's overlapped pairs as top-level compute actions."""

    def __init__(self, actions) -> None:
        self.actions = actions

    def begin(self, kind, subject) -> None:
        self.actions.begin(span_label(kind, subject), "action")

    def end(self, kind, subject) -> None:
        self.actions.end(span_label(kind, subject), "action")


def _p2p_span(actions, kind: str, desc: str | None):
    """torch posting pipeline messages as a ``post`` span (``post fwd_send``), waiting for them as ``p2p``."""
    if kind == "post":
        return actions.span(f"post {desc or ''}".strip(), "post")
    return actions.span("p2p", "p2p")


def build_torch_dualpipev(
    cfg: MoEConfig,
    layout: ParallelLayout,
    chunks: int,
    seed: int,
    recorder: EventRecorder,
    actions,
    overlap: bool = False,
    dtype: torch.dtype = torch.float32,
) -> tuple[Callable[[torch.Tensor, torch.Tensor], list[float]], list[torch.nn.Parameter]]:
    """``(step(ids, labels) -> this rank's micro-batch losses, parameters)`` for torch's ScheduleDualPipeV,
    with the bridge to our overlapped pairs when ``overlap``.

    ``actions`` records compute actions (``bench.overlap.run._ActionRecorder``); the stages' all-to-alls
    (and, piecewise, their sub-stages) go to ``recorder``.
    """
    device = recorder.device
    # our DualPipeV's stage split (rank r: stages r and 2N-1-r); plain autograd graphs unless overlapping
    modules = build_stages(cfg, layout, seed=seed, dtype=dtype, device=device, piecewise=overlap)
    num_stages = layout.config.num_stages
    stages = []
    for m in modules:
        m.recorder = recorder
        assert m.stage_index is not None
        # Shapes are inferred on the first step (torch's dynamic mode; that step leaves non-finite gradients
        # in the middle stages, observed with torch 2.13: it is a warm-up step here).
        stage = GradStoreStage(m, m.stage_index, num_stages, device, group=layout.pp_group)
        _instrument(stage, actions)
        stages.append(stage)
    schedule = ScheduleDualPipeV(stages, n_microbatches=chunks, loss_fn=lm_loss, scale_grads=True)
    if overlap:
        overlap_torch_schedule(schedule, observer=_Pairs(actions))
    # stage 0 (inputs) and the last stage (loss) both live on pipeline rank 0
    feeds = bool(layout.config.stage_layout.entries(layout.pp_rank))

    def step(ids: torch.Tensor, labels: torch.Tensor) -> list[float]:
        with record_batch_p2p(functools.partial(_p2p_span, actions)):
            if not feeds:
                schedule.step()
                return []
            losses: list[torch.Tensor] = []
            schedule.step(ids, target=labels, losses=losses)
        return [float(x) for x in losses]

    params = [p for m in modules for p in m.parameters()]
    return step, params

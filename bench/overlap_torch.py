"""The peer: torch.distributed.pipelining's ``ScheduleDualPipeV`` on our model, as users get it.

Same stage split as our DualPipeV (rank r holds stages r and 2N-1-r of 2N), same weights
(:meth:`MoEStage.reset_parameters` with the same seed), same micro-batches. The stages are built with
``piecewise=False``: one plain autograd graph per stage whose all-to-alls are blocking autograd nodes
(:class:`moe.block.Block` with a communicating dispatcher). No ``OVERLAP_F_B`` callback is registered,
so its paired actions run the forward, then the backward, and every all-to-all is exposed.
``scale_grads=True`` averages gradients over micro-batches, as our ``loss_reduction="mean"`` does.

Weight gradients: our layers compute them inside their own autograd functions (``moe.layers.Linear``,
the grouped experts) and hand them to ``WeightGradStore`` when it is enabled, so torch's default split
backward, which asks autograd for gradient edges to the parameters, finds none. The stages therefore get
the ``dw_builder`` that ``PipelineStage`` documents for this case: every backward runs with a fresh
:class:`dualpipe.weight_grad.GradStore` enabled, the builder closes that store's batch and its runner (the
``W`` action, or at once for a full backward) runs exactly those closures. This is configuration torch
asks of any model with custom weight gradients; it overlaps nothing.

Pipeline messages: torch's runtime posts them with ``schedules._batch_p2p`` and waits for them with
``schedules._wait_batch_p2p``, between compute actions. During a step both are wrapped to record
``"post"`` and ``"p2p"`` spans, as our executor's are, so both runtimes' bubbles are measured alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.distributed.pipelining import PipelineStage, ScheduleDualPipeV
from torch.distributed.pipelining import schedules as torch_schedules

from dualpipe.weight_grad import GradStore, active_store
from moe.config import MoEConfig
from moe.events import EventRecorder
from moe.model import lm_loss
from moe.parallel import ParallelLayout, build_stages

__all__ = ["build_torch_dualpipev"]


def _dw_builder() -> Callable[[], None]:
    """Called by torch right after a backward: close the active store's batch; the runner runs it."""
    store = active_store()
    store.flush()
    return store.pop


def _own_store_per_backward(stage: PipelineStage) -> None:
    backward = stage.backward_one_chunk

    def with_store(*args, **kwargs):
        with GradStore().activate(enabled=True):
            return backward(*args, **kwargs)

    stage.backward_one_chunk = with_store


def _instrument(stage: PipelineStage, actions) -> None:
    """Record torch's compute actions with the labels our schedules print (F, B full, I input-only, W)."""
    sid = stage.stage_index

    def backward_label(mb: int, *args, full_backward: bool = True, **kwargs) -> str:
        return f"{'B' if full_backward else 'I'}{sid}.{mb}"

    stage.forward_one_chunk = actions.wrap(stage.forward_one_chunk, lambda mb, *a, **k: f"F{sid}.{mb}")
    stage.backward_one_chunk = actions.wrap(stage.backward_one_chunk, backward_label)
    stage.backward_weight_one_chunk = actions.wrap(stage.backward_weight_one_chunk, lambda mb, *a, **k: "W")


@contextlib.contextmanager
def _recording_p2p(actions) -> Iterator[None]:
    """Record torch's posting of and waiting for pipeline messages (module functions, restored after)."""
    post, wait = torch_schedules._batch_p2p, torch_schedules._wait_batch_p2p
    torch_schedules._batch_p2p = actions.wrap(post, lambda ops, desc=None: f"post {desc or ''}".strip(), "post")
    torch_schedules._wait_batch_p2p = actions.wrap(wait, lambda works: "p2p", "p2p")
    try:
        yield
    finally:
        torch_schedules._batch_p2p, torch_schedules._wait_batch_p2p = post, wait


def build_torch_dualpipev(
    cfg: MoEConfig,
    layout: ParallelLayout,
    chunks: int,
    seed: int,
    recorder: EventRecorder,
    actions,
) -> tuple[Callable[[torch.Tensor, torch.Tensor], list[float]], list[torch.nn.Parameter]]:
    """``(step(ids, labels) -> this rank's micro-batch losses, parameters)`` for torch's ScheduleDualPipeV.

    ``actions`` records compute actions (``bench.overlap_run._ActionRecorder``); the stages' all-to-alls
    go to ``recorder``.
    """
    device = recorder.device
    # our DualPipeV's stage split (rank r: stages r and 2N-1-r), one plain autograd graph per stage
    modules = build_stages(cfg, layout, seed=seed, device=device, piecewise=False)
    num_stages = layout.config.num_stages
    stages = []
    for m in modules:
        m.recorder = recorder
        assert m.stage_index is not None
        # Shapes are inferred on the first step (torch's dynamic mode; that step leaves non-finite gradients
        # in the middle stages, observed with torch 2.13: it is a warm-up step here).
        stage = PipelineStage(m, m.stage_index, num_stages, device, group=layout.pp_group, dw_builder=_dw_builder)
        _own_store_per_backward(stage)
        _instrument(stage, actions)
        stages.append(stage)
    schedule = ScheduleDualPipeV(stages, n_microbatches=chunks, loss_fn=lm_loss, scale_grads=True)
    # stage 0 (inputs) and the last stage (loss) both live on pipeline rank 0
    feeds = bool(layout.config.stage_layout.entries(layout.pp_rank))

    def step(ids: torch.Tensor, labels: torch.Tensor) -> list[float]:
        with _recording_p2p(actions):
            if not feeds:
                schedule.step()
                return []
            losses: list[torch.Tensor] = []
            schedule.step(ids, target=labels, losses=losses)
        return [float(x) for x in losses]

    params = [p for m in modules for p in m.parameters()]
    return step, params

"""WHAT runs: a DeepSeek-V3-style MoE transformer, token dispatchers and the overlapped forward/backward.

Entry points: :class:`MoEConfig` / :func:`preset`, :class:`MoEModel` (single process), :class:`MoEStage`
(a pipeline stage with ``overlapped_forward_backward``), :func:`lm_loss`, the dispatchers in
:mod:`moe.dispatch`, and the parallel layout in :mod:`moe.parallel`.

Rooms, each importing only those below it (tests/moe/test_rooms.py): the commands ``convert`` and ``eval``;
:mod:`moe.train` (the trainer and all it keeps: optimizer, checkpoints, guards, gradient sync, memory);
:mod:`moe.parallel` (the (pp, dp, ep) layout); :mod:`moe.plan` (the planner); :mod:`moe.hf` (Hugging Face
checkpoints); :mod:`moe.models` (what a block is made of: config, layers, attention, router, experts, block,
stage, MTP); :mod:`moe.dispatch` and :mod:`moe.data`; at the bottom :mod:`moe.optim_state` (the optimizers' byte
rules), :mod:`moe.pipeline_layout`, :mod:`moe.groups` and :mod:`moe.command`. A training step at (pp, dp, ep)::

    layout = init_layout(ParallelConfig(pp=2, dp=8, ep=4, schedule="dualpipev", dispatcher="alltoall"), "cuda")
    stages = build_stages(preset("small"), layout, seed=0, dtype=torch.bfloat16, device="cuda")
    pipe = DualPipeV(stages, batch_dim=0, process_group=layout.pp_group)
    loss, _ = pipe.step(ids, num_chunks=8, criterion=lm_loss, labels=(labels,))  # ids on pp rank 0
    reduce_gradients(stages, layout)   # mirror sum (DualPipe), mean over the global batch (dp, edp)
    optimizer.step()
    balance_routers(stages, layout)    # auxiliary-loss-free bias update from the step's expert load
"""

from dualpipe.events import Event, EventRecorder
from moe.models.config import PRESETS, MoEConfig, preset
from moe.models.model import MoEModel, lm_loss, next_token_batch
from moe.models.stage import MoEStage
from moe.parallel import ParallelConfig, ParallelLayout, build_stages, init_layout

__all__ = [
    "PRESETS",
    "Event",
    "EventRecorder",
    "MoEConfig",
    "MoEModel",
    "MoEStage",
    "ParallelConfig",
    "ParallelLayout",
    "balance_routers",
    "build_stages",
    "init_layout",
    "lm_loss",
    "next_token_batch",
    "preset",
    "reduce_gradients",
]


def __getattr__(name: str) -> object:
    """The trainer's gradient helpers, imported on first use: ``import moe`` (the planner's, the converter's)
    need not load the trainer and its checkpointing (``torch.distributed.checkpoint``, most of a second)."""
    if name in ("balance_routers", "reduce_gradients"):
        from moe.train import grad_sync

        return getattr(grad_sync, name)
    raise AttributeError(f"module 'moe' has no attribute {name!r}")

"""Pipeline schedules as data, one executor, a drop-in API for deepseek-ai/DualPipe, and the overlap runtime
(a stage declared as compute and communication pieces gets ``overlapped_forward_backward``)."""

from dualpipe import generators as _generators  # noqa: F401 (registers the built-in schedules, first)
from dualpipe import generators_v as _generators_v  # noqa: F401 (then the zero-bubble V family)
from dualpipe.comm import set_p2p_tensor_dtype, set_p2p_tensor_shapes
from dualpipe.executor import PIPELINES, DualPipe, DualPipeV, OneFOneB, Pipeline, ZeroBubble1P
from dualpipe.grads import sum_mirrored_grads
from dualpipe.hooks import OverlappedForwardBackward
from dualpipe.observer import PipelineObserver
from dualpipe.overlap import OverlapStage
from dualpipe.p2p import PipelineCommError
from dualpipe.pieces import Comm, Compute, Pieces
from dualpipe.schedule import SCHEDULES, Action, Layout, Op, Schedule, ScheduleSpec, build_schedule, register_schedule
from dualpipe.weight_grad import WeightGradStore

__version__ = "0.1.0"

# The torch bridge imports torch.distributed.pipelining (about a second): loaded on first use only.
_LAZY = {"GradStoreStage": "dualpipe.torch_bridge", "overlap_torch_schedule": "dualpipe.torch_bridge"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'dualpipe' has no attribute {name!r}")


__all__ = [
    "PIPELINES",
    "SCHEDULES",
    "Action",
    "Comm",
    "Compute",
    "DualPipe",
    "DualPipeV",
    "GradStoreStage",
    "Layout",
    "OneFOneB",
    "Op",
    "OverlapStage",
    "OverlappedForwardBackward",
    "Pieces",
    "Pipeline",
    "PipelineCommError",
    "PipelineObserver",
    "Schedule",
    "ScheduleSpec",
    "WeightGradStore",
    "ZeroBubble1P",
    "build_schedule",
    "overlap_torch_schedule",
    "register_schedule",
    "set_p2p_tensor_dtype",
    "set_p2p_tensor_shapes",
    "sum_mirrored_grads",
]

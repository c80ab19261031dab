"""Pipeline schedules as data, one executor, and a drop-in API for deepseek-ai/DualPipe."""

from dualpipe.comm import set_p2p_tensor_dtype, set_p2p_tensor_shapes
from dualpipe.executor import PIPELINES, DualPipe, DualPipeV, OneFOneB, Pipeline, ZeroBubble1P
from dualpipe.grads import sum_mirrored_grads
from dualpipe.hooks import OverlappedForwardBackward
from dualpipe.observer import PipelineObserver
from dualpipe.p2p import PipelineCommError
from dualpipe.schedule import SCHEDULES, Action, Layout, Op, Schedule, ScheduleSpec, build_schedule, register_schedule
from dualpipe.weight_grad import WeightGradStore

__version__ = "0.1.0"

__all__ = [
    "PIPELINES",
    "SCHEDULES",
    "Action",
    "DualPipe",
    "DualPipeV",
    "Layout",
    "OneFOneB",
    "Op",
    "OverlappedForwardBackward",
    "Pipeline",
    "PipelineCommError",
    "PipelineObserver",
    "Schedule",
    "ScheduleSpec",
    "WeightGradStore",
    "ZeroBubble1P",
    "build_schedule",
    "register_schedule",
    "set_p2p_tensor_dtype",
    "set_p2p_tensor_shapes",
    "sum_mirrored_grads",
]

"""The planner (``python -m moe.plan``): from a model and a cluster to per-sub-stage costs, memory and a layout.

This package's cost model: device profiles (:mod:`.hardware`) and their cited efficiencies (:mod:`.efficiency`),
parameter shapes (:mod:`.params`), routing
reach (:mod:`.routing`), FLOPs and bytes per op (:mod:`.flops`), seconds per sub-stage (:mod:`.costs`),
memory per GPU (:mod:`.footprint`, with the memory options :class:`MemoryOptions` and the recompute
granularities :data:`RECOMPUTE`) and measured costs files (:mod:`.measured`, which builds on :mod:`.costs`).
"""

from moe.plan.costs import (
    COMPUTE_FIELDS,
    RECOMPUTE,
    STATE_DTYPES,
    AllToAllBytes,
    MemoryOptions,
    Parallelism,
    Precision,
    SubstageCosts,
    Workload,
    all_to_all_bytes,
    all_to_all_seconds,
    allreduce_seconds,
    dp_reduce_seconds,
    p2p_seconds,
    phase_work,
    substage_costs,
)
from moe.plan.efficiency import TABLES, Cited
from moe.plan.flops import model_flops_per_token
from moe.plan.footprint import HEADROOM, Footprint, footprint, layer_activations, module_activation_bytes
from moe.plan.hardware import GPU, GPUS, Cluster, gpu, with_overrides
from moe.plan.measured import MeasuredCosts, apply_measured, load_costs, save_costs, scale_field
from moe.plan.params import active_params, rank_params, rank_stages, total_params
from moe.plan.routing import expected_nodes, expected_ranks

__all__ = [
    "COMPUTE_FIELDS",
    "GPU",
    "GPUS",
    "HEADROOM",
    "RECOMPUTE",
    "STATE_DTYPES",
    "TABLES",
    "AllToAllBytes",
    "Cited",
    "Cluster",
    "Footprint",
    "MeasuredCosts",
    "MemoryOptions",
    "Parallelism",
    "Precision",
    "SubstageCosts",
    "Workload",
    "active_params",
    "all_to_all_bytes",
    "all_to_all_seconds",
    "allreduce_seconds",
    "apply_measured",
    "dp_reduce_seconds",
    "expected_nodes",
    "expected_ranks",
    "footprint",
    "gpu",
    "layer_activations",
    "load_costs",
    "model_flops_per_token",
    "module_activation_bytes",
    "p2p_seconds",
    "phase_work",
    "rank_params",
    "rank_stages",
    "save_costs",
    "scale_field",
    "substage_costs",
    "total_params",
    "with_overrides",
]

"""Multi-GPU tier (``pytest -m multigpu``): each test spawns its own NCCL ranks, one per GPU.

A test says how many GPUs it needs with ``@pytest.mark.multigpu(gpus=N)``; with fewer visible it is
skipped, naming both numbers. Run them from the repository root as a plain pytest command, not under
torchrun: ``tests.distributed.run_ranks(..., backend="nccl")`` starts the ranks and puts rank r on cuda:r.
"""

from __future__ import annotations

import pytest
import torch


def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("multigpu")
    if marker is None:
        return
    needed = marker.kwargs.get("gpus", 2)
    found = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if found < needed:
        pytest.skip(f"needs {needed} CUDA devices, found {found}")

"""Test tiers: plain unit -> multi-rank gloo on CPU -> Triton interpreter -> `gpu` -> `cluster`."""

from __future__ import annotations

import os

import pytest
import torch

# Several ranks share two cores in CI: one intra-op thread per process keeps them from thrashing.
torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_cluster = pytest.mark.skip(reason="needs root and DUALPIPE_CLUSTER_TESTS=1 (builds network namespaces)")
    has_cuda = torch.cuda.is_available()
    cluster_ok = os.geteuid() == 0 and os.environ.get("DUALPIPE_CLUSTER_TESTS") == "1"
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "cluster" in item.keywords and not cluster_ok:
            item.add_marker(skip_cluster)

"""Test tiers: plain unit -> multi-rank gloo on CPU -> Triton interpreter -> `gpu` -> `cluster`."""

from __future__ import annotations

import os

import pytest
import torch

# Several ranks share two cores in CI: one intra-op thread per process keeps them from thrashing.
torch.set_num_threads(1)

# Triton tier without CUDA: kernels run on CPU tensors under Triton's interpreter. Triton picks compiling or
# interpreting when a function is decorated, i.e. when triton.language and kernels.triton_* are first
# imported, and some imports pull Triton in early (torch.distributed.pipelining does): so it is set here,
# in the root conftest, before any test module is collected. It changes only how Triton kernels run:
# DUALPIPE_KERNELS=auto still sends CPU tensors to the torch reference.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _slow_modules_first(items: list[pytest.Item]) -> None:
    """On a pytest-xdist worker (scripts/test.sh: ``--dist loadscope``, a module at a time, so that a module's
    fixtures are built once): the modules with a slow test first, in their order otherwise, so that no long
    module is left for the end while the other worker idles."""
    slow = {item.module.__name__ for item in items if "slow" in item.keywords and getattr(item, "module", None)}
    items.sort(key=lambda item: getattr(item, "module", None) is None or item.module.__name__ not in slow)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # the order each worker collects is the order xdist hands modules out
        _slow_modules_first(items)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_cluster = pytest.mark.skip(reason="needs root and DUALPIPE_CLUSTER_TESTS=1 (builds network namespaces)")
    has_cuda = torch.cuda.is_available()
    cluster_ok = os.geteuid() == 0 and os.environ.get("DUALPIPE_CLUSTER_TESTS") == "1"
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "cluster" in item.keywords and not cluster_ok:
            item.add_marker(skip_cluster)

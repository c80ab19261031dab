"""Test tiers: plain unit -> multi-rank gloo on CPU -> Triton interpreter -> `gpu` -> `cluster`."""

from __future__ import annotations

import os
from collections.abc import Iterable

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


def _shared_fixtures(item: pytest.Item) -> Iterable[str]:
    """The fixtures of ours wider than one test that ``item`` uses: a module-scoped one is its module's, a
    session-scoped one is everyone's."""
    info = getattr(item, "_fixtureinfo", None)
    for name, defs in info.name2fixturedefs.items() if info else ():
        fixture = defs[-1]
        if fixture.baseid and fixture.scope in ("module", "class", "package"):
            yield f"{item.module.__name__}:{name}" if fixture.scope == "module" else f"{fixture.baseid}:{name}"
        elif fixture.baseid and fixture.scope == "session":
            yield f"session:{name}"


def _group_for_workers(items: list[pytest.Item]) -> None:
    """Under ``pytest -n N --dist loadgroup`` (scripts/test.sh): the tests that share one of our fixtures
    wider than a test run on one worker, so that it is built once; all others go wherever a worker is free.
    Then the slow ones first (stable order otherwise), so that no long test is left for the end."""
    parent: dict[str, str] = {}

    def root(key: str) -> str:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    keys = {item.nodeid: list(_shared_fixtures(item)) for item in items}
    for first, *rest in (k for k in keys.values() if k):
        for other in rest:
            parent[root(other)] = root(first)
    group = {nodeid: root(k[0]) for nodeid, k in keys.items() if k}
    slow_groups = {group.get(item.nodeid, item.nodeid) for item in items if "slow" in item.keywords}
    for item in items:
        if item.nodeid in group:
            item.add_marker(pytest.mark.xdist_group(group[item.nodeid]))
    items.sort(key=lambda item: group.get(item.nodeid, item.nodeid) not in slow_groups)


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.pluginmanager.hasplugin("xdist") and config.getoption("dist", "no") == "loadgroup":
        _group_for_workers(items)
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_cluster = pytest.mark.skip(reason="needs root and DUALPIPE_CLUSTER_TESTS=1 (builds network namespaces)")
    has_cuda = torch.cuda.is_available()
    cluster_ok = os.geteuid() == 0 and os.environ.get("DUALPIPE_CLUSTER_TESTS") == "1"
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)
        if "cluster" in item.keywords and not cluster_ok:
            item.add_marker(skip_cluster)

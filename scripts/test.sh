#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. As root with iproute2, the emulated-cluster tests
# (network namespaces) run too; DUALPIPE_CLUSTER_TESTS=0 skips them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ -z "${DUALPIPE_CLUSTER_TESTS:-}" ] && [ "$(id -u)" = 0 ] && command -v ip >/dev/null && command -v tc >/dev/null; then
    probe="dpm-probe-$$"
    if ip netns add "$probe" 2>/dev/null; then
        ip netns del "$probe"
        export DUALPIPE_CLUSTER_TESTS=1
    fi
fi
.venv/bin/python -m ruff check .
# One worker per core, at most 4 (DUALPIPE_TEST_WORKERS overrides; 0 runs in this process): single-process
# tests use one thread each (tests/conftest.py), and much of a multi-rank test is waiting. Tests that share a
# fixture wider than one test run on one worker, slow ones first (tests/conftest.py::_group_for_workers).
workers=${DUALPIPE_TEST_WORKERS:-$(nproc)}
[ "$workers" -gt 4 ] && workers=4
[ "$workers" -lt 2 ] && workers=0
.venv/bin/python -m pytest -n "$workers" --dist loadgroup --no-loadscope-reorder "$@"

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
# tests use one thread each (tests/conftest.py). A module at a time (its fixtures are built once), the modules
# with slow tests first (tests/conftest.py::_slow_modules_first).
workers=${DUALPIPE_TEST_WORKERS:-$(nproc)}
[ "$workers" -gt 4 ] && workers=4
[ "$workers" -lt 2 ] && workers=0
.venv/bin/python -m pytest -n "$workers" --dist loadscope --no-loadscope-reorder "$@"

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
.venv/bin/python -m pytest "$@"

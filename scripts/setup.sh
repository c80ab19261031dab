#!/usr/bin/env bash
# Create .venv with everything the project needs (CPU machine: torch's CPU build, Triton for its
# interpreter). Idempotent: once installed for this pyproject.toml, a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.dualpipe-moe-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    # torch==2.13.0 (the CPU build here) is pinned here, not in pyproject, so clusters keep their own CUDA build:
    # a torch already in .venv from pyproject's floor on is never replaced (scripts/torch_range.py).
    have=$(.venv/bin/python -c "import torch; print(torch.__version__)" 2>/dev/null || true)
    if "$PY" scripts/torch_range.py keep "$have"; then
        echo "keeping torch $have (inside the supported range, from $("$PY" scripts/torch_range.py floor) on)"
    else
        .venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
    fi
    .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev,plot]" 2>&1 | grep -v "is ignored" || true
    echo "$want" > "$stamp"
fi
.venv/bin/python -c "import torch, triton, numpy, pytest; print(f'torch {torch.__version__}, triton {triton.__version__}')"

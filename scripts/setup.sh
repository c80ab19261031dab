#!/usr/bin/env bash
# Create .venv with everything the project needs (CPU machine: torch's CPU build, Triton for its
# interpreter). Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# torch==2.13.0 is pinned here (not in pyproject) so clusters keep their own CUDA build of torch.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[dev,plot]" 2>&1 | grep -v "is ignored" || true
.venv/bin/python -c "import torch, triton, numpy, pytest; print(f'torch {torch.__version__}, triton {triton.__version__}')"

#!/usr/bin/env bash
# Set up (if needed) and run the main job: a short DualPipeV training run on 4 CPU ranks over gloo.
# Extra arguments go to the training script.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
NPROC=${NPROC:-4}
exec .venv/bin/torchrun --standalone --nproc-per-node "$NPROC" examples/toy_dualpipev.py "$@"

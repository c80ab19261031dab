#!/usr/bin/env bash
# Set up (if needed) and run the main job: MoE training with DualPipeV + overlap, pp=2 x ep=2 on 4 CPU
# ranks over gloo (about 30 s on 2 cores), as examples/configs/tiny.toml describes it. Extra arguments go
# to examples/train.py (flags override the file).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/torchrun --standalone --nproc-per-node 4 examples/train.py --config examples/configs/tiny.toml "$@"

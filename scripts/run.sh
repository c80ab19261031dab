#!/usr/bin/env bash
# Set up (if needed) and run the main job: MoE training with DualPipeV + overlap, pp=2 x ep=2 on 4 CPU
# ranks over gloo (about 30 s on 2 cores). Extra arguments go to examples/train.py (they override these).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/torchrun --standalone --nproc-per-node 4 examples/train.py \
    --pp 2 --ep 2 --schedule dualpipev --overlap --dispatcher alltoall \
    --preset tiny --layers 4 --seq-len 64 --micro-batch-size 4 --steps 80 --val-every 40 \
    --bias-update-rate 0.01 --log-every 10 "$@"

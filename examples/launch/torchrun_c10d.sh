#!/usr/bin/env bash
# Elastic c10d rendezvous: the same command on every node; nodes find each other through RDZV_ENDPOINT.
# With MAX_RESTARTS > 0 a failed rank restarts the whole job, which resumes from the newest checkpoint
# (pass --ckpt-dir, --ckpt-every and --resume).
#   NNODES=2 RDZV_ENDPOINT=10.0.0.1:29400 JOB_ID=moe1 examples/launch/torchrun_c10d.sh --pp 2 --ep 8 ...
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/cluster_env.sh"
: "${NNODES:?set NNODES}" "${RDZV_ENDPOINT:?set RDZV_ENDPOINT (host:port of any node)}"
PYTHON=${PYTHON:-python3}
exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" \
    --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --rdzv-backend c10d --rdzv-endpoint "$RDZV_ENDPOINT" --rdzv-id "${JOB_ID:-dualpipe-moe}" \
    --max-restarts "${MAX_RESTARTS:-3}" \
    "$here/../train.py" "$@"

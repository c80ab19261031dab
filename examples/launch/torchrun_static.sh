#!/usr/bin/env bash
# Static rendezvous: run this on every node with its NODE_RANK.
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 GPUS_PER_NODE=8 examples/launch/torchrun_static.sh --pp 2 --ep 8 ...
# Extra arguments go to examples/train.py. CPU nodes: set GPUS_PER_NODE to the number of ranks per node.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/cluster_env.sh"
: "${NNODES:?set NNODES}" "${NODE_RANK:?set NODE_RANK}" "${MASTER_ADDR:?set MASTER_ADDR}"
PYTHON=${PYTHON:-python3}
port=${MASTER_PORT:-29500}
# Node 0 serves the rendezvous on $port: if it is taken, say so in one line rather than torchrun's traceback.
if [ "$NODE_RANK" = 0 ] && ! "$PYTHON" -c 'import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the rendezvous store binds: TIME_WAIT is fine
s.bind(("", int(sys.argv[1])))' "$port" 2>/dev/null; then
    echo "error: port $port is in use on this node (NODE_RANK=0 serves the rendezvous); set MASTER_PORT to a free one" >&2
    exit 1
fi
exec "$PYTHON" -m torch.distributed.run \
    --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --nproc-per-node "${GPUS_PER_NODE:-8}" \
    --master-addr "$MASTER_ADDR" --master-port "$port" \
    --max-restarts "${MAX_RESTARTS:-0}" \
    "$here/../train.py" "$@"

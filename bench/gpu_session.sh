#!/usr/bin/env bash
# The GPU checklist (../shared/GPU_CHECKLIST.md) in at most three calls of the device tool, one per argument:
#   bash bench/gpu_session.sh 1   # does it work at all: versions, pytest -m gpu, a one-GPU training run (~8 min)
#   bash bench/gpu_session.sh 2   # how fast: kernels at V3 shapes, the overlap trace, host vs GPU per sub-stage
#   bash bench/gpu_session.sh 3   # measure again after a fix: kernels, the overlap at the full small preset,
#                                 # and the multigpu tier's collection (it skips on one GPU, saying why)
# Written for the lent machine: torch 2.11 + cu130, Triton 3.6, no network, run from the repository root
# without installing (pyproject pins a newer torch): PYTHONPATH=. is set here. Files go to $OUT (what the
# device tool brings back; at most 8 per call, so each call writes few) or bench/results when OUT is unset,
# named <what>-<device>-<date>; copy them into bench/results/ afterwards. Exit status: the first failed step.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
call=${1:-}
case "$call" in 1 | 2 | 3) ;; *) echo "usage: bash bench/gpu_session.sh 1|2|3" >&2; exit 2 ;; esac
out=${OUT:-bench/results}
mkdir -p "$out"
py=${PYTHON:-python3}
device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 | tr -c 'A-Za-z0-9.\n' '_' | tr -d '\n')
device=${device:-nogpu}
tag="$device-$(date -u +%Y%m%d)"
log="$out/session$call-$tag.log"
status=0

step() {  # step NAME COMMAND...: run, log, keep the first failure
    local name=$1
    shift
    echo "=== $name: $*" | tee -a "$log"
    local t0=$SECONDS
    "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
    return 0
}

versions() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$py" - <<'EOF'
import torch
nccl = torch.cuda.nccl.version()  # a tuple on recent torch, an int on old ones
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl)
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("triton: not installed")
p = torch.cuda.get_device_properties(0)
print("device", p.name, "sm", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count, "GiB", round(p.total_memory / 2**30, 1))
EOF
}

# The main job on one GPU: torchrun with NCCL, pp=1, ep=1, DualPipeV with overlap, bf16; the loss must fall.
train() {
    local metrics="$out/train-metrics-$tag.jsonl"
    rm -f "$metrics"
    torchrun --standalone --nproc-per-node 1 examples/train.py --preset small --layers 4 --pp 1 --ep 1 \
        --schedule dualpipev --overlap --dtype bfloat16 --steps 30 --seq-len 256 --micro-batch-size 2 \
        --val-every 0 --log-every 5 --metrics-file "$metrics" || return $?
    "$py" - "$metrics" <<'EOF'
import json, sys
losses = [json.loads(line)["loss"] for line in open(sys.argv[1])]
first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
print(f"loss: first 3 steps {first:.4f}, last 3 steps {last:.4f} over {len(losses)} steps")
sys.exit(0 if last < first else "the loss did not fall")
EOF
}

case "$call" in
1)
    step versions versions
    step "pytest -m gpu" "$py" -m pytest -m gpu -q -p no:cacheprovider -rs tests
    step "train (1 GPU, NCCL)" train
    ;;
2)
    step versions versions
    step "kernels v3" "$py" -m bench.kernels --shapes v3 --comm-sms 20 --out "$out"
    step "overlap trace + host vs GPU (small, 2 layers)" "$py" -m bench.gpu_overlap_trace --preset small --layers 2 --out "$out"
    gzip -f "$out"/overlap-trace-*.json  # Perfetto and chrome://tracing open .json.gz; keeps it under 16 MiB
    ;;
3)
    step versions versions
    step "kernels v3" "$py" -m bench.kernels --shapes v3 --comm-sms 20 --out "$out"
    step "overlap trace + host vs GPU (small, all layers)" "$py" -m bench.gpu_overlap_trace --preset small --layers 0 --reps 3 --out "$out"
    gzip -f "$out"/overlap-trace-*.json
    step "pytest -m multigpu (collection; skips on one GPU)" "$py" -m pytest -m multigpu -q -p no:cacheprovider -rs tests
    ;;
esac
echo "session call $call on $device: exit $status; files in $out" | tee -a "$log"
exit "$status"

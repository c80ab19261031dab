#!/usr/bin/env bash
# The one-GPU check (../shared/GPU_CHECKLIST.md): ONE run of at most 9 minutes on one GPU, every step under
# its own `timeout`, in priority order, so that what matters most has run when a later step overruns:
#   1. versions (device, torch, Triton, CUDA), then `pytest -m gpu`
#   2. the kernels at DeepSeek-V3 shapes, each output checked against its torch reference, then timed
#      against torch's own (python -m bench.kernels)
#   3. a full-width slice of the deepseek-v3 preset trained on one GPU, bf16 and --fp8: loss, tokens/s, MFU,
#      peak memory against the pre-flight estimate, host syncs per step (python -m bench.gpu_model)
#   4. the overlap on one GPU: the all-to-all emulated on the communication stream at a link's bandwidth, one
#      overlapped pair's CUDA-event timeline, its hidden fraction and a profiler trace
#      (python -m bench.gpu_overlap_trace --emulated-gbps)
#
#   bash bench/gpu_session.sh             # the check
#   bash bench/gpu_session.sh --dry-run   # each step with its time budget; runs nothing (any machine)
#
# Written for the lent machine: one H200, torch 2.11 + cu130, Triton 3.6, no DeepEP, no nsys, no network;
# run from the repository root without installing (PYTHONPATH=. is set here). Where pytest is missing,
# `pip install --target build/pydeps pytest` on a machine with a network and carry build/pydeps.
# Files go to $OUT (what the device tool brings back, at most 8 files), or bench/results when OUT is unset,
# named <what>-<gpu>-<date>; copy them into bench/results/ afterwards. Exit status: the first failed step's.
# Machines with 2+ GPUs (DeepEP, expert parallelism, pytest -m multigpu): bench/cluster_session.sh.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash bench/gpu_session.sh [--dry-run]   (the one-GPU check; 2+ GPUs: bench/cluster_session.sh)"
dry=0
case "${1:-}" in
--dry-run) dry=1 ;;
"") ;;
-h | --help) echo "$usage"; exit 0 ;;
*) echo "$usage" >&2; exit 2 ;;
esac
[ $# -le 1 ] || { echo "$usage" >&2; exit 2; }
py=${PYTHON:-python3}
out=${OUT:-bench/results}
log=/dev/null
status=0
source bench/gpu_common.sh
tag="$(gpu_name)-$(date -u +%Y%m%d)"

# Budgets in seconds, summing to 9 minutes (the machine is lent for 15 in all, start-up included: this leaves
# room for one rerun). The model step is the longest: two trainings at DeepSeek-V3's width, each warming up
# (autotuning) the Triton kernels first.
budgets=(versions:15 pytest:135 kernels:120 model:180 overlap:90)
total=0
for b in "${budgets[@]}"; do total=$((total + ${b#*:})); done
budget() { local b; for b in "${budgets[@]}"; do [ "${b%%:*}" = "$1" ] && echo "${b#*:}"; done; }

if [ "$dry" = 1 ]; then
    echo "dry run of the one-GPU check: $total s in all ($((total / 60)) min $((total % 60)) s); none of it runs"
else
    mkdir -p "$out"
    log="$out/gpu-session-$tag.log"
    : >"$log"
    started=$(mktemp)  # what the check writes is newer than this
fi

step versions "$(budget versions)" versions
# Not -x: on a first contact every failing test is worth its line, and the step's timeout bounds the whole.
step "pytest -m gpu" "$(budget pytest)" "$py" -m pytest -m gpu -q -p no:cacheprovider -rs --durations=5 tests
# --budget-s: it starts no new op past 90 s, so that its results and costs file are written before the timeout.
step "kernels at DeepSeek-V3 shapes" "$(budget kernels)" "$py" -m bench.kernels --shapes v3 --comm-sms 20 \
    --budget-s 90 --out "$out" --costs-out "$out/kernel-costs-$tag.json"
step "deepseek-v3 slice on one GPU, bf16 and FP8" "$(budget model)" "$py" -m bench.gpu_model --out "$out"
# 50 GB/s: one GPU's share of the inter-node link in DeepSeek-V3's cluster (a 400 Gb/s InfiniBand NIC per GPU).
step "overlap on one GPU, emulated all-to-all" "$(budget overlap)" "$py" -m bench.gpu_overlap_trace \
    --emulated-gbps 50 --out "$out"

if [ "$dry" = 0 ]; then
    files=$(find "$out" -type f -newer "$started" | wc -l)
    rm -f "$started"
    echo "the check wrote $files files to $out (the device tool brings back 8)" | tee -a "$log"
fi
echo "one-GPU check on $tag: exit $status" | tee -a "$log"
exit "$status"

#!/usr/bin/env bash
# Everything a session with one GPU should run, in one call (the device tool bills by the minute):
# the gpu test tier, the kernel benchmark at DeepSeek-V3 shapes, results into $OUT (or bench/results).
#   bash bench/gpu_session.sh            # on the GPU machine, from the repository root
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench/results}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu-session-device.txt"
python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$out/gpu-session-tests.txt"
tests=${PIPESTATUS[0]}
python3 -m bench.kernels --shapes small --out "$out" 2>&1 | tee "$out/gpu-session-kernels-small.txt"
python3 -m bench.kernels --shapes v3 --comm-sms 20 --out "$out" 2>&1 | tee "$out/gpu-session-kernels-v3.txt"
exit "$tests"

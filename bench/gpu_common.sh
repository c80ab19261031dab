# Shared by bench/gpu_session.sh (one GPU) and bench/cluster_session.sh (a machine with 2+ GPUs); sourced,
# never run. The caller sets: dry (1: print the plan only), log (a file, /dev/null in a dry run), py (the
# Python), and status=0 (the first failed step's exit code ends up there). It exports the variables that the
# caller's step functions read, since a step runs in a child shell (step below).

export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export py
# pytest and its few dependencies where the machine lacks them and has no network: installed here with
# `pip install --target build/pydeps pytest` and carried (build/ is ignored by git).
if [ -d build/pydeps ]; then export PYTHONPATH="$PYTHONPATH:$PWD/build/pydeps"; fi

gpu_name() {  # the first GPU's name, as a file-name part ("nogpu" without nvidia-smi or a GPU)
    local name
    name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 | tr -c 'A-Za-z0-9.\n' '_' | tr -d '\n')
    echo "${name:-nogpu}"
}

step() {  # step NAME BUDGET_S COMMAND...: run under `timeout`, log, keep the first failure (a dry run prints only)
    local name=$1 budget=$2
    shift 2
    echo "=== $name (budget ${budget} s): $*" | tee -a "$log"
    [ "$dry" = 1 ] && return 0
    local t0=$SECONDS
    # --kill-after: a command that ignores SIGTERM still ends. A torchrun launched inside a step kills its own
    # workers (they run in sessions of their own, out of timeout's reach): bench/process_tree.py. A shell
    # function runs in a child bash that is given every function (the variables they read are exported).
    local run=("$@")
    if declare -F "$1" >/dev/null; then run=(bash -c "$(declare -f); set -o pipefail; \"\$@\"" "$1" "$@"); fi
    timeout --kill-after=15 "$budget" "${run[@]}" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    local why=""
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then why=" (over its budget of $budget s)"; fi
    echo "=== $name: exit $rc after $((SECONDS - t0)) s$why" | tee -a "$log"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
    return 0
}

note() {  # note TEXT: a line of the plan that runs nothing (printed in a dry run too)
    echo "=== note: $*" | tee -a "$log"
}

versions() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$py" - <<'EOF'
import sys
import torch
nccl = torch.cuda.nccl.version() if torch.cuda.is_available() else "none"  # a tuple on recent torch
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl)
for name in ("triton", "transformers", "pytest"):
    try:
        print(name, __import__(name).__version__)
    except ImportError:
        print(f"{name}: not installed")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "sm", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count, "GiB", round(p.total_memory / 2**30, 1))
EOF
}

#!/usr/bin/env bash
# The GPU checklist (../shared/GPU_CHECKLIST.md) in calls of the device tool, one per argument:
#   bash bench/gpu_session.sh 1   # does it work at all: versions, pytest -m gpu, one-GPU training runs in bf16 and FP8 (~10 min)
#   bash bench/gpu_session.sh 2   # how fast: kernels at V3 shapes, the overlap trace, host vs GPU per sub-stage
#   bash bench/gpu_session.sh 3   # measure again after a fix: kernels, the overlap at the full small preset,
#                                 # and the multigpu tier's collection (it skips on one GPU, saying why)
#   bash bench/gpu_session.sh 4 [PART...]   # a machine with 2+ GPUs, parts in this order (default: all):
#       deepep  DeepEP V1 built at its pinned commit, then DeepEP's own tests/test_intranode.py on 2, 4 or 8 GPUs
#       ours    pytest -m multigpu: our dispatchers at 2 and 4 ranks, one ep step at ep = every local GPU (up
#               to 8) in the host-synced and the sync-free mode, DualPipeV pp=2 x ep=2 against one process
#       train   pp=2 x ep=4 (fewer ranks on fewer GPUs), alltoall then deepep, each at
#               CUDA_DEVICE_MAX_CONNECTIONS=1 and 32, under nsys when it is installed
#       v2      deepep-v2 last (DeepEP main: ElasticBuffer, NCCL >= 2.30.4): its tests, ours, one training run
#     On one GPU it says that DeepEP intranode with one rank is not possible and runs what one GPU allows
#     (the builds, the import checks, the multigpu tier's skips).
#   bash bench/gpu_session.sh --dry-run N [PART...]   # print call N's steps without running any
#     (NGPUS=8 plans call 4 for 8 GPUs on any machine; nothing is written)
# Written for the lent machine: torch 2.11 + cu130, Triton 3.6, no network, run from the repository root
# without installing (pyproject pins a newer torch): PYTHONPATH=. is set here. Files go to $OUT (what the
# device tool brings back; at most 8 per call, so each call writes few) or bench/results when OUT is unset,
# named <what>-<machine>-<date> (the machine: its GPU, and for call 4 the GPU count too); copy them into
# bench/results/ afterwards. Exit status: the first failed step.
# Call 4 finds no DeepEP on the machine and no network to fetch it: carry the sources (build/ is ignored by
# git, so name the folders in the device tool's carry) and it builds them in place:
#   DEEPEP_SRC     default build/DeepEP: git clone https://github.com/deepseek-ai/DeepEP at DEEPEP_V1_COMMIT
#                  (moe/dispatch/deepep.py); an installed deep_ep serves where the folder is absent
#   DEEPEP_V2_SRC  default build/DeepEP-v2: the same repository at main (V2), for the v2 part
# Call 4 runs longer than one 10-minute command on 8 GPUs (two DeepEP builds, four profiled trainings): split
# it over calls by part, e.g. `4 deepep ours` then `4 train v2`.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
usage="usage: bash bench/gpu_session.sh [--dry-run] 1|2|3|4 [PART...] (parts of call 4: deepep ours train v2)"
dry=0
if [ "${1:-}" = --dry-run ]; then
    dry=1
    shift
fi
call=${1:-}
case "$call" in 1 | 2 | 3 | 4) shift ;; *) echo "$usage" >&2; exit 2 ;; esac
parts=("$@")
if [ "$call" = 4 ] && [ ${#parts[@]} -eq 0 ]; then parts=(deepep ours train v2); fi
for part in "${parts[@]}"; do
    case "$call:$part" in 4:deepep | 4:ours | 4:train | 4:v2) ;; *) echo "$usage" >&2; exit 2 ;; esac
done
out=${OUT:-bench/results}
py=${PYTHON:-python3}
device=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n1 | tr -c 'A-Za-z0-9.\n' '_' | tr -d '\n')
device=${device:-nogpu}
ngpus=${NGPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')}
machine=$device
if [ "$call" = 4 ]; then machine="${ngpus}x$device"; fi
tag="$machine-$(date -u +%Y%m%d)"
log="$out/session$call-$tag.log"
if [ "$dry" = 1 ]; then
    log=/dev/null
    echo "dry run of call $call on $machine: the steps, none of them run"
else
    mkdir -p "$out"
fi
status=0

step() {  # step NAME COMMAND...: run, log, keep the first failure (a dry run prints it only); NAME has no ": "
    local name=$1
    shift
    echo "=== $name: $*" | tee -a "$log"
    [ "$dry" = 1 ] && return 0
    local t0=$SECONDS
    "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
    if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
    return 0
}

note() {  # note TEXT: a line of the plan that runs nothing (printed in a dry run too)
    echo "=== note: $*" | tee -a "$log"
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
train() {  # train NAME [FLAG...]: the one-GPU run (bf16) with extra flags; its loss must fall
    local name=$1
    shift
    local metrics="$out/train-$name-metrics-$tag.jsonl"
    rm -f "$metrics"
    torchrun --standalone --nproc-per-node 1 examples/train.py --preset small --layers 4 --pp 1 --ep 1 \
        --schedule dualpipev --overlap --dtype bfloat16 --steps 30 --seq-len 256 --micro-batch-size 2 \
        --val-every 0 --log-every 5 --metrics-file "$metrics" "$@" || return $?
    "$py" - "$metrics" <<'EOF'
import json, sys
losses = [json.loads(line)["loss"] for line in open(sys.argv[1])]
first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
print(f"loss: first 3 steps {first:.4f}, last 3 steps {last:.4f} over {len(losses)} steps")
sys.exit(0 if last < first else "the loss did not fall")
EOF
}

fp8_tracks_bf16() {  # the Triton FP8 run's loss within 1% (relative) of the bf16 run's after step 5, as on CPU
    "$py" - "$out/train-bf16-metrics-$tag.jsonl" "$out/train-fp8-metrics-$tag.jsonl" <<'EOF'
import json, sys
bf16, fp8 = ({r["step"]: r["loss"] for r in map(json.loads, open(path))} for path in sys.argv[1:])
worst = max(abs(fp8[s] - bf16[s]) / bf16[s] for s in bf16 if s > 5)
print(f"FP8 vs bf16: worst relative loss difference after step 5: {worst:.4f} (CPU tests hold 0.01)")
sys.exit(0 if worst < 0.01 else "FP8 drifts from bf16")
EOF
}

# ---- call 4 -----------------------------------------------------------------------------------------------
pinned=$(sed -n 's/^DEEPEP_V1_COMMIT = "\([0-9a-f]*\)"$/\1/p' moe/dispatch/deepep.py)
v1_src=${DEEPEP_SRC:-build/DeepEP}
v2_src=${DEEPEP_V2_SRC:-build/DeepEP-v2}
runs=${TMPDIR:-/tmp}/gpu-session4-$$  # metrics and profiles, bundled into one file at the end
# ep over every local GPU that DeepEP's intranode kernels take (2, 4 or 8); training at pp=2 x ep=4 on 8 GPUs.
ep=0
for n in 2 4 8; do if [ "$ngpus" -ge "$n" ]; then ep=$n; fi; done
if [ "$ngpus" -ge 8 ]; then pp=2 tep=4; elif [ "$ngpus" -ge 4 ]; then pp=2 tep=2; else pp=1 tep=2; fi

with_deepep() {  # with_deepep SRC COMMAND...: COMMAND with the DeepEP built in SRC first on the path (if any)
    local src=$1
    shift
    if [ -d "$src" ]; then PYTHONPATH="$src:$PYTHONPATH" "$@"; else "$@"; fi
}

deepep_build() {  # deepep_build SRC [COMMIT]: build SRC's extension in place, unless its deep_ep imports already
    local src=$1 want=${2:-}
    if [ ! -d "$src" ]; then
        if "$py" -c "import deep_ep" 2>/dev/null; then
            echo "no DeepEP source at $src: using the installed deep_ep"
            return 0
        fi
        echo "no DeepEP source at $src and no deep_ep installed: clone https://github.com/deepseek-ai/DeepEP" \
            "${want:+at $want }into $src and carry it (this machine has no network)"
        return 1
    fi
    if [ -n "$want" ] && [ -e "$src/.git" ]; then
        local have
        have=$(git -C "$src" rev-parse HEAD) || return 1
        if [ "$have" != "$want" ]; then
            echo "$src is at $have, not the pinned $want"
            return 1
        fi
    fi
    if with_deepep "$src" "$py" -c "import deep_ep" 2>/dev/null; then
        echo "$src: deep_ep imports, already built"
        return 0
    fi
    (cd "$src" && TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} "$py" setup.py build_ext --inplace)
}

describe() {  # describe KIND: what the backend sees of the deep_ep on the path (the dispatcher's own import)
    "$py" - "$1" <<'EOF'
import sys
if sys.argv[1] == "deepep":
    from moe.dispatch.deepep import deep_ep_api, import_deep_ep
    print(deep_ep_api(import_deep_ep()).describe())
else:
    from moe.dispatch.deepep_common import import_deep_ep
    from moe.dispatch.deepep_v2 import DEEPEP_V2_INSTALL_HINT
    module = import_deep_ep(DEEPEP_V2_INSTALL_HINT, needs="ElasticBuffer")
    print("DeepEP", getattr(module, "__version__", "?"), "with ElasticBuffer, from", module.__file__)
EOF
}

# The pp x ep training runs: the small preset's shapes (hidden 1024, 64 experts, top-8) over 8 layers.
train_flags=(--preset small --layers 8 --schedule dualpipev --overlap --dtype bfloat16 --steps 20 --seq-len 1024
    --micro-batch-size 2 --val-every 0 --log-every 5)

train_ep() {  # train_ep NAME CONNECTIONS FLAGS...: examples/train.py on pp x tep GPUs, metrics and profile in $runs
    local name=$1 connections=$2
    shift 2
    local cmd=(torchrun --standalone --nproc-per-node $((pp * tep)) examples/train.py "$@"
        --metrics-file "$runs/$name.jsonl")
    if command -v nsys >/dev/null; then
        cmd=(nsys profile --trace cuda,nvtx,osrt --force-overwrite true --output "$runs/$name" "${cmd[@]}")
    else
        echo "nsys is not installed: $name runs without a profile"
    fi
    CUDA_DEVICE_MAX_CONNECTIONS=$connections "${cmd[@]}"
}

summary() {  # tokens/s (median after 5 warm-up steps) and the loss of every training run, one JSON file
    "$py" - "$runs" "$out/session4-summary-$tag.json" <<'EOF'
import json, pathlib, statistics, sys
runs = {}
for path in sorted(pathlib.Path(sys.argv[1]).glob("train-*.jsonl")):
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steady = [r["tokens_per_s"] for r in records[5:]] or [r["tokens_per_s"] for r in records]
    runs[path.stem] = {"steps": len(records), "tokens_per_s_median": statistics.median(steady) if steady else None,
                       "loss_first": records[0]["loss"] if records else None,
                       "loss_last": records[-1]["loss"] if records else None}
    print(f"{path.stem:40s} {runs[path.stem]['tokens_per_s_median'] or 0:10.0f} tok/s  loss "
          f"{runs[path.stem]['loss_first']} -> {runs[path.stem]['loss_last']}")
pathlib.Path(sys.argv[2]).write_text(json.dumps(runs, indent=1) + "\n")
EOF
}

bundle() {  # one archive of $runs (the device tool returns 8 files): metrics, nsys kernel summaries, reports
    if command -v nsys >/dev/null; then
        for rep in "$runs"/*.nsys-rep; do
            [ -e "$rep" ] && nsys stats --report cuda_gpu_kern_sum,nvtx_sum --format csv --output "${rep%.nsys-rep}" "$rep"
        done
    fi
    local skip=(--exclude '*.sqlite')
    if [ "$(du -sm --exclude '*.sqlite' "$runs" | cut -f1)" -ge 15 ]; then
        echo "the nsys reports pass the device tool's 16 MiB: only their summaries go into the archive"
        skip+=(--exclude '*.nsys-rep')
    fi
    tar czf "$out/session4-runs-$tag.tar.gz" "${skip[@]}" -C "$runs" .
}

built_v1=0
need_v1() {  # the V1 build step, once per call (the parts that use it each ask)
    [ "$built_v1" = 1 ] && return 0
    built_v1=1
    step "DeepEP V1 build ($v1_src at ${pinned:0:7})" deepep_build "$v1_src" "$pinned"
}

call4() {
    step versions versions
    step "GPUs and their links" nvidia-smi topo -m
    local multi=1
    if [ "$ngpus" -lt 2 ]; then
        multi=0
        note "$ngpus GPU: DeepEP intranode with one rank is not possible (its kernels run 2, 4 or 8 ranks of one" \
            "node), nor is expert parallelism: DeepEP's tests, the ep runs and the pp x ep training are skipped;" \
            "the builds, the import checks and the multigpu tier's skips still run"
    fi
    [ "$dry" = 1 ] || mkdir -p "$runs"
    local part trained=0
    for part in deepep ours train v2; do  # this order whatever the command line's: deepep-v2 last
        [[ " ${parts[*]} " == *" $part "* ]] || continue
        case "$part" in
        deepep)
            need_v1
            step "DeepEP V1 as the deepep backend sees it" with_deepep "$v1_src" describe deepep
            if [ "$multi" = 1 ]; then
                step "DeepEP's own tests/test_intranode.py on $ep GPUs" \
                    with_deepep "$v1_src" "$py" "$v1_src/tests/test_intranode.py" --num-processes "$ep"
            fi
            ;;
        ours)
            need_v1
            local what="ep = $ep, alltoall and deepep, synced and sync-free"
            [ "$multi" = 1 ] || what="it skips on one GPU, saying why"
            step "pytest -m multigpu ($what)" with_deepep "$v1_src" \
                "$py" -m pytest -m multigpu -q -p no:cacheprovider -rs tests -k "not deepep-v2"
            ;;
        train)
            if [ "$multi" = 1 ]; then
                need_v1
                trained=1
                local d c
                for d in alltoall deepep; do
                    for c in 1 32; do
                        step "train pp=$pp x ep=$tep $d CUDA_DEVICE_MAX_CONNECTIONS=$c" with_deepep "$v1_src" \
                            train_ep "train-pp$pp-ep$tep-$d-cdmc$c" "$c" --pp "$pp" --ep "$tep" --dispatcher "$d" \
                            "${train_flags[@]}"
                    done
                done
            fi
            ;;
        v2)
            step "DeepEP V2 build ($v2_src)" deepep_build "$v2_src"
            step "DeepEP V2 as the deepep-v2 backend sees it" with_deepep "$v2_src" describe deepep-v2
            if [ "$multi" = 1 ]; then
                step "DeepEP V2's own tests/elastic/test_ep.py on $ep GPUs" \
                    with_deepep "$v2_src" "$py" "$v2_src/tests/elastic/test_ep.py" --num-processes "$ep"
            fi
            step "pytest -m multigpu -k deepep-v2" with_deepep "$v2_src" \
                "$py" -m pytest -m multigpu -q -p no:cacheprovider -rs tests -k deepep-v2
            if [ "$multi" = 1 ]; then
                trained=1
                step "train pp=$pp x ep=$tep deepep-v2 CUDA_DEVICE_MAX_CONNECTIONS=1" with_deepep "$v2_src" \
                    train_ep "train-pp$pp-ep$tep-deepep-v2-cdmc1" 1 --pp "$pp" --ep "$tep" --dispatcher deepep-v2 \
                    "${train_flags[@]}"
            fi
            ;;
        esac
    done
    if [ "$trained" = 1 ]; then
        step "tokens/s and loss per training run" summary
        step "bundle the runs into session4-runs-$tag.tar.gz" bundle
    fi
}

case "$call" in
1)
    step versions versions
    step "pytest -m gpu" "$py" -m pytest -m gpu -q -p no:cacheprovider -rs tests
    step "train (1 GPU, NCCL)" train bf16
    step "train FP8 (1 GPU, Triton FP8 GEMMs, FP8 activations)" train fp8 --fp8 --fp8-activations
    step "FP8 loss tracks bf16" fp8_tracks_bf16
    ;;
2)
    step versions versions
    step "kernels v3" "$py" -m bench.kernels --shapes v3 --comm-sms 20 --out "$out"
    step "overlap trace + host vs GPU (small, 2 layers)" "$py" -m bench.gpu_overlap_trace --preset small --layers 2 --out "$out"
    # Perfetto and chrome://tracing open .json.gz; keeps it under 16 MiB
    step "gzip the trace" gzip -f "$out"/overlap-trace-*.json
    ;;
3)
    step versions versions
    step "kernels v3" "$py" -m bench.kernels --shapes v3 --comm-sms 20 --out "$out"
    step "overlap trace + host vs GPU (small, all layers)" "$py" -m bench.gpu_overlap_trace --preset small --layers 0 --reps 3 --out "$out"
    step "gzip the trace" gzip -f "$out"/overlap-trace-*.json
    step "pytest -m multigpu (collection; skips on one GPU)" "$py" -m pytest -m multigpu -q -p no:cacheprovider -rs tests
    ;;
4)
    call4
    ;;
esac
[ "$dry" = 1 ] || rm -rf "$runs"
echo "session call $call on $machine: exit $status; files in $out" | tee -a "$log"
exit "$status"

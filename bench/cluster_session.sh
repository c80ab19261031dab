#!/usr/bin/env bash
# The multi-GPU checks, for a machine with 2+ GPUs (the one-GPU check is bench/gpu_session.sh). Parts, run in
# this order whatever the command line's (default: all):
#   deepep  DeepEP V1 built at its pinned commit, then DeepEP's own tests/test_intranode.py on 2, 4 or 8 GPUs
#   ours    pytest -m multigpu: our dispatchers at 2 and 4 ranks, one ep step at ep = every local GPU (up
#           to 8) in the host-synced and the sync-free mode, DualPipeV pp=2 x ep=2 against one process
#   train   pp=2 x ep=4 (fewer ranks on fewer GPUs), alltoall then deepep, each at
#           CUDA_DEVICE_MAX_CONNECTIONS=1 and 32, under nsys when it is installed
#   v2      deepep-v2 last (DeepEP main: ElasticBuffer, NCCL >= 2.30.4): its tests, ours, one training run
# On one GPU it says that DeepEP intranode with one rank is not possible and runs what one GPU allows (the
# builds, the import checks, the multigpu tier's skips).
#
#   bash bench/cluster_session.sh [PART...]
#   bash bench/cluster_session.sh --dry-run [PART...]   # the steps and their time limits; runs nothing
#                                                       # (NGPUS=8 plans for 8 GPUs on any machine)
#
# Run from the repository root without installing (PYTHONPATH=. is set here). Files go to $OUT or
# bench/results, named <what>-<N>x<gpu>-<date>; everything of the training runs is bundled into one archive.
# With no network to fetch DeepEP, carry its sources (build/ is ignored by git) and they are built in place:
#   DEEPEP_SRC     default build/DeepEP: git clone https://github.com/deepseek-ai/DeepEP at DEEPEP_V1_COMMIT
#                  (moe/dispatch/deepep.py); an installed deep_ep serves where the folder is absent
#   DEEPEP_V2_SRC  default build/DeepEP-v2: the same repository at main (V2), for the v2 part
# All parts on 8 GPUs run longer than 10 minutes (two DeepEP builds, four profiled trainings): where one
# command is limited, split them, e.g. `deepep ours` then `train v2`. Exit status: the first failed step's.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash bench/cluster_session.sh [--dry-run] [PART...] (parts: deepep ours train v2)"
dry=0
if [ "${1:-}" = --dry-run ]; then
    dry=1
    shift
fi
parts=("$@")
if [ ${#parts[@]} -eq 0 ]; then parts=(deepep ours train v2); fi
for part in "${parts[@]}"; do
    case "$part" in deepep | ours | train | v2) ;; *) echo "$usage" >&2; exit 2 ;; esac
done
py=${PYTHON:-python3}
out=${OUT:-bench/results}
log=/dev/null
status=0
source bench/gpu_common.sh
ngpus=${NGPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')}
machine="${ngpus}x$(gpu_name)"
tag="$machine-$(date -u +%Y%m%d)"
if [ "$dry" = 1 ]; then
    echo "dry run on $machine: the steps, none of them run"
else
    mkdir -p "$out"
    log="$out/cluster-session-$tag.log"
fi
# Time limits per kind of step (seconds): generous, they only stop a hung step.
build_s=1800 test_s=1200 train_s=900 short_s=120

pinned=$(sed -n 's/^DEEPEP_V1_COMMIT = "\([0-9a-f]*\)"$/\1/p' moe/dispatch/deepep.py)
v1_src=${DEEPEP_SRC:-build/DeepEP}
v2_src=${DEEPEP_V2_SRC:-build/DeepEP-v2}
runs=${TMPDIR:-/tmp}/cluster-session-$$  # metrics and profiles, bundled into one file at the end
# ep over every local GPU that DeepEP's intranode kernels take (2, 4 or 8); training at pp=2 x ep=4 on 8 GPUs.
ep=0
for n in 2 4 8; do if [ "$ngpus" -ge "$n" ]; then ep=$n; fi; done
if [ "$ngpus" -ge 8 ]; then pp=2 tep=4; elif [ "$ngpus" -ge 4 ]; then pp=2 tep=2; else pp=1 tep=2; fi
export py out tag runs pp tep  # read by the step functions below, which run in a child shell

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
    "$py" - "$runs" "$out/cluster-summary-$tag.json" <<'EOF'
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
    tar czf "$out/cluster-runs-$tag.tar.gz" "${skip[@]}" -C "$runs" .
}

built_v1=0
need_v1() {  # the V1 build step, once per run (the parts that use it each ask)
    [ "$built_v1" = 1 ] && return 0
    built_v1=1
    step "DeepEP V1 build ($v1_src at ${pinned:0:7})" "$build_s" deepep_build "$v1_src" "$pinned"
}

step versions "$short_s" versions
step "GPUs and their links" "$short_s" nvidia-smi topo -m
multi=1
if [ "$ngpus" -lt 2 ]; then
    multi=0
    note "$ngpus GPU: DeepEP intranode with one rank is not possible (its kernels run 2, 4 or 8 ranks of one" \
        "node), nor is expert parallelism: DeepEP's tests, the ep runs and the pp x ep training are skipped;" \
        "the builds, the import checks and the multigpu tier's skips still run"
fi
[ "$dry" = 1 ] || mkdir -p "$runs"
trained=0
for part in deepep ours train v2; do  # this order whatever the command line's: deepep-v2 last
    [[ " ${parts[*]} " == *" $part "* ]] || continue
    case "$part" in
    deepep)
        need_v1
        step "DeepEP V1 as the deepep backend sees it" "$short_s" with_deepep "$v1_src" describe deepep
        if [ "$multi" = 1 ]; then
            step "DeepEP's own tests/test_intranode.py on $ep GPUs" "$test_s" \
                with_deepep "$v1_src" "$py" "$v1_src/tests/test_intranode.py" --num-processes "$ep"
        fi
        ;;
    ours)
        need_v1
        what="ep = $ep, alltoall and deepep, synced and sync-free"
        [ "$multi" = 1 ] || what="it skips on one GPU, saying why"
        step "pytest -m multigpu ($what)" "$test_s" with_deepep "$v1_src" \
            "$py" -m pytest -m multigpu -q -p no:cacheprovider -rs tests -k "not deepep-v2"
        ;;
    train)
        if [ "$multi" = 1 ]; then
            need_v1
            trained=1
            for d in alltoall deepep; do
                for c in 1 32; do
                    step "train pp=$pp x ep=$tep $d CUDA_DEVICE_MAX_CONNECTIONS=$c" "$train_s" with_deepep "$v1_src" \
                        train_ep "train-pp$pp-ep$tep-$d-cdmc$c" "$c" --pp "$pp" --ep "$tep" --dispatcher "$d" \
                        "${train_flags[@]}"
                done
            done
        fi
        ;;
    v2)
        step "DeepEP V2 build ($v2_src)" "$build_s" deepep_build "$v2_src"
        step "DeepEP V2 as the deepep-v2 backend sees it" "$short_s" with_deepep "$v2_src" describe deepep-v2
        if [ "$multi" = 1 ]; then
            step "DeepEP V2's own tests/elastic/test_ep.py on $ep GPUs" "$test_s" \
                with_deepep "$v2_src" "$py" "$v2_src/tests/elastic/test_ep.py" --num-processes "$ep"
        fi
        step "pytest -m multigpu -k deepep-v2" "$test_s" with_deepep "$v2_src" \
            "$py" -m pytest -m multigpu -q -p no:cacheprovider -rs tests -k deepep-v2
        if [ "$multi" = 1 ]; then
            trained=1
            step "train pp=$pp x ep=$tep deepep-v2 CUDA_DEVICE_MAX_CONNECTIONS=1" "$train_s" with_deepep "$v2_src" \
                train_ep "train-pp$pp-ep$tep-deepep-v2-cdmc1" 1 --pp "$pp" --ep "$tep" --dispatcher deepep-v2 \
                "${train_flags[@]}"
        fi
        ;;
    esac
done
if [ "$trained" = 1 ]; then
    step "tokens/s and loss per training run" "$short_s" summary
    step "bundle the runs into cluster-runs-$tag.tar.gz" "$short_s" bundle
fi
[ "$dry" = 1 ] || rm -rf "$runs"
echo "cluster checks on $machine: exit $status; files in $out" | tee -a "$log"
exit "$status"

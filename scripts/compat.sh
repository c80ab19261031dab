#!/usr/bin/env bash
# Check the project on another torch release, beside the pinned .venv.
#
# Usage: bash scripts/compat.sh VERSION      (VERSION: a torch release from the floor on, e.g. 2.11.0)
#
# Creates .venv-torch-VERSION (kept for reruns), installs torch==VERSION from the package index (on Linux
# that is its CUDA build, which runs on CPU too), then the project with its test extras, which must keep that
# torch. Then runs, with logs in .venv-torch-VERSION/compat-*.log:
#   1. the test suite's quick tier, pytest -m "not slow" (all but the few multi-minute tests; the GPU
#      tests skip without CUDA and the emulated-cluster ones unless DUALPIPE_CLUSTER_TESTS=1);
#   2. the main job: torchrun --standalone --nproc-per-node 4 examples/train.py --config examples/configs/tiny.toml;
#   3. the same job with ZeRO-1 (--zero 1: optimizer state sharded over the data-parallel ranks).
# Ends with one summary line; exit 0 only when all three passed and each job's loss fell.
# A machine whose pip constraints cap torch below VERSION needs them lifted for this command
# (PIP_CONFIG_FILE=/dev/null bash scripts/compat.sh VERSION reads no pip config file).
set -euo pipefail
cd "$(dirname "$0")/.."
usage="usage: bash scripts/compat.sh VERSION (a torch release, e.g. 2.11.0; --help for more)"
case "${1:-}" in
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
esac
if [ $# -ne 1 ] || ! [[ $1 =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
    echo "$usage" >&2
    exit 2
fi
version=$1
PY=${PYTHON:-python3}
floor=$("$PY" scripts/torch_range.py floor)
if ! "$PY" scripts/torch_range.py keep "$version"; then
    echo "compat: torch $version is below the project's floor $floor (pyproject.toml)" >&2
    exit 2
fi
venv=.venv-torch-$version
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
py=$venv/bin/python
pip_install() { "$py" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored" || true; }
start=$SECONDS
pip_install "torch==$version"
# torch==$version already satisfies torch>=floor, so pip leaves it in place (checked below)
pip_install -e ".[test]"
got=$("$py" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || echo none)
if [ "$got" != "$version" ]; then
    echo "compat: torch $version wanted in $venv, found $got after installing the project" >&2
    exit 1
fi
# Triton 3.6's CPU interpreter (torch 2.11's Triton) turns one-element blocks into ints in a way numpy 2.4
# refuses ("only 0-dimensional arrays can be converted to Python scalars"), and the kernel tests run there;
# Triton 3.9's does not (3.7 and 3.8 unchecked, so held back too).
if "$py" -c "import sys, triton; sys.exit(tuple(map(int, triton.__version__.split('.')[:2])) >= (3, 9))" 2>/dev/null; then
    pip_install "numpy<2.4"
fi
echo "compat: $venv ready (torch $("$py" -c 'import torch; print(torch.__version__)'), $((SECONDS - start)) s)"

# step NAME LOG COMMAND...: run it with its output in LOG (and on the terminal), record its time and status
step() {
    local name=$1 log=$2
    shift 2
    local t0=$SECONDS rc=0
    echo "compat: $name: $*"
    "$@" 2>&1 | tee "$log" || rc=$?
    eval "${name}_rc=$rc ${name}_s=$((SECONDS - t0))"
}
# "loss A -> B" from a training log's first and last step lines, and whether it fell
loss_of() {
    awk '/^step +[0-9]+\/[0-9]+ +loss /{ if (first == "") first = $4; last = $4 }
         END { if (first == "") { print "no step logged"; exit 1 }
               printf "loss %s -> %s", first, last; exit !(last + 0 < first + 0) }' "$1"
}
export DUALPIPE_CLUSTER_TESTS=${DUALPIPE_CLUSTER_TESTS:-0}
job=(examples/train.py --config examples/configs/tiny.toml)
step suite "$venv/compat-suite.log" "$py" -m pytest -m "not slow" -q -p no:cacheprovider
step main "$venv/compat-main.log" "$venv/bin/torchrun" --standalone --nproc-per-node 4 "${job[@]}"
step zero "$venv/compat-zero1.log" "$venv/bin/torchrun" --standalone --nproc-per-node 4 "${job[@]}" --zero 1

# pytest -q's last line: "1 failed, 1272 passed, 41 skipped, 9 deselected in 1323.52s (0:22:03)"
counts=$(grep -E "(passed|failed|error).* in [0-9.]+s" "$venv/compat-suite.log" | tail -1 | sed -E 's/^=+ //; s/ in [0-9.]+s.*//' || true)
main_loss=$(loss_of "$venv/compat-main.log") && main_fell=1 || main_fell=0
zero_loss=$(loss_of "$venv/compat-zero1.log") && zero_fell=1 || zero_fell=0
ok=1
[ "$suite_rc" = 0 ] && [ "$main_rc" = 0 ] && [ "$zero_rc" = 0 ] && [ $main_fell = 1 ] && [ $zero_fell = 1 ] || ok=0
verdict() { [ "$1" = 0 ] && [ "$2" = 1 ] && echo ok || echo "FAILED (exit $1)"; }
echo "compat torch $version $(date -u +%F): $([ $ok = 1 ] && echo PASS || echo FAIL);" \
    "suite (not slow) ${counts:-no summary} in ${suite_s} s;" \
    "main job $(verdict "$main_rc" "$main_fell") ($main_loss, ${main_s} s);" \
    "--zero 1 $(verdict "$zero_rc" "$zero_fell") ($zero_loss, ${zero_s} s)"
[ $ok = 1 ]

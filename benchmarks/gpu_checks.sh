#!/usr/bin/env bash
# Every check that needs a GPU, in one go, for a machine lent for a few minutes: the planner's GPU
# verification (plan_verify.py --gpu), the CUDA tests (pytest -m cuda), the offload step beside
# FSDP2's (offload.py, one short round), and on request `default_run`, the first hour's bare
# `zeroshard train`. Each part runs under its own time limit and none starts after the deadline,
# so one hang costs one part. Logs and JSON go to the folder given (default benchmarks/out/gpu_checks).
#
#     bash benchmarks/gpu_checks.sh [OUT_DIR]        # DEADLINE_S=470 by default
#     PARTS="plan_verify default_run" DEADLINE_S=240 bash benchmarks/gpu_checks.sh   # some parts
#
# The parts together outlast one 10-minute call (benchmarks/README.md gives their times): on a short
# lease run PARTS="plan_verify offload", then PARTS=pytest_cuda at once, on the still-warm machine.
set -u
cd "$(dirname "$0")/.."
out=${1:-benchmarks/out/gpu_checks}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
deadline=$((SECONDS + ${DEADLINE_S:-470}))

part() {  # part NAME LIMIT_S COMMAND...: run COMMAND for at most LIMIT_S (and never past the deadline)
    local name=$1 limit=$2
    shift 2
    local left=$((deadline - SECONDS))
    if ((left < 20)); then
        echo "== $name: not run (the deadline has passed)" | tee -a "$out/summary.txt"
        return
    fi
    ((limit > left)) && limit=$left
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - start)) s (limit $limit s)" | tee -a "$out/summary.txt"
    tail -n 25 "$out/$name.log"
}

{ nvidia-smi -L; "$py" -c "import torch, transformers as t; print(torch.__version__, t.__version__)"; } 2>&1 |
    tee "$out/summary.txt"
# the console script the first-hour test runs (no network: no build isolation, no dependencies)
"$py" -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || echo "install failed"
run_dir=$(mktemp -d)
for name in ${PARTS:-plan_verify offload pytest_cuda}; do
    case $name in
    plan_verify) part plan_verify 240 "$py" benchmarks/plan_verify.py --gpu --steps 4 \
        --json "$out/plan_verify.json"
        "$py" benchmarks/plan_refit.py "$out/plan_verify.json" 2>&1 | tee -a "$out/summary.txt" ;;
    default_run) part default_run 120 bash -c "cd $run_dir && $py -m zeroshard train --nproc 1" ;;
    pytest_cuda) part pytest_cuda 480 "$py" -m pytest -v -p no:cacheprovider -m cuda --durations=8 tests ;;
    offload) part offload 180 "$py" benchmarks/offload.py --rounds 1 --warmup 2 --steps 4 \
        --impls zeroshard_3_offload fsdp2_offload zeroshard_3_offload_params zeroshard_3_offload_sequential
        cp benchmarks/out/offload.md benchmarks/out/offload.json "$out/" 2>/dev/null ;;
    *) echo "unknown part $name (plan_verify, default_run, pytest_cuda, offload)" ;;
    esac
done
true

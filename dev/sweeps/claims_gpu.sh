#!/usr/bin/env bash
# The claim sweeps on the GPU machine (docs/claims_plan.md). Run after tools/gpu_run.sh part1 / setup
# (and bnb for the qlora and nf4 arms), from the repo root:
#   bash dev/sweeps/claims_gpu.sh calibrate            -> results/calibration.json (copied to $OUT)
#   bash dev/sweeps/claims_gpu.sh sweep SPEC MINUTES   -> dev/runs/claims/NAME (resumable), NAME.tgz in $OUT
#   bash dev/sweeps/claims_gpu.sh parallel MINUTES SPEC:N [SPEC:N ...]
#        several sweeps at once on the one GPU, N runs each (their sum within the memory cap)
# MINUTES stops launching new runs; everything still running is killed at KILL_S seconds (default 560,
# under the device's 10-minute call limit) and restarts from scratch on the next call.
# The sweep folder travels with the working tree, so a later call continues where this one stopped.
set -euo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD QERL_GGUF=/tmp/qerl/SmolLM2-135M-Instruct.Q4_1.gguf
export QERL_CACHE=/tmp/qerl/cache HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/qerl/out}
mkdir -p "$OUT"
KILL_S=${KILL_S:-560}
stage=${1:?stage: calibrate | sweep | parallel}

sweep_one() {  # spec minutes concurrency("" = the spec's)
  local spec=$1 minutes=$2 conc=$3 name level temp
  name=$(basename "$spec" .toml)
  level=$(python3 -c "import json; print(json.load(open('results/calibration.json'))['chosen']['level'])")
  temp=$(python3 -c "import json; print(json.load(open('results/calibration.json'))['chosen']['temperature'])")
  timeout --signal=TERM --kill-after=15 "$KILL_S" \
    python3 -m qerl_lib sweep "$spec" --out "dev/runs/claims/$name" --device cuda --max-minutes "$minutes" \
    ${conc:+--concurrency "$conc"} --set data_level="$level" --set temperature="$temp" 2>&1 \
    | tr '\r' '\n' | grep -v "Loading weights" | tail -40 > "$OUT/$name.log" || true
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/$name.log" || true
  tar czf "$OUT/$name.tgz" --exclude=checkpoints --exclude=adapter -C dev/runs/claims "$name"
  tail -8 "$OUT/$name.log"
}
case "$stage" in
  calibrate)
    python3 -m qerl_lib calibrate --json results/calibration.json 2>&1 | tee "$OUT/calibrate.log"
    cp results/calibration.json "$OUT/" ;;
  sweep)
    sweep_one "${2:?spec}" "${3:-7}" "" ;;
  parallel)
    minutes=${2:?minutes}; shift 2
    for item in "$@"; do sweep_one "${item%%:*}" "$minutes" "${item##*:}" & done
    wait ;;
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac

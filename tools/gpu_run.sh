#!/usr/bin/env bash
# GPU runs of the kit, one stage per call of the remote GPU machine (no network there).
# The GPU machine has no network: stage `part1` (carry .gguf_a), then at once `setup` (carry .gguf_b .whl),
# optionally `bnb` (carry .whl_bnb), then the measurement stages. Every stage writes into $OUT and
# prints a short table last. Usage (on the GPU machine, repo root as cwd): bash tools/gpu_run.sh STAGE
# `sweep NAME [ARGS]` runs the development sweep dev/sweeps/NAME.py with OUT set; copy its records from
# $OUT into dev/runs/.
set -euo pipefail
export PYTHONUNBUFFERED=1
export PYTHONPATH=/tmp/site:$PWD
export QERL_GGUF=/tmp/qerl/SmolLM2-135M-Instruct.Q4_1.gguf
export QERL_CACHE=/tmp/qerl/cache
OUT=${OUT:-/tmp/qerl/out}
mkdir -p "$OUT"
PY=python3
stage=${1:?stage: part1 | setup | bnb | tests | gemm | rollout | train | sweep NAME}
case "$stage" in
  part1)
    mkdir -p /tmp/qerl && cp .gguf_a/part1 /tmp/qerl/ && ls -la /tmp/qerl ;;
  setup)
    cat /tmp/qerl/part1 .gguf_b/part2 > "$QERL_GGUF"
    echo "$(cat .gguf_b/sha256)  $QERL_GGUF" | sha256sum -c
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm --format=csv
    $PY -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name(0))"
    $PY -m qerl_lib prepare-model ;;
  bnb)
    $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_bnb/*.whl
    $PY -c "import bitsandbytes; print('bitsandbytes', bitsandbytes.__version__)" ;;
  tests)
    $PY -m pytest -q -m "cuda" -p no:cacheprovider tests 2>&1 | tee "$OUT/cuda_tests.log" ;;
  gemm)
    $PY -m qerl_lib bench gemm --models qwen2.5-7b,qwen2.5-32b --json "$OUT/gemm.json" 2>&1 | tee "$OUT/gemm.log" ;;
  rollout)
    shift; $PY -m qerl_lib bench rollout --json "$OUT/rollout.json" "$@" 2>&1 | tee "$OUT/rollout.log" ;;
  train)
    shift; $PY -m qerl_lib train --preset smollm2-arith --mode qerl --out "$OUT/train" "$@" 2>&1 | tee "$OUT/train.log"
    cp "$OUT/train/metrics.jsonl" "$OUT/train_metrics.jsonl" 2>/dev/null || true ;;
  sweep)
    shift; name=${1:?sweep NAME: a script of dev/sweeps/, e.g. fp4_kernel_sweep_waves}; shift
    OUT="$OUT" $PY "dev/sweeps/$name.py" "$@" 2>&1 | tee "$OUT/$name.log" ;;
  *)
    echo "unknown stage $stage" >&2; exit 2 ;;
esac

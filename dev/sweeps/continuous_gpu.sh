#!/usr/bin/env bash
# GPU check of continuous batching (engine/continuous.py) and of the NVFP4 backward layout (#17, #18).
# Part "tests": the CUDA tests of continuous batching, per-row streams and the FP4 backward.
# Part "rollout": random Qwen2.5-7B NVFP4 + LoRA r16, gsm8k-like lengths up to 1024 tokens, 256-token prompts,
#   a rollout of 256 completions on 32 and on 64 rows: static batches vs continuous batching, same run, 2 repeats.
# Part "gemm": `qerl bench gemm` forward and backward layouts of Qwen2.5-7B at training sizes.
# Run on the device machine from the repository root: bash dev/sweeps/continuous_gpu.sh PART...
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
for part in "$@"; do
  case $part in
    tests)
      python3 -m pytest -q -m cuda tests/test_engine_continuous.py tests/test_row_streams.py tests/test_fp4_backward.py \
        > "$OUT/cuda_tests_continuous_backward.log" 2>&1 || echo "CUDA TESTS FAILED"
      tail -6 "$OUT/cuda_tests_continuous_backward.log" ;;
    rollout)
      python3 -m qerl_lib bench rollout --models qwen2.5-7b --weights nvfp4 --no-hf-baseline --repeats 2 \
        --batch 32,64 --lora-rank 16 --gen-len 1024 --workload gsm8k-like --prompts 256 \
        --scheduling static,continuous --json "$OUT/rollout_continuous_7b.json" ;;
    gemm)
      python3 -m qerl_lib bench gemm --models qwen2.5-7b --m 1024,4096,16384 --layouts hf --directions fwd,bwd \
        --json "$OUT/gemm_fwd_bwd_7b.json" | tail -12 ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done

#!/usr/bin/env bash
# GPU check of the launch rule's 65 <= M < 193 fragment path (kernels/launch_rule.py, run 17, dev/LOG.md section 19):
# the FP4 kernel's CUDA tests, then random Qwen2.5-7B + LoRA r16, batch 128, 256 + 1024 tokens, one repeat, same run:
# NVFP4 with the previous rule (CUBLAS_MIN_M = 65: dequantize + cuBLAS from M = 65), NVFP4 with the new rule, bf16.
# Run on the device machine from the repository root, carrying .whl: bash dev/sweeps/mid_m_rollout_gpu.sh
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pytest -q -m cuda tests/test_fp4_kernel.py > "$OUT/cuda_tests_fp4_kernel.log" 2>&1 || echo "CUDA TESTS FAILED"
tail -3 "$OUT/cuda_tests_fp4_kernel.log"
args="bench rollout --models qwen2.5-7b --no-hf-baseline --repeats 1 --batch 128 --lora-rank 16 --gen-len 1024"
python3 -c "import sys, qerl_lib.kernels.launch_rule as rule; rule.CUBLAS_MIN_M = 65; from qerl_lib.cli import main
sys.exit(main(sys.argv[1:]))" $args --weights nvfp4 --json "$OUT/rollout_b128_nvfp4_rule65.json" | tail -3
python3 -m qerl_lib $args --weights nvfp4,bf16 --json "$OUT/rollout_b128_rule193.json" | tail -4

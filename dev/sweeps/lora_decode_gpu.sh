#!/usr/bin/env bash
# GPU check of kernels/lora.py (the decode step's LoRA in two launches per projection group).
# Part "tests": the CUDA tests of the kernels and of the engine with them.
# Part "nvfp4" / "bf16": random Qwen2.5-7B, 256 + 2048 tokens, batch 8, one repeat: LoRA ranks 0/16/64
# with the kernels, rank 16 without them (the torch path), in the same run.
# Part "b64": batch 64, 256 + 1024, NVFP4 and bf16, rank 0 and 16 (the NVFP4/bf16 ratio with LoRA).
# Run on the device machine from the repository root: bash dev/sweeps/lora_decode_gpu.sh PART...
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
bench() { python3 -m qerl_lib bench rollout --models qwen2.5-7b --no-hf-baseline --repeats 1 "$@"; }
for part in "$@"; do
  case $part in
    tests)
      python3 -m pytest -q -m cuda tests/test_lora_kernels.py > "$OUT/cuda_tests_lora_kernels.log" 2>&1 \
        || echo "CUDA TESTS FAILED"
      tail -4 "$OUT/cuda_tests_lora_kernels.log" ;;
    nvfp4|bf16)
      bench --weights "$part" --batch 8 --lora-rank 0,16,64 --gen-len 2048 --json "$OUT/rollout_${part}_b8_kernels.json"
      bench --weights "$part" --batch 8 --lora-rank 16 --gen-len 2048 --no-lora-kernels --json "$OUT/rollout_${part}_b8_torch.json" ;;
    b64)
      bench --weights nvfp4,bf16 --batch 64 --lora-rank 0,16 --gen-len 1024 --json "$OUT/rollout_b64_kernels.json" ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done

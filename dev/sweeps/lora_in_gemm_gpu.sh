#!/usr/bin/env bash
# #17: LoRA added by the NVFP4 decode GEMM itself (kernels/mma.cu "LoRA") against the two-kernel path
# (kernels/lora.py after the GEMM), random-weight Qwen2.5 shapes, batch 8, 256 + 2048 tokens, one H100.
# (Runs v1/v2 used the flag's earlier form, --no-lora-in-gemm on the second call, when in-GEMM was the default.)
# Device machine, repository root, carrying .whl: bash dev/sweeps/lora_in_gemm_gpu.sh PART...
#   tests : the CUDA tests of the LoRA paths and of the mma kernel
#   7b    : Qwen2.5-7B NVFP4, LoRA rank 0/16/64 with the adapters in the GEMM, then rank 16/64 without (two processes)
#   14b   : Qwen2.5-14B NVFP4, rank 0/32 in the GEMM, then rank 32 without
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2 || true
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bench() {  # model ranks tag [extra flags]
  python3 -m qerl_lib bench rollout --models "$1" --weights nvfp4 --batch 8 --lora-rank "$2" --prompt-len 256 \
    --gen-len 2048 --repeats 2 "${@:4}" --json "$OUT/rollout_$3.json" 2>&1 | grep -v "^WARNING" | tail -6
}
for part in "$@"; do
  case $part in
    tests)
      python3 -m pytest -q -m cuda tests/test_lora_in_gemm.py tests/test_lora_kernels.py tests/test_fp4_kernel_mma.py \
        2>&1 | tee "$OUT/cuda_tests_lora_in_gemm.log" | tail -15 ;;
    7b)
      bench qwen2.5-7b 0,16,64 7b_in_gemm --lora-in-gemm
      bench qwen2.5-7b 16,64 7b_two_kernels ;;
    14b)
      bench qwen2.5-14b 0,32 14b_in_gemm --lora-in-gemm
      bench qwen2.5-14b 32 14b_two_kernels ;;
    *) echo "unknown part $part"; exit 2 ;;
  esac
done

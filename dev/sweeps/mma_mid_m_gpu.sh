#!/usr/bin/env bash
# Run 18 (dev/LOG.md section 26): the mma.sync decode kernel at 9 <= M <= 64 on the device machine.
# Run from the repository root, carrying .whl:
#   bash dev/sweeps/mma_mid_m_gpu.sh sweep    # correctness + launch-shape sweep (fp4_mma_mid_m_sweep.py), ~5 min
#   bash dev/sweeps/mma_mid_m_gpu.sh engine   # the mma kernel's CUDA tests, then rollouts at batch 8/32/64 (r16), rule on and off
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/device.txt"
case "${1:-sweep}" in
  sweep)
    OUT=$OUT python3 dev/sweeps/fp4_mma_mid_m_sweep.py --ms "${MS:-16,32,64}" 2>&1 | tee "$OUT/sweep_mid_m_mma.log" ;;
  engine)
    python3 -m pytest -q -m cuda tests/test_fp4_kernel_mma.py tests/test_fp4_kernel.py > "$OUT/cuda_tests_mma_mid_m.log" 2>&1 \
      || echo "CUDA TESTS FAILED"
    tail -3 "$OUT/cuda_tests_mma_mid_m.log"
    args="bench rollout --models qwen2.5-7b --no-hf-baseline --repeats 2 --batch 8,32,64 --lora-rank 16 --gen-len 1024"
    QERL_FP4_MID_M=triton python3 -m qerl_lib $args --weights nvfp4 --json "$OUT/rollout_mid_m_triton.json" | tail -6
    python3 -m qerl_lib $args --weights nvfp4,bf16 --json "$OUT/rollout_mid_m_mma.json" | tail -8 ;;
  *) echo "usage: $0 sweep|engine" >&2; exit 2 ;;
esac

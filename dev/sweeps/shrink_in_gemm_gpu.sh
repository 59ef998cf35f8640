#!/usr/bin/env bash
# dev/LOG.md section 47: an NVFP4 group's LoRA shrink made by extra CTAs of its mma.sync GEMM launch
# (QERL_LORA_SHRINK_IN_GEMM=1), the expand left to kernels/lora.py. Run through gpu_job.sh; writes to $OUT.
# First the CUDA tests of the mma kernel's LoRA launches and the LoRA kernels, then 7B NVFP4 at batch 8, 256 + 2048,
# LoRA r0 / r16 / r64, two repeats, four processes alternating the switch 1 / 0, then 14B r32 with the switch on and off, then
# the step breakdown of r16 with the switch on (context 1280), each under a time limit.
set -u
timeout 240 python3 -m pytest -q -m cuda tests/test_lora_in_gemm.py tests/test_lora_kernels.py > "$OUT/cuda_tests.log" 2>&1
echo "exit $?" >> "$OUT/cuda_tests.log"
i=0
for s in 1 0 1 0; do
  i=$((i + 1))
  echo "QERL_LORA_SHRINK_IN_GEMM=$s batch 8" >> "$OUT/ab.log"
  QERL_LORA_SHRINK_IN_GEMM=$s timeout 200 python3 -m qerl_lib bench rollout --models qwen2.5-7b --no-hf-baseline \
    --repeats 2 --batch 8 --gen-len 2048 --lora-rank 0,16,64 --weights nvfp4 --json "$OUT/b8_${i}_$s.json" \
    > "$OUT/b8_${i}_$s.log" 2>&1 || echo "  exit $?" >> "$OUT/ab.log"
  grep -E "^ +qwen" "$OUT/b8_${i}_$s.log" | awk '!seen[$0]++' >> "$OUT/ab.log"
done
echo "QERL_LORA_SHRINK_IN_GEMM=1 14B" >> "$OUT/ab.log"
QERL_LORA_SHRINK_IN_GEMM=1 timeout 200 python3 -m qerl_lib bench rollout --models qwen2.5-14b --no-hf-baseline \
  --repeats 2 --batch 8 --gen-len 2048 --lora-rank 0,32 --weights nvfp4 --json "$OUT/b8_14b_1.json" \
  > "$OUT/b8_14b_1.log" 2>&1 || echo "  exit $?" >> "$OUT/ab.log"
grep -E "^ +qwen" "$OUT/b8_14b_1.log" | awk '!seen[$0]++' >> "$OUT/ab.log"
echo "QERL_LORA_SHRINK_IN_GEMM=0 14B" >> "$OUT/ab.log"
QERL_LORA_SHRINK_IN_GEMM=0 timeout 150 python3 -m qerl_lib bench rollout --models qwen2.5-14b --no-hf-baseline \
  --repeats 2 --batch 8 --gen-len 2048 --lora-rank 32 --weights nvfp4 --json "$OUT/b8_14b_0.json" \
  > "$OUT/b8_14b_0.log" 2>&1 || echo "  exit $?" >> "$OUT/ab.log"
grep -E "^ +qwen" "$OUT/b8_14b_0.log" | awk '!seen[$0]++' >> "$OUT/ab.log"
QERL_LORA_SHRINK_IN_GEMM=1 timeout 100 python3 dev/sweeps/rollout_step_breakdown.py --models qwen2.5-7b --weights nvfp4 \
  --lora-rank 16 --contexts 1280 --json "$OUT/breakdown_1.json" > "$OUT/breakdown_1.log" 2>&1
cd "$OUT" && tar czf shrink_in_gemm.tgz ./*.log ./*.json device.txt

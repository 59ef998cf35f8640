#!/usr/bin/env bash
# dev/LOG.md section 51: the LoRA CTAs of the mma.sync launch rewritten (ranks of a warp together, two steps' loads in
# flight, 512-column slices), QERL_LORA_SHRINK_IN_GEMM measured again. Run through gpu_job.sh; writes to $OUT.
# CUDA tests of the mma kernel's LoRA launches; 7B NVFP4 batch 8, 256 + 2048, r0 / r16 / r64, one process with the
# switch on and one off; 14B r32 on and off; the r16 breakdown with PDL off and the switch on (each kernel's own time).
set -u
timeout 200 python3 -m pytest -q -m cuda tests/test_lora_in_gemm.py > "$OUT/cuda_tests.log" 2>&1
echo "exit $?" >> "$OUT/cuda_tests.log"
for s in 1 0; do
  echo "QERL_LORA_SHRINK_IN_GEMM=$s 7B batch 8" >> "$OUT/ab.log"
  QERL_LORA_SHRINK_IN_GEMM=$s timeout 150 python3 -m qerl_lib bench rollout --models qwen2.5-7b --no-hf-baseline \
    --repeats 2 --batch 8 --gen-len 2048 --lora-rank 0,16,64 --weights nvfp4 --json "$OUT/b8_7b_$s.json" \
    > "$OUT/b8_7b_$s.log" 2>&1 || echo "  exit $?" >> "$OUT/ab.log"
  grep -E "^ +qwen" "$OUT/b8_7b_$s.log" | awk '!seen[$0]++' >> "$OUT/ab.log"
done
for s in 1 0; do
  echo "QERL_LORA_SHRINK_IN_GEMM=$s 14B batch 8" >> "$OUT/ab.log"
  QERL_LORA_SHRINK_IN_GEMM=$s timeout 120 python3 -m qerl_lib bench rollout --models qwen2.5-14b --no-hf-baseline \
    --repeats 2 --batch 8 --gen-len 2048 --lora-rank 32 --weights nvfp4 --json "$OUT/b8_14b_$s.json" \
    > "$OUT/b8_14b_$s.log" 2>&1 || echo "  exit $?" >> "$OUT/ab.log"
  grep -E "^ +qwen" "$OUT/b8_14b_$s.log" | awk '!seen[$0]++' >> "$OUT/ab.log"
done
QERL_LORA_SHRINK_IN_GEMM=1 QERL_PDL=0 timeout 100 python3 dev/sweeps/rollout_step_breakdown.py --models qwen2.5-7b \
  --weights nvfp4 --lora-rank 16 --contexts 1280 --json "$OUT/breakdown_s1_pdl0.json" > "$OUT/breakdown_s1_pdl0.log" 2>&1
cd "$OUT" && tar czf shrink_v2.tgz ./*.log ./*.json device.txt

#!/usr/bin/env bash
# dev/LOG.md section 67: NVFP4 LoRA at <= 8 rows with the q/k/v and gate/up shrinks made by the norm before the group
# (glue.norm_shrink) and their expands added in the mma.sync GEMM's epilogue (QERL_LORA_SHRINK_IN_NORM=1). Run through
# gpu_job.sh; writes to $OUT. CUDA tests of the LoRA-in-GEMM launches and the glue kernels; then 7B NVFP4 batch 8,
# 256 + 2048, r0 / r16 / r64, one process with the switch on and one off, twice in alternation; 14B r0 / r32 on and off.
set -u
timeout 240 python3 -m pytest -q -m cuda tests/test_lora_in_gemm.py tests/test_engine_glue.py > "$OUT/cuda_tests.log" 2>&1
echo "exit $?" >> "$OUT/cuda_tests.log"
for run in 1 2; do
  for s in 1 0; do
    echo "QERL_LORA_SHRINK_IN_NORM=$s 7B batch 8 (round $run)" >> "$OUT/ab.log"
    QERL_LORA_SHRINK_IN_NORM=$s timeout 150 python3 -m qerl_lib bench rollout --models qwen2.5-7b --no-hf-baseline \
      --repeats 2 --batch 8 --gen-len 2048 --lora-rank 0,16,64 --weights nvfp4 --json "$OUT/b8_7b_${run}_$s.json" \
      > "$OUT/b8_7b_${run}_$s.log" 2>&1 || echo "  exit $?" >> "$OUT/ab.log"
    grep -E "^ +qwen" "$OUT/b8_7b_${run}_$s.log" | awk '!seen[$0]++' >> "$OUT/ab.log"
  done
done
for s in 1 0; do
  echo "QERL_LORA_SHRINK_IN_NORM=$s 14B batch 8" >> "$OUT/ab.log"
  QERL_LORA_SHRINK_IN_NORM=$s timeout 150 python3 -m qerl_lib bench rollout --models qwen2.5-14b --no-hf-baseline \
    --repeats 2 --batch 8 --gen-len 2048 --lora-rank 0,32 --weights nvfp4 --json "$OUT/b8_14b_$s.json" \
    > "$OUT/b8_14b_$s.log" 2>&1 || echo "  exit $?" >> "$OUT/ab.log"
  grep -E "^ +qwen" "$OUT/b8_14b_$s.log" | awk '!seen[$0]++' >> "$OUT/ab.log"
done

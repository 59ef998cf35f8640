#!/usr/bin/env bash
# dev/LOG.md section 51: 7B NVFP4 + LoRA r32, batch 8, 256 + 2048, QERL_LORA_SHRINK_IN_GEMM on and off. Via gpu_job.sh.
set -u
for s in 1 0; do
  QERL_LORA_SHRINK_IN_GEMM=$s timeout 80 python3 -m qerl_lib bench rollout --models qwen2.5-7b --no-hf-baseline \
    --repeats 1 --batch 8 --gen-len 2048 --lora-rank 32 --weights nvfp4 --json "$OUT/r32_$s.json" > "$OUT/r32_$s.log" 2>&1
  echo "switch $s: $(grep -E '^ +qwen' "$OUT/r32_$s.log" | head -1)" >> "$OUT/ab.log"
done

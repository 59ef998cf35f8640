#!/usr/bin/env bash
# dev/LOG.md section 59: NVFP4 / bf16 with LoRA r16 against bf16 unmerged and merged (lora_merge), 7B, 256 + 1024,
# batch 8 / 32 / 64, one process per batch. Run through gpu_job.sh; writes to $OUT.
set -u
python3 -m pytest -q -m cuda tests/test_engine_merged.py > "$OUT/cuda_tests.log" 2>&1
tail -3 "$OUT/cuda_tests.log" > "$OUT/summary.log"
for b in 8 32 64; do
  timeout 240 python3 -m qerl_lib bench rollout --models qwen2.5-7b --no-hf-baseline --repeats 2 --batch $b \
    --gen-len 1024 --lora-rank 0,16 --weights nvfp4,bf16 --lora-merge off,on --json "$OUT/b$b.json" \
    > "$OUT/b$b.log" 2>&1 || echo "b$b exit $?" >> "$OUT/summary.log"
  grep -E "^ +qwen" "$OUT/b$b.log" | awk '!seen[$0]++' >> "$OUT/summary.log"
done

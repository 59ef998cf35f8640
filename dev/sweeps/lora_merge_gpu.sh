#!/usr/bin/env bash
# dev/LOG.md section 58: bf16 adapters merged into engine-owned weight copies (RolloutEngine(lora_merge=True)) against
# the unmerged kernels, one process per setting. Run through gpu_job.sh; writes to $OUT.
set -u
python3 -m pytest -q -m cuda tests/test_engine_merged.py tests/test_lora_kernels.py -k "merged or engine" \
  > "$OUT/cuda_tests.log" 2>&1
tail -3 "$OUT/cuda_tests.log" > "$OUT/summary.log"
# 7B bf16, batch 8, 256 + 2048: r0, then r16 and r64 unmerged and merged
timeout 300 python3 -m qerl_lib bench rollout --models qwen2.5-7b --no-hf-baseline --repeats 2 --batch 8 \
  --gen-len 2048 --lora-rank 0,16,64 --weights bf16 --lora-merge off,on --json "$OUT/b8.json" > "$OUT/b8.log" 2>&1 \
  || echo "b8 exit $?" >> "$OUT/summary.log"
# batch 32, 256 + 1024: r0, r16 unmerged and merged
timeout 200 python3 -m qerl_lib bench rollout --models qwen2.5-7b --no-hf-baseline --repeats 2 --batch 32 \
  --gen-len 1024 --lora-rank 0,16 --weights bf16 --lora-merge off,on --json "$OUT/b32.json" > "$OUT/b32.log" 2>&1 \
  || echo "b32 exit $?" >> "$OUT/summary.log"
for f in b8 b32; do grep -E "^ +qwen|lora_overhead" "$OUT/$f.log" | awk '!seen[$0]++' >> "$OUT/summary.log"; done

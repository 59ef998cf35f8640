#!/usr/bin/env bash
# dev/LOG.md section 52: the gate/up expand inside SiLU x up at batch 8 where xa arrives summed (a bf16 base's A as
# weight rows; an NVFP4 base at padded rank > 32, whose shrink sums its own slices). Run through gpu_job.sh; writes
# to $OUT. 7B, batch 8, 256 + 2048, two repeats, processes alternating --lora-fold on / auto (auto: no fold at 8 rows).
set -u
i=0
for fold in on auto on auto; do
  i=$((i + 1))
  echo "--lora-fold $fold" >> "$OUT/ab.log"
  timeout 170 python3 -m qerl_lib bench rollout --models qwen2.5-7b --no-hf-baseline --repeats 2 --batch 8 \
    --gen-len 2048 --lora-rank 0,16,64 --weights bf16 --lora-fold $fold --json "$OUT/bf16_${i}_$fold.json" \
    > "$OUT/bf16_${i}_$fold.log" 2>&1 || echo "  exit $?" >> "$OUT/ab.log"
  grep -E "^ +qwen" "$OUT/bf16_${i}_$fold.log" | awk '!seen[$0]++' >> "$OUT/ab.log"
  timeout 90 python3 -m qerl_lib bench rollout --models qwen2.5-7b --no-hf-baseline --repeats 2 --batch 8 \
    --gen-len 2048 --lora-rank 64 --weights nvfp4 --lora-fold $fold --json "$OUT/nvfp4_${i}_$fold.json" \
    > "$OUT/nvfp4_${i}_$fold.log" 2>&1 || echo "  exit $?" >> "$OUT/ab.log"
  grep -E "^ +qwen" "$OUT/nvfp4_${i}_$fold.log" | awk '!seen[$0]++' >> "$OUT/ab.log"
done
cd "$OUT" && tar czf fold_summed.tgz ./*.log ./*.json device.txt

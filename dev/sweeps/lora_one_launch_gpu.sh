#!/usr/bin/env bash
# dev/LOG.md section 40 (end): the batch-8 adapters in one launch per group. Run through gpu_job.sh; writes to $OUT.
# CUDA tests of the LoRA kernels, then the 7B NVFP4 batch-8 step (256 + 2048, r0 / r16 / r64), four processes
# alternating ONE_LAUNCH_ROWS 8 / 0 (the first also runs bf16), then one process each at 1 and 4 warps.
set -u
python3 -m pytest -q -m cuda tests/test_lora_kernels.py -k "one_launch or match_the_reference or engine" \
  > "$OUT/cuda_tests.log" 2>&1
i=0
for rows in 8 0 8 0; do
  i=$((i + 1)); w=nvfp4; [ $i = 1 ] && w=nvfp4,bf16
  echo "ONE_LAUNCH_ROWS=$rows $w" >> "$OUT/ab.log"
  ONE_LAUNCH_ROWS=$rows python3 dev/sweeps/lora_one_launch_ab.py bench rollout --models qwen2.5-7b --no-hf-baseline \
    --repeats 1 --batch 8 --gen-len 2048 --lora-rank 0,16,64 --weights $w --json "$OUT/ab_${i}_$rows.json" \
    > "$OUT/ab_${i}_$rows.log" 2>&1
  grep -E "^ +qwen" "$OUT/ab_${i}_$rows.log" | awk '!seen[$0]++' >> "$OUT/ab.log"
done
for warps in 1 4; do
  echo "ONE_LAUNCH_ROWS=8 ONE_LAUNCH_WARPS=$warps" >> "$OUT/ab.log"
  ONE_LAUNCH_ROWS=8 ONE_LAUNCH_WARPS=$warps python3 dev/sweeps/lora_one_launch_ab.py bench rollout \
    --models qwen2.5-7b --no-hf-baseline --repeats 1 --batch 8 --gen-len 2048 --lora-rank 16,64 --weights nvfp4 \
    --json "$OUT/warps_$warps.json" > "$OUT/warps_$warps.log" 2>&1
  grep -E "^ +qwen" "$OUT/warps_$warps.log" | awk '!seen[$0]++' >> "$OUT/ab.log"
done
cd "$OUT" && tar czf one_launch.tgz ./*.log ./*.json device.txt

#!/usr/bin/env bash
# dev/LOG.md section 67, the diagnosis: where the switch's extra time goes. 7B NVFP4 batch 8, context 1280, PDL off (each
# kernel's own time): QERL_LORA_SHRINK_IN_NORM on at r16 and r64, off at r16. Run through gpu_job.sh; writes to $OUT.
set -u
for case in "1 16" "1 64" "0 16"; do
  set -- $case
  QERL_LORA_SHRINK_IN_NORM=$1 QERL_PDL=0 timeout 120 python3 dev/sweeps/rollout_step_breakdown.py --models qwen2.5-7b \
    --weights nvfp4 --lora-rank $2 --contexts 1280 --json "$OUT/breakdown_norm$1_r$2.json" > "$OUT/breakdown_norm$1_r$2.log" 2>&1
done

#!/usr/bin/env bash
# dev/LOG.md section 141 (nvidia-h200, carrying .whl; no part calls needed: random weights, no bitsandbytes):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/lora_overhead_profile_gpu.sh'   then   ... poll 540
# The batch-8 decode step of 7B NVFP4 at r0 and r16 by kernel category, PDL on (the default) and off.
set -uo pipefail
export CUDA_VISIBLE_DEVICES=0
for pdl in 1 0; do
  for rank in 0 16; do
    QERL_PDL=$pdl timeout 240 python3 dev/sweeps/rollout_step_breakdown.py --models qwen2.5-7b --weights nvfp4 \
      --contexts 1280 --batch 8 --lora-rank $rank --json $OUT/breakdown_pdl${pdl}_r${rank}.json \
      > $OUT/breakdown_pdl${pdl}_r${rank}.log 2>&1
  done
done

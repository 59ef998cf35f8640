#!/usr/bin/env bash
# dev/LOG.md section 142 (nvidia-h200, carrying .whl and .tokcache; random weights, no part calls needed):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/lora_overhead_methods_gpu.sh'   then   ... poll 540
# The batch-8 r16 overhead measured two ways in one job: the bench's ms a decode step over a whole 256 + 2048
# rollout, and the step-breakdown script's wall at three contexts (PDL on, the default).
set -uo pipefail
export CUDA_VISIBLE_DEVICES=0 QERL_CACHE=$PWD/.tokcache
timeout 200 python3 -m qerl_lib bench rollout --models qwen2.5-7b --prompt-len 256 --gen-len 2048 --repeats 2 \
  --no-hf-baseline --weights nvfp4 --batch 8 --lora-rank 0,16 --json $OUT/bench_b8.json > $OUT/bench_b8.log 2>&1
for rank in 0 16; do
  timeout 200 python3 dev/sweeps/rollout_step_breakdown.py --models qwen2.5-7b --weights nvfp4 --contexts 256,1280,2240 \
    --batch 8 --lora-rank $rank --json $OUT/breakdown_r${rank}.json > $OUT/breakdown_r${rank}.log 2>&1
done

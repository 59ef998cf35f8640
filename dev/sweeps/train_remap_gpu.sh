#!/usr/bin/env bash
# dev/LOG.md section 106 item 1 (one H200; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/train_remap_gpu.sh'   then   bash dev/sweeps/gpu_job.sh poll 560
# The GRPO step at batch 8 with the remappable KV cache and merged copies (sections 104-105), section 100's command.
set -uo pipefail
OUT=${OUT:-/tmp/out}
bash dev/sweeps/gpu_job.sh assemble > $OUT/assemble.log 2>&1
export PYTHONPATH=$PYTHONPATH:/tmp/site_bnb QERL_CACHE=$PWD/.tokcache
python3 -m qerl_lib bench train --models qwen2.5-7b,qwen2.5-14b --modes lora,qerl --rollout-lora-merge off,on \
  --batches 8 --steps 4 --json $OUT/train_merge.json > $OUT/train_merge.log 2>&1

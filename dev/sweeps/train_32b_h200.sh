#!/usr/bin/env bash
# dev/LOG.md section 108 (one H200; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/train_32b_h200.sh'   then   bash dev/sweeps/gpu_job.sh poll 560
# The 32B GRPO step at batch 2 with today's code (remappable cache, fused trainer kernels), qerl and 16-bit lora.
set -uo pipefail
OUT=${OUT:-/tmp/out}
bash dev/sweeps/gpu_job.sh assemble > $OUT/assemble.log 2>&1
export PYTHONPATH=$PYTHONPATH:/tmp/site_bnb QERL_CACHE=$PWD/.tokcache
python3 -m qerl_lib bench train --models qwen2.5-32b --modes qerl,lora --batches 2 --steps 3 \
  --json $OUT/train_32b.json > $OUT/train_32b.log 2>&1

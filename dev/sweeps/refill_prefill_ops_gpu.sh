#!/usr/bin/env bash
# dev/LOG.md section 125, second run (nvidia-h200; after the two part calls, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/refill_prefill_ops_gpu.sh'   then   ... poll 300
# The torch operators behind one refill prefill's kernels (7B NVFP4, r0, 8 x 256), by self CUDA time and input shapes.
source dev/sweeps/job_prelude.sh
export CUDA_VISIBLE_DEVICES=0
python3 dev/sweeps/refill_prefill_profile.py --model qwen2.5-7b --weights nvfp4 --lora-rank 0 --rows 8 --prompt-len 256 \
  --ops 25 --json $OUT/refill_prefill_ops.json > $OUT/refill_prefill_ops.log 2>&1
stop_memory_samples

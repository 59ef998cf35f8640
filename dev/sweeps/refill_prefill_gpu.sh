#!/usr/bin/env bash
# dev/LOG.md section 125 (nvidia-h200; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/refill_prefill_gpu.sh'   then   bash dev/sweeps/gpu_job.sh poll 400
# One refill's prefill (8 rows x 256 tokens) at 7B, NVFP4 and bf16, LoRA r0 and r16: wall, kernels by category.
source dev/sweeps/job_prelude.sh
export CUDA_VISIBLE_DEVICES=0
python3 dev/sweeps/refill_prefill_profile.py --model qwen2.5-7b --weights nvfp4,bf16 --lora-rank 0,16 --rows 8 \
  --prompt-len 256 --json $OUT/refill_prefill.json > $OUT/refill_prefill.log 2>&1
stop_memory_samples

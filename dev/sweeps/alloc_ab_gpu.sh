#!/usr/bin/env bash
# dev/LOG.md section 112's next run (one H200; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/alloc_ab_gpu.sh'   then   bash dev/sweeps/gpu_job.sh poll 560
# The 14B batch-2 step, qerl and lora, under `qerl bench train`'s allocator setting and under PyTorch's default, three
# measured steps each: does expandable_segments make qerl's trainer phase 1.3x lora's (section 111) or not (112)?
source dev/sweeps/job_prelude.sh
for segments in True False; do
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:$segments python3 -m qerl_lib bench train --models qwen2.5-14b \
    --modes lora,qerl --batches 2 --steps 4 --json $OUT/b2_segments_$segments.json > $OUT/b2_segments_$segments.log 2>&1
done
stop_memory_samples

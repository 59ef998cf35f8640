#!/usr/bin/env bash
# dev/LOG.md section 115 (nvidia-h200-x2; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/tab3_tab8_x2.sh'   then   bash dev/sweeps/gpu_job.sh poll 560
# GPU 0, one case at a time: Tab. 8's 32B step at batch 8 (qerl, 16-bit lora), then Tab. 3's batch 4 at 7B and 14B.
# GPU 1 at the same time: section 112's allocator A/B (dev/sweeps/alloc_ab_gpu.sh's two commands).
source dev/sweeps/job_prelude.sh
(for segments in True False; do
   CUDA_VISIBLE_DEVICES=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:$segments python3 -m qerl_lib bench train \
     --models qwen2.5-14b --modes lora,qerl --batches 2 --steps 4 --json $OUT/b2_segments_$segments.json \
     > $OUT/b2_segments_$segments.log 2>&1
 done) &
AB=$!
CUDA_VISIBLE_DEVICES=0 python3 -m qerl_lib bench train --models qwen2.5-32b --modes qerl,lora --batches 8 --steps 3 \
  --json $OUT/train_32b_b8.json > $OUT/train_32b_b8.log 2>&1
CUDA_VISIBLE_DEVICES=0 python3 -m qerl_lib bench train --models qwen2.5-7b,qwen2.5-14b --modes lora,qerl --batches 4 \
  --steps 3 --json $OUT/train_b4.json > $OUT/train_b4.log 2>&1
wait $AB
stop_memory_samples

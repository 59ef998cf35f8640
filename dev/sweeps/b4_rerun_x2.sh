#!/usr/bin/env bash
# dev/LOG.md section 118 (nvidia-h200-x2; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/b4_rerun_x2.sh'   then   bash dev/sweeps/gpu_job.sh poll 560
# GPU 0: the stall probe (7B qerl batch 4, six steps, counters around every engine call), then Tab. 3's batch 4 at 7B
# again with five measured steps; GPU 1 at the same time: the same at 14B.
source dev/sweeps/job_prelude.sh
(CUDA_VISIBLE_DEVICES=1 python3 -m qerl_lib bench train --models qwen2.5-14b --modes lora,qerl --batches 4 --steps 6 \
   --json $OUT/train_b4_14b.json > $OUT/train_b4_14b.log 2>&1) &
OTHER=$!
CUDA_VISIBLE_DEVICES=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 dev/sweeps/rollout_stall_probe.py \
  --model qwen2.5-7b --mode qerl --batch 4 --steps 6 --json $OUT/stall_probe_7b.json > $OUT/stall_probe_7b.log 2>&1
CUDA_VISIBLE_DEVICES=0 python3 -m qerl_lib bench train --models qwen2.5-7b --modes lora,qerl --batches 4 --steps 6 \
  --json $OUT/train_b4_7b.json > $OUT/train_b4_7b.log 2>&1
wait $OTHER
stop_memory_samples

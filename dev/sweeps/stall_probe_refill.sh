#!/usr/bin/env bash
# dev/LOG.md section 121 item 3 (nvidia-h200; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/stall_probe_refill.sh'   then   ... poll 560
# The probe with continuous batching: 7B qerl, 32 completions a step in 4 groups, 8 rows decoding at once (the
# engine refills finished rows with the queued prompts), GSM8K-like lengths, 6 steps, an empty Triton cache.
source dev/sweeps/job_prelude.sh
export CUDA_VISIBLE_DEVICES=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
TRITON_CACHE_DIR=$(mktemp -d) python3 dev/sweeps/rollout_stall_probe.py --model qwen2.5-7b --mode qerl --batch 32 \
  --groups 4 --rollout-batch 8 --micro-batch 8 --steps 6 --workload gsm8k-like --json $OUT/probe_refill.json > $OUT/probe_refill.log 2>&1
stop_memory_samples

#!/usr/bin/env bash
# dev/LOG.md section 120 (nvidia-h200; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/stall_probe_gsm8k_like.sh'   then   ... poll 560
# Two probes at once on one GPU, each with an empty Triton cache: 7B batch 8, GSM8K-like completion lengths, 8 steps,
# qerl (NVFP4 base) and lora (bf16 base).
source dev/sweeps/job_prelude.sh
export CUDA_VISIBLE_DEVICES=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
for mode in qerl lora; do
  TRITON_CACHE_DIR=$(mktemp -d) python3 dev/sweeps/rollout_stall_probe.py --model qwen2.5-7b --mode $mode --batch 8 \
    --steps 8 --workload gsm8k-like --json $OUT/probe_$mode.json > $OUT/probe_$mode.log 2>&1 &
done
wait
stop_memory_samples

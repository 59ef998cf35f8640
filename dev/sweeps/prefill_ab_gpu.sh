#!/usr/bin/env bash
# dev/LOG.md section 127 item 3 (nvidia-h200; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/prefill_ab_gpu.sh'   then   bash dev/sweeps/gpu_job.sh poll 300
# QERL_PREFILL_GLUE's A/B in one process: one engine per case, the plain and the glue prefill ops alternating, three
# rounds, 7B NVFP4 (or WEIGHTS=bf16, section 134) r0 and r16, 8 x 256 (a refill of continuous batching at 64 rows).
source dev/sweeps/job_prelude.sh
export CUDA_VISIBLE_DEVICES=0
python3 dev/sweeps/refill_prefill_profile.py --model qwen2.5-7b --weights ${WEIGHTS:-nvfp4} --lora-rank 0,16 --rows 8 \
  --prompt-len 256 --prefill-ops plain,glue --rounds 3 --ops 20 --json $OUT/prefill_ab.json > $OUT/prefill_ab.log 2>&1
stop_memory_samples

#!/usr/bin/env bash
# dev/LOG.md section 126 (nvidia-h200; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/prefill_glue_gpu.sh'   then   bash dev/sweeps/gpu_job.sh poll 280
# The prefill with the glue kernels' norms and SiLU x up: its CUDA tests, then section 125's refill profile (NVFP4).
source dev/sweeps/job_prelude.sh
export CUDA_VISIBLE_DEVICES=0
timeout 150 python3 -m pytest -q -m cuda tests/test_engine_glue.py tests/test_engine.py > $OUT/tests.log 2>&1
python3 dev/sweeps/refill_prefill_profile.py --model qwen2.5-7b --weights nvfp4 --lora-rank 0,16 --rows 8 \
  --prompt-len 256 --json $OUT/refill_prefill.json > $OUT/refill_prefill.log 2>&1
stop_memory_samples

#!/usr/bin/env bash
# dev/LOG.md section 133 (nvidia-h200; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/scheduling_gpu.sh'   then   bash dev/sweeps/gpu_job.sh poll 300
# The scheduling study's CUDA test and the continuous engine's CUDA tests.
source dev/sweeps/job_prelude.sh
export CUDA_VISIBLE_DEVICES=0
timeout 280 python3 -m pytest -q -m cuda tests/test_scheduling_study.py tests/test_engine_continuous.py \
  > $OUT/cuda_tests.log 2>&1
stop_memory_samples

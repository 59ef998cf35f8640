#!/usr/bin/env bash
# The whole CUDA suite on the session's final code (house check; dev/LOG.md section 139). nvidia-h200, after the two
# part calls .bnb0 and .bnb1, carrying .whl and .tokcache:
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/cuda_suite_gpu.sh'   then   bash dev/sweeps/gpu_job.sh poll 560  (and poll again: ~9.5 min since LOG 148)
source dev/sweeps/job_prelude.sh
export CUDA_VISIBLE_DEVICES=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout 900 python3 -m pytest -q -m cuda tests/ --ignore=tests/test_hygiene.py -rs > $OUT/cuda_suite.log 2>&1
stop_memory_samples

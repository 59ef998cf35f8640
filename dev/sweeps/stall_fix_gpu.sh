#!/usr/bin/env bash
# dev/LOG.md section 119 (nvidia-h200 or -x2; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/stall_fix_gpu.sh'   then   bash dev/sweeps/gpu_job.sh poll 560
source dev/sweeps/job_prelude.sh
export CUDA_VISIBLE_DEVICES=0
timeout 300 python3 -m pytest -q -m cuda tests/test_fp4_wgmma_producer.py tests/test_fp4_wgmma.py > $OUT/cuda_tests.log 2>&1
TRITON_CACHE_DIR=$(mktemp -d) PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 dev/sweeps/rollout_stall_probe.py --model qwen2.5-7b --mode qerl --batch 4 \
  --steps 6 --json $OUT/stall_probe_7b.json > $OUT/stall_probe_7b.log 2>&1
stop_memory_samples

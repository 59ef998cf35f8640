#!/usr/bin/env bash
# dev/LOG.md section 123 (nvidia-h200; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/prefill_warm_gpu.sh'   then   bash dev/sweeps/gpu_job.sh poll 560
# 1. the continuous-batching CUDA tests (the warm: no prefill count compiles an FP4 GEMM after it);
# 2. section 122's refill probe again, same command, with the warm.
source dev/sweeps/job_prelude.sh
export CUDA_VISIBLE_DEVICES=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout 240 python3 -m pytest -q -m cuda tests/test_engine_continuous.py > $OUT/tests_continuous.log 2>&1
TRITON_CACHE_DIR=$(mktemp -d) python3 dev/sweeps/rollout_stall_probe.py --model qwen2.5-7b --mode qerl --batch 32 \
  --groups 4 --rollout-batch 8 --micro-batch 8 --steps 6 --workload gsm8k-like --json $OUT/probe_refill.json > $OUT/probe_refill.log 2>&1
stop_memory_samples

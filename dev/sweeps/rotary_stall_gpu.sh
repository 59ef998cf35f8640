#!/usr/bin/env bash
# dev/LOG.md section 137 (nvidia-h200; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/rotary_stall_gpu.sh'   then   bash dev/sweeps/gpu_job.sh poll 540
# 1. the rotary kernel's CUDA tests (prefill layout, trainer layout, one variant at any length);
# 2. the variants probe: the default-specialized copy against the library's kernel, fresh Triton cache;
# 3. section 122's refill probe again (same command), with the glue prefill on by default since section 128.
source dev/sweeps/job_prelude.sh
export CUDA_VISIBLE_DEVICES=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout 300 python3 -m pytest -q -m cuda tests/test_engine_glue.py tests/test_fused_layers.py > $OUT/tests_rotary.log 2>&1
TRITON_CACHE_DIR=$(mktemp -d) timeout 200 python3 dev/sweeps/rotary_variants_probe.py --json $OUT/variants.json > $OUT/variants.log 2>&1
TRITON_CACHE_DIR=$(mktemp -d) python3 dev/sweeps/rollout_stall_probe.py --model qwen2.5-7b --mode qerl --batch 32 \
  --groups 4 --rollout-batch 8 --micro-batch 8 --steps 6 --workload gsm8k-like --json $OUT/probe_refill.json > $OUT/probe_refill.log 2>&1
stop_memory_samples

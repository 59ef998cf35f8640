#!/usr/bin/env bash
# dev/LOG.md section 129 (nvidia-h200; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/prefill_default_gpu.sh'   then   ... poll 540 (twice)
# 1. #17's variable-length workload with the glue prefill ops by default, static and continuous in one process;
# 2. the whole CUDA suite on this session's code.
source dev/sweeps/job_prelude.sh
export CUDA_VISIBLE_DEVICES=0
python3 -m qerl_lib bench rollout --models qwen2.5-7b --prompt-len 256 --gen-len 1024 --repeats 2 --no-hf-baseline \
  --weights nvfp4 --batch 64 --lora-rank 16 --workload gsm8k-like --prompts 256 --scheduling static,continuous \
  --json $OUT/uneven_default.json > $OUT/uneven_default.log 2>&1
timeout 560 python3 -m pytest -q -m cuda tests/ --ignore=tests/test_hygiene.py > $OUT/cuda_suite.log 2>&1
stop_memory_samples

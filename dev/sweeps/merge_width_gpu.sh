#!/usr/bin/env bash
# dev/LOG.md section 122 (nvidia-h200; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/merge_width_gpu.sh'   then   bash dev/sweeps/gpu_job.sh poll 560
# 1. the decode attention's CUDA tests (the merge's new width; a longer bucket compiles no new merge);
# 2. section 121 item 3's refill probe (dev/sweeps/stall_probe_refill.sh's command), prediction amended in section 122;
# 3. the 7B NVFP4 batch-8 rollout, r0 and r16, against the committed H200 rows (the wider merge tile costs nothing);
# 4. the engine's CUDA tests (rollouts through the merge at every length bucket they reach).
source dev/sweeps/job_prelude.sh
export CUDA_VISIBLE_DEVICES=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout 240 python3 -m pytest -q -m cuda tests/test_engine_attention.py tests/test_decode_launch_folds.py \
  > $OUT/tests_attention.log 2>&1
TRITON_CACHE_DIR=$(mktemp -d) python3 dev/sweeps/rollout_stall_probe.py --model qwen2.5-7b --mode qerl --batch 32 \
  --groups 4 --rollout-batch 8 --micro-batch 8 --steps 6 --workload gsm8k-like --json $OUT/probe_refill.json > $OUT/probe_refill.log 2>&1
python3 -m qerl_lib bench rollout --models qwen2.5-7b --prompt-len 256 --gen-len 2048 --repeats 2 --no-hf-baseline \
  --weights nvfp4 --batch 8 --lora-rank 0,16 --json $OUT/rollout_b8.json > $OUT/rollout_b8.log 2>&1
timeout 420 python3 -m pytest -q -m cuda tests/test_engine.py tests/test_engine_continuous.py > $OUT/tests_engine.log 2>&1
stop_memory_samples

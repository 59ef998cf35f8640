#!/usr/bin/env bash
# dev/LOG.md section 111 (nvidia-h200-x2; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/two_gpu_remap_x2.sh'   then   bash dev/sweeps/gpu_job.sh poll 560
# (1) Tab. 3's batch-2 GRPO step, lora and qerl, 7B and 14B, on GPU 0 alone; (2) the CUDA tests that need two GPUs;
# (3) section 104's data-parallel rows again, now with the remappable KV cache.
set -uo pipefail
OUT=${OUT:-/tmp/out}
bash dev/sweeps/gpu_job.sh assemble > $OUT/assemble.log 2>&1
export PYTHONPATH=$PYTHONPATH:/tmp/site_bnb QERL_CACHE=$PWD/.tokcache
nvidia-smi --query-gpu=timestamp,index,memory.used,utilization.gpu --format=csv -l 2 > $OUT/gpu_memory.csv 2>&1 &
SMI=$!
CUDA_VISIBLE_DEVICES=0 python3 -m qerl_lib bench train --models qwen2.5-7b,qwen2.5-14b --modes lora,qerl --batches 2 \
  --steps 3 --json $OUT/train_b2.json > $OUT/train_b2.log 2>&1
python3 -m pytest -q -m cuda tests/test_distributed.py tests/test_engine_remap.py > $OUT/cuda_tests.log 2>&1
python3 -m qerl_lib bench train --models qwen2.5-7b --modes qerl --batches 16,64 --groups 2 --micro-batch 8 \
  --num-gpus 1,2 --steps 3 --json $OUT/bench_train_2gpu.json > $OUT/bench_train_2gpu.log 2>&1
kill $SMI

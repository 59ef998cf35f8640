#!/usr/bin/env bash
# dev/LOG.md section 104, run 2 (nvidia-h200-x2, after the six part calls, as two_gpu_gpu.sh): the one-GPU cases that
# run 1 lost to TRL's DataParallel refusal, now with grpo_args' one-GPU rule, beside the two-GPU cases again (same run).
set -uo pipefail
OUT=${OUT:-/tmp/out}
bash dev/sweeps/gpu_job.sh assemble > $OUT/assemble.log 2>&1
export PYTHONPATH=$PYTHONPATH:/tmp/site_bnb QERL_GGUF=/tmp/qerl/SmolLM2-135M-Instruct.Q4_1.gguf
nvidia-smi --query-gpu=timestamp,index,memory.used,utilization.gpu --format=csv -l 2 > $OUT/gpu_memory.csv 2>&1 &
SMI=$!
python3 -m pytest -q -m cuda tests/test_distributed.py > $OUT/cuda_tests.log 2>&1
python3 -m qerl_lib train --preset smollm2-arith --mode qerl --steps 40 --seed 0 --num-gpus 1 \
  --out /tmp/train_1gpu > $OUT/train_1gpu.log 2>&1
mkdir -p $OUT/train_1gpu && cp /tmp/train_1gpu/{metrics.jsonl,summary.json,run.json} $OUT/train_1gpu/ 2>/dev/null
python3 -m qerl_lib bench train --models qwen2.5-7b --modes qerl --batches 16,64 --groups 2 --micro-batch 8 \
  --num-gpus 1,2 --steps 3 --json $OUT/bench_train_2gpu.json > $OUT/bench_train_2gpu.log 2>&1
kill $SMI

#!/usr/bin/env bash
# dev/LOG.md section 113 item 3 and section 114 (nvidia-h200-x4; after the two part calls .bnb0 and .bnb1, carrying
# .whl and .tokcache):   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/dp4_gpu.sh'   then   ... poll 560
# (1) the CUDA tests that need two or more GPUs (section 114's engine-on-another-GPU test has never run);
# (2) data parallel on 1, 2 and 4 GPUs, the same global batch (section 111's batch-64 case, in 4 groups: one prompt a
# process at least, as grpo.accumulation_steps requires).
source dev/sweeps/job_prelude.sh
python3 -m pytest -q -m cuda tests/test_engine_other_gpu.py tests/test_engine_remap.py tests/test_distributed.py \
  > $OUT/cuda_tests.log 2>&1
python3 -m qerl_lib bench train --models qwen2.5-7b --modes qerl --batches 64 --groups 4 --micro-batch 8 \
  --num-gpus 1,2,4 --steps 3 --json $OUT/bench_train_4gpu.json > $OUT/bench_train_4gpu.log 2>&1
stop_memory_samples

#!/usr/bin/env bash
# dev/LOG.md section 149 (nvidia-h200, after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/bench_resume_gpu.sh'   then   bash dev/sweeps/gpu_job.sh poll 560
# `qerl bench train --json` resumed on real rows (section 147): a two-case run killed once the first case's row is in
# the file; the dry run names the case it would skip; the rerun runs only the other case and ends with both rows.
source dev/sweeps/job_prelude.sh
export CUDA_VISIBLE_DEVICES=0
J=$OUT/resume.json
python3 -m qerl_lib bench train --models qwen2.5-3b --modes lora,qerl --batches 2 --prompt-len 64 --gen-len 128 \
  --steps 2 --json $OUT/resume.json > $OUT/run1.log 2>&1 &
for i in $(seq 1 150); do
  sleep 2
  python3 -c "import json, sys; sys.exit(len(json.load(open('$J'))['rows']) < 1)" 2>/dev/null && break
done
pkill -KILL -f "qerl_lib bench train"; pkill -KILL -f "qerl_lib.studies.train_bench"; sleep 5  # (not `wait`: it would wait for the memory sampler too)
cp $J $OUT/after_kill.json
python3 -m qerl_lib bench train --models qwen2.5-3b --modes lora,qerl --batches 2 --prompt-len 64 --gen-len 128 \
  --steps 2 --json $OUT/resume.json --dry-run > $OUT/dry_run.log 2>&1
python3 -m qerl_lib bench train --models qwen2.5-3b --modes lora,qerl --batches 2 --prompt-len 64 --gen-len 128 \
  --steps 2 --json $OUT/resume.json > $OUT/run2.log 2>&1
stop_memory_samples

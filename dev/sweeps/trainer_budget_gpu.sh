#!/usr/bin/env bash
# dev/LOG.md section 42, "one budget": each mode's trainer phase at the fewest recomputing layers that fit one 80 GB
# H100 (7B random weights, batch 8 in one micro-batch, 256 + 2048, LoRA r32), against all 28 recomputing; five steps
# per case, the last four timed. Needs bitsandbytes and the embedded model: the job's commands start with
#   bash dev/sweeps/gpu_job.sh assemble && export PYTHONPATH=$PYTHONPATH:/tmp/site_bnb QERL_GGUF=...   (gpu_job.sh)
# Settings from attempt 2's 3.7 GiB a kept layer over 25.6 (lora) / 16.8 GiB (qerl), kept under ~74 GiB: lora 15
# recomputing (13 kept, ~73.7 GiB), qerl 13 (15 kept, ~72.3 GiB). One process per mode, so that a case that runs
# out of memory does not take the other mode's rows with it.
set -u
for m in lora qerl; do
  c=$([ $m = lora ] && echo 28,15 || echo 28,13)
  timeout 600 python3 -m qerl_lib bench train --models qwen2.5-7b --modes $m --batches 8 --steps 5 \
    --checkpoint-layers $c --json "$OUT/budget_7b_$m.json" > "$OUT/budget_7b_$m.log" 2>&1
done
cd "$OUT" && tar czf trainer_budget.tgz ./*.log ./*.json device.txt

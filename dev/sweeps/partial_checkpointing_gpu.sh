#!/usr/bin/env bash
# dev/LOG.md section 42: what recomputing fewer decoder layers buys and costs in the trainer phase. Run through
# gpu_job.sh (writes to $OUT). 7B random weights, batch 8, 256 + 2048, LoRA r32, modes lora and qerl, with 28 (all),
# 14 and 7 of the 28 layers recomputing (0 would keep ~80 GB of activations at 8 x 2304 tokens) in the backward: each case's train_s and peak_gib. A case that runs out of
# memory is a row with its error. Two steps per case (the first warms up); ~1.5 min a case.
set -u
timeout 1500 python3 -m qerl_lib bench train --models qwen2.5-7b --modes lora,qerl --batches 8 --steps 2 \
  --checkpoint-layers 28,14,0 --json "$OUT/partial_checkpointing_7b.json" > "$OUT/partial_checkpointing_7b.log" 2>&1
cd "$OUT" && tar czf partial_checkpointing.tgz ./*.log ./*.json device.txt

#!/usr/bin/env bash
# dev/LOG.md section 109: issues #17's and #18's acceptance rows on an H100 with today's code, when one is lent (one job;
# after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/h100_acceptance.sh'   then   bash dev/sweeps/gpu_job.sh poll 560
# Most important first, so a job stopped by the device limit still returns the first parts (~25 min in all, estimated
# from the H200's times): (1) the GRPO step at 7B/14B batch 8 in every 16-bit and 4-bit mode, (2) the 32B step at
# batch 2, (3) Tab. 3's batch-2 step at 7B/14B, (4) the FP4 GEMM at every M in both layouts, (5) the 7B rollout with
# LoRA r0/r16/r64 and the 14B r32 row.
set -uo pipefail
OUT=${OUT:-/tmp/out}
bash dev/sweeps/gpu_job.sh assemble > $OUT/assemble.log 2>&1
export PYTHONPATH=$PYTHONPATH:/tmp/site_bnb QERL_CACHE=$PWD/.tokcache
python3 -m qerl_lib bench train --models qwen2.5-7b,qwen2.5-14b --modes lora,qlora,qerl --rollout-lora-merge off,on \
  --batches 8 --steps 3 --json $OUT/train_b8.json > $OUT/train_b8.log 2>&1
python3 -m qerl_lib bench train --models qwen2.5-32b --modes qerl --batches 2 --steps 3 \
  --json $OUT/train_32b.json > $OUT/train_32b.log 2>&1
python3 -m qerl_lib bench train --models qwen2.5-7b,qwen2.5-14b --modes lora,qerl --batches 2 --steps 3 \
  --json $OUT/train_b2.json > $OUT/train_b2.log 2>&1
python3 -m qerl_lib bench gemm --models qwen2.5-7b,qwen2.5-32b --json $OUT/gemm.json > $OUT/gemm.log 2>&1
python3 -m qerl_lib bench rollout --models qwen2.5-7b --weights bf16,nvfp4 --batch 8 --gen-len 2048 --lora-rank 0,16,64 \
  --no-hf-baseline --json $OUT/rollout_7b.json > $OUT/rollout_7b.log 2>&1
python3 -m qerl_lib bench rollout --models qwen2.5-14b --weights nvfp4 --batch 8 --gen-len 2048 --lora-rank 0,32 \
  --no-hf-baseline --json $OUT/rollout_14b.json > $OUT/rollout_14b.log 2>&1
# (6) added before any run (dev/LOG.md section 116): Tab. 8's 16-bit 32B step on an 80 GB GPU itself, batch 2 and 8,
# and QeRL's 32B step at batch 8; an out-of-memory case becomes a row with its error.
python3 -m qerl_lib bench train --models qwen2.5-32b --modes lora --batches 2,8 --steps 3 \
  --json $OUT/train_32b_lora.json > $OUT/train_32b_lora.log 2>&1
python3 -m qerl_lib bench train --models qwen2.5-32b --modes qerl --batches 8 --steps 3 \
  --json $OUT/train_32b_b8.json > $OUT/train_32b_b8.log 2>&1

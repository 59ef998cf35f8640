#!/usr/bin/env bash
# The QLoRA baseline in `qerl bench rollout` (#17): random Qwen2.5-7B as bitsandbytes NF4, NVFP4 and bf16, LoRA r16,
# 256 + 2048 tokens, batch 8 and 64, one repeat, same run. Needs bitsandbytes: a call before this one carries
# .whl_bnb alone and runs `bash dev/sweeps/train_step_gpu.sh bnb` (installs it into /tmp/site_bnb).
# Run on the device machine from the repository root, carrying .whl: bash dev/sweeps/nf4_rollout_gpu.sh
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:/tmp/site_bnb:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m qerl_lib bench rollout --models qwen2.5-7b --no-hf-baseline --repeats 1 --batch 8,64 --lora-rank 16 \
  --gen-len 2048 --weights nf4,nvfp4,bf16 --json "$OUT/rollout_7b_nf4_nvfp4_bf16_r16.json" | tail -9

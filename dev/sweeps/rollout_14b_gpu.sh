#!/usr/bin/env bash
# #17's 14B row: random-weight Qwen2.5-14B, NVFP4 and bf16, LoRA rank 0 and 32, batch 8, 256 + 2048 tokens (the
# paper's rollout setting; its vLLM number for 14B NVFP4 is 1091 tok/s). Device machine, repository root, carrying .whl.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING | tail -2 || true
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m qerl_lib bench rollout --models qwen2.5-14b --weights nvfp4,bf16 --batch 8 --lora-rank 0,32 \
  --prompt-len 256 --gen-len 2048 --repeats 2 --json "$OUT/rollout_14b_lora.json" 2>&1 | tee "$OUT/log.txt"

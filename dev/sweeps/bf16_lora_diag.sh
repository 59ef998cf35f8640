#!/usr/bin/env bash
# dev/LOG.md section 57: where bf16 + r16's decode-step overhead goes. The step breakdown of 7B bf16 at r0 and r16
# (batch 8, context 1280) with programmatic dependent launch off (QERL_PDL=0: each kernel's time is its own), then r16
# with PDL on. Run from the repository root with PYTHONPATH=/tmp/site:$PWD and OUT set.
set -u
for setting in "0 0" "16 0" "16 1"; do
  set -- $setting
  QERL_PDL=$2 timeout 100 python3 dev/sweeps/rollout_step_breakdown.py --models qwen2.5-7b --weights bf16 \
    --lora-rank $1 --contexts 1280 --json "$OUT/bf16_r$1_pdl$2.json" > "$OUT/bf16_r$1_pdl$2.log" 2>&1
  tail -1 "$OUT/bf16_r$1_pdl$2.log"
done

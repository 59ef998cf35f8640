#!/usr/bin/env bash
# dev/LOG.md section 50: which kernel grows when QERL_LORA_SHRINK_IN_GEMM=1 slows the NVFP4 decode step. The step
# breakdown of 7B NVFP4 + r16 (batch 8, context 1280) with the switch off and on, with programmatic dependent launch
# off (QERL_PDL=0: each kernel's measured time is its own, not its wait for the previous one) and, for the switch
# off, with PDL on (section 47's on-case is in dev/runs/shrink_in_gemm_h200_2026-11-28/). Run through gpu_job.sh.
set -u
for setting in "0 0" "1 0" "0 1"; do
  set -- $setting
  QERL_LORA_SHRINK_IN_GEMM=$1 QERL_PDL=$2 timeout 120 python3 dev/sweeps/rollout_step_breakdown.py \
    --models qwen2.5-7b --weights nvfp4 --lora-rank 16 --contexts 1280 --json "$OUT/breakdown_s$1_pdl$2.json" \
    > "$OUT/breakdown_s$1_pdl$2.log" 2>&1
done
cd "$OUT" && tar czf shrink_diag.tgz ./*.log ./*.json device.txt

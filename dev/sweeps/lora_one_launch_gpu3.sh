#!/usr/bin/env bash
# dev/LOG.md section 41, run 3: the LoRA and glue CUDA tests on the fixed code, then the batch-8 results runs
# (256 + 2048, two repeats): 7B NVFP4 and bf16 at LoRA r0 / r16 / r64; 14B NVFP4 and bf16 at r0 / r32.
# Run through gpu_job.sh; writes to $OUT.
set -u
timeout 300 python3 -m pytest -q -m cuda tests/test_lora_kernels.py tests/test_engine_glue.py > "$OUT/cuda_tests.log" 2>&1
echo "exit $?" >> "$OUT/cuda_tests.log"
timeout 300 python3 -m qerl_lib bench rollout --models qwen2.5-7b --no-hf-baseline --repeats 2 --batch 8 \
  --gen-len 2048 --lora-rank 0,16,64 --weights nvfp4,bf16 --json "$OUT/rollout_7b_b8_lora.json" > "$OUT/rollout_7b.log" 2>&1
timeout 360 python3 -m qerl_lib bench rollout --models qwen2.5-14b --no-hf-baseline --repeats 2 --batch 8 \
  --gen-len 2048 --lora-rank 0,32 --weights nvfp4,bf16 --json "$OUT/rollout_14b_b8_lora.json" > "$OUT/rollout_14b.log" 2>&1
cd "$OUT" && tar czf run3.tgz ./*.log ./*.json device.txt

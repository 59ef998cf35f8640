#!/usr/bin/env bash
# dev/LOG.md section 40, run 1: CUDA tests, then the producer GEMM's PDL A/B in the 7B engine (batch 32 / 64,
# LoRA r16, 256 + 1024), four processes alternating on / off. Run through gpu_job.sh; writes to $OUT.
set -u
python3 -m pytest -q -m cuda tests/test_fp4_wgmma_producer.py tests/test_engine_glue.py tests/test_lora_kernels.py \
  tests/test_decode_launch_folds.py tests/test_engine.py > "$OUT/cuda_tests.log" 2>&1
i=0
for s in 1 0 1 0; do
  i=$((i + 1)); w=nvfp4; [ $i = 1 ] && w=nvfp4,bf16
  echo "PRODUCER_PDL=$s $w" >> "$OUT/ab.log"
  PRODUCER_PDL=$s python3 dev/sweeps/producer_pdl_ab.py bench rollout --models qwen2.5-7b --no-hf-baseline \
    --repeats 2 --batch 32,64 --gen-len 1024 --lora-rank 16 --weights $w --json "$OUT/ab_${i}_$s.json" \
    > "$OUT/ab_${i}_$s.log" 2>&1
  grep -E "^ +qwen" "$OUT/ab_${i}_$s.log" >> "$OUT/ab.log"
done

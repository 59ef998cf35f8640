#!/usr/bin/env bash
# dev/LOG.md section 40. Run through gpu_job.sh; writes to $OUT.
#   run 1: CUDA tests, then the producer GEMM's PDL A/B in the 7B engine (batch 32 / 64, LoRA r16, 256 + 1024)
#   run 2: CUDA tests, then the A/B of fp4_wgmma's, the permute's and the split-K sum's PDL (batch 32 / 64 / 128,
#          r0 and r16, 256 + 512, one repeat)
#   run 3: the final code (the split-K sum plain again): CUDA tests, then OTHER_PDL 1 / 0 at batch 32 / 128, r0 / r16
set -u
case "${1:-run1}" in
run1)
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
  done ;;
run2)
  python3 -m pytest -q -m cuda tests/test_fp4_wgmma.py tests/test_fp4_wgmma_producer.py tests/test_fp4_kernel.py \
    tests/test_engine_glue.py tests/test_engine.py tests/test_engine_continuous.py > "$OUT/cuda_tests2.log" 2>&1
  i=0
  for s in 1 0 1 0; do
    i=$((i + 1))
    echo "OTHER_PDL=$s" >> "$OUT/ab2.log"
    OTHER_PDL=$s python3 dev/sweeps/producer_pdl_ab.py bench rollout --models qwen2.5-7b --no-hf-baseline \
      --repeats 1 --batch 32,64,128 --gen-len 512 --lora-rank 0,16 --weights nvfp4 --json "$OUT/ab2_${i}_$s.json" \
      > "$OUT/ab2_${i}_$s.log" 2>&1
    grep -E "^ +qwen" "$OUT/ab2_${i}_$s.log" >> "$OUT/ab2.log"
  done
  cd "$OUT" && tar czf run2.tgz ./*.log ./*.json device.txt ;;
run3)
  python3 -m pytest -q -m cuda tests/test_fp4_wgmma.py tests/test_fp4_wgmma_producer.py -k "pdl or k_slices or oracle" \
    > "$OUT/cuda_tests3.log" 2>&1
  i=0
  for s in 1 0 1 0; do
    i=$((i + 1))
    echo "OTHER_PDL=$s" >> "$OUT/ab3.log"
    OTHER_PDL=$s python3 dev/sweeps/producer_pdl_ab.py bench rollout --models qwen2.5-7b --no-hf-baseline \
      --repeats 1 --batch 32,128 --gen-len 512 --lora-rank 0,16 --weights nvfp4 --json "$OUT/ab3_${i}_$s.json" \
      > "$OUT/ab3_${i}_$s.log" 2>&1
    grep -E "^ +qwen" "$OUT/ab3_${i}_$s.log" | awk '!seen[$0]++' >> "$OUT/ab3.log"
  done
  cd "$OUT" && tar czf run3.tgz ./*.log ./*.json device.txt ;;
esac

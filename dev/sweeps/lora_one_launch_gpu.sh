#!/usr/bin/env bash
# dev/LOG.md section 41: the batch-8 adapters in one launch per group. Run through gpu_job.sh; writes to $OUT.
# (Ran at commit 6ef0a72; the one-launch path it switches was removed after section 41.)
# 1. CUDA tests: the LoRA kernels (one launch = two launches, engine) and the two PDL graph tests that the review
#    after section 40 moved into tests/conftest.py.
# 2. 7B NVFP4 batch 8, 256 + 2048, r0 / r16 / r64: four processes alternating ONE_LAUNCH_ROWS 8 / 0 (the first also
#    runs bf16).
# 3. 14B NVFP4 batch 8, 256 + 2048, r0 / r32: two processes, ONE_LAUNCH_ROWS 8 / 0.
# 4. 7B r16 / r64 at 1 and 4 warps.
# Every step has a time limit (an expand program that spun forever would otherwise hold the machine).
set -u
timeout 420 python3 -m pytest -q -m cuda tests/test_lora_kernels.py -k "one_launch or match_the_reference or engine" \
  > "$OUT/cuda_tests.log" 2>&1; echo "exit $?" >> "$OUT/cuda_tests.log"
timeout 240 python3 -m pytest -q -m cuda tests/test_fp4_wgmma.py tests/test_fp4_wgmma_producer.py -k "glue_kernel_in_a_graph" \
  > "$OUT/cuda_tests_graph.log" 2>&1; echo "exit $?" >> "$OUT/cuda_tests_graph.log"
bench() {  # name rows model ranks weights [warps]
  echo "ONE_LAUNCH_ROWS=$2 ${6:+ONE_LAUNCH_WARPS=$6 }$3 $5" >> "$OUT/ab.log"
  env ONE_LAUNCH_ROWS=$2 ${6:+ONE_LAUNCH_WARPS=$6} timeout 420 python3 dev/sweeps/lora_one_launch_ab.py bench rollout \
    --models "$3" --no-hf-baseline --repeats 1 --batch 8 --gen-len 2048 --lora-rank "$4" --weights "$5" \
    --json "$OUT/$1.json" > "$OUT/$1.log" 2>&1 || echo "  $1 exit $?" >> "$OUT/ab.log"
  grep -E "^ +qwen" "$OUT/$1.log" | awk '!seen[$0]++' >> "$OUT/ab.log"
}
i=0
for rows in 8 0 8 0; do
  i=$((i + 1)); w=nvfp4; [ $i = 1 ] && w=nvfp4,bf16
  bench "ab_${i}_$rows" $rows qwen2.5-7b 0,16,64 $w
done
bench ab14_1_8 8 qwen2.5-14b 0,32 nvfp4
bench ab14_2_0 0 qwen2.5-14b 0,32 nvfp4
for warps in 1 4; do bench "warps_$warps" 8 qwen2.5-7b 16,64 nvfp4 $warps; done
cd "$OUT" && tar czf one_launch.tgz ./*.log ./*.json device.txt

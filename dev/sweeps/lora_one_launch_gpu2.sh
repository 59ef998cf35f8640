#!/usr/bin/env bash
# dev/LOG.md section 41, run 2: after run 1's compile failure of the two-launch expand (member_xa's string default,
# refused by Triton 3.6). Run through gpu_job.sh; writes to $OUT. The LoRA CUDA tests, then in the 7B engine,
# batch 8, 256 + 2048, one repeat: two launches (r0 / r16 / r64, NVFP4 and bf16), one launch at 4 and 2 warps
# (r16 / r64), two launches again (r16 / r64); then 14B two launches (r0 / r32).
# (Ran at commit 937838a; the one-launch path it switches was removed after this run.)
set -u
timeout 420 python3 -m pytest -q -m cuda tests/test_lora_kernels.py > "$OUT/cuda_tests.log" 2>&1
echo "exit $?" >> "$OUT/cuda_tests.log"
bench() {  # name rows model ranks weights [warps]
  echo "ONE_LAUNCH_ROWS=$2 ${6:+ONE_LAUNCH_WARPS=$6 }$3 $5" >> "$OUT/ab.log"
  env ONE_LAUNCH_ROWS=$2 ${6:+ONE_LAUNCH_WARPS=$6} timeout 420 python3 dev/sweeps/lora_one_launch_ab.py bench rollout \
    --models "$3" --no-hf-baseline --repeats 1 --batch 8 --gen-len 2048 --lora-rank "$4" --weights "$5" \
    --json "$OUT/$1.json" > "$OUT/$1.log" 2>&1 || echo "  $1 exit $?" >> "$OUT/ab.log"
  grep -E "^ +qwen" "$OUT/$1.log" | awk '!seen[$0]++' >> "$OUT/ab.log"
}
bench two_1 0 qwen2.5-7b 0,16,64 nvfp4,bf16
bench one_w4 8 qwen2.5-7b 16,64 nvfp4 4
bench one_w2 8 qwen2.5-7b 16,64 nvfp4 2
bench two_2 0 qwen2.5-7b 16,64 nvfp4
bench two_14b 0 qwen2.5-14b 0,32 nvfp4
cd "$OUT" && tar czf run2.tgz ./*.log ./*.json device.txt

#!/usr/bin/env bash
# dev/LOG.md section 44: a bf16 base's LoRA A as extra rows of its weight (QERL_LORA_ROWS=1), so the base GEMM makes
# xa and the shrink launch goes. Run through gpu_job.sh; writes to $OUT. First the CUDA tests of the LoRA kernels,
# the fused groups and the glue (the "bf16-rows" cases run the new path), then 7B bf16 at batch 8, 256 + 2048, LoRA
# r0 / r16 / r64, two repeats, four processes alternating QERL_LORA_ROWS 1 / 0, then one pair at batch 32 (256 + 512,
# r16), each under a time limit.
set -u
timeout 300 python3 -m pytest -q -m cuda tests/test_lora_kernels.py tests/test_layers_fused.py tests/test_engine_glue.py \
  > "$OUT/cuda_tests.log" 2>&1
echo "exit $?" >> "$OUT/cuda_tests.log"
i=0
for s in 1 0 1 0; do
  i=$((i + 1))
  echo "QERL_LORA_ROWS=$s batch 8" >> "$OUT/ab.log"
  QERL_LORA_ROWS=$s timeout 240 python3 -m qerl_lib bench rollout --models qwen2.5-7b --no-hf-baseline --repeats 2 \
    --batch 8 --gen-len 2048 --lora-rank 0,16,64 --weights bf16 --json "$OUT/b8_${i}_$s.json" > "$OUT/b8_${i}_$s.log" 2>&1 \
    || echo "  exit $?" >> "$OUT/ab.log"
  grep -E "^ +qwen" "$OUT/b8_${i}_$s.log" | awk '!seen[$0]++' >> "$OUT/ab.log"
done
for s in 1 0; do
  echo "QERL_LORA_ROWS=$s batch 32" >> "$OUT/ab.log"
  QERL_LORA_ROWS=$s timeout 200 python3 -m qerl_lib bench rollout --models qwen2.5-7b --no-hf-baseline --repeats 2 \
    --batch 32 --gen-len 512 --lora-rank 16 --weights bf16 --json "$OUT/b32_$s.json" > "$OUT/b32_$s.log" 2>&1 \
    || echo "  exit $?" >> "$OUT/ab.log"
  grep -E "^ +qwen" "$OUT/b32_$s.log" | awk '!seen[$0]++' >> "$OUT/ab.log"
done
# where the step's time goes (section 44's first look saved 0.06 ms of a predicted ~0.27): kernel time by category
# and idle time, bf16 r16 with the switch on and off, context 1280, batch 8
for s in 1 0; do
  QERL_LORA_ROWS=$s timeout 150 python3 dev/sweeps/rollout_step_breakdown.py --models qwen2.5-7b --weights bf16 \
    --lora-rank 16 --contexts 1280 --json "$OUT/breakdown_$s.json" > "$OUT/breakdown_$s.log" 2>&1
done
cd "$OUT" && tar czf lora_rows.tgz ./*.log ./*.json device.txt

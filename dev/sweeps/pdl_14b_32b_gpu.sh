#!/usr/bin/env bash
# dev/LOG.md section 40, "Next" (3): the producer-warp GEMM's PDL launch (section 40, run 1: +7.7% at 7B batch 32) in
# the 14B and 32B engines. Run through gpu_job.sh; writes to $OUT. Batch 32, 256 + 512, NVFP4 + LoRA r16, one repeat:
# four processes per size alternating PRODUCER_PDL 1 / 0 (dev/sweeps/producer_pdl_ab.py), each under a time limit.
# PDL_ORDER (default "1 0 1 0") picks the alternation; the second attempt ran "0 1 0" after the first's PDL=0 half failed
# (the switch-off stub had pdl.use_for's old one-argument signature).
set -u
for model in qwen2.5-14b qwen2.5-32b; do
  i=0
  for s in ${PDL_ORDER:-1 0 1 0}; do
    i=$((i + 1))
    echo "PRODUCER_PDL=$s $model" >> "$OUT/ab.log"
    PRODUCER_PDL=$s timeout 300 python3 dev/sweeps/producer_pdl_ab.py bench rollout --models $model --no-hf-baseline \
      --repeats 1 --batch 32 --gen-len 512 --lora-rank 16 --weights nvfp4 --json "$OUT/${model}_${i}_$s.json" \
      > "$OUT/${model}_${i}_$s.log" 2>&1 || echo "  exit $?" >> "$OUT/ab.log"
    grep -E "^ +qwen" "$OUT/${model}_${i}_$s.log" | awk '!seen[$0]++' >> "$OUT/ab.log"
  done
done
cd "$OUT" && tar czf pdl_14b_32b.tgz ./*.log ./*.json device.txt

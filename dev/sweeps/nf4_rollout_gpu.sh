#!/usr/bin/env bash
# dev/LOG.md section 48: QLoRA's base (bitsandbytes NF4) in the kit's engine against NVFP4, same process, for #17's
# "NVFP4 / NF4 >= 1.5x". Needs bitsandbytes: send the two .bnb parts (gpu_job.sh `part .bnb0`, `part .bnb1`), then
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/gpu_job.sh assemble > $OUT/assemble.log 2>&1 &&
#     export PYTHONPATH=$PYTHONPATH:/tmp/site_bnb; bash dev/sweeps/nf4_rollout_gpu.sh'
# 7B random weights: batch 8, 256 + 2048, LoRA r0 / r16, two repeats; then batch 32, 256 + 1024, r16.
set -u
timeout 330 python3 -m qerl_lib bench rollout --models qwen2.5-7b --no-hf-baseline --repeats 2 --batch 8 \
  --gen-len 2048 --lora-rank 0,16 --weights nvfp4,nf4 --json "$OUT/nf4_b8.json" > "$OUT/nf4_b8.log" 2>&1
timeout 200 python3 -m qerl_lib bench rollout --models qwen2.5-7b --no-hf-baseline --repeats 2 --batch 32 \
  --gen-len 1024 --lora-rank 16 --weights nvfp4,nf4 --json "$OUT/nf4_b32.json" > "$OUT/nf4_b32.log" 2>&1
cd "$OUT" && tar czf nf4_rollout.tgz ./*.log ./*.json device.txt

#!/usr/bin/env bash
# dev/LOG.md section 61 (the session's last device time, so one repeat per row): the merge kernel's CUDA tests, then
# 7B bf16 merged and unmerged adapters at batch 8 (256 + 2048, r0/16/64) and batch 32 (256 + 1024, r0/16).
# Run through gpu_job.sh; writes to $OUT.
python3 -m pytest -q -m cuda tests/test_engine_merged.py > $OUT/merge_tests.log 2>&1
for b in 8:2048:0,16,64 32:1024:0,16; do
  IFS=: read n g r <<< "$b"
  timeout 150 python3 -m qerl_lib bench rollout --models qwen2.5-7b --no-hf-baseline --repeats 1 --batch $n \
    --gen-len $g --lora-rank $r --weights bf16 --lora-merge off,on --json $OUT/b$n.json > $OUT/b$n.log 2>&1
done

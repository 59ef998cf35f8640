#!/usr/bin/env bash
# dev/LOG.md section 128 (nvidia-h200; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/prefill_inplace_gpu.sh'   then   ... poll 540 (twice)
# 1. the CUDA tests of the touched paths (the plain-torch adapters' in-place expand, the prefill's RoPE kernel, the
#    moved rotary kernel, the engine's LoRA paths);
# 2. the refill prefill's A/B in one process again, five rounds: 7B NVFP4 r0 and r16, 8 x 256, plain and glue ops;
# 3. #17's variable-length workload (7B NVFP4 + r16, 256 gsm8k-like completions <= 1024 on 64 rows), static and
#    continuous with the default prefill ops, then continuous with QERL_PREFILL_GLUE=1.
source dev/sweeps/job_prelude.sh
export CUDA_VISIBLE_DEVICES=0
timeout 300 python3 -m pytest -q -m cuda tests/test_engine_adapters_torch.py tests/test_engine_glue.py \
  tests/test_fused_layers.py tests/test_lora_in_gemm.py tests/test_engine.py > $OUT/cuda_tests.log 2>&1
python3 dev/sweeps/refill_prefill_profile.py --model qwen2.5-7b --weights nvfp4 --lora-rank 0,16 --rows 8 \
  --prompt-len 256 --prefill-ops plain,glue --rounds 5 --ops 20 --json $OUT/prefill_ab.json > $OUT/prefill_ab.log 2>&1
python3 -m qerl_lib bench rollout --models qwen2.5-7b --prompt-len 256 --gen-len 1024 --repeats 2 --no-hf-baseline \
  --weights nvfp4 --batch 64 --lora-rank 16 --workload gsm8k-like --prompts 256 --scheduling static,continuous \
  --json $OUT/uneven_plain.json > $OUT/uneven_plain.log 2>&1
QERL_PREFILL_GLUE=1 python3 -m qerl_lib bench rollout --models qwen2.5-7b --prompt-len 256 --gen-len 1024 --repeats 2 \
  --no-hf-baseline --weights nvfp4 --batch 64 --lora-rank 16 --workload gsm8k-like --prompts 256 \
  --scheduling continuous --json $OUT/uneven_glue.json > $OUT/uneven_glue.log 2>&1
stop_memory_samples

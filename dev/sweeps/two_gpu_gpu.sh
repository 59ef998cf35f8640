#!/usr/bin/env bash
# dev/LOG.md section 104, on an nvidia-h200-x2 machine (2 H200s): the job's commands, run by gpu_job.sh start after
# the six part calls (.bnb0 .bnb1 .gguf_a1 .gguf_a2 .gguf_b1 .gguf_b2, one call each), from the repository root:
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/two_gpu_gpu.sh'
# 1. what a rollout after the engine's release pays again (rollout_recapture.py), NVFP4 and bf16 + r32, one GPU each
# 2. `qerl bench train` at 1 and 2 GPUs (data parallel), 7B qerl, batch 16 and 64 in 2 groups, micro-batch 8
# 3. the embedded model's smollm2-arith preset in mode qerl, 40 steps, on 1 and on 2 GPUs, same seed
# nvidia-smi samples every GPU's memory every 2 s throughout (gpu_memory.csv), so the use of both GPUs is on record.
set -uo pipefail
OUT=${OUT:-/tmp/out}
bash dev/sweeps/gpu_job.sh assemble > $OUT/assemble.log 2>&1
export PYTHONPATH=$PYTHONPATH:/tmp/site_bnb QERL_GGUF=/tmp/qerl/SmolLM2-135M-Instruct.Q4_1.gguf
env | grep -E '^(NCCL_NVLS_ENABLE|TORCH_SYMM_MEM_DISABLE_MULTICAST|NVSHMEM_DISABLE_NVLS)=' > $OUT/multicast_env.txt
nvidia-smi topo -m > $OUT/topo.txt 2>&1
nvidia-smi --query-gpu=timestamp,index,memory.used,utilization.gpu --format=csv -l 2 > $OUT/gpu_memory.csv 2>&1 &
SMI=$!

CUDA_VISIBLE_DEVICES=0 python3 dev/sweeps/rollout_recapture.py --weights nvfp4 --rank 32 \
  --json $OUT/recapture_nvfp4.json > $OUT/recapture_nvfp4.log 2>&1 &
A=$!
CUDA_VISIBLE_DEVICES=1 python3 dev/sweeps/rollout_recapture.py --weights bf16 --rank 32 \
  --json $OUT/recapture_bf16.json > $OUT/recapture_bf16.log 2>&1 &
B=$!
wait $A $B

python3 -m qerl_lib bench train --models qwen2.5-7b --modes qerl --batches 16,64 --groups 2 --micro-batch 8 \
  --num-gpus 1,2 --steps 3 --json $OUT/bench_train_2gpu.json > $OUT/bench_train_2gpu.log 2>&1

for n in 1 2; do
  python3 -m qerl_lib train --preset smollm2-arith --mode qerl --steps 40 --seed 0 --num-gpus $n \
    --out /tmp/train_${n}gpu > $OUT/train_${n}gpu.log 2>&1
  mkdir -p $OUT/train_${n}gpu && cp /tmp/train_${n}gpu/{metrics.jsonl,summary.json,run.json} $OUT/train_${n}gpu/ 2>/dev/null
done
kill $SMI

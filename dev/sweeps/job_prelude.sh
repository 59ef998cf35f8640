# Sourced at the top of a GPU job script run by `gpu_job.sh start` (after the two part calls .bnb0 and .bnb1, carrying
# .whl and .tokcache): installs bitsandbytes, points the runs at the embedded model's tokenizer, and samples every
# GPU's memory every 2 s into $OUT/gpu_memory.csv until the script calls `stop_memory_samples`.
set -uo pipefail
OUT=${OUT:-/tmp/out}
bash dev/sweeps/gpu_job.sh assemble > $OUT/assemble.log 2>&1
export PYTHONPATH=$PYTHONPATH:/tmp/site_bnb QERL_CACHE=$PWD/.tokcache
nvidia-smi --query-gpu=timestamp,index,memory.used,utilization.gpu --format=csv -l 2 > $OUT/gpu_memory.csv 2>&1 &
MEMORY_SAMPLER=$!
stop_memory_samples() { kill $MEMORY_SAMPLER; }

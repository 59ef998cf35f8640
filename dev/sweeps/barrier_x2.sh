#!/usr/bin/env bash
# dev/LOG.md section 146 (nvidia-h200-x2; after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache, and
# the four GGUF parts for the embedded model's weights):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/barrier_x2.sh'   then   bash dev/sweeps/gpu_job.sh poll 560
# (1) the CUDA tests that need two GPUs; (2) a two-GPU `qerl train` (NCCL) saving a checkpoint every 2 steps, each
# checked: process 0's marker waited for process 1's rng_state_1.pth, no training_args.bin; (a resume on two GPUs is test_distributed's, on gloo).
source dev/sweeps/job_prelude.sh
export QERL_GGUF=/tmp/qerl/SmolLM2-135M-Instruct.Q4_1.gguf && unset QERL_CACHE  # the embedded model assemble converted
python3 -m pytest -q -m cuda tests/test_distributed.py tests/test_engine_remap.py tests/test_engine_other_gpu.py \
  -rs > $OUT/cuda_tests.log 2>&1
python3 -m qerl_lib train --preset smollm2-expr --level 1 --base nvfp4 --aqn rollout --prompts-per-step 2 \
  --micro-batch 4 --save-steps 2 --save-total-limit 3 --num-gpus 2 --seed 0 --steps 4 --out /tmp/run2 \
  > $OUT/train_2gpu.log 2>&1
python3 - > $OUT/checkpoints.txt 2>&1 <<'PY'
import json, pathlib
from qerl_lib.train.metrics import PICKLED_ARGS, SIDE_STATE, checkpoint_problem
for c in sorted(pathlib.Path("/tmp/run2/checkpoints").glob("checkpoint-*")):
    files = json.loads((c / SIDE_STATE).read_text())["files"] if (c / SIDE_STATE).is_file() else {}
    print(c.name, "problem:", checkpoint_problem(c), "| rng files:", sorted(f for f in files if f.startswith("rng_state")),
          "| training_args.bin present:", (c / PICKLED_ARGS).exists())
PY
cp /tmp/run2/metrics.jsonl /tmp/run2/run.json $OUT/ 2>/dev/null
stop_memory_samples

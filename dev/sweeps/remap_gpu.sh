#!/usr/bin/env bash
# dev/LOG.md section 105 (one H200, carrying .whl): bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/remap_gpu.sh'
set -uo pipefail
OUT=${OUT:-/tmp/out}
python3 -m pytest -q -m cuda tests/test_engine_remap.py tests/test_engine.py tests/test_engine_merged.py \
  tests/test_engine_continuous.py > $OUT/cuda_tests.log 2>&1
python3 dev/sweeps/rollout_recapture.py --weights nvfp4 --rank 32 --json $OUT/recapture_nvfp4.json \
  > $OUT/recapture_nvfp4.log 2>&1

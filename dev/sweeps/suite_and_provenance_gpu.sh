#!/usr/bin/env bash
# dev/LOG.md section 148 (nvidia-h200, after the two part calls .bnb0 and .bnb1, carrying .whl and .tokcache):
#   bash dev/sweeps/gpu_job.sh start 'bash dev/sweeps/suite_and_provenance_gpu.sh'   then   bash dev/sweeps/gpu_job.sh poll 560
# (1) Does `provenance()` (called by `qerl bench train` before its cases now, section 147) leave a CUDA context in
# the parent process while the cases run? (2) The whole CUDA suite with the tightened tests of section 148.
source dev/sweeps/job_prelude.sh
export CUDA_VISIBLE_DEVICES=0 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
python3 - > $OUT/provenance_context.txt 2>&1 <<'PY'
import os, subprocess, torch
from qerl_lib.io import provenance
device = provenance()["device"]
apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                      capture_output=True, text=True).stdout
print("device:", device)
print("this pid:", os.getpid(), "| torch.cuda.is_initialized():", torch.cuda.is_initialized())
print("compute apps after provenance():", repr(apps))
PY
timeout 560 python3 -m pytest -q -m cuda tests/ --ignore=tests/test_hygiene.py -rs > $OUT/cuda_suite.log 2>&1
stop_memory_samples

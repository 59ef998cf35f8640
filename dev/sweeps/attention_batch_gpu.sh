#!/usr/bin/env bash
# Decode attention at RL batch sizes (dev/LOG.md section 30) on the device machine, from the repository
# root, carrying .whl. The slices-by-column kernel is compared with the one before it (commit df35b38):
#   git show df35b38:qerl_lib/engine/attention.py > dev/runs/attention_batch_h100_2026-11-25/attention_before.py
#   (travels with the tree; not committed)
#   bash dev/sweeps/attention_batch_gpu.sh start   # CUDA attention tests, then attention_batch_sweep.py, in the background
#   bash dev/sweeps/attention_batch_gpu.sh poll 560   # waits up to 560 s; copies what is done to $OUT
# The machine goes back 30 s after a call ends: poll again at once until FINISHED.
set -euo pipefail
OUT=${OUT:-/tmp/out}
JOB=/tmp/job
BEFORE=${BEFORE:-dev/runs/attention_batch_h100_2026-11-25/attention_before.py}
case "${1:-start}" in
  start)
    rm -rf $JOB && mkdir -p $JOB/out && cp -r . $JOB/tree
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
    cd $JOB/tree
    (nohup setsid bash -c "export PYTHONPATH=/tmp/site:$JOB/tree PYTHONUNBUFFERED=1
      nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $JOB/out/device.txt
      python3 -m pytest -q -m cuda tests/test_engine_attention.py > $JOB/out/cuda_tests_attention.log 2>&1 || true
      OUT=$JOB/out BEFORE=$BEFORE python3 dev/sweeps/attention_batch_sweep.py > $JOB/out/sweep.log 2>&1
      echo done > $JOB/out/DONE" > $JOB/nohup.log 2>&1 &)
    echo started ;;
  poll)
    end=$((SECONDS + ${2:-560}))
    while [ ! -f $JOB/out/DONE ] && [ $SECONDS -lt $end ]; do sleep 10; done
    mkdir -p "$OUT" && cp $JOB/out/* "$OUT"/ 2>/dev/null || true
    tail -3 $JOB/out/cuda_tests_attention.log 2>/dev/null; tail -4 $JOB/out/sweep.log 2>/dev/null
    [ -f $JOB/out/DONE ] && echo FINISHED || echo RUNNING ;;
  *) echo "usage: $0 start|poll [seconds]" >&2; exit 2 ;;
esac

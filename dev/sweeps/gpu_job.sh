#!/usr/bin/env bash
# One background job on the device machine, from the repository root, carrying .whl (the machine goes back
# 30 s after a call ends, so long work runs detached and is polled):
#   bash dev/sweeps/gpu_job.sh start 'python3 -m pytest -q -m cuda tests/x.py > $OUT/x.log 2>&1; python3 dev/sweeps/y.py > $OUT/y.log 2>&1'
#   bash dev/sweeps/gpu_job.sh poll 560    # waits up to 560 s; copies what is done to $OUT (default /tmp/out)
# The commands run in a copy of the tree with PYTHONPATH set and OUT pointing at the job's output folder;
# device.txt (nvidia-smi) is written first. Poll again at once until it prints FINISHED.
set -euo pipefail
OUT=${OUT:-/tmp/out}
JOB=/tmp/job
case "${1:-}" in
  start)
    rm -rf $JOB && mkdir -p $JOB/out && cp -r . $JOB/tree
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
    printf '%s\n' "$2" > $JOB/commands.sh
    cd $JOB/tree
    (nohup setsid bash -c "export PYTHONPATH=/tmp/site:$JOB/tree PYTHONUNBUFFERED=1 OUT=$JOB/out
      nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $JOB/out/device.txt
      bash $JOB/commands.sh; echo done > $JOB/out/DONE" > $JOB/nohup.log 2>&1 &)
    echo started ;;
  poll)
    end=$((SECONDS + ${2:-560}))
    while [ ! -f $JOB/out/DONE ] && [ $SECONDS -lt $end ]; do sleep 10; done
    mkdir -p "$OUT" && cp $JOB/out/* "$OUT"/ 2>/dev/null || true
    for f in $JOB/out/*.log; do [ -f "$f" ] && { echo "== $(basename $f)"; tail -4 "$f"; }; done
    [ -f $JOB/out/DONE ] && echo FINISHED || echo RUNNING ;;
  *) echo "usage: $0 start '<commands>' | poll [seconds]" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Where the decode step's time goes at RL batch sizes (dev/LOG.md section 27), and the GEMM table refreshed:
#   1. rollout_step_breakdown.py: random Qwen2.5-7B + LoRA r16, NVFP4 and bf16, batch 8 / 32 / 64, context 768
#      (the middle of a 256 + 1024 rollout), 48 decode steps profiled per case;
#   2. qerl bench gemm --models qwen2.5-7b,qwen2.5-32b (forward and backward layouts) with today's kernels.
# Part "lora" instead: lora_kernel_sweep.py by batch (8 / 32 / 64) and rank (16 / 64): who sums the shrink's
# K-slice partials x K columns per shrink program, 256 + 256 tokens. The device machine goes back 30 s after a
# call, so run it in the foreground, a few batch sizes per call:
#   BATCHES=8,32 bash dev/sweeps/decode_batch_gpu.sh lora   (then BATCHES=64)
#   ABLATE=1 BATCHES=8,32,64 bash dev/sweeps/decode_batch_gpu.sh lora   # each LoRA kernel left out (section 28)
#   git show <commit>:qerl_lib/kernels/lora.py > dev/runs/<run>/lora_before.py   # travels with the tree; not committed
#     (section 28-29's "before" files: commit 377636c for lora_unroll_* and lora_warps_*, 33a53eb for lora_fold_*)
#   BEFORE_KERNELS=dev/runs/<run>/lora_before.py BATCHES=8,32,64 bash dev/sweeps/decode_batch_gpu.sh lora
# After kernels/lora.split_rule took the sweep's result:
#   bash dev/sweeps/decode_batch_gpu.sh check   # the LoRA kernels' CUDA tests, and qerl bench gemm again
#   bash dev/sweeps/decode_batch_gpu.sh rule    # 7B NVFP4 rollouts at batch 32 / 64, r0 / r16 / r64, the rule
#                                               # before (FEW_ROWS = MAX_M: batch 8's shape everywhere) and after
# On the device machine, from the repository root, carrying .whl:
#   bash dev/sweeps/decode_batch_gpu.sh start [lora]  # copies the tree to /tmp/job, runs in the background
#   bash dev/sweeps/decode_batch_gpu.sh poll 560      # waits up to 560 s; copies what is done to $OUT
set -euo pipefail
OUT=${OUT:-/tmp/out}
JOB=/tmp/job
case "${1:-start}" in
  start)  # $2: "lora" for the LoRA sweep
    rm -rf $JOB && mkdir -p $JOB/out && cp -r . $JOB/tree
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
    cd $JOB/tree
    if [ "${2:-}" = lora ]; then
      (nohup setsid bash -c "export PYTHONPATH=/tmp/site:$JOB/tree PYTHONUNBUFFERED=1
        nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $JOB/out/device.txt
        OUT=$JOB/out BATCHES=8,32,64 RANKS=16,64 GEN=256 python3 dev/sweeps/lora_kernel_sweep.py > $JOB/out/lora.log 2>&1
        echo done > $JOB/out/DONE" > $JOB/nohup.log 2>&1 &)
      echo started lora; exit 0
    fi
    (nohup setsid bash -c "export PYTHONPATH=/tmp/site:$JOB/tree PYTHONUNBUFFERED=1
      nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > $JOB/out/device.txt
      python3 dev/sweeps/rollout_step_breakdown.py --models qwen2.5-7b --weights nvfp4,bf16 --batch 8,32,64 \
        --lora-rank 16 --contexts 768 --json $JOB/out/breakdown_7b_r16.json > $JOB/out/breakdown.log 2>&1
      python3 -m qerl_lib bench gemm --models qwen2.5-7b,qwen2.5-32b --json $JOB/out/gemm.json > $JOB/out/gemm.log 2>&1
      echo done > $JOB/out/DONE" > $JOB/nohup.log 2>&1 &)  # setsid: outlives this call's process group
    echo started ;;
  lora)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
    mkdir -p "$OUT"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/device.txt"
    OUT=$OUT ABLATE=${ABLATE:-0} BEFORE_KERNELS=${BEFORE_KERNELS:-} COMPARE_VARIANTS=${COMPARE_VARIANTS:-} BATCHES=${BATCHES:-8,32,64} RANKS=${RANKS:-16,64} GEN=256 VARIANTS=${VARIANTS:-256e,512e,1024e,256s,512s} \
      PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 python3 dev/sweeps/lora_kernel_sweep.py 2>&1 | grep -v -i warn ;;
  check|rule)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    mkdir -p "$OUT"
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/device.txt"
    if [ "$1" = check ]; then
      python3 -m pytest -q -m cuda tests/test_lora_kernels.py > "$OUT/cuda_tests_lora_kernels.log" 2>&1 || echo "CUDA TESTS FAILED"
      tail -2 "$OUT/cuda_tests_lora_kernels.log"
      python3 -m qerl_lib bench gemm --models qwen2.5-7b,qwen2.5-32b --json "$OUT/gemm.json" | tail -4
    else
      args="bench rollout --models qwen2.5-7b --no-hf-baseline --repeats 1 --batch 32,64 --gen-len 1024 --weights nvfp4"
      python3 -c "import sys, qerl_lib.kernels.lora as lk; lk.FEW_ROWS = lk.MAX_M; from qerl_lib.cli import main
sys.exit(main(sys.argv[1:]))" $args --lora-rank 16,64 --json "$OUT/rollout_rule_before.json" | tail -5
      python3 -m qerl_lib $args --lora-rank 0,16,64 --json "$OUT/rollout_rule_after.json" | tail -7
    fi ;;
  poll)
    end=$((SECONDS + ${2:-560}))
    while [ ! -f $JOB/out/DONE ] && [ $SECONDS -lt $end ]; do sleep 10; done
    mkdir -p "$OUT" && cp $JOB/out/* "$OUT"/ 2>/dev/null || true
    tail -5 $JOB/out/*.log 2>/dev/null
    [ -f $JOB/out/DONE ] && echo FINISHED || echo RUNNING ;;
  *) echo "usage: $0 start|poll [seconds]" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# dev/LOG.md section 76: Nsight Compute on the register-A GEMM's backward layout (7B gate/up's dx = dy @ W, M = 4096)
# as built, without the producer's repack (probe 4), and on cuBLAS's bf16 torch.mm of the same shape, one launch each;
# the details page and the raw metrics (CSV) kept as text. Run through gpu_job.sh start.
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for case in p0 p4 bf16; do
  case $case in
    p0) ENVS="PROBE=0"; K="regex:qerl_fp4_ra" ;;
    p4) ENVS="PROBE=4"; K="regex:qerl_fp4_ra" ;;
    bf16) ENVS="BF16=1"; K="regex:gemm|sm90|cutlass|nvjet" ;;
  esac
  env BACKWARD=1 $ENVS $NCU -k "$K" -c 1 --set full -o $OUT/bwd_$case python3 dev/sweeps/fp4_ra_profile_ncu.py \
    > $OUT/ncu_run_bwd_$case.log 2>&1
  $NCU -i $OUT/bwd_$case.ncu-rep --page details > $OUT/details_bwd_$case.txt 2>&1
  $NCU -i $OUT/bwd_$case.ncu-rep --page raw --csv > $OUT/raw_bwd_$case.csv 2>&1
done
rm -f $OUT/*.ncu-rep

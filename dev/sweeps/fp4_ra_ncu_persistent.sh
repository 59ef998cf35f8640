#!/usr/bin/env bash
# dev/LOG.md section 74: Nsight Compute on the persistent register-A GEMM (split schedule) as built and without its
# decode (probe 1), and on cuBLAS's bf16 GEMM of the same shape (7B gate/up, M = 4096), each one launch; the details
# page and the raw metrics (CSV) are kept as text, the .ncu-rep files dropped. Run through gpu_job.sh start.
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
for case in p0 p1 bf16; do
  case $case in
    p0) ENVS="PROBE=0"; K="regex:qerl_fp4_ra" ;;
    p1) ENVS="PROBE=1"; K="regex:qerl_fp4_ra" ;;
    bf16) ENVS="BF16=1"; K="regex:gemm|sm90|cutlass|nvjet" ;;
  esac
  env $ENVS $NCU -k "$K" -c 1 --set full -o $OUT/$case python3 dev/sweeps/fp4_ra_profile_ncu.py > $OUT/ncu_run_$case.log 2>&1
  $NCU -i $OUT/$case.ncu-rep --page details > $OUT/details_$case.txt 2>&1
  $NCU -i $OUT/$case.ncu-rep --page raw --csv > $OUT/raw_$case.csv 2>&1
done
rm -f $OUT/*.ncu-rep

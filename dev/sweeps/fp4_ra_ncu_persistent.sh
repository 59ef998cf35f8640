#!/usr/bin/env bash
# dev/LOG.md sections 74 and 76: Nsight Compute on the persistent register-A GEMM (split schedule, 7B gate/up,
# M = 4096) as built and with each probe in PROBES (default "1": no decode), and on cuBLAS's bf16 GEMM of the same
# shape, each one launch; the details page and the raw metrics (CSV) are kept as text, the .ncu-rep files dropped.
# Section 76 ran the backward layout: BACKWARD=1 PROBES=4 (no repack; files prefixed bwd_). Run through gpu_job.sh start.
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
PREFIX=$([ "${BACKWARD:-0}" = 1 ] && echo bwd_ || true)
for case in p0 $(for p in ${PROBES:-1}; do echo p$p; done) bf16; do
  case $case in
    bf16) ENVS="BF16=1"; K="regex:gemm|sm90|cutlass|nvjet" ;;
    *) ENVS="PROBE=${case#p}"; K="regex:qerl_fp4_ra" ;;
  esac
  name=$PREFIX$case
  env BACKWARD=${BACKWARD:-0} $ENVS $NCU -k "$K" -c 1 --set full -o $OUT/$name python3 dev/sweeps/fp4_ra_profile_ncu.py \
    > $OUT/ncu_run_$name.log 2>&1
  $NCU -i $OUT/$name.ncu-rep --page details > $OUT/details_$name.txt 2>&1
  $NCU -i $OUT/$name.ncu-rep --page raw --csv > $OUT/raw_$name.csv 2>&1
done
rm -f $OUT/*.ncu-rep

#!/usr/bin/env bash
# dev/LOG.md section 72: Nsight Compute on the register-A CUDA GEMM, as built and with its two probes (7B gate/up, M = 4096,
# 256 rows of x, 4 stages). Run through gpu_job.sh start; reports printed to text, the .ncu-rep files dropped.
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1); echo "ncu: $NCU" > $OUT/ncu_path.log
for P in 0 1 2; do
  PROBE=$P $NCU -k regex:qerl_fp4_ra -c 1 --set full -o $OUT/ra_p$P python3 dev/sweeps/fp4_ra_profile_ncu.py > $OUT/ncu_run_p$P.log 2>&1
  $NCU -i $OUT/ra_p$P.ncu-rep --page details > $OUT/details_p$P.txt 2>&1
done
$NCU -i $OUT/ra_p0.ncu-rep --page source --print-source sass --csv > $OUT/source_p0.csv 2>&1
rm -f $OUT/*.ncu-rep

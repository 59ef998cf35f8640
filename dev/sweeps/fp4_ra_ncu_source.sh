#!/usr/bin/env bash
# dev/LOG.md section 76: Nsight Compute's per-instruction warp-stall samples (SASS) of one launch of the register-A
# GEMM's backward layout (7B gate/up's dx = dy @ W, M = 4096; PROBE from the environment, 0 by default), kept as CSV.
# Run through gpu_job.sh start.
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
P=${PROBE:-0}
env BACKWARD=1 PROBE=$P $NCU -k regex:qerl_fp4_ra -c 1 --section SourceCounters --section WarpStateStats \
  --import-source no -o $OUT/src_p$P python3 dev/sweeps/fp4_ra_profile_ncu.py > $OUT/ncu_src_p$P.log 2>&1
$NCU -i $OUT/src_p$P.ncu-rep --page source --csv --print-source sass > $OUT/source_p$P.csv 2>&1
rm -f $OUT/*.ncu-rep

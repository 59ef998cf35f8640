#!/usr/bin/env bash
# Run 18 (dev/LOG.md section 26): the mma.sync decode kernel at 9 <= M <= 64 on the device machine: correctness
# and a launch-shape sweep (fp4_mma_mid_m_sweep.py, < 1 min). The kernel it swept is commit 96c99c1's (x read one
# word at a time from 3 n8 blocks on); it lost to the Triton kernel at M >= 32 and was reverted, so check that
# commit out to repeat it. Run from the repository root, carrying .whl: bash dev/sweeps/mma_mid_m_gpu.sh
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/device.txt"
OUT=$OUT python3 dev/sweeps/fp4_mma_mid_m_sweep.py --ms "${MS:-16,32,64}" 2>&1 | tee "$OUT/sweep_mid_m_mma.log"

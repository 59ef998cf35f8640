"""One 7B gate_up GEMM (N=37888, K=3584, M=8; env M for another row count) through the mma.sync kernel
(M <= 8 only) and the Triton kernel, for Nsight Compute: pipe utilisation, stall reasons, DRAM throughput
(run 10; its report is dev/runs/fp4_kernel_ncu_run10_h200.txt; section 31 profiled M = 16 and 64). Output:
ncu's report, which goes to dev/runs/.

    ncu -k regex:"qerl_fp4|_fp4_gemm" -c 2 --set full python3 dev/sweeps/fp4_kernel_profile_ncu.py > dev/runs/NAME.txt
"""
import os

import torch

from qerl_lib.kernels import mma
from qerl_lib.kernels.fp4_gemm import fp4_linear, prepare_fp4_weights
from qerl_lib.quant.nvfp4 import quantize

n, k, m = 37888, 3584, int(os.environ.get("M", "8"))
q = quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
w = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
for _ in range(3 if m <= 8 else 0):
    mma.mma_linear(x, w.words, w.scales, w.global_scale, None, out)
for _ in range(3):
    fp4_linear(x, w, out=out, small_m_backend="triton")
torch.cuda.synchronize()

"""One Gluon NVFP4 GEMM launch (``kernels/fp4_wgmma.py``) for Nsight Compute (dev/LOG.md section 33): the
7B gate/up shape (N=37888, K=3584) at ``M`` rows (default 64) with ``CONFIG`` = "block_m,warpgroups,split_k,
stages,max_registers" (0: no cap; default the launch rule's pick). The report goes to dev/runs/.

    M=64 CONFIG=64,2,1,4,128 ncu -k regex:_fp4_wgmma -c 1 --set full python3 dev/sweeps/fp4_wgmma_profile_ncu.py
"""
import os

import torch

from qerl_lib.kernels.fp4_gemm import fp4_linear, prepare_fp4_weights
from qerl_lib.kernels.fp4_wgmma import WgmmaConfig
from qerl_lib.kernels.launch_rule import pick_wgmma_config
from qerl_lib.quant.nvfp4 import quantize

n, k, m = 37888, 3584, int(os.environ.get("M", "64"))
if os.environ.get("CONFIG"):
    bm, wg, split, stages, regs = map(int, os.environ["CONFIG"].split(","))
    config = WgmmaConfig(bm, wg, split, stages, regs or None)
else:
    config = pick_wgmma_config(m, n, k, torch.cuda.get_device_properties(0).multi_processor_count)
print("config", config, flush=True)
q = quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
w = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
for _ in range(3):
    fp4_linear(x, w, out=out, config=config)
torch.cuda.synchronize()

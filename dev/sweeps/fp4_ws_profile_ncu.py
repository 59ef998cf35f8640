"""One training-size GEMM launch for Nsight Compute (dev/LOG.md section 34): ``KERNEL`` = ``ws`` (the
warp-specialized kernel, ``kernels/fp4_wgmma_ws.py``), ``wg256`` (``fp4_wgmma`` with 256 rows of x and two
warpgroups; forward only), ``pc`` (``fp4_wgmma_producer``, section 35; forward only, x already permuted) or
``bf16`` (cuBLAS), at ``M`` rows (default 4096) of the 7B gate/up shape, ``DIRECTION``
fwd or bwd. Three warm-up calls first; the profiler's kernel filter picks the launch.

    KERNEL=ws ncu -k regex:_fp4_ws_kernel -c 1 --set full python3 dev/sweeps/fp4_ws_profile_ncu.py
"""
import os

import torch

from qerl_lib.kernels import fp4_wgmma_producer as pc
from qerl_lib.kernels import fp4_wgmma_ws as ws
from qerl_lib.kernels.fp4_gemm import fp4_linear, prepare_fp4_weights
from qerl_lib.kernels.fp4_wgmma import WgmmaConfig
from qerl_lib.quant.nvfp4 import quantize

n, k, m = 37888, 3584, int(os.environ.get("M", "4096"))
kernel, direction = os.environ.get("KERNEL", "ws"), os.environ.get("DIRECTION", "fwd")
dense = (torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16)
q = quantize(dense)
w = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
a = torch.randn(m, k if direction == "fwd" else n, device="cuda").to(torch.bfloat16)
xp = pc.permute_x(a) if direction == "fwd" else None
out = torch.empty(m, n if direction == "fwd" else k, dtype=torch.bfloat16, device="cuda")
calls = {"ws": lambda: ws.launch(a, w.words, w.scales, w.global_scale, None, out, direction),
         "wg256": lambda: fp4_linear(a, w, out=out, config=WgmmaConfig(256, 2, 1, 3)),
         "pc": lambda: pc.linear(xp, w.words, w.scales, w.global_scale, None, out, permuted=True),
         "bf16": lambda: torch.mm(a, dense.t() if direction == "fwd" else dense, out=out)}
print(kernel, direction, m, flush=True)
for _ in range(4):
    calls[kernel]()
torch.cuda.synchronize()

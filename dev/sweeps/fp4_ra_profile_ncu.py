"""One launch of the register-A CUDA GEMM (``kernels/fp4_ra.py``) for Nsight Compute (dev/LOG.md section 72):
N, K, M, TOK, STAGES, SCHEDULE (section 74) and PROBE (0 as built, 1 no weight decode, 2 no MMA; see fp4_ra_probe.py)
from the environment; BF16=1 runs cuBLAS's bf16 GEMM of the same shape instead; BACKWARD=1 the backward layout
(section 76: ``grad_input``, dy [M, N] @ W [N, K]; PROBE 4: no repack; with BF16=1, ``torch.mm(dy, W)``).

    PROBE=0 ncu -k regex:qerl_fp4_ra -c 1 --set full python3 dev/sweeps/fp4_ra_profile_ncu.py
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from fp4_ra_probe import ProbeConfig  # noqa: E402  (also installs the PROBE define)

from qerl_lib.kernels import fp4_ra  # noqa: E402
from qerl_lib.kernels.fp4_gemm import prepare_fp4_weights  # noqa: E402
from qerl_lib.quant.nvfp4 import quantize  # noqa: E402

env = os.environ.get
n, k, m = int(env("N", "18944")), int(env("K", "3584")), int(env("M", "4096"))
backward = env("BACKWARD") == "1"
cfg = ProbeConfig(int(env("TOK", "256")), int(env("STAGES", "4")), env("SCHEDULE", "split"), backward=backward,
                  probe=int(env("PROBE", "0")))
q = quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
w = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
x = torch.randn(m, n if backward else k, device="cuda").to(torch.bfloat16)
out = torch.empty(m, k if backward else n, dtype=torch.bfloat16, device="cuda")
dense = torch.randn(n, k, device="cuda").to(torch.bfloat16)
for _ in range(3):
    if env("BF16") == "1":
        torch.mm(x, dense) if backward else torch.nn.functional.linear(x, dense)
    elif backward:
        fp4_ra.grad_input(x, w.words, w.scales, w.global_scale, out, cfg)
    else:
        fp4_ra.linear(x, w.words, w.scales, w.global_scale, None, out, cfg)
torch.cuda.synchronize()
print("ran", cfg, flush=True)

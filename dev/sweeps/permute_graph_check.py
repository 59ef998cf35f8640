"""Section 35, after run 10: ``fp4_linear`` calls that run ``fp4_wgmma`` (25-128 rows) now launch the Triton permute of
x; check they still capture into a CUDA graph the way the engine does it (a warm-up on a side stream, then capture) and
that replays give the eager call's bits, at 32, 64, 100 and 128 rows, with the decode step's neighbours (8 and 16 rows)
for contrast. Section 37 added 24-96 rows (the producer kernel at decode sizes) and the 7B down shape (its K-slices:
an fp32 workspace and the reduction inside the graph). Prints one line per M and exits non-zero on a mismatch.

    PYTHONPATH=$PWD python dev/sweeps/permute_graph_check.py
"""

from __future__ import annotations

import sys

import torch

from qerl_lib.kernels.fp4_gemm import fp4_linear, planned_launch, prepare_fp4_weights, uses_mma
from qerl_lib.kernels.launch_rule import path_name
from qerl_lib.quant.nvfp4 import quantize

bad = 0
for n, k in [(37888, 3584), (4096, 4096), (3584, 18944)]:  # the last: K-slices at 24-64 rows
    q = quantize((torch.randn(n, k, device="cuda") * 0.02).to(torch.bfloat16))
    w = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    for m in (8, 16, 24, 32, 48, 64, 72, 96, 100, 128):
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        eager = fp4_linear(x, w)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up, as engine/cache.py does before capturing
            fp4_linear(x, w)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fp4_linear(x, w)
        graph.replay()
        torch.cuda.synchronize()
        same = torch.equal(out, eager)
        bad += not same
        path = "mma" if uses_mma(m, k, x.device) else path_name(planned_launch(m, w, x.device))
        print(f"N={n} K={k} M={m:4d} path {path:15s} graph replay equals eager: {same}", flush=True)
sys.exit(1 if bad else 0)

"""Run 17 (H100; dev/LOG.md section 19): the NVFP4 GEMM at the decode batch sizes of large RL rollouts, 64 < M <= 256.

Question: the launch rule sends M >= 65 to dequantize + cuBLAS, which at M = 128-256 runs at 0.42-0.56x of
bf16 (results/gemm_h100_v3.json): there cuBLAS is memory-bound, so the extra 2.56 B/weight pass costs more than
the GEMM. Does the fused fragment path (64-row tiles of x, W decoded in registers; each 64-row tile decodes
and streams W again) beat it, and at which tile width and programs per SM? And the generic 128 x 128 tiles?

One call: correctness of each variant at M = 96, 128, 200 (a partial tile) against the oracle, then device
time per (shape, M) with the benchmark's CUDA-graph + L2-rotation timer (fp4_kernel_sweep.time_variants).
Writes $OUT/sweep.jsonl; prints one line per (shape, M).

    OUT=/tmp/out PYTHONPATH=$PWD python dev/sweeps/fp4_mid_m_sweep.py
"""

from __future__ import annotations

import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp4_kernel_sweep as sweep  # noqa: E402  (opens $OUT/sweep.jsonl)

from qerl_lib.bench.gemm import mean_relative_error  # noqa: E402
from qerl_lib.kernels.fp4_gemm import fp4_linear, prepare_fp4_weights  # noqa: E402
from qerl_lib.kernels.launch_rule import KernelConfig, k_splits  # noqa: E402
from qerl_lib.quant.nvfp4 import reference_matmul  # noqa: E402

SHAPES = [("7b.gate_up", 37888, 3584), ("7b.down", 3584, 18944), ("7b.qkv", 4608, 3584), ("7b.o", 3584, 3584),
          ("32b.gate_up", 55296, 5120), ("32b.down", 5120, 27648)]
MS = (96, 128, 192, 256)


def variants(m: int, n: int, k: int, sms: int) -> list:
    out = [("auto", False, None)]
    for bn in (64, 128, 256):
        tiles = math.ceil(n / bn) * math.ceil(m / 64)
        for per_sm in (1, 2, 4):
            split = k_splits(tiles, math.ceil(k / 128), sms, per_sm)
            label = f"frag64-n{bn}s{split}"
            if not any(v[0] == label for v in out):
                out.append((label, False, KernelConfig(64, bn, 128, split, 4, 1, fragment=True)))
    tiles = math.ceil(n / 128) * math.ceil(m / 128)
    out.append(("fused128", False, KernelConfig(128, 128, 64, k_splits(tiles, math.ceil(k / 64), sms), 8, 3,
                                                swap_ab=False)))
    return out


def check(sms: int) -> None:
    worst = 0.0
    for m in (96, 128, 200):
        n, k = 3584, 3584
        _, q, x = sweep.make(n, k, m, seed=m)
        ref = reference_matmul(x, q)
        prep = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
        for label, _, cfg in variants(m, n, k, sms):
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            fp4_linear(x, prep, out=out, config=cfg)
            again = fp4_linear(x, prep, config=cfg)
            rel = mean_relative_error(out.float().nan_to_num(0), ref.float())
            ok = not torch.isnan(out).any() and rel < 1e-3 and torch.equal(out, again)
            worst = max(worst, rel)
            sweep.emit({"kind": "correct", "m": m, "n": n, "k": k, "variant": label, "rel": rel, "ok": bool(ok)})
            if not ok:
                print(f"CORRECTNESS FAIL {label} M={m} rel {rel:.2e}", flush=True)
    print(f"correctness: worst mean rel err {worst:.2e}", flush=True)


def main() -> int:
    sms, l2, copy_gbps = sweep.device_header()
    check(sms)
    for m in MS:
        for name, n, k in SHAPES:
            sweep.time_variants(name, n, k, m, variants(m, n, k, sms), l2, copy_gbps)
    print(f"done [{time.time() - sweep.T0:.0f}s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

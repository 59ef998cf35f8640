"""Section 34 (dev/LOG.md): the warp-specialized NVFP4 GEMM at training sizes (``kernels/fp4_wgmma_ws.py``)
against bf16 cuBLAS and the dequantize + cuBLAS path, forward (``x @ W.T``) and backward (``dy @ W``).

One call: correctness of every variant on awkward and real shapes (poisoned outputs, bias, determinism, the
oracles ``reference_matmul`` / ``reference_grad_input``), then device time per (shape, M, direction) with the
benchmark's CUDA-graph + L2-rotation timer. ``PART=check`` (correctness only), ``time`` or both (default).
Writes $OUT/sweep.jsonl; prints one line per (shape, M, direction).

    OUT=/tmp/out PYTHONPATH=$PWD python dev/sweeps/fp4_ws_sweep.py
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp4_kernel_sweep as sweep  # noqa: E402  (opens $OUT/sweep.jsonl)

from qerl_lib.bench.gemm import mean_relative_error, rotation_copies, time_graph  # noqa: E402
from qerl_lib.kernels import fp4_wgmma_ws as ws  # noqa: E402
from qerl_lib.kernels.fp4_gemm import dequantize_exact, prepare_fp4_weights  # noqa: E402
from qerl_lib.quant.nvfp4 import reference_grad_input, reference_matmul  # noqa: E402

SHAPES = [("7b.gate_up", 37888, 3584), ("7b.down", 3584, 18944), ("7b.qkv", 4608, 3584), ("7b.o", 3584, 3584),
          ("7b.kv", 1024, 3584), ("32b.gate_up", 55296, 5120), ("32b.down", 5120, 27648)]
MS = [int(v) for v in os.environ.get("MS", "256,1024,2048,4096,8192").split(",")]
CHECK_CASES = [(1, 256, 128), (77, 320, 192), (129, 1000, 1024), (300, 4608, 3584), (1024, 512, 3584),
               (257, 3584, 18944), (2048, 37888, 3584)]  # M, N, K (backward needs N % 64: 1000 runs forward only)
CHECK_CONFIGS = [ws.WsConfig(), ws.WsConfig(2, 1), ws.WsConfig(3, 3, 128), ws.WsConfig(6, 2), ws.WsConfig(5, 3, 64)]
TIME_CONFIGS = [("ws", ws.WsConfig()), ("ws-3/2", ws.WsConfig(3, 2)), ("ws-5/2", ws.WsConfig(5, 2)),
                ("ws-4/3", ws.WsConfig(4, 3)), ("ws-6/2-r128", ws.WsConfig(6, 2, 128))]
PART = os.environ.get("PART", "check,time")


def prepared(q):
    return prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)


def run(direction, a, w, bias, out, cfg):
    ws.launch(a, w.words, w.scales, w.global_scale, bias, out, direction, cfg)


def dequant_cublas(direction, a, w, bias, out):
    deq = dequantize_exact(w, unscale=False)
    if direction == "fwd":
        out.addmm_(a, deq.t(), beta=0.0, alpha=256.0 * w.inv_global_scale)
        if bias is not None:
            out += bias
    else:
        out.addmm_(a, deq, beta=0.0, alpha=256.0 * w.inv_global_scale)


def correctness():
    worst = 0.0
    fails = 0
    for (m, n, k) in CHECK_CASES:
        dense, q, x = sweep.make(n, k, m, seed=m + n + k)
        w = prepared(q)
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        dy = torch.randn(m, n, device="cuda").to(torch.bfloat16)
        refs = {("fwd", True): reference_matmul(x, q, bias), ("fwd", False): reference_matmul(x, q),
                ("bwd", False): reference_grad_input(dy, q)}
        for (direction, with_bias), ref in refs.items():
            if not ws.supported_problem(n, k, direction):
                continue
            a = x if direction == "fwd" else dy
            cols = n if direction == "fwd" else k
            cub = torch.empty(m, cols, dtype=torch.bfloat16, device="cuda")
            dequant_cublas(direction, a, w, bias if with_bias else None, cub)
            for cfg in CHECK_CONFIGS:
                out = torch.full((m, cols), float("nan"), dtype=torch.bfloat16, device="cuda")
                out2 = torch.empty_like(out)
                run(direction, a, w, bias if with_bias else None, out, cfg)
                run(direction, a, w, bias if with_bias else None, out2, cfg)
                torch.cuda.synchronize()
                rec = {"kind": "correct", "direction": direction, "m": m, "n": n, "k": k, "bias": with_bias,
                       "config": cfg.__dict__, "nan": int(torch.isnan(out).sum()),
                       "rel": mean_relative_error(out.float().nan_to_num(0), ref.float()),
                       "rel_cublas_path": mean_relative_error(cub.float(), ref.float()),
                       "deterministic": bool(torch.equal(out, out2)),
                       "equal_cublas_path": bool(torch.equal(out, cub)),
                       "max_abs": float((out.float() - ref.float()).abs().nan_to_num(1e30).max())}
                worst = max(worst, rec["rel"])
                sweep.emit(rec)
                if rec["nan"] or rec["rel"] > 1e-3 or not rec["deterministic"]:
                    fails += 1
                    print("CORRECTNESS FAIL", rec, flush=True)
        del dense, q, x, w
    print(f"correctness: worst mean rel err {worst:.2e}, {fails} failures  [{time.time() - sweep.T0:.0f}s]", flush=True)


def timing(l2):
    for name, n, k in SHAPES:
        dense, q, _ = sweep.make(n, k, 16)
        for m in MS:
            for direction in ("fwd", "bwd"):
                if not ws.supported_problem(n, k, direction):
                    continue
                cols_in, cols_out = (k, n) if direction == "fwd" else (n, k)
                a0 = torch.randn(m, cols_in, device="cuda").to(torch.bfloat16)
                rows = []
                bf_bytes = n * k * 2 + 2 * m * (k + n)
                sets = [(a0.clone(), dense.clone()) for _ in range(rotation_copies(bf_bytes, l2))]
                bf16_call = (lambda s: torch.nn.functional.linear(s[0], s[1])) if direction == "fwd" else \
                    (lambda s: torch.mm(s[0], s[1]))
                t = time_graph([(lambda s=s: bf16_call(s)) for s in sets])
                rows.append(("bf16", t.median_ms * 1e3))
                del sets
                fp_bytes = n * k * 0.5625 + 2 * m * (k + n)
                sets = [(a0.clone(), prepared(q), torch.empty(m, cols_out, dtype=torch.bfloat16, device="cuda"))
                        for _ in range(rotation_copies(fp_bytes, l2))]
                t = time_graph([(lambda s=s: dequant_cublas(direction, s[0], s[1], None, s[2])) for s in sets])
                rows.append(("dequant+cublas", t.median_ms * 1e3))
                configs = TIME_CONFIGS if m in (1024, 4096) and name in ("7b.gate_up", "7b.down", "7b.o") else TIME_CONFIGS[:1]
                for label, cfg in configs:
                    try:
                        t = time_graph([(lambda s=s, c=cfg: run(direction, s[0], s[1], None, s[2], c)) for s in sets])
                        rows.append((label, t.median_ms * 1e3))
                    except Exception as e:  # a config that does not compile is a finding, not a crash
                        rows.append((label, float("nan")))
                        sweep.emit({"kind": "error", "shape": name, "m": m, "direction": direction, "variant": label,
                                    "error": repr(e)[:400]})
                del sets, a0
                bf = rows[0][1]
                flops = 2.0 * m * n * k
                for label, us in rows:
                    sweep.emit({"kind": "time", "shape": name, "n": n, "k": k, "m": m, "direction": direction,
                                "variant": label, "us": us, "speedup": bf / us, "tflops": flops / us / 1e6})
                print(f"{name:<12} {direction} M={m:<5} bf16 {bf:8.1f}us | " + " | ".join(
                    f"{lab} {us:.1f} x{bf / us:.2f}" for lab, us in rows[1:]), flush=True)
                torch.cuda.empty_cache()
        del dense, q


if __name__ == "__main__":
    sms, l2, _ = sweep.device_header()
    if "check" in PART:
        correctness()
    if "time" in PART:
        timing(l2)
    print(f"done [{time.time() - sweep.T0:.0f}s]", flush=True)

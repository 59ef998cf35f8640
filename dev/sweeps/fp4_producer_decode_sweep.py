"""Section 37 (dev/LOG.md): the producer-warp NVFP4 GEMM (``kernels/fp4_wgmma_producer.py``) at decode batch sizes,
one consumer warpgroup per program and several programs per SM, against the launch ``fp4_linear`` picks today
(``fp4_wgmma``'s one-warpgroup kernel from 25 rows, with K-slices and wave balancing) and bf16 cuBLAS.

One call: correctness of the new launches (poisoned outputs, bias, determinism, the oracle ``reference_matmul``,
bit-equality with ``fp4_wgmma`` 256 x 2), then device time per (shape, M) with the benchmark's CUDA-graph +
L2-rotation timer, the permute of x included. ``PART``: ``check``, ``time`` (default both); ``MS`` the rows of x;
``CONFIGS`` producer launches as ``block_m/stages/warpgroups/programs_per_sm[/split_k]`` items (producer registers
40 at one or two programs per SM, 24 from three); ``PERMUTED=1`` hands them x already relabeled (the engine's
decode step since section 38), so the permute is not timed. With K-slices the bits differ from ``fp4_wgmma`` 256 x 2 (another
summation order): ``equal_wgmma_256x2`` is then expected false. Writes $OUT/sweep.jsonl; one line per (shape, M,
variant).

    OUT=/tmp/out PYTHONPATH=$PWD python dev/sweeps/fp4_producer_decode_sweep.py
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp4_kernel_sweep as sweep  # noqa: E402  (opens $OUT/sweep.jsonl)

from qerl_lib.bench.gemm import mean_relative_error, rotation_copies, time_graph  # noqa: E402
from qerl_lib.kernels import fp4_wgmma_producer as pc  # noqa: E402
from qerl_lib.kernels.fp4_gemm import reduce_splits, fp4_linear, planned_launch, prepare_fp4_weights  # noqa: E402
from qerl_lib.kernels.fp4_wgmma import WgmmaConfig, permute_x  # noqa: E402
from qerl_lib.kernels.launch_rule import path_name  # noqa: E402
from qerl_lib.quant.nvfp4 import reference_matmul  # noqa: E402

ALL_SHAPES = [("7b.gate_up", 37888, 3584), ("32b.gate_up", 55296, 5120), ("7b.gate", 18944, 3584),
              ("7b.down", 3584, 18944), ("7b.qkv", 4608, 3584), ("32b.down", 5120, 27648), ("7b.o", 3584, 3584),
              ("32b.qkv", 7168, 5120), ("32b.o", 5120, 5120)]
SHAPES = [s for s in ALL_SHAPES if s[0] in os.environ.get("SHAPES", "7b.gate_up,32b.gate_up,7b.gate,7b.down,7b.qkv,"
                                                          "32b.down").split(",")]
MS = [int(v) for v in os.environ.get("MS", "16,32,64,128").split(",")]
CONFIGS = os.environ.get("CONFIGS", "64/4/1/2,64/3/1/3,32/4/1/2,32/3/1/3,128/3/1/2,128/3/2/1").split(",")
CHECK_CASES = [(1, 128, 256), (16, 200, 768), (33, 320, 512), (64, 4608, 3584), (100, 1000, 1024),
               (128, 3584, 18944), (24, 5120, 27648), (64, 37888, 3584), (32, 18944, 3584)]  # M, N, K (K % 256 == 0)
REF_WG = WgmmaConfig(256, 2, 1, 3)
PART = os.environ.get("PART", "check,time")
PERMUTED = os.environ.get("PERMUTED", "0") == "1"  # time the producer launches on x already relabeled (LOG 39)


def config(spec: str) -> pc.ProducerConfig:
    bm, st, wg, pps, *split = (int(v) for v in spec.lstrip("T").split("/"))
    return pc.ProducerConfig(bm, st, 40 if pps <= 2 else 24, wg, pps, split[0] if split else 1)


def prepared(q):
    return prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)


def run_pc(x, w, bias, out, cfg, tail=False, permuted=False):
    if not tail:
        pc.linear(x, w.words, w.scales, w.global_scale, bias, out, cfg, reduce_splits=reduce_splits, permuted=permuted)
        return
    # "T" specs (LOG 37, after run 7): the whole waves of output tiles unsplit, the tail's tiles in K-slices
    xp, n, k = permute_x(x), w.words.shape[0], x.shape[1]
    slots, tiles = 132 * cfg.programs_per_sm, -(-n // cfg.block_n)
    head = (tiles // slots) * slots * cfg.block_n if tiles > slots and tiles % slots else n
    pc.linear(xp, w.words[:head], w.scales[:head], w.global_scale, None if bias is None else bias[:head],
              out[:, :head], cfg, permuted=True, reduce_splits=reduce_splits)
    if head < n:
        split = max(1, min(slots // (tiles % slots), k // 256, 8))
        pc.linear(xp, w.words[head:], w.scales[head:], w.global_scale, None if bias is None else bias[head:],
                  out[:, head:], dataclasses.replace(cfg, split_k=split), permuted=True, reduce_splits=reduce_splits)


def correctness():
    worst, fails = 0.0, 0
    for (m, n, k) in CHECK_CASES:
        dense, q, x = sweep.make(n, k, m, seed=m + n + k)
        w = prepared(q)
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        for with_bias in (False, True):
            b = bias if with_bias else None
            ref = reference_matmul(x, q, b)
            wg = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            fp4_linear(x, w, b, out=wg, config=REF_WG)
            for spec in CONFIGS:
                cfg = config(spec)
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                out2 = torch.empty_like(out)
                run_pc(x, w, b, out, cfg, spec.startswith("T"))
                run_pc(x, w, b, out2, cfg, spec.startswith("T"))
                torch.cuda.synchronize()
                rec = {"kind": "correct", "m": m, "n": n, "k": k, "bias": with_bias, "config": spec,
                       "nan": int(torch.isnan(out).sum()),
                       "rel": mean_relative_error(out.float().nan_to_num(0), ref.float()),
                       "deterministic": bool(torch.equal(out, out2)), "equal_wgmma_256x2": bool(torch.equal(out, wg))}
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
            x0 = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            rows = []
            sets = [(x0.clone(), dense.clone()) for _ in range(rotation_copies(n * k * 2 + 2 * m * (k + n), l2))]
            t = time_graph([(lambda s=s: torch.nn.functional.linear(s[0], s[1])) for s in sets])
            rows.append(("bf16", t.median_ms * 1e3))
            del sets
            sets = [(x0.clone(), prepared(q), torch.empty(m, n, dtype=torch.bfloat16, device="cuda"))
                    for _ in range(rotation_copies(n * k * 0.5625 + 2 * m * (k + n), l2))]
            t = time_graph([(lambda s=s: fp4_linear(s[0], s[1], None, out=s[2])) for s in sets])
            rows.append((f"rule:{path_name(planned_launch(m, sets[0][1], x0.device))}", t.median_ms * 1e3))
            for spec in CONFIGS:
                label = f"pc{spec}"
                try:
                    cfg = config(spec)
                    tail = spec.startswith("T")
                    xs = [permute_x(s[0]) if PERMUTED and not tail else s[0] for s in sets]
                    t = time_graph([(lambda s=s, c=cfg, tl=tail, xx=xx: run_pc(xx, s[1], None, s[2], c, tl, PERMUTED and not tl))
                                    for s, xx in zip(sets, xs)])
                    rows.append((label, t.median_ms * 1e3))
                except Exception as e:  # a launch that fails is a finding, not a crash
                    rows.append((label, float("nan")))
                    sweep.emit({"kind": "error", "shape": name, "m": m, "variant": label, "error": repr(e)[:400]})
            del sets, x0
            bf, rule = rows[0][1], rows[1][1]
            floor_us = n * k * 0.5625 / 3.35e6  # the weights' bytes at the H100's 3.35 TB/s
            for label, us in rows:
                sweep.emit({"kind": "time", "shape": name, "n": n, "k": k, "m": m, "variant": label, "us": us,
                            "speedup": bf / us, "vs_rule": rule / us, "floor_us": floor_us})
            print(f"{name:<12} M={m:<4} bf16 {bf:7.1f} | floor {floor_us:5.1f} | " + " | ".join(
                f"{lab} {us:.1f}" + ("" if i < 2 else f" ({rule / us:.2f})")
                for i, (lab, us) in enumerate(rows[1:], 1)),
                flush=True)
            torch.cuda.empty_cache()
        del dense, q


if __name__ == "__main__":
    sms, l2, _ = sweep.device_header()
    if "check" in PART:
        correctness()
    if "time" in PART:
        timing(l2)
    print(f"done [{time.time() - sweep.T0:.0f}s]", flush=True)

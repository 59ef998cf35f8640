"""Runs 5 and 6 (H100; dev/LOG.md): Triton's software pipeliner (cp.async stages) instead of register prefetch.

Question: with ``prefetch=False`` and ``num_stages`` 2-5, Triton 3.6 stages the fragment path's loads
through shared memory with cp.async (offline SASS: LDGSTS appear). Does a deeper pipeline lift the
small-M kernel above the ~55% of copy bandwidth the register prefetch reaches?

One call: correctness of the pipelined variants (NaN-poisoned outputs vs the oracle), then device
time of each variant per (shape, M) with the benchmark's CUDA-graph + L2-rotation timer. Writes
$OUT/sweep5.jsonl as it goes (OUT defaults to dev/runs/) and prints one line per (shape, M).

    PYTHONPATH=$PWD python dev/sweeps/fp4_kernel_sweep5.py [--quick] [--run6]

Run 6 (``--run6``) adds the register-prefetch variants (the kernel's default path) by tile width and
programs per SM, M = 2 and 4, and the 32B o_proj shape, to set ``pick_config`` from H100 data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from qerl_lib.bench.gemm import copy_bandwidth_gbps, l2_cache_bytes, mean_relative_error, rotation_copies, time_graph
from qerl_lib.kernels.fp4_gemm import fp4_linear, prepare_fp4_weights
from qerl_lib.kernels.launch_rule import KernelConfig, k_splits  # k_splits: the K-slice rule pick_config uses
from qerl_lib.quant.nvfp4 import quantize, reference_matmul

OUT = os.environ.get("OUT", "dev/runs")  # where the kept records live
T0 = time.time()
LOG = open(os.path.join(OUT, "sweep5.jsonl"), "a")


def emit(rec: dict) -> None:
    rec["t"] = round(time.time() - T0, 1)
    LOG.write(json.dumps(rec) + "\n")
    LOG.flush()


def ceil(a, b):
    return -(-a // b)


def variants(m: int, n: int, k: int, sms: int, quick: bool, run6: bool = False):
    bm = 16 if m <= 16 else 32
    out = [("auto", None)]
    if run6:  # run 6: register prefetch (the default) by tile width and programs per SM, vs the pipeliner
        for bn in (64, 128):
            tiles = ceil(n, bn) * ceil(m, bm)
            for per_sm in (2, 4):
                sp = k_splits(tiles, ceil(k, 128), sms, per_sm)
                for label, cfg in ((f"pf-n{bn}s{sp}", KernelConfig(bm, bn, 128, sp, 4, 1, fragment=True)),
                                   (f"n{bn}s{sp}st3", KernelConfig(bm, bn, 128, sp, 4, 3, fragment=True, prefetch=False)),
                                   (f"n{bn}s{sp}st4", KernelConfig(bm, bn, 128, sp, 4, 4, fragment=True, prefetch=False))):
                    if not any(v[0] == label for v in out):
                        out.append((label, cfg))
        return out
    for bn in ((128,) if quick else (64, 128, 256)):
        tiles = ceil(n, bn) * ceil(m, bm)
        for per_sm in (2, 4):
            sp = k_splits(tiles, ceil(k, 128), sms, per_sm)
            for st in (2, 3, 4):
                label = f"n{bn}s{sp}st{st}"
                if not any(v[0] == label for v in out):
                    out.append((label, KernelConfig(bm, bn, 128, sp, 4, st, fragment=True, prefetch=False)))
    return out


def make(n, k, m, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dense = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    return dense, quantize(dense), torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)


def correctness() -> float:
    worst = 0.0
    for m, n, k in [(1, 77, 208), (3, 130, 400), (16, 4608, 3584), (8, 3584, 18944)]:
        dense, q, x = make(n, k, m, seed=m + n + k)
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        ref = reference_matmul(x, q, bias)
        prep = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
        for st in (2, 3, 4):
            for sp in (1, 3):
                cfg = KernelConfig(16, 128, 128, sp, 4, st, fragment=True, prefetch=False)
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                fp4_linear(x, prep, bias, out=out, config=cfg)
                again = fp4_linear(x, prep, bias, config=cfg)
                rel = mean_relative_error(out.float().nan_to_num(0), ref.float())
                rec = {"kind": "correct", "m": m, "n": n, "k": k, "stages": st, "split": sp, "rel": rel,
                       "nan": int(torch.isnan(out).sum()), "deterministic": bool(torch.equal(out, again))}
                emit(rec)
                worst = max(worst, rel)
                if rec["nan"] or rel > 1e-3 or not rec["deterministic"]:
                    print("CORRECTNESS FAIL", rec, flush=True)
    return worst


def time_shape(name, n, k, m, sms, l2, copy_gbps, quick, run6=False):
    dense, q, x0 = make(n, k, m)
    fp4_bytes = n * k * 0.5625 + 2 * m * (k + n)
    bf16_bytes = n * k * 2 + 2 * m * (k + n)
    sets = [(x0.clone(), dense.clone()) for _ in range(rotation_copies(bf16_bytes, l2))]
    bf = time_graph([(lambda s=s: torch.nn.functional.linear(s[0], s[1])) for s in sets]).median_ms * 1e3
    del sets
    sets = [(x0.clone(), prepare_fp4_weights(q.weight_packed.clone(), q.weight_scale.clone(), q.weight_global_scale.clone()),
             torch.empty(m, n, dtype=torch.bfloat16, device="cuda")) for _ in range(rotation_copies(fp4_bytes, l2))]
    rows = []
    for label, cfg in variants(m, n, k, sms, quick, run6):
        try:
            us = time_graph([(lambda s=s, c=cfg: fp4_linear(s[0], s[1], out=s[2], config=c)) for s in sets],
                            target_ms=40).median_ms * 1e3
        except Exception as e:  # a config Triton cannot compile is a finding, not a crash
            emit({"kind": "time", "shape": name, "m": m, "variant": label, "error": repr(e)[:300]})
            continue
        rec = {"kind": "time", "shape": name, "n": n, "k": k, "m": m, "variant": label, "us": us, "bf16_us": bf,
               "speedup": bf / us, "pct_copy": 100 * fp4_bytes / us / 1e3 / copy_gbps}
        emit(rec)
        rows.append(rec)
    auto = next(r for r in rows if r["variant"] == "auto")
    best = min(rows, key=lambda r: r["us"])
    top = sorted(rows, key=lambda r: r["us"])[:3]
    print(f"{name:<12} M={m:<3} bf16 {bf:7.1f}us auto {auto['us']:6.1f} (x{auto['speedup']:.2f}, {auto['pct_copy']:.0f}%) "
          f"best {best['variant']} {best['us']:6.1f} (x{best['speedup']:.2f}, {best['pct_copy']:.0f}%) | "
          + " ".join(f"{r['variant']}:{r['us']:.1f}" for r in top[1:]) + f" [{time.time() - T0:.0f}s]", flush=True)
    del sets, dense, q, x0
    torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--run6", action="store_true", help="run 6: prefetch vs pipeliner, M = 1, 2, 4, 8, 16")
    args = ap.parse_args()
    import triton
    props = torch.cuda.get_device_properties(0)
    copy_gbps, l2 = copy_bandwidth_gbps(), l2_cache_bytes()
    emit({"kind": "device", "name": props.name, "sms": props.multi_processor_count, "copy_gbps": copy_gbps, "l2": l2,
          "torch": torch.__version__, "triton": triton.__version__})
    print(f"{props.name}: copy {copy_gbps:.0f} GB/s, L2 {l2 >> 20} MiB, torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    print(f"correctness: worst mean rel err {correctness():.2e} [{time.time() - T0:.0f}s]", flush=True)
    shapes = [("7b.gate_up", 37888, 3584), ("7b.down", 3584, 18944), ("7b.qkv", 4608, 3584), ("7b.o", 3584, 3584),
              ("32b.gate_up", 55296, 5120), ("32b.down", 5120, 27648), ("32b.qkv", 7168, 5120)]
    if args.run6:
        shapes.append(("32b.o", 5120, 5120))
    for m in ((1, 2, 4, 8, 16) if args.run6 else (1, 8, 16)):
        for name, n, k in shapes:
            time_shape(name, n, k, m, props.multi_processor_count, l2, copy_gbps, args.quick, args.run6)
    print(f"done [{time.time() - T0:.0f}s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Development sweep for qerl_lib.kernels.fp4_gemm (the Triton kernel) on one GPU, kept for provenance
(dev/LOG.md).

Runs 1-3 used earlier versions of this script and of the kernel, with knobs since removed (load-time
repack, gathered x, one-launch split-K); their raw records are dev/runs/fp4_kernel_sweep_run{1,2,3}_*.jsonl.
This version sweeps the knobs the kernel still has.

One call does everything a GPU lease allows: correctness of every kernel path on awkward and real
shapes (poisoned outputs, determinism), then device-time of launch variants per (shape, M) with
the benchmark's CUDA-graph + L2-rotation timer. Writes $OUT/sweep.jsonl as it goes (partial
results survive a timeout; OUT defaults to dev/runs/) and prints a short table at the end.

    PYTHONPATH=$PWD python dev/sweeps/fp4_kernel_sweep.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from qerl_lib.bench.gemm import (copy_bandwidth_gbps, l2_cache_bytes, mean_relative_error, rotation_copies, time_eager,
                                 time_graph)
from qerl_lib.kernels.fp4_gemm import fp4_linear, fp4_matmul, prepare_fp4_weights
from qerl_lib.kernels.launch_rule import KernelConfig
from qerl_lib.quant.nvfp4 import quantize, reference_matmul

OUT = os.environ.get("OUT", "dev/runs")  # where the kept records live
LOG = open(os.path.join(OUT, "sweep.jsonl"), "a")
T0 = time.time()


def emit(rec: dict) -> None:
    rec["t"] = round(time.time() - T0, 1)
    LOG.write(json.dumps(rec) + "\n")
    LOG.flush()


def device_header() -> tuple[int, int, float]:
    """Record (``kind: device``) and print the GPU, with tf32 off for the bf16 baselines: ``(SMs, L2 bytes,
    copy GB/s)``, what ``time_variants`` and the launch rules take."""
    props = torch.cuda.get_device_properties(0)
    torch.backends.cuda.matmul.allow_tf32 = False
    copy_gbps, l2 = copy_bandwidth_gbps(), l2_cache_bytes()
    emit({"kind": "device", "name": props.name, "sms": props.multi_processor_count, "copy_gbps": copy_gbps, "l2": l2,
          "torch": torch.__version__})
    print(f"{props.name} sms={props.multi_processor_count} copy {copy_gbps:.0f} GB/s", flush=True)
    return props.multi_processor_count, l2, copy_gbps


def make(n, k, m, seed=0, scale=0.02):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dense = (torch.randn(n, k, device="cuda", generator=g) * scale).to(torch.bfloat16)
    q = quantize(dense)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    return dense, q, x


def correctness():
    cases = [(1, 33, 48), (3, 77, 80), (17, 33, 208), (5, 130, 256), (64, 512, 3584), (300, 4608, 3584),
             (1, 3584, 18944), (16, 37888, 3584), (100, 3584, 3584)]  # M, N, K
    configs = [None, KernelConfig(16, 64, 128, split_k=3, fragment=True), KernelConfig(16, 128, 128, split_k=3, fragment=True),
               KernelConfig(32, 256, 128, fragment=True), KernelConfig(64, 128, 128, split_k=2, fragment=True),
               KernelConfig(16, 64, 64, split_k=3), KernelConfig(32, 128, 128, split_k=2),
               KernelConfig(128, 128, 64, num_warps=8, num_stages=3, swap_ab=False),
               KernelConfig(128, 256, 64, num_warps=8, num_stages=3, swap_ab=False), KernelConfig(128, 128, 64, cublas=True)]
    worst = 0.0
    for (m, n, k) in cases:
        dense, q, x = make(n, k, m, seed=m + n + k)
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        ref = reference_matmul(x, q, bias)
        ref_nb = reference_matmul(x, q)
        for repack in (False,):
            prep = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
            for cfg in configs:
                for b, r in ((bias, ref), (None, ref_nb)):
                    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                    fp4_linear(x, prep, b, out=out, config=cfg)
                    out2 = fp4_linear(x, prep, b, config=cfg)
                    torch.cuda.synchronize()
                    rec = {"kind": "correct", "m": m, "n": n, "k": k, "repack": repack, "bias": b is not None,
                           "config": None if cfg is None else cfg.__dict__, "nan": int(torch.isnan(out).sum()),
                           "rel": mean_relative_error(out.float().nan_to_num(0), r.float()),
                           "deterministic": bool(torch.equal(out, out2)),
                           "max_abs": float((out.float() - r.float()).abs().nan_to_num(1e30).max())}
                    worst = max(worst, rec["rel"])
                    emit(rec)
                    if rec["nan"] or rec["rel"] > 1e-3 or not rec["deterministic"]:
                        print("CORRECTNESS FAIL", rec, flush=True)
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        fp4_matmul(x, q.weight_packed, q.weight_scale, q.weight_global_scale, bias, out=out)
        rel = mean_relative_error(out.float().nan_to_num(0), ref.float())
        emit({"kind": "correct_raw", "m": m, "n": n, "k": k, "nan": int(torch.isnan(out).sum()), "rel": rel})
        worst = max(worst, rel)
        del dense, q, x
    print(f"correctness: worst mean rel err {worst:.2e}  [{time.time() - T0:.0f}s]", flush=True)


def time_variants(name, n, k, m, variants, l2, copy_gbps, with_bf16=True, eager_fp4=False):
    dense, q, x0 = make(n, k, m)
    fp4_bytes = n * k * 0.5625 + 2 * m * (k + n)
    bf16_bytes = n * k * 2 + 2 * m * (k + n)
    rows = []
    if with_bf16:
        nb = rotation_copies(bf16_bytes, l2)
        sets = [(x0.clone(), dense.clone()) for _ in range(nb)]
        t = time_graph([(lambda s=s: torch.nn.functional.linear(s[0], s[1])) for s in sets])
        rows.append({"variant": "bf16", "us": t.median_ms * 1e3, "p20": t.p20_ms * 1e3, "p80": t.p80_ms * 1e3,
                     "gbps": bf16_bytes / t.median_ms / 1e6})
        del sets
    nf = rotation_copies(fp4_bytes, l2)
    for repack in sorted({v[1] for v in variants}, reverse=True):
        sets = [(x0.clone(), prepare_fp4_weights(q.weight_packed.clone(), q.weight_scale.clone(),
                                                 q.weight_global_scale.clone()),
                 torch.empty(m, n, dtype=torch.bfloat16, device="cuda")) for _ in range(nf)]
        for label, rp, cfg in variants:
            if rp != repack:
                continue
            try:
                t = time_graph([(lambda s=s, c=cfg: fp4_linear(s[0], s[1], out=s[2], config=c)) for s in sets])
            except Exception as e:  # a config Triton cannot compile is a finding, not a crash
                rows.append({"variant": label, "error": repr(e)[:300]})
                continue
            rows.append({"variant": label, "us": t.median_ms * 1e3, "p20": t.p20_ms * 1e3, "p80": t.p80_ms * 1e3,
                         "gbps": fp4_bytes / t.median_ms / 1e6})
        if eager_fp4 and not repack:
            t = time_eager([(lambda s=s: fp4_linear(s[0], s[1], out=s[2])) for s in sets])
            rows.append({"variant": "auto-eager", "us": t.median_ms * 1e3, "gbps": fp4_bytes / t.median_ms / 1e6})
        del sets
    bf = next((r["us"] for r in rows if r["variant"] == "bf16"), None)
    for r in rows:
        if "us" in r:
            r["speedup"] = bf / r["us"] if bf else None
            r["pct_copy"] = 100 * r["gbps"] / copy_gbps
        emit({"kind": "time", "shape": name, "n": n, "k": k, "m": m, **r})
    best = min((r for r in rows if "us" in r and r["variant"] != "bf16"), key=lambda r: r["us"],
               default={"variant": "none", "us": float("inf")})
    print(f"{name:<14} M={m:<5} bf16 {bf or 0:8.1f}us | " + " | ".join(
        f"{r['variant']} {r['us']:.1f}" if "us" in r else f"{r['variant']} ERR" for r in rows if r["variant"] != "bf16")
        + f"  => best {best['variant']} x{(bf or 0) / best['us']:.2f} [{time.time() - T0:.0f}s]", flush=True)
    del dense, q, x0
    torch.cuda.empty_cache()
    return rows


def split_for(tiles, k_iters, ctas_per_sm, sms):
    if tiles >= ctas_per_sm * sms:
        return 1
    split = max(1, min(-(-ctas_per_sm * sms // tiles), max(1, k_iters // 2)))
    return -(-k_iters // -(-k_iters // split))


def small_m_variants(m, n, k, sms):
    """The fragment path by tile width and programs per SM, against the generic path."""
    bm = 16 if m <= 16 else (32 if m <= 32 else 64)
    v = [("auto", False, None), ("generic-n64p4", False, KernelConfig(bm, 64, 128, split_for(-(-n // 64) * -(-m // bm), -(-k // 128), 4, sms)))]
    for bn in (64, 128, 256):
        tiles = -(-n // bn) * -(-m // bm)
        kit = -(-k // 128)
        for cps in (2, 4, 8):
            label = f"frag-n{bn}p{split_for(tiles, kit, cps, sms)}"
            if not any(x[0] == label for x in v):
                v.append((label, False, KernelConfig(bm, bn, 128, split_for(tiles, kit, cps, sms), 4, 1, fragment=True)))
    return v


def large_m_variants(m, n, k, sms):
    v = [("cublas", False, KernelConfig(128, 128, 64, cublas=True)), ("auto", False, None)]
    for bm, bn, bk, nw, ns, sw in [(128, 128, 64, 8, 3, False), (128, 256, 64, 8, 3, False), (256, 128, 64, 8, 3, True)]:
        if bm <= max(64, m):
            v.append((f"m{bm}n{bn}k{bk}s{ns}{'-swap' if sw else ''}", False, KernelConfig(bm, bn, bk, 1, nw, ns, swap_ab=sw)))
    return v


def main():
    ap = argparse.ArgumentParser()
    ap.parse_args()
    import triton
    props = torch.cuda.get_device_properties(0)
    sms = props.multi_processor_count
    print(f"{props.name} sms={sms} torch {torch.__version__} triton {triton.__version__}", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    copy_gbps = copy_bandwidth_gbps()
    l2 = l2_cache_bytes()
    emit({"kind": "device", "name": props.name, "sms": sms, "copy_gbps": copy_gbps, "l2": l2,
          "torch": torch.__version__, "triton": triton.__version__})
    print(f"copy bandwidth {copy_gbps:.0f} GB/s, L2 {l2 / 2**20:.0f} MiB [{time.time() - T0:.0f}s]", flush=True)
    correctness()
    shapes = [("7b.gate_up", 37888, 3584), ("7b.down", 3584, 18944), ("7b.q_o", 3584, 3584), ("7b.kv", 512, 3584),
              ("7b.qkv", 4608, 3584), ("32b.gate_up", 55296, 5120), ("32b.down", 5120, 27648), ("32b.gate", 27648, 5120)]
    for m in (1, 4, 16):
        pick = shapes if m == 1 else ([shapes[i] for i in (0, 1, 2, 3)] if m == 4 else [shapes[i] for i in (0, 1, 2, 3, 5, 6)])
        for name, n, k in pick:
            time_variants(name, n, k, m, small_m_variants(m, n, k, sms), l2, copy_gbps, eager_fp4=(m == 1 and name == "7b.gate_up"))
    for m in (32, 64, 128, 256):
        for name, n, k in shapes[:4]:
            v = small_m_variants(m, n, k, sms) if m <= 64 else [("auto", False, None)]
            v = v + [("cublas", False, KernelConfig(128, 128, 64, cublas=True)),
                                                              ("fused128", False, KernelConfig(128, 128, 64, 1, 8, 3, swap_ab=False))]
            time_variants(name, n, k, m, v, l2, copy_gbps)
    print(f"done [{time.time() - T0:.0f}s]", flush=True)


if __name__ == "__main__":
    sys.exit(main())

"""Run 18 (H100; dev/LOG.md section 26): the mma.sync decode kernel at 9 <= M <= 64 rows of x.

Question: at the decode batch sizes of RL rollouts (32-64 rows) the launch rule runs the Triton fragment
kernel, which measured 0.83x of cuBLAS bf16 at M = 64 (results/gemm_h100_v3.json), and the rollout's
NVFP4/bf16 ratio falls to 1.32x at batch 32 and 1.09x at batch 64 (dev/LOG.md section 22). The mma.sync
kernel reads W once per CTA for all its rows of x (n8 blocks: M / 8 MMAs per decoded A fragment), so its
decode cost is shared by the rows. Prediction (7B gate/up, M = 64): ~45 us (the MMAs at ~40% of the
tensor cores' mma.sync rate) against bf16's ~95 us, i.e. ~2x; at M = 32 ~2.5x. The risk: x, 8x the bytes
of the weights per warp at M = 64, comes through L1 every chunk, and 222 registers per thread at NB = 8.

One call: (1) correctness of NB = 2..8 launches (M = 9, 17, 24, 33, 47, 64; bias; K-slices; N not a multiple
of the rows per CTA) against the oracle, bit-determinism; (2) device time per (shape, M) of bf16, the launch
rule of the day ("auto"), and mma.sync launch shapes, with the benchmark's CUDA-graph + L2-rotation timer.
Writes $OUT/sweep_mma.jsonl; prints one line per (shape, M).

    OUT=/tmp/out PYTHONPATH=$PWD python dev/sweeps/fp4_mma_mid_m_sweep.py [--ms 16,32,64] [--quick]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fp4_kernel_sweep_mma import T0, emit, quantized  # noqa: E402  (records go to $OUT/sweep_mma.jsonl)

from qerl_lib.bench.gemm import copy_bandwidth_gbps, l2_cache_bytes, mean_relative_error, rotation_copies, time_graph  # noqa: E402
from qerl_lib.kernels import mma  # noqa: E402
from qerl_lib.kernels.fp4_gemm import fp4_linear, prepare_fp4_weights  # noqa: E402
from qerl_lib.quant.nvfp4 import reference_matmul  # noqa: E402

SHAPES = [("7b.qkv", 4608, 3584), ("7b.o", 3584, 3584), ("7b.gate_up", 37888, 3584), ("7b.down", 3584, 18944),
          ("32b.gate_up", 55296, 5120), ("32b.down", 5120, 27648)]
# (tiles, warps_r, warps_k, depth, min_ctas): rows per CTA 16 * tiles * warps_r
SHAPES_NB2 = [(2, 1, 8, 2, 2), (1, 4, 2, 3, 1), (1, 8, 1, 3, 1), (2, 4, 1, 2, 1), (2, 2, 2, 2, 1), (1, 2, 4, 3, 1),
              (1, 4, 1, 3, 2)]
SHAPES_WIDE_NB = [(1, 8, 1, 3, 1), (1, 4, 2, 3, 1), (1, 2, 4, 3, 1), (1, 4, 1, 3, 2), (2, 4, 1, 2, 1), (2, 2, 2, 2, 1),
                  (1, 8, 1, 2, 1), (1, 4, 2, 2, 1), (1, 2, 2, 3, 2)]


def correctness() -> bool:
    ok_all = True
    cases = [(200, 256, (9, 17, 24, 33, 47, 64), None), (4608, 3584, (16, 32, 64), None),
             (3584, 18944, (24, 64), mma.MmaConfig(1, 4, 2, 3, 6, 1)),
             (1000, 1024, (40, 64), mma.MmaConfig(1, 8, 1, 3, 3, 1)), (300, 2048, (33,), mma.MmaConfig(2, 2, 2, 2, 5, 1)),
             (130, 512, (57,), mma.MmaConfig(1, 4, 1, 3, 1, 2))]
    for n, k, ms, cfg in cases:
        _, q = quantized(n, k, n + k)
        w = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
        bias = (torch.randn(n, device="cuda") * 0.1).to(torch.bfloat16)
        for m in ms:
            for b in (None, bias):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                c = cfg or mma.MmaConfig(1, 4, 2, 3, 1, 1)
                mma.mma_linear(x, w.words, w.scales, w.global_scale, b, out, c)
                again = torch.empty_like(out)
                mma.mma_linear(x, w.words, w.scales, w.global_scale, b, again, c)
                ref = reference_matmul(x, q, b)
                rel = mean_relative_error(out.float().nan_to_num(0.0), ref.float())
                same = bool(torch.equal(out.view(torch.int16), again.view(torch.int16)))
                unwritten = int(torch.isnan(out).sum())
                ok = unwritten == 0 and rel <= 1e-3 and same
                ok_all &= ok
                emit({"kind": "check", "n": n, "k": k, "m": m, "bias": b is not None, "config": str(c), "rel_err": rel,
                      "deterministic": same, "unwritten": unwritten, "ok": ok})
                if not ok:
                    print(f"CHECK FAIL N={n} K={k} M={m} bias={b is not None} rel {rel:.1e} det {same} "
                          f"unwritten {unwritten} {c}", flush=True)
    print(f"correctness {'ok' if ok_all else 'FAILED'} [{time.time() - T0:.0f}s]", flush=True)
    return ok_all


def variants(m: int, n: int, k: int, sms: int, quick: bool) -> list[tuple[str, mma.MmaConfig]]:
    nb = mma.n8_blocks(m)
    shapes = SHAPES_NB2 if nb <= 2 else SHAPES_WIDE_NB
    out = []
    for tiles, wr, wk, depth, min_ctas in (shapes[:3] if quick else shapes):
        probe = mma.MmaConfig(tiles, wr, wk, depth, 1, min_ctas)
        try:
            probe.check_shared(nb)
            per_sm = mma.ctas_per_sm(probe, nb, torch.device("cuda", 0))
        except (ValueError, RuntimeError):
            continue
        blocks = math.ceil(n / probe.rows_per_cta)
        chunks = k // mma.CHUNK
        fill = max(1, round(per_sm * sms / blocks))  # K-slices to fill one wave of resident CTAs
        most = max(1, chunks // (4 * wk))  # at least ~4 chunks per warp
        for split in sorted({1, min(fill, most)}):
            cfg = mma.MmaConfig(tiles, wr, wk, depth, split, min_ctas)
            out.append((f"t{tiles}r{wr}k{wk}d{depth}o{min_ctas}s{split}(occ{per_sm})", cfg))
    return out


def sweep(ms: tuple[int, ...], quick: bool) -> None:
    l2, copy = l2_cache_bytes(), copy_bandwidth_gbps()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    emit({"kind": "device", "name": torch.cuda.get_device_name(0), "copy_gbps": copy, "l2": l2, "sms": sms,
          "torch": torch.__version__})
    print(f"{torch.cuda.get_device_name(0)}: copy {copy:.0f} GB/s, L2 {l2 >> 20} MiB, {sms} SMs", flush=True)
    for name, n, k in (SHAPES[2:4] if quick else SHAPES):
        dense, q = quantized(n, k, 0)
        ws = [prepare_fp4_weights(q.weight_packed.clone(), q.weight_scale.clone(), q.weight_global_scale.clone())
              for _ in range(rotation_copies(n * k * 0.5625, l2))]
        wb = [dense.clone() for _ in range(rotation_copies(n * k * 2.0, l2))]
        for m in ms:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            fp4_bytes = n * k * 0.5625 + 2 * m * (k + n)
            outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in ws]
            bf16_us = time_graph([(lambda w=w: torch.nn.functional.linear(x, w)) for w in wb]).median_ms * 1e3
            auto_us = time_graph([(lambda w=w, o=o: fp4_linear(x, w, out=o)) for w, o in zip(ws, outs)]).median_ms * 1e3
            rec = {"kind": "time", "shape": name, "n": n, "k": k, "m": m, "bf16_us": bf16_us, "auto_us": auto_us, "mma": {}}
            best = ("none", float("inf"))
            for label, cfg in variants(m, n, k, sms, quick):
                try:
                    us = time_graph([(lambda w=w, o=o, c=cfg: mma.mma_linear(x, w.words, w.scales, w.global_scale, None, o, c))
                                     for w, o in zip(ws, outs)]).median_ms * 1e3
                except Exception as err:  # noqa: BLE001 - a launch shape that fails is a finding
                    rec["mma"][label] = {"error": str(err)[:200]}
                    continue
                rec["mma"][label] = {"us": us, "pct_copy": 100 * fp4_bytes / (us * 1e-6) / 1e9 / copy}
                if us < best[1]:
                    best = (label, us)
            emit(rec)
            print(f"{name:<12} M={m:<3} bf16 {bf16_us:7.1f}  auto {auto_us:7.1f} (x{bf16_us / auto_us:.2f})  "
                  f"best mma {best[0]} {best[1]:7.1f} (x{bf16_us / best[1]:.2f}, "
                  f"{100 * fp4_bytes / (best[1] * 1e-6) / 1e9 / copy:3.0f}% copy) [{time.time() - T0:.0f}s]", flush=True)
            del outs
        del ws, wb, dense, q
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="16,32,64")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    args = ap.parse_args()
    if not args.no_check:
        correctness()
    sweep(tuple(int(v) for v in args.ms.split(",")), args.quick)
    print(f"done in {time.time() - T0:.0f} s", flush=True)


if __name__ == "__main__":
    main()

"""Runs 8-14 (H200, H100; dev/LOG.md): the CUDA mma.sync kernel (qerl_lib/kernels/mma.py) against the Triton one.

Run 8: first version (register prefetch ring). Run 9: a cp.async shared-memory ring (slower; dropped).
Run 10: register ring again with fewer integer ops (scale table, cheaper pair decode, immediate offsets).
Run 11: x out of the ring, scales through L1, register cap (min_ctas) and K-slice variants.
Run 12: --auto-only, the launch rule set from run 11. Run 13: x staged in shared memory (slower; dropped).
Run 14: H100, 32B shapes at M = 8 (--models qwen2.5-32b --ms 8).

Question: with every operand in registers (mma.sync, no shared-memory staging of x, loads running
ahead in a register ring), how close does the small-M GEMM get to copy bandwidth on the Qwen2.5
7B / 32B decode shapes, and which launch shape (tiles per warp, warps along rows / K, ring depth,
K-slices) is best?

One call: (1) correctness of the default launch on awkward shapes (N not a multiple of the row
block, every M in 1..16, bias, K-slices) vs the oracle, bit-determinism and CUDA-graph replay;
(2) device time per (shape, M) for bf16 ``F.linear``, the Triton kernel and mma variants, with the
benchmark's CUDA-graph + L2-rotation timer. Writes $OUT/sweep_mma.jsonl as it goes (OUT defaults
to dev/runs/). The variants take ``MmaConfig``'s defaults for what they do not set (today
``l2_hint=1``, the launch rule's; runs 8-14 predate the hint and ran without it).

    PYTHONPATH=$PWD python dev/sweeps/fp4_kernel_sweep_mma.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from qerl_lib.kernels import mma
from qerl_lib.bench.gemm import copy_bandwidth_gbps, l2_cache_bytes, mean_relative_error, rotation_copies, time_graph
from qerl_lib.kernels.fp4_gemm import fp4_linear, prepare_fp4_weights
from qerl_lib.quant.nvfp4 import quantize, reference_matmul

OUT = os.environ.get("OUT", "dev/runs")  # where the kept records live
AUTO_ONLY = False
MODELS: list[str] = []
MS: tuple[int, ...] | None = None
T0 = time.time()
LOG = open(os.path.join(OUT, "sweep_mma.jsonl"), "a")

SHAPES = {  # fused layout, as the engine runs them: (name, N, K)
    "qwen2.5-7b": [("qkv_proj", 4608, 3584), ("o_proj", 3584, 3584), ("gate_up_proj", 37888, 3584), ("down_proj", 3584, 18944)],
    "qwen2.5-32b": [("qkv_proj", 7168, 5120), ("o_proj", 5120, 5120), ("gate_up_proj", 55296, 5120), ("down_proj", 5120, 27648)],
}


def emit(rec: dict) -> None:
    rec["t"] = round(time.time() - T0, 1)
    LOG.write(json.dumps(rec) + "\n")
    LOG.flush()


def quantized(n: int, k: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dense = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    return dense, quantize(dense, name=f"w{n}x{k}")


def correctness() -> bool:
    ok_all = True
    cases = [(200, 256, (1, 2, 3, 5, 8, 9, 13, 16), None), (4608, 3584, (1, 8, 16), None), (3584, 18944, (1, 8, 16), None),
             (1000, 1024, (4, 11), mma.MmaConfig(split_k=3)), (130, 512, (7,), mma.MmaConfig(tiles=1, warps_r=4, warps_k=2, depth=3)),
             (300, 2048, (2, 8), mma.MmaConfig(tiles=4, warps_r=1, warps_k=2, depth=3, split_k=5))]
    for n, k, ms, cfg in cases:
        _, q = quantized(n, k, n + k)
        w = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
        bias = (torch.randn(n, device="cuda") * 0.1).to(torch.bfloat16)
        for m in ms:
            for b in (None, bias):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                mma.mma_linear(x, w.words, w.scales, w.global_scale, b, out, cfg)
                again = torch.empty_like(out)
                mma.mma_linear(x, w.words, w.scales, w.global_scale, b, again, cfg)
                ref = reference_matmul(x, q, b)
                rel = mean_relative_error(out.float().nan_to_num(0.0), ref.float())
                ulps = int((out.view(torch.int16).int() - ref.view(torch.int16).int()).abs().max())
                same = bool(torch.equal(out.view(torch.int16), again.view(torch.int16)))
                unwritten = int(torch.isnan(out).sum())
                ok = unwritten == 0 and rel <= 1e-3 and same
                ok_all &= ok
                emit({"kind": "check", "n": n, "k": k, "m": m, "bias": b is not None, "config": str(cfg),
                      "rel_err": rel, "max_bf16_ulps": ulps, "deterministic": same, "unwritten": unwritten, "ok": ok})
                print(f"check N={n:<6} K={k:<6} M={m:<3} bias={b is not None!s:<5} rel {rel:.1e} ulps {ulps} "
                      f"det {same} {'ok' if ok else 'FAIL'}", flush=True)
    # CUDA-graph capture and replay (K-slices use the counters)
    n, k, m = 3584, 3584, 8
    _, q = quantized(n, k, 7)
    w = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    mma.mma_linear(x, w.words, w.scales, w.global_scale, None, out)
    eager = out.clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        mma.mma_linear(x, w.words, w.scales, w.global_scale, None, out)
    out.zero_()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    same = bool(torch.equal(out, eager))
    ok_all &= same
    emit({"kind": "graph", "ok": same})
    print(f"graph replay equals eager: {same}", flush=True)
    return ok_all


def variants(m: int, n: int, k: int, sms: int, quick: bool):
    base = mma.pick_mma_config(m, n, k)
    out = [("mma-auto", base)]
    if AUTO_ONLY:
        return out
    shapes = [(2, 1, 8), (2, 2, 4), (2, 2, 2), (1, 2, 4), (2, 4, 2), (1, 1, 8), (4, 1, 4)]
    if quick:
        shapes = shapes[:2]
    nb = 1 if m <= 8 else 2
    for tiles, wr, wk in shapes:
        for depth in (2, 3):
            for min_ctas in (1, 2, 3):
                if min_ctas > 1 and (tiles, wr, wk) not in ((2, 1, 8), (2, 2, 4), (1, 2, 4)):
                    continue
                try:
                    probe = mma.MmaConfig(tiles, wr, wk, depth, 1, min_ctas)
                    occ = mma.ctas_per_sm(probe, nb, torch.device("cuda", 0))
                except (ValueError, RuntimeError):
                    continue
                splits = {1, max(1, (k // mma.CHUNK) // (8 * wk))}  # none; ~8 chunks per warp
                for split in sorted(splits):
                    cfg = mma.MmaConfig(tiles, wr, wk, depth, split, min_ctas)
                    label = f"t{tiles}r{wr}k{wk}d{depth}o{min_ctas}s{split}(occ{occ})"
                    if not any(v[0] == label for v in out) and cfg != base:
                        out.append((label, cfg))
    return out


def sweep(quick: bool) -> None:
    l2 = l2_cache_bytes()
    copy = copy_bandwidth_gbps()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    emit({"kind": "device", "name": torch.cuda.get_device_name(0), "copy_gbps": copy, "l2": l2, "sms": sms,
          "torch": torch.__version__})
    print(f"copy bandwidth {copy:.0f} GB/s, L2 {l2 >> 20} MiB, {sms} SMs", flush=True)
    for model, shapes in SHAPES.items():
        if MODELS and model not in MODELS:
            continue
        for name, n, k in (shapes[:2] if quick else shapes):
            dense, q = quantized(n, k, 0)
            fp4_bytes1 = n * k * 0.5625
            ws = [prepare_fp4_weights(q.weight_packed.clone(), q.weight_scale.clone(), q.weight_global_scale.clone())
                  for _ in range(rotation_copies(fp4_bytes1, l2))]
            wb = [dense.clone() for _ in range(rotation_copies(n * k * 2.0, l2))]
            for m in MS or ((1, 8) if quick else ((1, 8, 16) if model.endswith('7b') else (1, 8))):
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                fp4_bytes = fp4_bytes1 + 2 * m * (k + n)
                outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in ws]
                bf16_t = time_graph([(lambda w=w: torch.nn.functional.linear(x, w)) for w in wb]).median_ms
                tri_t = time_graph([(lambda w=w, o=o: fp4_linear(x, w, out=o, small_m_backend="triton"))
                                    for w, o in zip(ws, outs)]).median_ms
                rec = {"kind": "time", "model": model, "proj": name, "n": n, "k": k, "m": m, "bf16_us": bf16_t * 1e3,
                       "triton_us": tri_t * 1e3, "triton_pct_copy": 100 * fp4_bytes / (tri_t * 1e-3) / 1e9 / copy, "mma": {}}
                best = None
                for label, cfg in variants(m, n, k, sms, quick):
                    try:
                        t = time_graph([(lambda w=w, o=o, c=cfg: mma.mma_linear(x, w.words, w.scales, w.global_scale, None, o, c))
                                        for w, o in zip(ws, outs)]).median_ms
                    except Exception as err:  # noqa: BLE001 - record and go on
                        rec["mma"][label] = {"error": str(err)[:200]}
                        continue
                    pct = 100 * fp4_bytes / (t * 1e-3) / 1e9 / copy
                    rec["mma"][label] = {"us": t * 1e3, "pct_copy": pct}
                    if best is None or t < best[1]:
                        best = (label, t)
                emit(rec)
                auto = rec["mma"]["mma-auto"]
                print(f"{model:<11} {name:<13} M={m:<3} bf16 {bf16_t * 1e3:7.1f}  triton {tri_t * 1e3:7.1f} "
                      f"({rec['triton_pct_copy']:3.0f}%)  mma-auto {auto['us']:7.1f} ({auto['pct_copy']:3.0f}%)  "
                      f"best {best[0]} {best[1] * 1e3:7.1f} ({100 * fp4_bytes / (best[1] * 1e-3) / 1e9 / copy:3.0f}%)  "
                      f"x{bf16_t / best[1]:.2f} vs bf16", flush=True)
                del outs
            del ws, wb, dense, q
            torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--auto-only", action="store_true", help="time only pick_mma_config's choice")
    ap.add_argument("--models", default=",".join(SHAPES), help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--ms", default=None, help="comma list of M (default 1,8 and 16 for 7B)")
    args = ap.parse_args()
    global AUTO_ONLY
    AUTO_ONLY = args.auto_only
    global MODELS, MS
    MODELS = args.models.split(",")
    MS = tuple(int(v) for v in args.ms.split(",")) if args.ms else None
    print(f"mma available: {mma.available()} ({mma.unavailable_reason()})", flush=True)
    if not args.no_check:
        ok = correctness()
        print("CORRECTNESS", "ok" if ok else "FAILED", flush=True)
    sweep(args.quick)
    print(f"done in {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()

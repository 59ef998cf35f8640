"""Runs 23-24 (H200; dev/LOG.md): launch shapes that fill whole waves of CTAs, for the 7B decode GEMMs.

Question: the launch rule's shapes leave SMs idle at the end of a kernel or for all of it.
7B gate/up (N = 37,888) runs 592 CTAs of 64 rows on 264 resident slots (two per SM): 2.24 waves,
so the third wave runs a quarter full. q/k/v (144 CTAs) and o (112 CTAs of 32 rows) do not reach
every SM of 132, and down (224 CTAs of 2 K-slices) fills 85% of the slots. Candidates: 48-row
warps (``tiles=3``), 96-row CTAs of 12 warps (one per SM, 395 CTAs = 2.99 waves), 4-warp CTAs with
more of them resident, K-slices chosen to fill the slots, and deeper register rings where the
lower occupancy leaves registers free.

One call: (1) every variant matches the oracle (rel_err <= 1e-3) at M = 1 and 8 on the four 7B
shapes; (2) device time per (shape, M, variant), CUDA-graph + L2-rotation timer; (3) the engine
at Qwen2.5-7B shapes, batch 8, 256 + 2048 tokens: the rule, and the rule with each shape's
fastest variant at M = 8 (interleaved, two rounds), each launch rule handed to the engine's layers
with ``set_small_m_kernel(model, mma_rule=...)``. Writes $OUT/sweep_waves.jsonl as it goes (OUT
defaults to dev/runs/). "rule" is the launch rule as it was before run 23 (``rule_before_run23``
below, a local copy of a rule the library no longer has).

Run 24 (``--wide``): the wave-filling rule that run 23 led to (``pick_mma_config``, "rule24") on
the gate/up shapes of Qwen2.5-3B, 7B and 32B against every ``WIDE_SHAPES`` candidate and the
other shapes above, at M = 1 and 8; then the engine (7B and 32B, batch 8, 256 + 2048) with the
rule before and the rule after.

    PYTHONPATH=$PWD python dev/sweeps/fp4_kernel_sweep_waves.py [--no-rollout] [--wide]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch

from qerl_lib.kernels import mma
from qerl_lib.bench.gemm import copy_bandwidth_gbps, l2_cache_bytes, mean_relative_error, rotation_copies, time_graph
from qerl_lib.kernels.fp4_gemm import prepare_fp4_weights
from qerl_lib.quant.nvfp4 import quantize, reference_matmul

OUT = os.environ.get("OUT", "dev/runs")  # where the kept records live
T0 = time.time()
LOG = open(os.path.join(OUT, "sweep_waves.jsonl"), "a")
SHAPES = [("qkv_proj", 4608, 3584), ("o_proj", 3584, 3584), ("gate_up_proj", 37888, 3584), ("down_proj", 3584, 18944)]
RULE = mma.pick_mma_config
WIDE = [("qwen2.5-3b gate_up", 22016, 2048), ("qwen2.5-7b gate_up", 37888, 3584), ("qwen2.5-32b gate_up", 55296, 5120)]


def rule_before_run23(m: int, n: int, k: int) -> mma.MmaConfig:
    """Local copy of a superseded launch rule: ``pick_mma_config`` as committed before run 23
    (gate/up: 64-row CTAs below K = 4096, else 128). Not in the library any more."""
    chunks = k // mma.CHUNK
    if n >= 8 * k:
        if k >= 4096:
            return mma.MmaConfig(tiles=2, warps_r=4, warps_k=2, depth=2, split_k=1, min_ctas=1, l2_hint=1)
        return mma.MmaConfig(tiles=2, warps_r=2, warps_k=4, depth=2, split_k=1, min_ctas=2, l2_hint=1)
    split = min(64, max(1, chunks // 64)) if k >= 4 * n else 1
    return mma.MmaConfig(tiles=2, warps_r=1, warps_k=8, depth=2, split_k=split, min_ctas=2, l2_hint=1)


def emit(rec: dict) -> None:
    rec["t"] = round(time.time() - T0, 1)
    LOG.write(json.dumps(rec) + "\n")
    LOG.flush()


def quantized(n: int, k: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return quantize((torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16), name=f"w{n}x{k}")


def cfg(tiles, wr, wk, occ, depth=2, split=1) -> mma.MmaConfig:
    return mma.MmaConfig(tiles=tiles, warps_r=wr, warps_k=wk, depth=depth, split_k=split, min_ctas=occ, l2_hint=1)


def label(c: mma.MmaConfig) -> str:
    return f"t{c.tiles}r{c.warps_r}k{c.warps_k}o{c.min_ctas}d{c.depth}s{c.split_k}"


def variants(m: int, n: int, k: int) -> list[tuple[str, mma.MmaConfig]]:
    out = [("rule", rule_before_run23(m, n, k))]
    if n >= 8 * k:  # gate/up: whole waves, more rows per warp
        cands = [cfg(3, 1, 8, 2), cfg(3, 1, 8, 2, 3), cfg(2, 3, 4, 1), cfg(2, 3, 4, 1, 3), cfg(2, 3, 5, 1),
                 cfg(3, 2, 6, 1), cfg(3, 1, 4, 3), cfg(3, 1, 4, 3, 3), cfg(2, 1, 8, 2), cfg(4, 1, 8, 1),
                 cfg(2, 2, 4, 2, 3)]
    elif k >= 4 * n:  # down: K-slices that fill the resident slots
        cands = [cfg(3, 1, 4, 4, 2, 7), cfg(3, 1, 4, 4, 3, 7), cfg(2, 1, 4, 4, 2, 4), cfg(3, 1, 4, 3, 2, 5),
                 cfg(3, 1, 4, 3, 3, 5), cfg(3, 1, 8, 2, 2, 3), cfg(2, 1, 4, 3, 2, 7), cfg(2, 1, 8, 2, 3, 2),
                 cfg(1, 1, 8, 4, 2, 2), cfg(2, 1, 8, 2, 2, 3)]
    else:  # q/k/v, o: every SM busy, more bytes in flight per warp
        cands = [cfg(1, 1, 8, 4), cfg(1, 1, 8, 4, 3), cfg(2, 1, 4, 4), cfg(2, 1, 4, 4, 3), cfg(1, 1, 4, 4),
                 cfg(1, 1, 4, 4, 3), cfg(2, 1, 8, 2, 2, 2), cfg(2, 1, 8, 1, 4), cfg(2, 1, 8, 2, 3), cfg(1, 2, 4, 4),
                 cfg(1, 1, 4, 4, 2, 2)]
    out += [(label(c), c) for c in cands]
    return out


def wide_variants(m: int, n: int, k: int) -> list[tuple[str, mma.MmaConfig]]:
    out = [("rule", rule_before_run23(m, n, k)), ("rule24", RULE(m, n, k))]
    cands = [c for c, _ in mma.WIDE_SHAPES] + [cfg(2, 4, 2, 1), cfg(3, 1, 4, 4), cfg(3, 1, 8, 2), cfg(3, 1, 4, 3, 3)]
    return out + [(label(c), c) for c in cands]


def correctness(shapes=SHAPES, variants=variants) -> bool:
    ok_all = True
    for name, n, k in shapes:
        q = quantized(n, k, n + k)
        w = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            ref = reference_matmul(x, q, None)
            for lab, c in variants(m, n, k):
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                for _ in range(2):  # twice: the K-slice counters must reset
                    mma.mma_linear(x, w.words, w.scales, w.global_scale, None, out, c)
                rel = mean_relative_error(out.float().nan_to_num(0.0), ref.float())
                ok = rel <= 1e-3 and not torch.isnan(out).any()
                ok_all &= bool(ok)
                emit({"kind": "check", "proj": name, "n": n, "k": k, "m": m, "variant": lab, "rel_err": rel, "ok": bool(ok)})
                if not ok:
                    print(f"check FAIL {name} M={m} {lab}: rel {rel:.1e}", flush=True)
    print("CORRECTNESS", "ok" if ok_all else "FAILED", flush=True)
    return ok_all


def sweep(ms=(1, 8), shapes=SHAPES, variants=variants) -> dict:
    l2, copy = l2_cache_bytes(), copy_bandwidth_gbps()
    emit({"kind": "device", "name": torch.cuda.get_device_name(0), "copy_gbps": copy, "l2": l2,
          "sms": torch.cuda.get_device_properties(0).multi_processor_count})
    print(f"{torch.cuda.get_device_name(0)}: copy bandwidth {copy:.0f} GB/s, L2 {l2 >> 20} MiB", flush=True)
    best = {}
    for name, n, k in shapes:
        q = quantized(n, k, 0)
        one = n * k * 0.5625
        ws = [prepare_fp4_weights(q.weight_packed.clone(), q.weight_scale.clone(), q.weight_global_scale.clone())
              for _ in range(rotation_copies(one, l2))]
        for m in ms:
            x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            outs = [torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in ws]
            us, cfgs = {}, {}
            for lab, c in variants(m, n, k):
                t = time_graph([(lambda w=w, o=o, c=c: mma.mma_linear(x, w.words, w.scales, w.global_scale, None, o, c))
                                for w, o in zip(ws, outs)]).median_ms
                us[lab], cfgs[lab] = round(t * 1e3, 2), c
            top = min(us, key=us.get)
            rec = {"kind": "time", "proj": name, "n": n, "k": k, "m": m, "us": us, "best": top,
                   "rule": label(cfgs["rule"]), "pct_copy_best": round(100 * one / (us[top] * 1e-6) / 1e9 / copy, 1),
                   "pct_copy_rule": round(100 * one / (us["rule"] * 1e-6) / 1e9 / copy, 1)}
            emit(rec)
            order = sorted(us, key=us.get)
            new = f"rule24 {us['rule24']:6.1f}  " if "rule24" in us else ""
            print(f"{name:<13} M={m}  rule {us['rule']:6.1f} us ({rec['pct_copy_rule']:4.1f}%)  {new}best {top} {us[top]:6.1f} "
                  f"({rec['pct_copy_best']:4.1f}%, {us['rule'] / us[top]:.3f}x)  next: "
                  + ", ".join(f"{v} {us[v]:.1f}" for v in order[1:5]), flush=True)
            if m == 8:
                best[(n, k)] = cfgs[top]
            del outs
        del ws, q
        torch.cuda.empty_cache()
    return best


def rollout(best: dict, rounds: int = 2, model_name: str = "qwen2.5-7b", settings=None, repeats: int = 3) -> None:
    from qerl_lib.bench.rollout import Row, load_bench_model, time_engine
    from qerl_lib.models.nvfp4_linear import set_small_m_kernel

    model = load_bench_model(model_name, "nvfp4", torch.device("cuda"))

    def patched(m, n, k):
        return best.get((n, k), rule_before_run23(m, n, k)) if m <= 8 else rule_before_run23(m, n, k)

    settings = settings or [("rule", rule_before_run23), ("best", patched)]
    for r in range(rounds):
        for name, pick in settings:
            set_small_m_kernel(model, mma_rule=pick)
            try:
                row = time_engine(model, Row(model_name, "nvfp4", 8, 0, "auto", "qerl", 256, 2048), "auto", None, repeats, 0)
            finally:
                set_small_m_kernel(model)  # back to the library's rule
            emit({"kind": "rollout", "round": r, "setting": name,
                  "configs": {f"{n}x{k}": label(c) for (n, k), c in best.items()} if name == "best" else None,
                  "model_name": model_name,
                  **dataclasses.asdict(row)})
            print(f"rollout {model_name} nvfp4 b8 256+2048 round {r} {name:<6}: {row.tok_s:7.1f} tok/s, "
                  f"{row.ms_per_step:.4f} ms/step, ttft {row.ttft_ms:.1f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-rollout", action="store_true")
    ap.add_argument("--wide", action="store_true", help="run 24: the wave-filling gate/up rule")
    args = ap.parse_args()
    print(f"mma available: {mma.available()} ({mma.unavailable_reason()})", flush=True)
    if args.wide:
        correctness(WIDE, wide_variants)
        sweep(shapes=WIDE, variants=wide_variants)
        if not args.no_rollout:
            for name, rounds, repeats in (("qwen2.5-7b", 2, 3), ("qwen2.5-32b", 1, 2)):
                rollout({}, rounds, name, [("rule", rule_before_run23), ("rule24", RULE)], repeats)
        print(f"done in {time.time() - T0:.0f} s")
        return
    correctness()
    best = sweep()
    print("fastest at M=8:", {f"{n}x{k}": label(c) for (n, k), c in best.items()}, flush=True)
    if not args.no_rollout:
        rollout(best)
    print(f"done in {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()

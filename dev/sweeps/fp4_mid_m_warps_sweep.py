"""The fragment GEMM at decode batches 16-128 (dev/LOG.md section 31): two warpgroups per x tile, and x put
in the fragment's K order by torch before the launch.

Why (offline SASS, sm_90a, Triton 3.6 with the runtime's divisibility hints): at M = 64 the rule's launch
(64 W rows x 64 x rows, 4 warps) spends ~335 instructions per thread per 128-wide K-step, 32 of them scalar
shared-memory stores of x's permuted tile; every 64 W rows re-stage the whole x tile from L2, which at M = 64
is 3.5x the weight bytes (265 MB of L2 reads for 7B gate/up against 76 MB of weights). Families timed here,
each a function of (m, n, k, SMs) -> KernelConfig: "base" (pick_config), "px" (the same with permute_x),
"w8pP" / "w8pP-px" (128 W rows = two warpgroups sharing each x tile, 8 warps, K-splits for ~P programs per
SM). Correctness first (the oracle, determinism, and px bit-equal to the same launch without it), then device
time per (shape, M) with fp4_kernel_sweep's CUDA-graph + L2-rotation timer (px variants include the torch
permute), then the 7B NVFP4 + r16 engine's ms per decode step at batch 32 / 64 / 128 with the rule against
the family that won at that M (geomean over the shapes), patched in as fp4_gemm.pick_config.

    OUT=/tmp/out PYTHONPATH=$PWD python dev/sweeps/fp4_mid_m_warps_sweep.py

Both knobs lost and were reverted: run it on commit 93f410d's qerl_lib/kernels (fp4_gemm.py, launch_rule.py).
With FAMILY_SET=regs it times instead the rule's launch under ptxas register caps (``KernelConfig.max_registers``:
168 / 160 / 128 per thread), after Nsight Compute showed 2 programs per SM at M = 64 (183 registers) and 2.24 waves.
That field lost too and was reverted: run it on commit dc85fd1's qerl_lib/kernels.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp4_kernel_sweep as sweep  # noqa: E402  (opens $OUT/sweep.jsonl)
from fp4_mid_m_sweep import SHAPES  # noqa: E402  (the six 7B/32B projection shapes)

from qerl_lib.bench.gemm import mean_relative_error  # noqa: E402
from qerl_lib.kernels import fp4_gemm  # noqa: E402
from qerl_lib.kernels.fp4_gemm import fp4_linear, prepare_fp4_weights  # noqa: E402
from qerl_lib.kernels.launch_rule import KernelConfig, k_splits, pick_config  # noqa: E402
from qerl_lib.quant.nvfp4 import reference_matmul  # noqa: E402

MS = [int(m) for m in os.environ.get("MS", "16,32,64,128").split(",")]  # regs run: 16,32,64,128,192
ENGINE_BATCHES = [int(b) for b in os.environ.get("ENGINE_BATCHES", "32,64,128").split(",") if b]
GEN = int(os.environ.get("GEN", "512"))


def base(m, n, k, sms):
    return pick_config(m, n, k, sms)


def with_px(fn):
    def f(m, n, k, sms):
        cfg = fn(m, n, k, sms)
        return dataclasses.replace(cfg, permute_x=True) if cfg.fragment else cfg
    return f


def w8(per_sm):
    def f(m, n, k, sms):
        block_m = 16 if m <= 16 else min(64, 1 << (m - 1).bit_length())
        tiles = math.ceil(n / 128) * math.ceil(m / block_m)
        return KernelConfig(block_m, 128, 128, k_splits(tiles, math.ceil(k / 128), sms, per_sm), 8, 1, fragment=True)
    return f


def capped(regs):
    def f(m, n, k, sms):
        cfg = pick_config(m, n, k, sms)
        return dataclasses.replace(cfg, max_registers=regs) if cfg.fragment else cfg
    return f


if os.environ.get("FAMILY_SET", "warps") == "warps":  # section 31's first run (commit 93f410d's kernels)
    FAMILIES = {"base": base, "px": with_px(base)}
    for p in (1, 2, 4):
        FAMILIES[f"w8p{p}"] = w8(p)
        FAMILIES[f"w8p{p}-px"] = with_px(w8(p))
else:  # "regs": ptxas register caps, so that 3-4 programs fit on an SM (section 31's second run)
    FAMILIES = {"base": base, **{f"r{r}": capped(r) for r in (168, 160, 128)}}


def check(sms) -> bool:
    ok_all, worst = True, 0.0
    for m in (16, 64, 128, 150):
        for n, k in ((3584, 3584), (4608, 3584)):
            _, q, x = sweep.make(n, k, m, seed=m + n)
            ref = reference_matmul(x, q)
            prep = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
            for label, fn in FAMILIES.items():
                cfg = fn(m, n, k, sms)
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                fp4_linear(x, prep, out=out, config=cfg)
                rel = mean_relative_error(out.float().nan_to_num(0), ref.float())
                same = torch.equal(out, fp4_linear(x, prep, config=cfg))
                if getattr(cfg, "permute_x", False):  # only relabels K: the same bits as without it
                    same = same and torch.equal(out, fp4_linear(x, prep, config=dataclasses.replace(cfg, permute_x=False)))
                ok = not torch.isnan(out).any() and rel < 1e-3 and same
                worst = max(worst, rel)
                ok_all &= ok
                sweep.emit({"kind": "correct", "m": m, "n": n, "k": k, "variant": label, "config": str(cfg),
                            "rel": rel, "ok": bool(ok)})
                if not ok:
                    print(f"CORRECTNESS FAIL {label} M={m} N={n} rel {rel:.2e} same {same}", flush=True)
    print(f"correctness: {'all ok' if ok_all else 'FAILURES'}; worst mean rel err {worst:.2e}", flush=True)
    return ok_all


def isolation(sms, l2, copy_gbps) -> dict[int, str]:
    best = {}
    for m in MS:
        ratios: dict[str, list[float]] = {}
        for name, n, k in SHAPES:
            variants = [(label, False, fn(m, n, k, sms)) for label, fn in FAMILIES.items()]
            rows = sweep.time_variants(name, n, k, m, variants, l2, copy_gbps)
            base_us = next(r["us"] for r in rows if r["variant"] == "base")
            for r in rows:
                if "us" in r and r["variant"] != "bf16":
                    ratios.setdefault(r["variant"], []).append(r["us"] / base_us)
        geo = {v: math.exp(sum(map(math.log, xs)) / len(xs)) for v, xs in ratios.items() if len(xs) == len(SHAPES)}
        best[m] = min(geo, key=geo.get)
        sweep.emit({"kind": "geomean_vs_base", "m": m, **{v: round(g, 4) for v, g in geo.items()}})
        print(f"M={m}: time / base, geomean over shapes: " + ", ".join(f"{v} {g:.3f}" for v, g in sorted(geo.items(), key=lambda kv: kv[1])), flush=True)
    return best


def engine(best) -> None:
    from qerl_lib.bench.rollout import load_bench_model, random_lora, random_prompts
    from qerl_lib.engine.rollout import RolloutEngine

    model = load_bench_model("qwen2.5-7b", "nvfp4", torch.device("cuda"))
    lora = random_lora(model, 16, 0)
    for batch in ENGINE_BATCHES:
        family = best.get(batch, "base")
        for label in dict.fromkeys(("base", family)):
            fn = FAMILIES[label]
            fp4_gemm.pick_config = (lambda m, n, k, sms=132, allow_cublas=True, fn=fn:
                                    fn(m, n, k, sms) if 9 <= m < 193 else pick_config(m, n, k, sms, allow_cublas))
            try:
                eng = RolloutEngine(model, max_seq_len=256 + GEN)
                prompts = random_prompts(batch, 256, model.config.vocab_size, 0)
                eng.warmup(batch, 256, GEN, lora=lora)
                eng.generate(prompts, GEN, temperature=1.0, seed=0, stop_token_ids=[], lora=lora, timing=True)
                t = eng.last_timing
                ms = 1e3 * t.decode_s / t.steps
                eng.release()
            finally:
                fp4_gemm.pick_config = pick_config
            sweep.emit({"kind": "engine", "batch": batch, "family": label, "gen": GEN, "rank": 16, "ms_per_step": ms})
            print(f"engine batch {batch} {label:<10} {ms:7.3f} ms/step", flush=True)


def main() -> int:
    sms, l2, copy_gbps = sweep.device_header()
    if not check(sms):
        return 1
    best = isolation(sms, l2, copy_gbps)
    if ENGINE_BATCHES:
        engine(best)
    print(f"done [{time.time() - sweep.T0:.0f}s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

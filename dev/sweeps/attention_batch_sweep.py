"""Decode attention at RL batch sizes (dev/LOG.md section 30): launch shape x batch x cached tokens in
isolation, the slices cut from each row's own columns (today's kernel) against slices cut from the
captured cache length (BEFORE: an earlier engine/attention.py,
``git show df35b38:qerl_lib/engine/attention.py``), and the engine's decode step with the best shape per batch. (Section 30's "today" was commit 3b60c33's kernel, whose
slices were cut from each row's columns; that change was reverted, so today's kernel now equals BEFORE's.)

Phase 1, isolation: for each batch of BATCHES and cached-token count of CONTEXTS, the cache view is the
engine's length bucket (the count rounded up to 256) and the call is ``rope_cache_attention`` (the
engine's), timed over several cache sets in one CUDA graph (so that L2 holds none of them). ``gbs`` = the
K/V bytes the rows actually read / time; ``copy_gbs`` = a device copy of the same bytes (read + write
counted) in the same process, for scale. Every shape of the grid runs on today's kernel; BEFORE's runs
the default shape and today's three best shapes of each case.
Phase 2, engine: random Qwen2.5-7B NVFP4 + LoRA r16, 256 + GEN tokens, ms per decode step at each batch
of ENGINE_BATCHES for BEFORE's kernel (default shape), today's (default shape) and today's with the
shape that was fastest in phase 1 summed over that batch's contexts.

Writes attention_batch.jsonl to $OUT as it goes and prints tables.
    OUT=... BEFORE=/tmp/attention_before.py PYTHONPATH=$PWD python dev/sweeps/attention_batch_sweep.py
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import json
import math
import os
import sys
import time

import torch

from qerl_lib.bench.gemm import time_graph
from qerl_lib.bench.rollout import load_bench_model, random_lora, random_prompts
from qerl_lib.bench.table import format_table
from qerl_lib.engine import attention as today
from qerl_lib.engine import forward as forward_mod
from qerl_lib.engine.rollout import RolloutEngine

OUT = os.environ.get("OUT", "dev/runs")
BATCHES = [int(b) for b in os.environ.get("BATCHES", "8,32,64,128").split(",")]
CONTEXTS = [int(c) for c in os.environ.get("CONTEXTS", "640,1100,2000").split(",")]
ENGINE_BATCHES = [int(b) for b in os.environ.get("ENGINE_BATCHES", "8,32,64,128").split(",") if b]
GEN = int(os.environ.get("GEN", "1024"))
H, KV, D = 28, 4, 128  # Qwen2.5-7B's attention
GRID = [dict(block=bl, warps=w, stages=st, programs=p)
        for bl, w, st, p in itertools.product((64, 128), (4, 8), (2, 3, 4), (132, 264, 528, 1056, 2112))]
DEFAULT = dataclasses.asdict(today.DEFAULT_LAUNCH)
T0 = time.time()
os.makedirs(OUT, exist_ok=True)
LOG = open(os.path.join(OUT, "attention_batch.jsonl"), "a")


def emit(rec: dict) -> dict:
    rec["t"] = round(time.time() - T0, 1)
    LOG.write(json.dumps(rec) + "\n")
    LOG.flush()
    return rec


def load_before():
    path = os.environ.get("BEFORE")
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("attention_before", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["attention_before"] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def case_inputs(b: int, ctx: int):
    length = 256 * math.ceil(ctx / 256)
    kv_bytes = 2 * b * KV * length * D * 2
    sets = max(2, min(8, math.ceil(200e6 / kv_bytes)))
    caches = [(torch.randn(b, KV, length, D, device="cuda", dtype=torch.bfloat16),
               torch.randn(b, KV, length, D, device="cuda", dtype=torch.bfloat16)) for _ in range(sets)]
    fused = torch.randn(b, 1, (H + 2 * KV) * D, device="cuda", dtype=torch.bfloat16)
    q = fused[..., :H * D].view(b, 1, H, D).transpose(1, 2)
    k = fused[..., H * D:(H + KV) * D].view(b, 1, KV, D).transpose(1, 2)
    v = fused[..., (H + KV) * D:].view(b, 1, KV, D).transpose(1, 2)
    cos, sin = torch.randn(b, 1, D, device="cuda"), torch.randn(b, 1, D, device="cuda")
    pad = torch.zeros(b, dtype=torch.long, device="cuda")
    col = torch.tensor([ctx - 1], device="cuda")
    return caches, (q, k, v, cos.bfloat16(), sin.bfloat16(), pad, col), length


def time_case(mod, caches, args, cfg) -> float:
    q, k, v, cos, sin, pad, col = args
    launch = mod.AttentionLaunch(**cfg)
    calls = [(lambda kc=kc, vc=vc: mod.rope_cache_attention(q, k, v, cos, sin, kc, vc, pad, col, D ** -0.5,
                                                            launch=launch)) for kc, vc in caches]
    return time_graph(calls, target_ms=20.0, min_repeats=5, max_repeats=40).median_ms * 1e3


def copy_gbs(nbytes: int) -> float:
    src = torch.empty(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    us = time_graph([lambda: dst.copy_(src)], target_ms=20.0, min_repeats=5).median_ms * 1e3
    return 2 * nbytes / us / 1e3


def isolation(before) -> dict[int, dict]:
    best_by_batch: dict[int, dict] = {}
    table = []
    for b in BATCHES:
        totals: dict[str, float] = {}
        for ctx in CONTEXTS:
            caches, args, length = case_inputs(b, ctx)
            read = 2 * b * KV * ctx * D * 2  # the columns the rows attend to
            ref = copy_gbs(read)
            results = []
            for cfg in GRID:
                try:
                    us = time_case(today, caches, args, cfg)
                except Exception as err:  # noqa: BLE001 - e.g. shared memory limits: record and go on
                    emit({"kind": "iso", "kernel": "today", "batch": b, "ctx": ctx, **cfg, "error": str(err)[:160]})
                    continue
                emit({"kind": "iso", "kernel": "today", "batch": b, "ctx": ctx, "length": length, **cfg,
                      "us": round(us, 2), "gbs": round(read / us / 1e3, 1), "copy_gbs": round(ref, 1)})
                results.append((us, cfg))
                totals[json.dumps(cfg)] = totals.get(json.dumps(cfg), 0.0) + us
            results.sort(key=lambda r: r[0])
            default_us = next(us for us, cfg in results if cfg == DEFAULT)
            row = {"batch": b, "ctx": ctx, "copy_gbs": ref, "today_default_us": default_us,
                   "today_best_us": results[0][0], "best": results[0][1]}
            if before is not None:
                for cfg in [DEFAULT] + [c for _, c in results[:3]]:
                    us = time_case(before, caches, args, cfg)
                    emit({"kind": "iso", "kernel": "before", "batch": b, "ctx": ctx, "length": length, **cfg,
                          "us": round(us, 2), "gbs": round(read / us / 1e3, 1), "copy_gbs": round(ref, 1)})
                    if cfg == DEFAULT:
                        row["before_default_us"] = us
            row["gbs_default"] = read / default_us / 1e3
            row["gbs_best"] = read / results[0][0] / 1e3
            table.append(row)
            print(f"batch {b} ctx {ctx}: {row}", flush=True)
            del caches
            torch.cuda.empty_cache()
        best_by_batch[b] = json.loads(min(totals.items(), key=lambda kv: kv[1])[0])
        emit({"kind": "best", "batch": b, **best_by_batch[b]})
    cols = (("batch", "", 5), ("ctx", "", 5), ("copy_gbs", ".0f", 8), ("before_default_us", ".1f", 17),
            ("today_default_us", ".1f", 16), ("today_best_us", ".1f", 13), ("gbs_default", ".0f", 11),
            ("gbs_best", ".0f", 8))
    print(format_table(table, cols), flush=True)
    for b, cfg in best_by_batch.items():
        print(f"best shape over contexts at batch {b}: {cfg}", flush=True)
    return best_by_batch


def engine_step_ms(model, lora, batch: int, launch) -> float:
    engine = RolloutEngine(model, max_seq_len=256 + GEN, attention_launch=launch)
    prompts = random_prompts(batch, 256, model.config.vocab_size, 0)
    engine.warmup(batch, 256, GEN, lora=lora)
    engine.generate(prompts, GEN, temperature=1.0, seed=0, stop_token_ids=[], lora=lora, timing=True)
    t = engine.last_timing
    engine.release()
    return 1e3 * t.decode_s / t.steps


def engine_phase(before, best_by_batch) -> None:
    model = load_bench_model("qwen2.5-7b", "nvfp4", torch.device("cuda"))
    lora = random_lora(model, 16, 0)
    rows = []
    for b in ENGINE_BATCHES:
        variants = [("today default", None, today.DEFAULT_LAUNCH)]
        if b in best_by_batch:
            variants.append(("today best", None, today.AttentionLaunch(**best_by_batch[b])))
        if before is not None:
            variants.insert(0, ("before default", before, before.DEFAULT_LAUNCH))
        for name, mod, launch in variants:
            if mod is not None:
                forward_mod.rope_cache_attention = mod.rope_cache_attention
            try:
                ms = engine_step_ms(model, lora, b, launch)
            finally:
                forward_mod.rope_cache_attention = today.rope_cache_attention
            rec = emit({"kind": "engine", "variant": name, "batch": b, "gen": GEN, "rank": 16,
                        "launch": dataclasses.asdict(launch), "ms_per_step": round(ms, 4),
                        "tok_s_decode": round(b * 1e3 / ms, 1)})
            rows.append(rec)
            print(f"engine batch {b} {name:<15} {ms:7.3f} ms/step", flush=True)
    print(format_table(rows, (("batch", "", 5), ("variant", "", 15), ("ms_per_step", ".3f", 11),
                              ("tok_s_decode", ".0f", 12))), flush=True)


def main() -> None:
    emit({"kind": "device", "name": torch.cuda.get_device_name(0), "torch": torch.__version__})
    before = load_before()
    best = isolation(before)
    if ENGINE_BATCHES:
        engine_phase(before, best)
    print(f"done in {time.time() - T0:.0f} s", flush=True)


if __name__ == "__main__":
    main()

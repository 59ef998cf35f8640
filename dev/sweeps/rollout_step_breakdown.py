"""Where one decode step's time goes: kernel time per category and the GPU's idle time between
kernels, for the engine's CUDA-graph decode at Qwen2.5 shapes (random weights), at each batch size and
LoRA rank asked for (default batch 8, no adapter).

    python3 dev/sweeps/rollout_step_breakdown.py --models qwen2.5-7b --weights nvfp4,bf16 \
        --contexts 256,1280,2240 [--batch 8,32,64 --lora-rank 16] --json dev/runs/NAME.json

``--skip-permute``: a timing probe, not a result (wrong outputs): the Gluon kernels take ``x`` as if it were
already in their K relabeling, so the per-call permute launch is left out (dev/LOG.md section 38).

The JSON goes where ``--json`` says: records are kept in dev/runs/ (the one the README quotes is
results/rollout_step_breakdown_h200.json).

For each context length C the script profiles two calls with torch.profiler (CUPTI records the
kernels a replayed graph runs): prompt C with 1 new token (prefill only) and prompt C with
1 + STEPS new tokens. The difference of the two is STEPS decode steps near context C. Busy time is
the union of kernel intervals; idle is the span of the decode kernels minus busy. The wall time
per step comes from the same calls without the profiler (CUDA events around generate).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import tempfile
import time

import torch

from qerl_lib.bench.rollout import load_bench_model, random_lora, random_prompts
from qerl_lib.bench.table import format_table
from qerl_lib.engine.rollout import RolloutEngine
from qerl_lib.io import provenance

CATEGORIES = (  # first match wins
    ("norm + lora shrink", ("_norm_shrink_kernel",)),  # engine/glue.py's norm_shrink (QERL_LORA_SHRINK_IN_NORM=1)
    ("lora (shrink, expand)", ("_shrink_kernel", "_expand_kernel")),
    ("fp4 gemm (mma)", ("qerl_fp4",)),
    ("fp4 gemm (gluon)", ("_fp4_wgmma",)),  # fp4_wgmma's and the producer kernel's
    ("fp4 permute x", ("_permute_x",)),
    ("fp4 split-K reduce", ("_splitk_reduce",)),
    ("fp4 gemm (triton)", ("_fp4_gemm",)),
    ("attention", ("_decode_attention", "_merge_splits")),
    ("rope + cache write", ("_rope_cache",)),
    ("rmsnorm (+residual)", ("triton_red_fused", "_rms_norm_kernel")),  # torch.compile's, engine/glue.py's
    ("silu * up", ("triton_poi_fused_mul_silu", "_silu_mul_kernel")),
    ("cublas gemm", ("nvjet", "gemm", "gemv", "cutlass", "sm90_xmma")),
    ("sampling", ("_sample_", "SoftMax", "distribution", "reduce_kernel", "scatter", "index", "argmax", "sort",
                  "cumsum")),
)


def category(name: str) -> str:
    for label, keys in CATEGORIES:
        if any(k in name for k in keys):
            return label
    return "other"


def kernels(fn) -> list[tuple[str, float, float]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    out = [(e["name"], float(e["ts"]), float(e["dur"])) for e in events
           if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")]
    return sorted(out, key=lambda r: r[1])


def summarize(ks: list[tuple[str, float, float]]) -> dict:
    per_cat = collections.Counter()
    counts = collections.Counter()
    busy, end_busy = 0.0, None
    for name, ts, dur in ks:
        c = category(name)
        per_cat[c] += dur
        counts[c] += 1
        if end_busy is None or ts >= end_busy:
            busy += dur
            end_busy = ts + dur
        elif ts + dur > end_busy:
            busy += ts + dur - end_busy
            end_busy = ts + dur
    span = (ks[-1][1] + ks[-1][2] - ks[0][1]) if ks else 0.0
    return {"per_cat_us": dict(per_cat), "counts": dict(counts), "busy_us": busy, "span_us": span, "n": len(ks)}


def wall_ms(engine, prompts, new_tokens, lora=None) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(prompts, new_tokens, temperature=1.0, seed=0, stop_token_ids=[], lora=lora)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def profile_case(model, name: str, weights: str, batch: int, ctx: int, steps: int, lora, rank: int) -> dict:
    engine = RolloutEngine(model, max_seq_len=ctx + steps + 8)
    prompts = random_prompts(batch, ctx, model.config.vocab_size, 0)
    engine.warmup(batch, ctx, steps + 1, lora=lora)
    walls = [(wall_ms(engine, prompts, 1, lora), wall_ms(engine, prompts, steps + 1, lora)) for _ in range(3)]
    ms_step = min(b - a for a, b in walls) / steps
    pre = summarize(kernels(lambda: engine.generate(prompts, 1, stop_token_ids=[], lora=lora)))
    full_k = kernels(lambda: engine.generate(prompts, steps + 1, stop_token_ids=[], lora=lora))
    # decode region: the kernels after the prefill's (same count, same order)
    dec = summarize(full_k[pre["n"]:])
    per_step = {c: round(v / steps, 2) for c, v in sorted(dec["per_cat_us"].items(), key=lambda kv: -kv[1])}
    row = {"model": name, "weights": weights, "batch": batch, "lora_rank": rank, "context": ctx, "steps": steps,
           "wall_ms_per_step": round(ms_step, 4), "busy_us_per_step": round(dec["busy_us"] / steps, 2),
           "span_us_per_step": round(dec["span_us"] / steps, 2),
           "idle_us_per_step": round((dec["span_us"] - dec["busy_us"]) / steps, 2),
           "kernels_per_step": round(dec["n"] / steps, 2), "us_per_step": per_step,
           "counts_per_step": {c: round(v / steps, 2) for c, v in dec["counts"].items()},
           "top_other": collections.Counter(n for n, _, _ in full_k[pre["n"]:] if category(n) == "other").most_common(12)}
    print(json.dumps(row), flush=True)
    engine.release()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="qwen2.5-7b")
    p.add_argument("--weights", default="nvfp4")
    p.add_argument("--batch", default="8", help="comma list of batch sizes")
    p.add_argument("--lora-rank", type=int, default=0, help="random adapters of this rank on every projection (0: none)")
    p.add_argument("--contexts", default="256,1280,2240")
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--json", required=True)
    p.add_argument("--skip-permute", action="store_true", help="probe: leave out the Gluon kernels' permute of x")
    args = p.parse_args()
    if args.skip_permute:
        from qerl_lib.kernels import fp4_wgmma, fp4_wgmma_producer
        fp4_wgmma.permute_x = fp4_wgmma_producer.permute_x = lambda x2: x2
    device = torch.device("cuda")
    doc = {"provenance": provenance(), "config": vars(args), "rows": []}
    for name in args.models.split(","):
        for weights in args.weights.split(","):
            model = load_bench_model(name, weights, device)
            lora = random_lora(model, args.lora_rank) if args.lora_rank else None
            for batch in map(int, args.batch.split(",")):
                for ctx in map(int, args.contexts.split(",")):
                    doc["rows"].append(profile_case(model, name, weights, batch, ctx, args.steps, lora, args.lora_rank))
                    with open(args.json + ".tmp", "w") as f:
                        json.dump(doc, f, indent=1)
                    os.replace(args.json + ".tmp", args.json)
            del model, lora
            torch.cuda.empty_cache()
    table = [{**r, "top categories (us/step)": ", ".join(f"{c} {v:.0f}" for c, v in list(r["us_per_step"].items())[:6])}
             for r in doc["rows"]]
    print(format_table(table, (("model", "", 11), ("weights", "", 7), ("batch", "", 5), ("lora_rank", "", 9),
                               ("context", "", 7), ("wall_ms_per_step", ".3f", 16),
                               ("busy_us_per_step", ".0f", 16), ("idle_us_per_step", ".0f", 16),
                               ("kernels_per_step", ".0f", 16), ("top categories (us/step)", "", 0))))


if __name__ == "__main__":
    main()

"""What a rollout after ``engine.release()`` pays again: the trainer's call, timed with and without a release.

`qerl train` releases the engine's KV cache and decode graphs after every rollout (``release_engine_cache``), so
each step's rollout allocates the cache and captures a graph per length bucket again; `qerl bench rollout` warms
up first and never pays that. This script makes the trainer's call (random prompts, one seed per row, per-row
budgets, ``max_batch``, LoRA adapters) on a random-weight model several times, a release before some calls, and
splits each call's seconds: adapters' load, prefill, decode, and inside the decode the graph captures (timed by
wrapping ``DecodeGraphs._capture`` with synchronizations).

    python dev/sweeps/rollout_recapture.py --model qwen2.5-7b --weights nvfp4 --rank 32 --batch 8 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from qerl_lib.bench.rollout import load_bench_model, random_lora, random_prompts
from qerl_lib.engine import cache as engine_cache
from qerl_lib.engine.rollout import RolloutEngine
from qerl_lib.io import provenance, write_json_atomic

CAPTURES: list[float] = []


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed_capture(original):
    def capture(self, batch, kv_len):
        sync()
        t0 = time.perf_counter()
        out = original(self, batch, kv_len)
        sync()
        CAPTURES.append(time.perf_counter() - t0)
        return out
    return capture


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--weights", default="nvfp4")
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-len", type=int, default=2048)
    p.add_argument("--plan", default="cold,warm,release,warm,release,warm,release",
                   help="comma-separated calls: cold (the first), warm (no release before), release (release first)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    engine_cache.DecodeGraphs._capture = _timed_capture(engine_cache.DecodeGraphs._capture)
    device = torch.device(args.device)
    model = load_bench_model(args.model, args.weights, device)
    lora = random_lora(model, args.rank) if args.rank else None
    engine = RolloutEngine(model, max_seq_len=args.prompt_len + args.gen_len, keep_alive=False)
    prompts = random_prompts(args.batch, args.prompt_len, model.config.vocab_size, 0)
    rows = []
    for i, kind in enumerate(args.plan.split(",")):
        release_s = 0.0
        if kind == "release":
            sync()
            t0 = time.perf_counter()
            engine.release()
            sync()
            release_s = time.perf_counter() - t0
        CAPTURES.clear()
        sync()
        t0 = time.perf_counter()
        out = engine.generate(prompts, [args.gen_len] * args.batch, temperature=1.0, row_seeds=list(range(i, i + args.batch)),
                              stop_token_ids=[], lora=lora, timing=True, max_batch=args.batch)
        sync()
        total = time.perf_counter() - t0
        t = engine.last_timing
        tokens = sum(len(c.token_ids) for c in out)
        capture = sum(CAPTURES)
        rows.append({"call": i, "kind": kind, "total_s": total, "release_s": release_s, "load_s": t.load_s,
                     "prefill_s": t.prefill_s, "decode_s": t.decode_s, "captures": len(CAPTURES), "capture_s": capture,
                     "decode_less_capture_s": t.decode_s - capture, "rest_s": total - t.load_s - t.prefill_s - t.decode_s,
                     "tokens": tokens, "ms_per_step": 1e3 * (t.decode_s - capture) / max(t.steps, 1)})
        r = rows[-1]
        print(f"call {i} {kind:8s} total {total:7.3f} s  load {t.load_s:.3f}  prefill {t.prefill_s:.3f}  decode "
              f"{t.decode_s:.3f} (captures {len(CAPTURES)}: {capture:.3f} s)  rest {r['rest_s']:.3f}  "
              f"release {release_s:.3f}  {r['ms_per_step']:.3f} ms/step", flush=True)
    summary = {}
    for kind in ("warm", "release"):
        sel = [r for r in rows if r["kind"] == kind]
        if sel:
            summary[kind] = {k: statistics.median(r[k] for r in sel)
                             for k in ("total_s", "capture_s", "captures", "decode_less_capture_s", "load_s", "prefill_s")}
    if "warm" in summary and "release" in summary:
        summary["release_costs_s"] = summary["release"]["total_s"] - summary["warm"]["total_s"]
    print(json.dumps(summary, indent=1))
    if args.json:
        write_json_atomic(args.json, {"args": vars(args), "rows": rows, "summary": summary, "provenance": provenance()})


if __name__ == "__main__":
    main()

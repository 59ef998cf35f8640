"""Where a refill's prefill goes: one prefill of ROWS prompts of LEN tokens (what continuous batching runs when it
refills ROWS rows), at Qwen2.5 shapes with random weights, per weights and LoRA rank: wall ms (CUDA-synchronized, best
of five), and one profiled call's kernel time by category, its busy time and span (span - busy: the GPU idle,
waiting for the host), and the ten costliest kernels; ``--ops N`` also the N torch operators with the most GPU time
(with their input shapes) and with the most host time.

    python3 dev/sweeps/refill_prefill_profile.py --model qwen2.5-7b --weights nvfp4,bf16 --lora-rank 0,16 \
        --rows 8 --prompt-len 256 --json dev/runs/NAME/refill_prefill.json

dev/LOG.md section 125: at 64 rows a continuous call's refills (8 rows x up to 256 tokens) took 78 ms each on an
H200, 16% of the call.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from rollout_step_breakdown import category, kernels, summarize  # noqa: E402

from qerl_lib.bench.rollout import load_bench_model, random_lora, random_prompts  # noqa: E402
from qerl_lib.engine.rollout import RolloutEngine  # noqa: E402
from qerl_lib.io import provenance  # noqa: E402


def case(model, weights: str, rank: int, rows: int, plen: int, ops: int = 0, prefill_ops: str = "default") -> dict:
    lora = random_lora(model, rank) if rank else None
    engine = RolloutEngine(model, max_seq_len=plen + 64)
    prompts = random_prompts(rows, plen, model.config.vocab_size, 0)
    call = lambda: engine.generate(prompts, 1, temperature=1.0, seed=0, stop_token_ids=[], lora=lora)  # noqa: E731
    call()
    if prefill_ops != "default":  # "plain" / "glue": the A/B of QERL_PREFILL_GLUE in one process
        forward = engine._forward
        forward.prefill_ops = forward.eager_ops if prefill_ops == "plain" else forward.prefill_glue_ops
        call()
    walls = []
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        call()
        sync()
        walls.append((time.perf_counter() - t0) * 1e3)
    ks = kernels(call) if torch.cuda.is_available() else []  # (a CPU dry run profiles nothing)
    s = summarize(ks)
    per_kernel = collections.Counter()
    for name, _, dur in ks:
        per_kernel[name[:90]] += dur
    row = {"weights": weights, "rank": rank, "prefill_ops": prefill_ops, "rows": rows, "prompt_len": plen, "wall_ms": round(min(walls), 2),
           "walls_ms": [round(w, 2) for w in walls], "busy_ms": round(s["busy_us"] / 1e3, 2),
           "span_ms": round(s["span_us"] / 1e3, 2), "kernels": s["n"],
           "ms_by_category": {c: round(v / 1e3, 2) for c, v in sorted(s["per_cat_us"].items(), key=lambda kv: -kv[1])},
           "top_kernels_ms": [(n, round(v / 1e3, 2)) for n, v in per_kernel.most_common(10)]}
    if ops:  # the torch operators behind the kernels, by self CUDA time and shapes (a CPU dry run: host only)
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []),
                     record_shapes=True) as prof:
            call()
            sync()
        table = prof.key_averages(group_by_input_shape=True)
        top = sorted(table, key=lambda e: -e.self_device_time_total)[:ops]
        row["top_ops"] = [(e.key, str(e.input_shapes)[:160], e.count, round(e.self_device_time_total / 1e3, 2))
                          for e in top]
        host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:ops]  # where the host's time goes
        row["top_host_ops"] = [(e.key, e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in host]
    print(json.dumps(row), flush=True)
    engine.release()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--weights", default="nvfp4,bf16")
    p.add_argument("--lora-rank", default="0,16")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--json", required=True)
    p.add_argument("--prefill-ops", default="default", help="comma list of default / plain / glue (QERL_PREFILL_GLUE)")
    p.add_argument("--rounds", type=int, default=1, help="repeat the whole list this many times (alternating A/B)")
    p.add_argument("--ops", type=int, default=0, help="also list the N torch operators with the most CUDA time")
    p.add_argument("--device", default="cuda", help="cpu: a dry run of the script (no kernels to profile)")
    args = p.parse_args()
    device = torch.device(args.device)
    rows = []
    for weights in args.weights.split(","):
        model = load_bench_model(args.model, weights, device)
        for _ in range(args.rounds):
            for rank in (int(r) for r in args.lora_rank.split(",")):
                for prefill_ops in args.prefill_ops.split(","):
                    rows.append(case(model, weights, rank, args.rows, args.prompt_len, args.ops, prefill_ops))
        del model
        torch.cuda.empty_cache()
    out = {"provenance": provenance(), "config": vars(args), "rows": rows}
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

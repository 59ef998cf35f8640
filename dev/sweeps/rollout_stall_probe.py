"""Where a GRPO step's occasional 2-2.5 s rollout stall goes (dev/LOG.md section 118).

Runs one `qerl bench train` case in this process (`studies.train_bench.run_case_here`, the real trainer) with
counters around every engine call: its wall seconds, and inside it the decode-graph captures, Triton compilations
(JIT `_do_compile`, disk-cache hits included) and autotuner benchmarks, torch.compile's compilation time, and the
garbage collector's collections, each with count and seconds, and the same counters between one call and the next
(the trainer phase). Writes one JSON line per engine call, then the trainer's own per-step metrics beside them.

    python dev/sweeps/rollout_stall_probe.py --model qwen2.5-7b --mode qerl --batch 4 --steps 6 --json out.json
    (--workload gsm8k-like: each row stops at its own drawn length, as `qerl bench train --workload`)
"""
from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from qerl_lib.engine import cache as engine_cache
from qerl_lib.engine.rollout import RolloutEngine
from qerl_lib.io import provenance, read_jsonl, write_json_atomic
from qerl_lib.studies.train_bench import TrainCase, run_case_here

COUNTS: dict[str, float] = defaultdict(float)
NAMES: list[str] = []


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(kind: str, original, synchronize: bool = False, name=None):
    def wrapper(*args, **kwargs):
        if synchronize:
            sync()
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            if synchronize:
                sync()
            COUNTS[f"{kind}_n"] += 1
            COUNTS[f"{kind}_s"] += time.perf_counter() - t0
            if name is not None:
                NAMES.append(f"{kind}:{name(*args)}")
    return wrapper


def install() -> None:
    engine_cache.DecodeGraphs._capture = timed("capture", engine_cache.DecodeGraphs._capture, synchronize=True)
    try:
        from triton.runtime import autotuner, jit
        if hasattr(jit.JITFunction, "_do_compile"):
            jit.JITFunction._do_compile = timed("triton_compile", jit.JITFunction._do_compile,
                                                name=lambda self, *a: self.fn.__qualname__)
        if hasattr(autotuner.Autotuner, "_bench"):
            autotuner.Autotuner._bench = timed("autotune_bench", autotuner.Autotuner._bench)
    except ImportError:
        pass
    gc_start: list[float] = []

    def on_gc(phase, info):
        if phase == "start":
            gc_start[:] = [time.perf_counter()]
        elif gc_start:
            COUNTS[f"gc{info['generation']}_n"] += 1
            COUNTS[f"gc{info['generation']}_s"] += time.perf_counter() - gc_start[0]
    gc.callbacks.append(on_gc)


def dynamo_seconds() -> float:
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return 0.0
    return float(sum(sum(v) for v in compilation_time_metrics.values()))


CALLS: list[dict] = []
# the counters when the last engine call ended: what they gained until the next call is the trainer phase's
LAST_END: dict = {"counts": {}, "names": 0}


def since(counts: dict, names: int) -> dict:
    """The counters' gains since ``counts`` / ``names``, with the kernels compiled."""
    gains = {k: v - counts.get(k, 0.0) for k, v in COUNTS.items() if v != counts.get(k, 0.0)}
    return {**gains, "names": NAMES[names:][:40]}


def wrap_generate() -> None:
    original = RolloutEngine.generate

    def generate(self, *args, **kwargs):
        between = since(LAST_END["counts"], LAST_END["names"]) if CALLS else None
        before, names, dyn = dict(COUNTS), len(NAMES), dynamo_seconds()
        sync()
        t0 = time.perf_counter()
        out = original(self, *args, **kwargs)
        sync()
        record = {"call": len(CALLS), "seconds": time.perf_counter() - t0,
                  "dynamo_compile_s": dynamo_seconds() - dyn, **since(before, names),
                  "before_call": between}  # the previous step's trainer phase (None before the first call)
        LAST_END.update(counts=dict(COUNTS), names=len(NAMES))
        CALLS.append(record)
        print(json.dumps(record), flush=True)
        return out
    RolloutEngine.generate = generate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--mode", default="qerl")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-len", type=int, default=2048)
    p.add_argument("--device", default="cuda")
    p.add_argument("--workload", default="fixed", help="fixed or gsm8k-like (studies.train_bench.TrainCase)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward (default: all)")
    p.add_argument("--groups", type=int, default=1, help="prompts per step (the batch splits into that many groups)")
    p.add_argument("--rollout-batch", type=int, default=None,
                   help="rows the engine decodes at once (below --batch: continuous batching refills the rest)")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    install()
    wrap_generate()
    case = TrainCase(model=args.model, mode=args.mode, batch=args.batch, steps=args.steps, prompt_len=args.prompt_len,
                     gen_len=args.gen_len, device=args.device, workload=args.workload,
                     rollout_batch=args.rollout_batch, groups=args.groups,
                     micro_batch=args.micro_batch)
    run_dir = Path(tempfile.mkdtemp(prefix="stall-probe-"))
    try:
        row = run_case_here(case, run_dir)
        steps = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("step_seconds") is not None]
        CALLS.append({"call": "after the last", **since(LAST_END["counts"], LAST_END["names"])})
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    write_json_atomic(Path(args.json), {"case": vars(args), "calls": CALLS, "steps": steps, "row": row,
                                        "provenance": provenance(command="python dev/sweeps/rollout_stall_probe.py")})


if __name__ == "__main__":
    main()

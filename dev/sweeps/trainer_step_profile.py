"""One real trainer step's trainer phase by operator: where `train_s` goes besides the decoder (#18; dev/LOG.md 81).

    python3 dev/sweeps/trainer_step_profile.py --model qwen2.5-7b --mode qerl --batch 8 --json dev/runs/NAME.json

Runs the real trainer for ``--steps`` steps in this process, with `qerl bench train`'s settings
(`studies.train_bench.case_config`: random weights of the architecture, random-token prompts, a synthetic reward,
r32, gradient checkpointing), and profiles the trainer phase of step ``--profile-step``: from TRL's first
`compute_loss` call of that step (the rollout is over) to the end of its optimizer step. Prints and writes the kernel
time by category and the top operators, also grouped by input shape (`trainer_phase_profile.summarize`): the
decoder's share is what `trainer_phase_profile.py` measures alone, the rest (lm_head, TRL's log-probabilities and
loss, the optimizer) is what this adds. ``--model`` also takes a config.json path (a CPU smoke run: ``--device cpu``).
Every step's trainer phase, padded length and allocator retry count are recorded; ``--trace`` keeps the profiled
step's Chrome trace (for ``idle_gaps.py``), ``--workload gsm8k-like`` stops each rollout row at a drawn length,
``--pad-to-multiple-of`` classes the trainer's lengths, and ``--time-attention`` times every attention forward of
every step (the slowest flags a plan build, profiled step or not; dev/LOG.md 82-86). Each step's ``train_seconds``
is also taken apart: the rest of TRL's generate-and-score call, the engine's release within it, the trainer phase and
what is left (``split_by_step``; dev/LOG.md 97).
"""
from __future__ import annotations

import argparse
import gzip
import os
import shutil
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trainer_phase_profile import summarize  # noqa: E402

from qerl_lib.bench.workloads import WORKLOADS  # noqa: E402
from qerl_lib.io import provenance, write_json_atomic  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--mode", default="qerl", help="lora, qlora, nvfp4 or qerl")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-len", type=int, default=2048)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--profile-step", type=int, default=2, help="1-based; the first step warms up")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--device", default="cuda")
    p.add_argument("--workload", choices=WORKLOADS, default="fixed", help="gsm8k-like: rows stop at drawn lengths")
    p.add_argument("--pad-to-multiple-of", type=int, default=None,
                   help="the trainer's padded lengths in classes; 0: to each batch's longest (default: the preset's)")
    p.add_argument("--time-attention", action="store_true",
                   help="time every attention forward of the trainer phase (a sync around each): the slowest call of "
                        "each step flags a plan build at any step, profiled or not")
    p.add_argument("--json", required=True)
    p.add_argument("--trace", help="also write the profiled step's Chrome trace here (gzip; for idle_gaps.py)")
    args = p.parse_args()
    if not 1 <= args.profile_step <= args.steps:
        raise SystemExit(f"--profile-step {args.profile_step} is not one of the {args.steps} steps")

    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    from qerl_lib.engine.rollout import RolloutEngine
    from qerl_lib.io import read_jsonl
    from qerl_lib.studies.train_bench import TrainCase, case_config, completion_budgets, padding_of, synthetic_reward
    from qerl_lib.train import trainer as trainer_module
    from qerl_lib.train.grpo import train

    case = TrainCase(model=args.model, mode=args.mode, batch=args.batch, prompt_len=args.prompt_len,
                     gen_len=args.gen_len, steps=args.steps, lora_rank=args.rank, device=args.device,
                     workload=args.workload, pad_to_multiple_of=args.pad_to_multiple_of)
    cuda = args.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    state = {"prof": None, "wall_s": None, "step_start": None, "phase_s": [], "lengths": [], "alloc_retries": [],
             "attention_max_s": [], "attention_sum_s": [], "generate_and_score_s": [], "release_s": []}
    cls = trainer_module.trainer_class()
    original = cls.compute_loss
    original_generate = cls._generate_and_score_completions
    original_release, original_engine_generate = RolloutEngine.release, RolloutEngine.generate
    in_generate = [False]  # the engine's own release() inside generate (a rebuilt forward pass) is rollout time

    def engine_generate(self, *a, **kw):
        in_generate[0] = True
        try:
            return original_engine_generate(self, *a, **kw)
        finally:
            in_generate[0] = False

    def timed(fn, sink: list, when=lambda: True):  # each call's wall time (while ``when()``), synchronized at both ends
        def wrapper(*a, **kw):
            if not when():
                return fn(*a, **kw)
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(*a, **kw)
            if cuda:
                torch.cuda.synchronize()
            sink.append(time.perf_counter() - start)
            return out
        return wrapper

    def compute_loss(self, *a, **kw):  # each step's first call starts its clock; the profiled step's, the profiler
        if state["step_start"] is None:
            if cuda:
                torch.cuda.synchronize()
            if self.state.global_step == args.profile_step - 1 and state["prof"] is None:
                state["prof"] = profile(activities=activities, record_shapes=True)
                state["prof"].start()
            state["step_start"] = time.perf_counter()
            inputs = kw.get("inputs", a[1] if len(a) > 1 else {})
            if "prompt_ids" in inputs and "completion_ids" in inputs:  # the padded length: new ones cost plans
                state["lengths"].append(inputs["prompt_ids"].shape[1] + inputs["completion_ids"].shape[1])
        return original(self, *a, **kw)

    class StopAtStepEnd(TrainerCallback):
        def on_step_end(self, targs, tstate, control, **kwargs):
            if state["step_start"] is None:
                return
            if cuda:
                torch.cuda.synchronize()
            phase_s = time.perf_counter() - state["step_start"]
            state["phase_s"].append(phase_s)
            if args.time_attention:
                state["attention_max_s"].append(max(attention_s, default=0.0))
                state["attention_sum_s"].append(sum(attention_s))
                attention_s.clear()
            if cuda:  # the caching allocator's retries (a cudaFree of its cache, then cudaMalloc again) so far
                state["alloc_retries"].append(torch.cuda.memory_stats().get("num_alloc_retries", 0))
            state["step_start"] = None
            if state["prof"] is not None and state["wall_s"] is None:
                state["wall_s"] = phase_s
                state["prof"].stop()

    cls.compute_loss = compute_loss
    cls._generate_and_score_completions = timed(original_generate, state["generate_and_score_s"])
    RolloutEngine.generate = engine_generate
    RolloutEngine.release = timed(original_release, state["release_s"], when=lambda: not in_generate[0])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    attention_s: list[float] = []  # this step's attention forwards (trainer phase only)
    if args.time_attention:  # transformers calls torch.nn.functional.scaled_dot_product_attention by name
        torch.nn.functional.scaled_dot_product_attention = timed(sdpa, attention_s,
                                                                 when=lambda: state["step_start"] is not None)
    try:
        with tempfile.TemporaryDirectory(prefix="trainer-step-profile-") as out:
            train(case_config(case), out, extra_rewards=[("synthetic", synthetic_reward, 1.0)],
                  callbacks=[StopAtStepEnd()], quiet=True, completion_budgets=completion_budgets(case))
            logged = [r for r in read_jsonl(os.path.join(out, "metrics.jsonl")) if r.get("step_seconds") is not None]
    finally:
        cls.compute_loss = original
        cls._generate_and_score_completions = original_generate
        RolloutEngine.release, RolloutEngine.generate = original_release, original_engine_generate
        torch.nn.functional.scaled_dot_product_attention = sdpa
    if state["wall_s"] is None:
        raise SystemExit("the profiled step did not finish")
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        totals, ops, by_shape = summarize(state["prof"], args.top, trace_path=raw)
        if args.trace:
            with open(raw, "rb") as f, gzip.open(args.trace + ".tmp", "wb") as g:
                shutil.copyfileobj(f, g)
            os.replace(args.trace + ".tmp", args.trace)
    record = {"provenance": provenance(), "device": torch.cuda.get_device_name() if cuda else "cpu",
              "settings": vars(args), "padding": padding_of(case), "trainer_phase_wall_s": state["wall_s"],
              "phase_s_by_step": state["phase_s"], "padded_length_by_step": state["lengths"],
              "alloc_retries_by_step": state["alloc_retries"],
              "attention_forward_max_s_by_step": state["attention_max_s"],
              "attention_forward_sum_s_by_step": state["attention_sum_s"], "kernel_s": totals, "top_ops": ops,
              "top_ops_by_shape": by_shape, "split_by_step": split_by_step(state, logged),
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    write_json_atomic(args.json, record)
    print(f"{args.model} {args.mode}, batch {args.batch}, {args.prompt_len} + {args.gen_len} tokens, r{args.rank}: "
          f"step {args.profile_step}'s trainer phase {state['wall_s']:.3f} s (profiled)")
    print("  trainer phase by step (s): " + ", ".join(f"{t:.3f}" for t in state["phase_s"])
          + "; padded lengths: " + ", ".join(map(str, state["lengths"]))
          + ("; allocator retries so far: " + ", ".join(map(str, state["alloc_retries"])) if cuda else ""))
    print(f"  {'step':>4}{'step s':>9}{'rollout':>9}{'train':>9}{'score etc':>11}{'release':>9}{'phase':>9}"
          f"{'rest':>9}   (score etc: TRL's generate-and-score call less the engine's generate and release)")
    for i, row in enumerate(record["split_by_step"], 1):
        print(f"  {i:>4}" + "".join(f"{row[k]:>{w}.3f}" if row[k] is not None else f"{'-':>{w}}" for k, w in
                                     (("step_s", 9), ("rollout_s", 9), ("train_s", 9), ("score_etc_s", 11),
                                      ("release_s", 9), ("phase_s", 9), ("rest_s", 9))))
    if args.time_attention:
        print("  slowest attention forward by step (ms): "
              + ", ".join(f"{t * 1e3:.1f}" for t in state["attention_max_s"]))
    for c, v in sorted(totals.items()):
        print(f"  {c:<24}{v:>10.4f} s")
    print("top operators by own device time:" if cuda else "top operators (CPU run: no device time)")
    for o in ops:
        print(f"  {o['op'][:60]:<60}{o['calls']:>8}{o['device_s']:>10.4f} s")
    print("top (operator, input shapes):")
    for o in by_shape:
        print(f"  {o['op'][:28]:<28}{o['shapes'][:70]:<72}{o['calls']:>6}{o['device_s']:>9.4f} s")


def split_by_step(state: dict, logged: list[dict]) -> list[dict]:
    """Each step's ``train_seconds`` (the step less the engine's generate) taken apart: the rest of TRL's
    generate-and-score call (rewards, AQN's noise draw, the engine's release, TRL's tensors), the engine's release
    within it, the trainer phase (first ``compute_loss`` to the step's end: forward, backward, optimizer) and what
    is left (data loading, callbacks, logging)."""
    rows = []
    for i, logged_row in enumerate(logged):
        pick = lambda key: state[key][i] if i < len(state[key]) else None  # noqa: E731
        step_s, rollout_s, train_s = (logged_row.get(k) for k in ("step_seconds", "rollout_seconds", "train_seconds"))
        generate, release, phase = pick("generate_and_score_s"), pick("release_s"), pick("phase_s")
        score = generate - (rollout_s or 0.0) - (release or 0.0) if generate is not None else None
        rest = step_s - generate - phase if None not in (step_s, generate, phase) else None
        rows.append({"step_s": step_s, "rollout_s": rollout_s, "train_s": train_s, "score_etc_s": score,
                     "release_s": release, "phase_s": phase, "rest_s": rest})
    return rows


if __name__ == "__main__":
    main()

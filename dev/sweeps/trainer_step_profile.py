"""One real trainer step's trainer phase by operator: where `train_s` goes besides the decoder (#18; dev/LOG.md 81).

    python3 dev/sweeps/trainer_step_profile.py --model qwen2.5-7b --mode qerl --batch 8 --json dev/runs/NAME.json

Runs the real trainer for ``--steps`` steps in this process, with `qerl bench train`'s settings
(`studies.train_bench.case_config`: random weights of the architecture, random-token prompts, a synthetic reward,
r32, gradient checkpointing), and profiles the trainer phase of step ``--profile-step``: from TRL's first
`compute_loss` call of that step (the rollout is over) to the end of its optimizer step. Prints and writes the kernel
time by category and the top operators, also grouped by input shape (`trainer_phase_profile.summarize`): the
decoder's share is what `trainer_phase_profile.py` measures alone, the rest (lm_head, TRL's log-probabilities and
loss, the optimizer) is what this adds. ``--model`` also takes a config.json path (a CPU smoke run: ``--device cpu``).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trainer_phase_profile import summarize  # noqa: E402

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
    p.add_argument("--json", required=True)
    args = p.parse_args()
    if not 1 <= args.profile_step <= args.steps:
        raise SystemExit(f"--profile-step {args.profile_step} is not one of the {args.steps} steps")

    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    from qerl_lib.studies.train_bench import TrainCase, case_config, synthetic_reward
    from qerl_lib.train import trainer as trainer_module
    from qerl_lib.train.grpo import train

    case = TrainCase(model=args.model, mode=args.mode, batch=args.batch, prompt_len=args.prompt_len,
                     gen_len=args.gen_len, steps=args.steps, lora_rank=args.rank, device=args.device)
    cuda = args.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    state = {"prof": None, "start": None, "wall_s": None}
    cls = trainer_module.trainer_class()
    original = cls.compute_loss

    def compute_loss(self, *a, **kw):  # the first call of the profiled step starts the profiler
        if self.state.global_step == args.profile_step - 1 and state["prof"] is None:
            if cuda:
                torch.cuda.synchronize()
            state["prof"] = profile(activities=activities, record_shapes=True)
            state["prof"].start()
            state["start"] = time.perf_counter()
        return original(self, *a, **kw)

    class StopAtStepEnd(TrainerCallback):
        def on_step_end(self, targs, tstate, control, **kwargs):
            if state["prof"] is not None and state["wall_s"] is None:
                if cuda:
                    torch.cuda.synchronize()
                state["wall_s"] = time.perf_counter() - state["start"]
                state["prof"].stop()

    cls.compute_loss = compute_loss
    try:
        with tempfile.TemporaryDirectory(prefix="trainer-step-profile-") as out:
            train(case_config(case), out, extra_rewards=[("synthetic", synthetic_reward, 1.0)],
                  callbacks=[StopAtStepEnd()], quiet=True)
    finally:
        cls.compute_loss = original
    if state["wall_s"] is None:
        raise SystemExit("the profiled step did not finish")
    totals, ops, by_shape = summarize(state["prof"], args.top)
    record = {"provenance": provenance(), "device": torch.cuda.get_device_name() if cuda else "cpu",
              "settings": vars(args), "trainer_phase_wall_s": state["wall_s"], "kernel_s": totals, "top_ops": ops,
              "top_ops_by_shape": by_shape,
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}
    write_json_atomic(args.json, record)
    print(f"{args.model} {args.mode}, batch {args.batch}, {args.prompt_len} + {args.gen_len} tokens, r{args.rank}: "
          f"step {args.profile_step}'s trainer phase {state['wall_s']:.3f} s (profiled)")
    for c, v in sorted(totals.items()):
        print(f"  {c:<24}{v:>10.4f} s")
    print("top operators by own device time:" if cuda else "top operators (CPU run: no device time)")
    for o in ops:
        print(f"  {o['op'][:60]:<60}{o['calls']:>8}{o['device_s']:>10.4f} s")
    print("top (operator, input shapes):")
    for o in by_shape:
        print(f"  {o['op'][:28]:<28}{o['shapes'][:70]:<72}{o['calls']:>6}{o['device_s']:>9.4f} s")


if __name__ == "__main__":
    main()

"""What padding the trainer's lengths to multiples of 64 costs and saves at a preset's own lengths (#18; dev/LOG.md 94).

    python3 dev/sweeps/padding_cost.py --model qwen2.5-7b --steps 12 --json dev/runs/NAME.json

TRL pads a step's whole generation batch to one length (the prompts to the longest prompt, the completions to the
longest completion, each rounded up to ``pad_to_multiple_of`` when set) and then cuts micro-batches from it, so every
micro-batch of a step has that one length. At the GSM8K presets' settings (128 completions, at most 4096 tokens) the
longest of 128 is the step's length. Here, for ``--steps`` draws of 128 gsm8k-like completion lengths
(`bench.workloads.sample_lengths`, seeded as `qerl bench train` seeds its rollouts) with a ``--prompt-len`` prompt,
one micro-batch (``--micro`` rows with their own lengths as the attention mask, the step's longest as the width) runs
forward + backward as the trainer runs it (random weights of the architecture, NVFP4 or bf16, LoRA r``rank``, the
fused layers, non-reentrant checkpointing, bf16 autocast; the completion's log-probabilities as the loss), at the
unpadded width and at the width rounded up to ``--multiple``, alternating which goes first. Per width: the first call
(a width this process has not run: cuDNN builds its attention plans then, dev/LOG.md 88-90) and the median of
``--repeats`` more. A fixed-width table and JSON with provenance; the two sides of the trade (extra tokens on every
call, builds at new widths) are put together in dev/LOG.md, not here. ``--profile-widths`` then profiles one
warmed call at each width named (with ``--steps 0``, only that).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from trainer_phase_profile import build, summarize  # noqa: E402

from qerl_lib.bench.workloads import sample_lengths  # noqa: E402
from qerl_lib.io import provenance, write_json_atomic  # noqa: E402


def rounded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-7b", help="a data/configs name or a config.json path")
    p.add_argument("--weights", default="nvfp4", choices=("nvfp4", "bf16"))
    p.add_argument("--steps", type=int, default=12, help="seeded draws of a step's 128 lengths")
    p.add_argument("--completions", type=int, default=128, help="completions per step (the preset's 16 x 8)")
    p.add_argument("--gen-len", type=int, default=4096, help="the completion cap; the longest GSM8K solution maps here")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--micro", type=int, default=8, help="rows per forward/backward (the preset's micro-batch)")
    p.add_argument("--multiple", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--device", default="cuda")
    p.add_argument("--profile-widths", default="",
                   help="comma-separated widths: after the steps, one warmed call at each under torch.profiler, its "
                        "kernel time by category and the top operators by input shape (which kernel is off its fast "
                        "path at an unpadded width)")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    device = torch.device(args.device)
    policy = build(args.model, args.weights, args.rank, device)
    vocab = policy.base_model.model.config.vocab_size
    generator = torch.Generator(device).manual_seed(0)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def call(width: int, lengths: list[int]) -> float:
        """One micro-batch's forward + backward at ``width`` completion tokens, its rows ``lengths`` long."""
        ids = torch.randint(0, vocab, (args.micro, args.prompt_len + width), device=device, generator=generator)
        mask = torch.zeros_like(ids)
        for row, n in enumerate(lengths):
            mask[row, :args.prompt_len + n] = 1
        synchronize()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = policy(input_ids=ids, attention_mask=mask, logits_to_keep=width + 1).logits[:, :-1]
        targets = ids[:, args.prompt_len:]
        logp = logits.float().log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        keep = mask[:, args.prompt_len:].float()
        (-(logp * keep).sum() / keep.sum()).backward()
        policy.zero_grad(set_to_none=True)
        synchronize()
        return time.perf_counter() - start

    call(17, [17] * args.micro)  # warm-up at a width no step uses: autotuning, the allocator
    seen: set[int] = set()
    rows = []
    for step in range(args.steps):
        lengths = sample_lengths("gsm8k-like", args.completions, args.gen_len, seed=1000 * step)  # the bench's seeds
        micro_lengths = lengths[:args.micro]
        longest = max(lengths)
        widths = {"unpadded": longest, "padded": rounded(longest, args.multiple)}
        order = ("unpadded", "padded") if step % 2 == 0 else ("padded", "unpadded")
        row = {"step": step, "longest": longest}
        for arm in order:
            width = widths[arm]
            new = width not in seen
            seen.add(width)
            first = call(width, [min(n, width) for n in micro_lengths])
            repeats = [call(width, [min(n, width) for n in micro_lengths]) for _ in range(args.repeats)]
            row[arm] = {"width": width, "new_width": new, "first_s": first, "repeat_s": repeats,
                        "repeat_median_s": statistics.median(repeats)}
        rows.append(row)
        u, q = row["unpadded"], row["padded"]
        print(f"step {step:>3}  longest {longest:>5}  unpadded {u['width']:>5} first {u['first_s']:7.3f} s "
              f"repeat {u['repeat_median_s']:7.3f} s   padded {q['width']:>5} first {q['first_s']:7.3f} s "
              f"repeat {q['repeat_median_s']:7.3f} s{'' if q['new_width'] else ' (width seen)'}", flush=True)
    profiles = {}
    for width in [int(w) for w in args.profile_widths.split(",") if w]:
        lengths = [min(n, width) for n in sample_lengths("gsm8k-like", args.micro, args.gen_len, seed=0)]
        lengths[0] = width  # the longest row fills the width, as in a step
        for _ in range(2):
            call(width, lengths)
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
            seconds = call(width, lengths)
        kernels, _, by_shape = summarize(prof, args.top)
        profiles[str(width)] = {"s": seconds, "kernel_s": kernels, "top_ops_by_shape": by_shape}
    if profiles:
        labels = sorted({c for p in profiles.values() for c in p["kernel_s"]})
        print(f"{'kernel time, s':<24}" + "".join(f"{w:>12}" for w in profiles))
        for c in labels + ["total", "wall"]:
            vals = [sum(p["kernel_s"].values()) if c == "total" else p["s"] if c == "wall" else
                    p["kernel_s"].get(c, 0.0) for p in profiles.values()]
            print(f"{c:<24}" + "".join(f"{v:>12.4f}" for v in vals))
        for w, p in profiles.items():
            print(f"top (operator, input shapes) by own device time, width {w}:")
            for o in p["top_ops_by_shape"]:
                print(f"  {o['op'][:34]:<34}{o['shapes'][:70]:<72}{o['calls']:>6}{o['device_s']:>9.4f} s")
    record = {"provenance": provenance(), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "settings": vars(args), "rows": rows, "profiles": profiles,
              "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None}
    write_json_atomic(args.json, record)
    if not rows:
        return
    tokens = [(args.prompt_len + r["padded"]["width"]) / (args.prompt_len + r["unpadded"]["width"]) - 1 for r in rows]
    extra = [r["padded"]["repeat_median_s"] / r["unpadded"]["repeat_median_s"] - 1 for r in rows]
    print(f"{'steps':<8}{'extra tokens':>14}{'extra time (repeats)':>22}")
    print(f"{len(rows):<8}{statistics.mean(tokens):>14.2%}{statistics.mean(extra):>22.2%}")


if __name__ == "__main__":
    main()

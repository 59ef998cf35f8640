"""Where the trainer phase's time goes: NVFP4 base against bf16 base, and peft's LoRA forward against the kit's.

    python3 dev/sweeps/trainer_phase_profile.py --model qwen2.5-7b --rows 8 --seq 2304 --rank 32 \
        --blocks 3 --steps 4 --json dev/runs/NAME.json

Both bases are random weights of the architecture (NVFP4: random codes and block scales), LoRA r``rank`` on the
kit's default targets (`models.lora.attach_lora`, as the trainer), gradient checkpointing on as the Qwen presets,
the forward under bf16 autocast as TRL runs it (``--no-autocast`` leaves it out, as this script did before
dev/LOG.md section 78). One step here is the trainer's forward + backward on ``rows`` x ``seq`` tokens through the
decoder (the lm_head and the loss are left out: they are the same bf16 work in both modes); the optimizer is left
out for the same reason. Each base runs as built (``kit``: `models.lora_forward` and `train.fused_layers`), with the
fused LoRA forward alone (``fused``) and with neither (``peft``), or the ``--forwards`` named (``FORWARDS``).
Timing alternates blocks of ``steps`` steps between the arms (both models stay resident), so drift of the GPU's
clocks falls on all; ratios carry a 95% bootstrap CI over steps. One more step per arm runs under torch.profiler and
its kernel time is summed by category, and the ``--top`` operators are listed by their own device time, also grouped
by input shape (a shape names the tensor: a `mul` on [8, 2304, 18944] is the MLP's).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import statistics
import tempfile

import torch

from qerl_lib.io import provenance, write_json_atomic

CATEGORIES = (  # first match wins
    ("fp4 dequantize", ("_fp4_dequant",)),
    ("fp4 gemm (fused)", ("qerl_fp4", "_fp4_gemm", "fp4_wgmma", "_producer", "permute")),
    ("gemm (cuBLAS)", ("nvjet", "gemm", "gemv", "cutlass", "sm90_xmma", "Kernel2")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("elementwise / reduce", ("elementwise", "reduce", "vectorized", "unrolled", "triton_", "copy", "fill",
                              "_rms_norm", "_silu_mul")),  # the last two: train/fused_layers' kernels
)


def category(name: str) -> str:
    lowered = name.lower()
    for label, keys in CATEGORIES:
        if any(k.lower() in lowered for k in keys):
            return label
    return "other"


def build(model: str, weights: str, rank: int, device: torch.device):
    from qerl_lib.models.loader import build_random_model
    from qerl_lib.models.lora import attach_lora

    from qerl_lib.train.fused_layers import use_fused_layers

    base = build_random_model(model, dtype=torch.bfloat16, device=device, nvfp4=weights == "nvfp4",
                              init="random_codes", seed=0)
    use_fused_layers(base)  # as the trainer (train/grpo.load_policy); QERL_FUSED_LAYERS=0 at call time turns it off
    policy = attach_lora(base, rank=rank)
    policy.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.train()
    return policy


KIT = {"QERL_LORA_FUSED": "1", "QERL_LORA_EXPAND_KERNEL": "1", "QERL_FUSED_LAYERS": "1", "QERL_FUSED_ROTARY": "1",
       "QERL_FP4_RECOMPUTE_REUSE": "1"}
FORWARDS = {  # the environment switches each arm runs with
    "kit": KIT,  # as built
    "addmm": {**KIT, "QERL_LORA_EXPAND_KERNEL": "0"},  # cuBLAS's expand
    "norotary": {**KIT, "QERL_FUSED_ROTARY": "0"},  # transformers' rotary embedding (section 93)
    "noreuse": {**KIT, "QERL_FP4_RECOMPUTE_REUSE": "0"},  # three expansions of each NVFP4 weight a step (section 91)
    "fused": {**KIT, "QERL_LORA_EXPAND_KERNEL": "0", "QERL_FUSED_LAYERS": "0"},  # section 78 run 2
    "peft": {**KIT, "QERL_LORA_FUSED": "0", "QERL_LORA_EXPAND_KERNEL": "0", "QERL_FUSED_LAYERS": "0"},  # neither
}


def step_fn(policy, ids, forward: str, autocast: bool):
    decoder = policy.base_model.model.model

    def step():
        os.environ.update(FORWARDS[forward])
        context = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with context:
            hidden = decoder(input_ids=ids).last_hidden_state
        hidden.float().square().mean().backward()
        policy.zero_grad(set_to_none=True)
    return step


def timed(step, count: int) -> list[float]:
    times = []
    for _ in range(count):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def kernel_totals(step, top: int) -> tuple[dict[str, float], list[dict], list[dict]]:
    """Kernel seconds of one step by category, the ``top`` operators by their own device seconds, and the ``top``
    (operator, input shapes) pairs: a shape names the tensor, so a `mul` on [8, 2304, 18944] is the MLP's."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    return summarize(prof, top)


def summarize(prof, top: int, trace_path: str | None = None) -> tuple[dict[str, float], list[dict], list[dict]]:
    """`kernel_totals`' three tables from a finished ``torch.profiler.profile`` (its Chrome trace, which a profile
    exports once, is kept at ``trace_path`` if given)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = trace_path or os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    totals: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("cat") == "kernel":
            totals[category(e["name"])] += e["dur"] / 1e6

    def own_device_us(a) -> float:  # the attribute's name moved between torch releases
        return float(getattr(a, "self_device_time_total", None) or getattr(a, "self_cuda_time_total", 0.0))

    def rows(averages, shapes: bool) -> list[dict]:
        ranked = sorted(averages, key=own_device_us, reverse=True)[:top]
        return [{"op": a.key, "calls": a.count, "device_s": own_device_us(a) / 1e6,
                 **({"shapes": str(a.input_shapes)} if shapes else {})} for a in ranked]

    return (dict(totals), rows(prof.key_averages(), False),
            rows(prof.key_averages(group_by_input_shape=True), True))


def bootstrap_ratio(a: list[float], b: list[float], draws: int = 4000, seed: int = 0) -> tuple[float, float]:
    """95% CI of median(b) / median(a), resampling steps with replacement."""
    rng = random.Random(seed)
    ratios = sorted(statistics.median(rng.choices(b, k=len(b))) / statistics.median(rng.choices(a, k=len(a)))
                    for _ in range(draws))
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--seq", type=int, default=2304)
    p.add_argument("--rank", type=int, default=32)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--top", type=int, default=25, help="operators listed by their own device time")
    p.add_argument("--forwards", default="kit,fused,peft",
                   help="forwards to run: kit (as built), addmm (kit with cuBLAS's expand), norotary (kit with "
                        "transformers' rotary embedding), noreuse (kit expanding each NVFP4 weight three times), "
                        "fused (the fused LoRA forward alone, cuBLAS's expand), peft (neither)")
    p.add_argument("--bases", default="bf16,nvfp4", help="base weights to build: bf16, nvfp4")
    p.add_argument("--no-autocast", dest="autocast", action="store_false", help="run the forward outside autocast")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    forwards = args.forwards.split(",")
    if not set(forwards) <= set(FORWARDS):
        raise SystemExit(f"--forwards takes {', '.join(FORWARDS)}, got {args.forwards!r}")
    device = torch.device("cuda")
    bases = args.bases.split(",")
    if not bases or not set(bases) <= {"bf16", "nvfp4"}:
        raise SystemExit(f"--bases takes bf16 and/or nvfp4, got {args.bases!r}")
    models = {w: build(args.model, w, args.rank, device) for w in bases}
    vocab = models[bases[0]].base_model.model.config.vocab_size
    generator = torch.Generator(device).manual_seed(0)
    ids = torch.randint(0, vocab, (args.rows, args.seq), device=device, generator=generator)
    arms = [f"{w}/{f}" for w in models for f in forwards]
    steps = {arm: step_fn(models[arm.split("/")[0]], ids, arm.split("/")[1], args.autocast) for arm in arms}
    for arm in arms:  # warm-up: autotuning, allocator
        timed(steps[arm], 2)
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for block in range(args.blocks):
        for arm in arms[block % len(arms):] + arms[:block % len(arms)]:  # rotate the order each block
            times[arm] += timed(steps[arm], args.steps)
    profiled = {arm: kernel_totals(steps[arm], args.top) for arm in arms}
    kernels = {arm: k for arm, (k, _, _) in profiled.items()}
    med = {arm: statistics.median(t) for arm, t in times.items()}
    pairs = [(f"bf16/{f}", f"nvfp4/{f}") for f in forwards] if len(models) == 2 else []
    pairs += [(f"{w}/{b}", f"{w}/{a}") for w in models for a, b in zip(forwards, forwards[1:])]
    pairs += [(f"{w}/{b}", f"{w}/{forwards[0]}") for w in models for b in forwards[2:]]  # each against the first
    ratios = {f"{b} over {a}": {"ratio": med[b] / med[a], "ci95": list(bootstrap_ratio(times[a], times[b]))}
              for a, b in pairs}
    record = {
        "provenance": provenance(), "device": torch.cuda.get_device_name(),
        "settings": vars(args), "step_s": times, "median_s": med, "ratios": ratios,
        "kernel_s": kernels, "top_ops": {arm: ops for arm, (_, ops, _) in profiled.items()},
        "top_ops_by_shape": {arm: ops for arm, (_, _, ops) in profiled.items()},
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }
    write_json_atomic(args.json, record)
    print(f"{args.model}, {args.rows} x {args.seq} tokens, LoRA r{args.rank}, gradient checkpointing, fwd + bwd, "
          f"autocast {'on' if args.autocast else 'off'}")
    print("median step: " + ", ".join(f"{arm} {med[arm]:.3f} s" for arm in arms) + f" ({args.blocks * args.steps} steps each)")
    for name, r in ratios.items():
        print(f"  {name}: {r['ratio']:.3f} (95% CI {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f})")
    labels = sorted({c for k in kernels.values() for c in k})
    print(f"{'kernel time, s':<24}" + "".join(f"{arm:>14}" for arm in arms))
    for c in labels + ["total"]:
        vals = [sum(kernels[arm].values()) if c == "total" else kernels[arm].get(c, 0.0) for arm in arms]
        print(f"{c:<24}" + "".join(f"{v:>14.4f}" for v in vals))
    for arm, (_, ops, by_shape) in profiled.items():
        print(f"top operators by own device time, {arm}:")
        for o in ops:
            print(f"  {o['op'][:60]:<60}{o['calls']:>8}{o['device_s']:>10.4f} s")
        print(f"top (operator, input shapes) by own device time, {arm}:")
        for o in by_shape:
            print(f"  {o['op'][:28]:<28}{o['shapes'][:70]:<72}{o['calls']:>6}{o['device_s']:>9.4f} s")


if __name__ == "__main__":
    main()

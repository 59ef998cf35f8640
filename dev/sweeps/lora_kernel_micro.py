"""kernels/lora.py's two kernels alone, per projection group of Qwen2.5-7B (dev/LOG.md section 28).

In the engine the LoRA kernels cost 13-31% of a decode step (section 28's ablation), more than their bytes
explain, and which group or kernel pays is not visible there. This times ``apply_`` on synthetic tensors of each
group's shape, outside the engine: microseconds per call (a CUDA graph of CALLS calls, median of REPLAYS
replays), for the pair of kernels, the shrink alone and the expand alone (the other kernel not launched; the
expand then reads zeroed partials), at M = 8 / 32 / 64 rows and ranks 16 / 64, with PDL off (plain launches, the
kernels back to back). Then a few launch-shape variants of the pair (expand tile width, expand warps, K columns
per shrink slice). Writes lora_kernel_micro.json to $OUT.

Run on a GPU: python dev/sweeps/lora_kernel_micro.py   (environment: ROWS, RANKS; VARIANTS=0 skips the variants,
VARIANTS='{"name": {"CONSTANT": value, ...}, ...}' replaces them and times the pair per group; PARTS=0 skips the
first table; TAG names the JSON)
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lora_kernel_sweep import _NoLaunch, _ZeroedTorch  # noqa: E402  (the kernel stand-ins of section 28's ablation)
from qerl_lib.io import provenance  # noqa: E402
from qerl_lib.kernels import lora as lk  # noqa: E402

HIDDEN, INTER, KV = 3584, 18944, 512  # Qwen2.5-7B
GROUPS = {  # name -> (K, member widths)
    "qkv": (HIDDEN, (HIDDEN, KV, KV)),
    "o": (HIDDEN, (HIDDEN,)),
    "gate_up": (HIDDEN, (INTER, INTER)),
    "down": (INTER, (HIDDEN,)),
}
CALLS, REPLAYS = 20, 15
OUT = os.environ.get("OUT", ".")
TAG = os.environ.get("TAG", "")


def make_case(group: str, m: int, rank: int, gen: torch.Generator):
    k, widths = GROUPS[group]
    dev = torch.device("cuda")
    members, n0 = [], 0
    for j, w in enumerate(widths):
        members.append((n0, n0 + w, j * rank, rank, 2.0))
        n0 += w
    a_cat = (torch.randn(rank * len(widths), k, generator=gen, device=dev) / k ** 0.5).to(torch.bfloat16)
    plan = lk.build_plan(a_cat, n0, members, block_n=lk.BLOCK_N)  # the default argument was bound at import
    plan.b_cat[:, :rank].copy_((torch.randn(n0, rank, generator=gen, device=dev) * 0.01).to(torch.bfloat16))
    x = torch.randn(m, k, generator=gen, device=dev).to(torch.bfloat16)
    out = torch.randn(m, n0, generator=gen, device=dev).to(torch.bfloat16)
    return out, x, plan


def time_calls(fn, calls: int = CALLS, replays: int = REPLAYS) -> float:
    """Microseconds per call: a graph of ``calls`` calls, median over ``replays`` replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(1e3 * start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def measure(out, x, plan, skip: str | None) -> float:
    kernels = {"shrink": lk._shrink_kernel, "expand": lk._expand_kernel}
    if skip:
        setattr(lk, f"_{skip}_kernel", _NoLaunch())
    if skip == "shrink":
        lk.torch = _ZeroedTorch()
    try:
        return time_calls(lambda: lk.apply_(out, x, plan, use_pdl=False))
    finally:
        for name, fn in kernels.items():
            setattr(lk, f"_{name}_kernel", fn)
        lk.torch = torch


VARIANTS = {  # name -> module constants to set
    "expand tile 64": {"BLOCK_N": 64},
    "expand tile 256": {"BLOCK_N": 256},
    "expand 8 warps": {"EXPAND_WARPS": 8},
    "expand 2 warps": {"EXPAND_WARPS": 2},
    "1024 K per slice": {"K_PER_SPLIT": 1024, "K_PER_SPLIT_MANY_ROWS": 1024},
    "4096 K per slice": {"K_PER_SPLIT": 4096, "K_PER_SPLIT_MANY_ROWS": 4096},
}


def main():
    rows_list = [int(v) for v in os.environ.get("ROWS", "8,32,64").split(",")]
    ranks = [int(v) for v in os.environ.get("RANKS", "16,64").split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = []

    def record(**row):
        results.append(row)
        print(" ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        doc = {"benchmark": "lora_kernel_micro", "provenance": provenance(),
               "settings": {"model": "qwen2.5-7b shapes", "calls_per_graph": CALLS, "replays": REPLAYS, "pdl": False},
               "rows": results}
        with open(os.path.join(OUT, f"lora_kernel_micro{TAG}.json.tmp"), "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(os.path.join(OUT, f"lora_kernel_micro{TAG}.json.tmp"), os.path.join(OUT, f"lora_kernel_micro{TAG}.json"))

    for m in rows_list if os.environ.get("PARTS", "1") == "1" else []:
        for rank in ranks:
            for group in GROUPS:
                out, x, plan = make_case(group, m, rank, gen)
                splits, k_per, shrink_sums = lk.split_rule(m, x.shape[1], plan.padded_rank)
                us = {skip or "pair": measure(out, x, plan, skip) for skip in (None, "expand", "shrink")}
                record(m=m, rank=rank, group=group, splits=splits, shrink_sums=shrink_sums, pair_us=us["pair"],
                       shrink_us=us["expand"], expand_us=us["shrink"])
    variants = VARIANTS if os.environ.get("VARIANTS", "1") in ("0", "1") else json.loads(os.environ["VARIANTS"])
    if os.environ.get("VARIANTS", "1") != "0":
        defaults = {name: getattr(lk, name) for v in variants.values() for name in v}
        for m in rows_list:
            for rank in ranks:
                for vname, consts in variants.items():
                    for name, value in consts.items():
                        setattr(lk, name, value)
                    try:
                        per_group = {}
                        for group in GROUPS:
                            out, x, plan = make_case(group, m, rank, gen)
                            per_group[group] = measure(out, x, plan, None)
                    finally:
                        for name, value in defaults.items():
                            setattr(lk, name, value)
                    record(m=m, rank=rank, group="all four", variant=vname, pair_us=sum(per_group.values()),
                           **{f"{g}_us": v for g, v in per_group.items()})


if __name__ == "__main__":
    main()

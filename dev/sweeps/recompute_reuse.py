"""One Qwen2.5-7B decoder layer's seven NVFP4 weights, checkpointed, with and without the recompute's expansion
handed to the backward (`nvfp4_linear.RecomputeStash`; dev/LOG.md 91).

    python3 dev/sweeps/recompute_reuse.py --json dev/runs/NAME.json

Forward (non-reentrant checkpoint, as TRL runs it) + backward of q/k/v/o and gate/up/down at ``--rows`` tokens,
random weights; median of ``--reps`` CUDA-event timings per setting, alternating the two; the peak memory above the
inputs; the expansions counted per pass. Fixed-width table and JSON with provenance.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from qerl_lib.io import provenance, write_json_atomic  # noqa: E402
from qerl_lib.kernels import fp4_gemm  # noqa: E402
from qerl_lib.models.nvfp4_linear import RECOMPUTE_REUSE_ENV, NVFP4Linear  # noqa: E402

SHAPES = {"q": (3584, 3584), "k": (3584, 512), "v": (3584, 512), "o": (3584, 3584), "gate": (3584, 18944),
          "up": (3584, 18944), "down": (18944, 3584)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=2304)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.manual_seed(0)
    w = {name: NVFP4Linear.from_linear(nn.Linear(a, b, bias=False).to(torch.bfloat16), impl="kernel", name=name).cuda()
         for name, (a, b) in SHAPES.items()}

    def layer(x):
        attn = w["o"](w["q"](x)) + w["k"](x).sum(-1, keepdim=True) + w["v"](x).sum(-1, keepdim=True)
        return x + attn + w["down"](torch.nn.functional.silu(w["gate"](x)) * w["up"](x))

    x0 = torch.randn(args.rows, 3584, dtype=torch.bfloat16, device="cuda") * 0.1
    calls = []
    expand = fp4_gemm.dequantize_exact
    fp4_gemm.dequantize_exact = lambda *a, **kw: calls.append(1) or expand(*a, **kw)

    def once(reuse: bool):
        os.environ[RECOMPUTE_REUSE_ENV] = "1" if reuse else "0"
        x = x0.clone().requires_grad_(True)
        calls.clear()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        checkpoint(layer, x, use_reentrant=False).float().square().mean().backward()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end), (torch.cuda.max_memory_allocated() - base) / 2**30, len(calls)

    for _ in range(3):
        once(True), once(False)
    times = {True: [], False: []}
    for _ in range(args.reps):
        for reuse in (True, False):
            times[reuse].append(once(reuse)[0])
    rows = []
    for reuse in (False, True):
        _, peak, expansions = once(reuse)
        rows.append({"reuse": reuse, "rows": args.rows, "ms_median": statistics.median(times[reuse]),
                     "ms_min": min(times[reuse]), "peak_gib_above_inputs": peak, "expansions": expansions})
    print(f"{'reuse':<7}{'rows':>6}{'ms median':>11}{'ms min':>9}{'peak GiB':>10}{'expansions':>12}")
    for r in rows:
        print(f"{str(r['reuse']):<7}{r['rows']:>6}{r['ms_median']:>11.3f}{r['ms_min']:>9.3f}"
              f"{r['peak_gib_above_inputs']:>10.3f}{r['expansions']:>12}")
    if args.json:
        write_json_atomic(args.json, {"provenance": provenance(), "device": torch.cuda.get_device_name(),
                                      "rows": rows, "times_ms": {str(k): v for k, v in times.items()}})


if __name__ == "__main__":
    main()

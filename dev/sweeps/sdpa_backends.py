"""The trainer's attention by SDPA backend: first call at a new sequence length, and the steady time (#18; LOG 82).

    python3 dev/sweeps/sdpa_backends.py --json dev/runs/NAME.json [--models qwen2.5-7b,qwen2.5-14b] [--lengths ...]

For each architecture (its head counts from `data/configs/`), batch ``--batch``, bf16, causal, K/V heads shared
(`enable_gqa`), and each backend (cuDNN, flash, memory-efficient) alone: one forward + backward at each length in
order, timed with a sync (the first call at a length pays whatever the backend builds for it), then the median of
``--repeats`` more at the last length. RL's padded lengths change from step to step, so the first-call column is what
a step pays when its length is new.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from qerl_lib.io import provenance, write_json_atomic

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "data", "configs")


def fwd_bwd(q, k, v) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(torch.ones_like(out))
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen2.5-7b,qwen2.5-14b")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lengths", default="2299,2300,2303,2304,2311,2330")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    rows = []
    for model in args.models.split(","):
        with open(os.path.join(CONFIGS, f"{model}.json")) as f:
            cfg = json.load(f)
        heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
        dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        for name, backend in BACKENDS.items():
            row = {"model": model, "backend": name, "first_call_s": {}, "error": None}
            try:
                with sdpa_kernel([backend]):
                    for n in lengths:
                        q = torch.randn(args.batch, heads, n, dim, device="cuda", dtype=torch.bfloat16,
                                        requires_grad=True)
                        k, v = (torch.randn(args.batch, kv, n, dim, device="cuda", dtype=torch.bfloat16,
                                            requires_grad=True) for _ in range(2))
                        row["first_call_s"][n] = fwd_bwd(q, k, v)
                    row["steady_s"] = statistics.median(fwd_bwd(q, k, v) for _ in range(args.repeats))
            except RuntimeError as e:  # a backend that does not take these inputs says so
                row["error"] = str(e).splitlines()[0][:200]
            rows.append(row)
            first = " ".join(f"{n}:{t * 1e3:7.1f}" for n, t in row["first_call_s"].items())
            steady = f"{row['steady_s'] * 1e3:7.2f} ms" if "steady_s" in row else row["error"]
            print(f"{model:<12} {name:<10} steady {steady}  first call at each length (ms): {first}", flush=True)
    write_json_atomic(args.json, {"provenance": provenance(), "device": torch.cuda.get_device_name(),
                                  "settings": vars(args), "rows": rows})


if __name__ == "__main__":
    main()

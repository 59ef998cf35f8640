"""dev/LOG.md section 56: does cuBLAS at 8 rows pay for the LoRA A rows of a bf16 weight (A as weight rows) more than
their bytes, and would padding the extra rows to a multiple of 64 or 128 help? One process, 7B group shapes.

    PYTHONPATH=/tmp/site:$PWD python3 dev/sweeps/lora_rows_pad.py --json OUT.json
"""
import argparse
import sys

import torch

from qerl_lib.bench.gemm import l2_cache_bytes, rotation_copies, time_graph
from qerl_lib.io import provenance, write_json_atomic

# (group, N, K, stacked rank-16 A rows): q|k|v, o, gate|up, down of Qwen2.5-7B
GROUPS = [("qkv", 4608, 3584, 48), ("o", 3584, 3584, 16), ("gate_up", 37888, 3584, 32), ("down", 3584, 18944, 16)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--json", required=True)
    args = p.parse_args()
    l2, rows = l2_cache_bytes(), []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for group, n, k, extra in GROUPS:
        x = torch.randn(args.rows, k, device="cuda", generator=gen).to(torch.bfloat16)
        for label, add in (("base", 0), ("a_rows", extra), ("pad64", -(-extra // 64) * 64),
                           ("pad128", -(-extra // 128) * 128), ("a_rows_x4", 4 * extra)):
            ws = [torch.randn(n + add, k, device="cuda", generator=gen).to(torch.bfloat16)
                  for _ in range(rotation_copies((n + add) * k * 2, l2))]
            t = time_graph([lambda w=w: torch.nn.functional.linear(x, w) for w in ws])
            rows.append({"group": group, "n": n, "k": k, "extra_rows": add, "label": label, "m": args.rows,
                         "us": t.median_ms * 1e3, "us_p20": t.p20_ms * 1e3, "us_p80": t.p80_ms * 1e3})
            print(f"{group:<8} N={n:<6}+{add:<4} K={k:<6} {label:<9} {t.median_ms * 1e3:7.2f} us "
                  f"[{t.p20_ms * 1e3:.2f}, {t.p80_ms * 1e3:.2f}]", flush=True)
            del ws
    write_json_atomic(args.json, {"provenance": provenance(" ".join(["dev/sweeps/lora_rows_pad.py", *sys.argv[1:]])),
                                  "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The LoRA expand kernel with and without specializing on its row count M (#18; dev/LOG.md 88).

    python3 dev/sweeps/expand_specialize.py --json dev/runs/NAME.json

Builds two jit functions from `lora_forward._expand_add_kernel`'s source, one that specializes on M (Triton's
default: a multiple of 16 is a different compiled kernel) and one with ``do_not_specialize=["M"]`` (the library's),
in a fresh Triton cache. For each it times the first call at a row count divisible by 16 and at the next count (each
a compile when specialized), then the steady-state kernel (`triton.testing.do_bench`, median ms) at the 7B trainer's
shapes. Prints a fixed-width table and writes JSON with provenance.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_cache_")  # compiles are timed: start empty

import torch  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from qerl_lib.io import provenance, write_json_atomic  # noqa: E402
from qerl_lib.models import lora_forward  # noqa: E402

SHAPES = [(2304, 18944, 32), (2305, 18944, 32), (18432, 18944, 32), (18433, 3584, 32), (18432, 3584, 32)]


def launch(kernel, base, h, b, out, scale=2.0):
    (m, n), r = base.shape, h.shape[1]
    grid = (triton.cdiv(n, lora_forward.EXPAND_BLOCK_N), triton.cdiv(m, lora_forward.EXPAND_BLOCK_M))
    kernel[grid](base, h, b, out, m, n, r, scale, BLOCK_M=lora_forward.EXPAND_BLOCK_M,
                 BLOCK_N=lora_forward.EXPAND_BLOCK_N, RP=max(16, triton.next_power_of_2(r)), PRECISION="tf32",
                 num_warps=4)


def tensors(m, n, r):
    g = torch.Generator(device="cuda").manual_seed(m + n + r)
    base, h, b = (torch.randn(*s, generator=g, device="cuda").bfloat16() for s in ((m, n), (m, r), (n, r)))
    return base, h, b, torch.empty_like(base)


def first_call_s(kernel, m, n, r):
    args = tensors(m, n, r)
    torch.cuda.synchronize()
    start = time.perf_counter()
    launch(kernel, *args)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    args = p.parse_args()
    fn = lora_forward._expand_add_kernel.fn
    kernels = {"specialized": triton.jit(fn), "do_not_specialize": triton.jit(do_not_specialize=["M"])(fn)}
    rows = []
    for name, kernel in kernels.items():
        row = {"kernel": name, "first_call_s_m2048": first_call_s(kernel, 2048, 3584, 32),
               "first_call_s_m2049": first_call_s(kernel, 2049, 3584, 32),
               "first_call_s_m2050": first_call_s(kernel, 2050, 3584, 32)}
        for m, n, r in SHAPES:
            base, h, b, out = tensors(m, n, r)
            row[f"ms_{m}x{n}_r{r}"] = do_bench(lambda: launch(kernel, base, h, b, out), rep=200,
                                              return_mode="median")
        rows.append(row)
    keys = list(rows[0])[1:]
    print(f"{'kernel':<18}" + "".join(f"{k:>22}" for k in keys))
    for row in rows:
        print(f"{row['kernel']:<18}" + "".join(f"{row[k]:>22.4f}" for k in keys))
    if args.json:
        write_json_atomic(args.json, {"provenance": provenance(), "device": torch.cuda.get_device_name(),
                                      "rows": rows})


if __name__ == "__main__":
    main()

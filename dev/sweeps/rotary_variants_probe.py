"""How many `_rotary_kernel` variants a run of changing prefill lengths compiles, and what one costs (dev/LOG.md 137).

Two kernels on the same inputs: the library's `glue._rotary_kernel` (its position count `positions` unspecialized) and
a copy of the same function under Triton's default specialization (integers specialized on == 1 and on divisibility
by 16). For each, `glue.rotate` runs q and k of the prefill's layout (7B heads, 8 rows) at lengths 250, 256, 1, 37,
240 in turn, in a fresh Triton cache: per length the wall seconds of the call (a first call of a new variant includes
its compilation) and the number of compiled variants after it. Then each kernel's steady time at 8 x 256 and 8 x 250
(CUDA events, median of 200) in rounds whose order alternates, to see what leaving `positions` unspecialized costs
the kernel, and each variant's registers and PTX. Bits equal to `reference_ops.rope_qk` at every length, both kernels.

    TRITON_CACHE_DIR=$(mktemp -d) python dev/sweeps/rotary_variants_probe.py --json out.json
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import torch
import triton

from qerl_lib.engine import glue, reference_ops
from qerl_lib.io import provenance, write_json_atomic

HEADS, KV, D, ROWS = 28, 4, 128, 8
LENGTHS = (250, 256, 1, 37, 240)


def inputs(length: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(ROWS, length, (HEADS + 2 * KV) * D, device="cuda", generator=g).bfloat16()
    q = qkv[..., :HEADS * D].view(ROWS, length, HEADS, D).transpose(1, 2)
    k = qkv[..., HEADS * D:(HEADS + KV) * D].view(ROWS, length, KV, D).transpose(1, 2)
    angles = torch.rand(ROWS, length, D // 2, device="cuda", generator=g) * 50
    cos = torch.cat([angles.cos(), angles.cos()], -1).bfloat16()
    sin = torch.cat([angles.sin(), angles.sin()], -1).bfloat16()
    return q, k, cos, sin


def variants(kernel) -> int:
    return len(kernel.device_caches[torch.cuda.current_device()][0])


@contextlib.contextmanager
def using(kernel):
    """``glue.rotate`` launches ``kernel`` inside the block."""
    library, glue._rotary_kernel = glue._rotary_kernel, kernel
    try:
        yield
    finally:
        glue._rotary_kernel = library


def run_kernel(name: str, kernel) -> dict:
    with using(kernel):
        calls = []
        for i, length in enumerate(LENGTHS):
            q, k, cos, sin = inputs(length, i)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = glue.rope_qk(q, k, cos, sin)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            exact = all(torch.equal(a, b) for a, b in zip(got, reference_ops.rope_qk(q, k, cos, sin)))
            calls.append({"length": length, "seconds": round(seconds, 4), "variants": variants(kernel),
                          "bit_exact": exact})
    return {"kernel": name, "calls": calls}


def steady_us(kernel, length: int, repeats: int = 200) -> float:
    """Median microseconds of one ``rope_qk`` (q and k launches) at ``ROWS x length`` with ``kernel``."""
    with using(kernel):
        q, k, cos, sin = inputs(length, 99)
        glue.rope_qk(q, k, cos, sin)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            glue.rope_qk(q, k, cos, sin)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1000.0)
    return statistics.median(times)


def compiled(kernel, out_dir: str | None) -> list[dict]:
    """Each compiled variant's registers and PTX size (PTX written to ``out_dir`` when given)."""
    found = []
    for i, (key, binary) in enumerate(kernel.device_caches[torch.cuda.current_device()][0].items()):
        ptx = binary.asm.get("ptx", "")
        found.append({"n_regs": binary.n_regs, "ptx_lines": ptx.count("\n"), "key": str(key)[:400]})
        if out_dir:
            Path(out_dir, f"{'lib' if kernel is glue._rotary_kernel else 'default'}_{i}.ptx").write_text(ptx)
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True)
    p.add_argument("--rounds", type=int, default=4, help="steady-time rounds, the kernels' order alternating")
    p.add_argument("--ptx-dir", help="write each compiled variant's PTX here")
    args = p.parse_args()
    specialized = triton.jit(glue._rotary_kernel.fn)  # the same function, Triton's default specialization
    kernels = {"default specialization": specialized, "library (positions unspecialized)": glue._rotary_kernel}
    rows = [run_kernel(name, kernel) for name, kernel in kernels.items()]
    # steady times in alternating order, rounds x lengths: one kernel first, then the other first
    steady = {name: {"256": [], "250": []} for name in kernels}
    for rnd in range(args.rounds):
        order = list(kernels.items()) if rnd % 2 == 0 else list(kernels.items())[::-1]
        for length in (256, 250):
            for name, kernel in order:
                steady[name][str(length)].append(round(steady_us(kernel, length), 2))
    for row in rows:
        row["steady_us_q_and_k"] = steady[row["kernel"]]
        row["compiled"] = compiled(kernels[row["kernel"]], args.ptx_dir)
        print(f"{row['kernel']:36s} " + "  ".join(f"L={c['length']}: {c['seconds']:.3f}s v{c['variants']}"
                                                  f"{'' if c['bit_exact'] else ' NOT EXACT'}" for c in row["calls"]))
        print(f"{'':36s} steady us (q+k), rounds: {row['steady_us_q_and_k']}; registers "
              f"{[c['n_regs'] for c in row['compiled']]}, PTX lines {[c['ptx_lines'] for c in row['compiled']]}")
    write_json_atomic(args.json, {"provenance": provenance(), "rows_x_heads": [ROWS, HEADS, KV, D], "rows": rows})


if __name__ == "__main__":
    main()

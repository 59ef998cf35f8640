"""NVFP4 LoRA at batch 8 on a second stream of the graph: does it leave the GEMM's critical path? (dev/LOG.md section 69)

Section 29 left one design for #17's batch-8 LoRA overhead untried: the shrink and an expand into a separate delta
buffer on a side stream of the captured graph, concurrent with the group's base GEMM, the consumer kernel then adding
the delta as it reads the GEMM's output. Before any consumer kernel is changed, this measures the first question: how
long the critical path is with the adapters beside the GEMM instead of after it, on Qwen2.5-7B's four decode groups.

Per group, rank and variant, a CUDA graph of LAYERS calls, each on its own random NVFP4 weight copy (so the weights
stream from HBM as in a decode step), 8 rows of x, the mma.sync GEMM; median of REPLAYS replays, microseconds a call
(the section-69 run warmed up on a side stream before capturing; this version warms up on the current stream):
* ``base``: the GEMM alone;
* ``serial``: the engine's order (GEMM, then kernels/lora.py's shrink, which reads x early under PDL, then the expand
  into the GEMM's output);
* ``side``: fork to a side stream (zero a delta buffer, shrink, expand into the delta) while the main stream runs the
  GEMM; join before the next call (the consumer's add of the delta is not launched: a lower bound);
* ``side+add``: ``side`` plus ``out += delta`` on the main stream after the join (an upper bound: one launch more).
The delta path's output is checked against the serial path's. PDL as the environment says (default on).

Run on a GPU from the repository root: python dev/sweeps/lora_side_stream_micro.py   (RANKS=16,64; LAYERS=28)
Writes lora_side_stream_micro.json to $OUT.
"""

import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lora_kernel_micro import GROUPS, make_case, time_calls  # noqa: E402
from qerl_lib.io import provenance  # noqa: E402
from qerl_lib.kernels import lora as lk  # noqa: E402
from qerl_lib.kernels import pdl  # noqa: E402
from qerl_lib.kernels.fp4_gemm import fp4_linear, prepare_fp4_weights  # noqa: E402

M = 8
LAYERS = int(os.environ.get("LAYERS", "28"))
REPLAYS = 20
OUT = os.environ.get("OUT", ".")


def random_weights(n: int, k: int, copies: int, gen: torch.Generator):
    """``copies`` NVFP4 weights ``[n, k]`` with random codes and scales (the bytes, not a quantized matrix: speed only)."""
    dev = torch.device("cuda")
    out = []
    for _ in range(copies):
        packed = torch.randint(0, 256, (n, k // 2), generator=gen, device=dev, dtype=torch.uint8)
        scale = (torch.rand(n, k // 16, generator=gen, device=dev) * 2 + 0.5).to(torch.float8_e4m3fn)
        out.append(prepare_fp4_weights(packed, scale, torch.tensor([448.0 * 6.0], device=dev)))
    return out


def replay_us(body) -> float:
    """Microseconds per call of ``body(i)``, i cycling over the LAYERS weight copies, in a graph of LAYERS calls
    (``lora_kernel_micro.time_calls``), median over REPLAYS replays."""
    layer = itertools.cycle(range(LAYERS))
    return time_calls(lambda: body(next(layer)), calls=LAYERS, replays=REPLAYS)


def main():
    ranks = [int(v) for v in os.environ.get("RANKS", "16,64").split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    side = torch.cuda.Stream()
    for group, (k, widths) in GROUPS.items():
        n = sum(widths)
        weights = random_weights(n, k, LAYERS, gen)
        for rank in ranks:
            out, x, plan = make_case(group, M, rank, gen)
            outs = [torch.empty_like(out) for _ in range(LAYERS)]
            deltas = [torch.empty_like(out) for _ in range(LAYERS)]

            def gemm(i):
                fp4_linear(x, weights[i], out=outs[i], small_m_backend="mma")

            def serial(i):
                gemm(i)
                lk.expand_(outs[i], lk.shrink_(x, plan))

            def beside(i, add=False):
                main = torch.cuda.current_stream()
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    deltas[i].zero_()
                    lk.expand_(deltas[i], lk.shrink_(x, plan))
                gemm(i)
                main.wait_stream(side)
                if add:
                    outs[i].add_(deltas[i])

            us = {"base": replay_us(gemm), "serial": replay_us(serial), "side": replay_us(beside),
                  "side+add": replay_us(lambda i: beside(i, add=True))}
            serial(0)
            want = outs[0].float().clone()
            beside(0, add=True)
            torch.cuda.synchronize()
            err = float((outs[0].float() - want).abs().max() / want.abs().max())
            row = {"group": group, "rank": rank, "m": M, "layers": LAYERS, "pdl": pdl.use_for(x.device),
                   **{f"{k}_us": v for k, v in us.items()}, "side_vs_serial_max_rel_err": err}
            rows.append(row)
            print(f"{group:8s} r{rank:<3d} base {us['base']:7.2f}  serial {us['serial']:7.2f}  side {us['side']:7.2f}  "
                  f"side+add {us['side+add']:7.2f} us   (err {err:.1e})", flush=True)
            doc = {"benchmark": "lora_side_stream_micro", "provenance": provenance(), "rows": rows}
            tmp = os.path.join(OUT, "lora_side_stream_micro.json.tmp")
            with open(tmp, "w") as f:
                json.dump(doc, f, indent=1)
            os.replace(tmp, os.path.join(OUT, "lora_side_stream_micro.json"))
    for rank in ranks:
        sums = {v: sum(r[f"{v}_us"] for r in rows if r["rank"] == rank) for v in ("base", "serial", "side", "side+add")}
        print(f"one layer's four groups, r{rank}: " + ", ".join(f"{v} {t:.1f} us" for v, t in sums.items()), flush=True)


if __name__ == "__main__":
    main()

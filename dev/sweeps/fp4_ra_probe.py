"""dev/LOG.md section 72: where the register-A CUDA GEMM's time goes. Each launch shape is timed as built (probe 0),
without the weight decode (probe 1: the A registers are the block scales; loads, waits and MMAs unchanged) and
without the MMAs (probe 2: decode, loads and waits only), on a few 7B shapes, beside cuBLAS bf16. Outputs of the
probes are meaningless; only their times are read.

    PYTHONPATH=/tmp/site:. python3 dev/sweeps/fp4_ra_probe.py --json OUT.json
"""
import argparse
import dataclasses
import sys

import torch

from qerl_lib.bench.gemm import l2_cache_bytes, rotation_copies, time_graph
from qerl_lib.io import provenance, write_json_atomic
from qerl_lib.kernels import fp4_ra
from qerl_lib.kernels.fp4_gemm import prepare_fp4_weights
from qerl_lib.quant.nvfp4 import quantize


@dataclasses.dataclass(frozen=True)
class ProbeConfig(fp4_ra.RaConfig):
    probe: int = 0

    @property
    def name(self) -> str:
        return super().name + f"_probe{self.probe}"


_source = fp4_ra.kernel_source
fp4_ra.kernel_source = lambda cfg: (f"#define PROBE {getattr(cfg, 'probe', 0)}\n" + _source(cfg))

SHAPES = [(18944, 3584, 4096), (18944, 3584, 1024), (3584, 18944, 1024), (3584, 3584, 4096)]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="256:4,128:6")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, l2 = [], l2_cache_bytes()
    for n, k, m in SHAPES:
        dense = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
        q = quantize(dense)
        kit = [prepare_fp4_weights(q.weight_packed.clone(), q.weight_scale.clone(), q.weight_global_scale.clone())
               for _ in range(rotation_copies(n * k * 0.5625, l2))]
        bf16 = [dense.clone() for _ in range(rotation_copies(n * k * 2, l2))]
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        row = {"n": n, "k": k, "m": m,
               "bf16_us": time_graph([lambda w=w: torch.nn.functional.linear(x, w) for w in bf16]).median_ms * 1e3}
        line = f"N={n:<6} K={k:<6} M={m:<5} bf16 {row['bf16_us']:8.1f}"
        for c in args.configs.split(","):
            tok, stages = map(int, c.split(":"))
            for probe in (0, 1, 2):
                cfg = ProbeConfig(tok, stages, probe=probe)
                key = f"t{tok}_s{stages}_p{probe}_us"
                row[key] = time_graph([lambda w=w: fp4_ra.linear(x, w.words, w.scales, w.global_scale, None, out, cfg)
                                       for w in kit]).median_ms * 1e3
                line += f"  {key[:-3]} {row[key]:8.1f} ({row['bf16_us'] / row[key]:.2f}x)"
        rows.append(row)
        print(line, flush=True)
        del kit, bf16, dense, q
        torch.cuda.empty_cache()
    write_json_atomic(args.json, {"provenance": provenance(" ".join(["dev/sweeps/fp4_ra_probe.py", *sys.argv[1:]])),
                                  "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

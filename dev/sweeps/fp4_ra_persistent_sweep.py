"""dev/LOG.md section 74: the register-A CUDA GEMM (`kernels/fp4_ra.py`) persistent, and with the part-empty last
wave split along K, against one CTA per tile, cuBLAS bf16 and the kit's forward path (`fp4_linear`), in one process
(runs 1-4: "split" with split_max_fill 1.0 and "split_half" with 0.5, the no-decode probe with 1.0; from run 5 the
default 0.5 is "split", 1.0 "split_all", and the probes use the default).

    PYTHONPATH=/tmp/site:. python3 dev/sweeps/fp4_ra_persistent_sweep.py --json OUT.json [--models qwen2.5-7b]

Correctness of every schedule first (section 72's odd shapes, and shapes whose tiles leave a part-empty wave), then
median device times in CUDA graphs with L2-rotated weight copies, as `qerl bench gemm` times, plus the split launch
without its weight decode (section 72's probe 1: the pipeline's ceiling at that shape) and without its epilogue (probe 3).
"""
import argparse
import sys

import torch

import fp4_ra_probe  # noqa: F401  (dev/sweeps: PROBE builds through ProbeConfig)
from fp4_ra_sweep import CHECKS, check, timed_shapes
from qerl_lib.bench.gemm import mean_relative_error, time_graph
from qerl_lib.io import provenance, write_json_atomic
from qerl_lib.kernels import fp4_ra

LAUNCHES = {"one_tile": fp4_ra.RaConfig(256, 4, "one_tile"), "persistent": fp4_ra.RaConfig(256, 4, "persistent"),
            "split": fp4_ra.RaConfig(256, 4, "split"),
            "split_all": fp4_ra.RaConfig(256, 4, "split", split_max_fill=1.0),
            "split_nodecode": fp4_ra_probe.ProbeConfig(256, 4, "split", probe=1),
            "split_noepilogue": fp4_ra_probe.ProbeConfig(256, 4, "split", probe=3)}
PROBES = ("split_nodecode", "split_noepilogue")  # diagnostics: their outputs are not checked
EXTRA_CHECKS = [(4608, 3584, 1024), (3584, 18944, 1024)]  # one whole wave + a split tail; all tiles split


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="qwen2.5-7b")
    p.add_argument("--ms", default="1024,2048,4096")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    checks = []
    for name, cfg in LAUNCHES.items():
        if name in PROBES:
            continue
        for n, k, m in CHECKS + EXTRA_CHECKS:
            for bias in (False, True):
                row = {"launch": name, "schedule": cfg.schedule, **check(cfg, n, k, m, bias, gen)}
                checks.append(row)
                print(f"check {name} N={n} K={k} M={m} bias={bias}: err {row['rel_err']:.2e} guard {row['guard_ok']} "
                      f"det {row['deterministic']} {'ok' if row['ok'] else 'FAIL'}", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for row, x, ref, out, kit in timed_shapes(args.models.split(","), map(int, args.ms.split(",")), gen):
        n, k, m = row["n"], row["k"], row["m"]
        row["sms"] = sms
        line = (f"{row['model']} {row['proj']:<18} N={n:<6} K={k:<6} M={m:<5} bf16 {row['bf16_us']:7.1f} "
                f"kit {row['bf16_us'] / row['kit_us']:.2f}x")
        for name, cfg in LAUNCHES.items():
            s = fp4_ra.plan_schedule(m, n, k, cfg, sms)
            row[name + "_schedule"] = {"grid": s.grid, "tiles": s.tiles, "dp_tiles": s.dp_tiles, "sk_per": s.sk_per,
                                       "sk_ctas": s.sk_ctas}
            fp4_ra.linear(x, kit[0].words, kit[0].scales, kit[0].global_scale, None, out, cfg)
            if name not in PROBES:
                row[name + "_rel_err"] = mean_relative_error(out.float(), ref)
            row[name + "_us"] = time_graph([lambda w=w: fp4_ra.linear(x, w.words, w.scales, w.global_scale, None, out,
                                                                      cfg) for w in kit]).median_ms * 1e3
            line += f" {name} {row['bf16_us'] / row[name + '_us']:.2f}x"
        rows.append(row)
        print(line, flush=True)
    doc = {"provenance": provenance(" ".join(["dev/sweeps/fp4_ra_persistent_sweep.py", *sys.argv[1:]])),
           "checks": checks, "rows": rows}
    write_json_atomic(args.json, doc)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

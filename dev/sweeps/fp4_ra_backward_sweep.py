"""dev/LOG.md section 76: the register-A CUDA GEMM's backward layout (`fp4_ra.grad_input`, dx = dy @ W from the forward's
bytes) against cuBLAS bf16 (`torch.mm(dy, W)`) and the kit's backward path (`fp4_grad_input`: dequantize + cuBLAS),
in one process.

    PYTHONPATH=/tmp/site:. python3 dev/sweeps/fp4_ra_backward_sweep.py --json OUT.json [--models qwen2.5-7b] [--ms 1024]

Correctness first (odd shapes, every launch, an output inside a larger buffer, two launches bit-equal), then median
device times in CUDA graphs with L2-rotated weight copies, as `qerl bench gemm` times, plus the default launch without
its weight decode (probe 1: the A registers are the scale pairs; the repack, loads, waits and MMAs unchanged) and
without the producer's repack (probe 4: the raw ring is still loaded and waited for).
"""
import argparse
import sys

import torch

import fp4_ra_probe
from fp4_ra_sweep import check_output, rotated_weights
from qerl_lib.bench.gemm import MAX_REL_ERR, l2_cache_bytes, mean_relative_error, projection_shapes, time_graph
from qerl_lib.io import provenance, write_json_atomic
from qerl_lib.kernels import fp4_ra
from qerl_lib.kernels.fp4_gemm import fp4_grad_input, prepare_fp4_weights
from qerl_lib.quant.nvfp4 import quantize, reference_grad_input

LAUNCHES = {"t256s4": fp4_ra.RaConfig(256, 4, backward=True), "t128s6": fp4_ra.RaConfig(128, 6, backward=True),
            "t256s4_persistent": fp4_ra.RaConfig(256, 4, "persistent", backward=True),
            "t256s4_nodecode": fp4_ra_probe.ProbeConfig(256, 4, backward=True, probe=1),
            "t256s4_norepack": fp4_ra_probe.ProbeConfig(256, 4, backward=True, probe=4),
            "t128s6_norepack": fp4_ra_probe.ProbeConfig(128, 6, backward=True, probe=4)}
PROBES = ("t256s4_nodecode", "t256s4_norepack", "t128s6_norepack")
CHECKS = [(128, 256, 1), (64, 768, 300), (192, 1280, 257), (3584, 512, 777), (18944, 3584, 1024), (3584, 18944, 1000)]


def check(cfg: fp4_ra.RaConfig, n: int, k: int, m: int, gen: torch.Generator) -> dict:
    dense = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    q = quantize(dense)
    w = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    dy = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
    result = check_output(lambda out: fp4_ra.grad_input(dy, w.words, w.scales, w.global_scale, out, cfg), m, k,
                          reference_grad_input(dy, q).float())
    return {"tok": cfg.tok, "stages": cfg.stages, "schedule": cfg.schedule, "n": n, "k": k, "m": m, **result}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="qwen2.5-7b,qwen2.5-32b")
    p.add_argument("--ms", default="1024,2048,4096")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    checks = []
    for name, cfg in LAUNCHES.items():
        if name in PROBES:
            continue
        for n, k, m in CHECKS:
            row = {"launch": name, **check(cfg, n, k, m, gen)}
            checks.append(row)
            print(f"check {name} N={n} K={k} M={m}: err {row['rel_err']:.2e} guard {row['guard_ok']} "
                  f"det {row['deterministic']} {'ok' if row['ok'] else 'FAIL'}", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, l2, ms = [], l2_cache_bytes(), [int(v) for v in args.ms.split(",")]
    for model in args.models.split(","):
        for shape in projection_shapes(model):
            n, k = shape.n, shape.k
            if not fp4_ra.supported_backward_problem(n, k):
                continue
            q, kit, bf16 = rotated_weights(n, k, gen, l2)
            for m in ms:
                dy = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
                out = torch.empty(m, k, device="cuda", dtype=torch.bfloat16)
                ref = reference_grad_input(dy, q).float()
                row = {"model": model, "proj": shape.name, "layout": shape.layout, "n": n, "k": k, "m": m, "sms": sms}
                row["bf16_us"] = time_graph([lambda w=w: torch.mm(dy, w) for w in bf16]).median_ms * 1e3
                row["kit_us"] = time_graph([lambda w=w: fp4_grad_input(dy, w, out=out) for w in kit]).median_ms * 1e3
                line = (f"{model} {shape.name:<18} N={n:<6} K={k:<6} M={m:<5} bf16 {row['bf16_us']:7.1f} "
                        f"kit {row['bf16_us'] / row['kit_us']:.2f}x")
                for name, cfg in LAUNCHES.items():
                    fp4_ra.grad_input(dy, kit[0].words, kit[0].scales, kit[0].global_scale, out, cfg)
                    if name not in PROBES:
                        row[name + "_rel_err"] = mean_relative_error(out.float(), ref)
                    row[name + "_us"] = time_graph([lambda w=w: fp4_ra.grad_input(
                        dy, w.words, w.scales, w.global_scale, out, cfg) for w in kit]).median_ms * 1e3
                    line += f" {name} {row['bf16_us'] / row[name + '_us']:.2f}x"
                rows.append(row)
                print(line, flush=True)
            del kit, bf16, q
            torch.cuda.empty_cache()
    doc = {"provenance": provenance(" ".join(["dev/sweeps/fp4_ra_backward_sweep.py", *sys.argv[1:]])),
           "checks": checks, "rows": rows}
    write_json_atomic(args.json, doc)
    return 0 if all(c["ok"] for c in checks) and all(
        r[f"{name}_rel_err"] <= MAX_REL_ERR for r in rows for name in LAUNCHES if name not in PROBES) else 1


if __name__ == "__main__":
    sys.exit(main())

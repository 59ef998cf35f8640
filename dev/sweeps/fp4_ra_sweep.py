"""dev/LOG.md section 72: the register-A NVFP4 GEMM in CUDA (`kernels/fp4_ra.py`) against the oracle, then timed
beside cuBLAS bf16 and the kit's current forward path (`fp4_linear`) at #18's training sizes, in one process.

    PYTHONPATH=/tmp/site:. python3 dev/sweeps/fp4_ra_sweep.py --json OUT.json [--models qwen2.5-7b] [--ms 1024,4096]

Correctness first (every launch shape on odd shapes: one K-step, step counts that are not a multiple of the
three-way unroll, N and M off the tile, bias, an output inside a larger buffer whose other rows must stay
untouched), then median device times in CUDA graphs with L2-rotated weight copies, as `qerl bench gemm` times.
"""
import argparse
import sys

import torch

from qerl_lib.bench.gemm import (MAX_REL_ERR, l2_cache_bytes, mean_relative_error, projection_shapes,
                                 rotation_copies, time_graph)
from qerl_lib.io import provenance, write_json_atomic
from qerl_lib.kernels import fp4_ra
from qerl_lib.kernels.fp4_gemm import fp4_linear, prepare_fp4_weights
from qerl_lib.quant.nvfp4 import quantize, reference_matmul

CHECKS = [(128, 64, 100), (136, 192, 300), (264, 640, 257), (512, 3584, 1024), (3584, 3584, 1000), (4608, 3584, 33)]


def check_output(launch, m: int, cols: int, ref: torch.Tensor) -> dict:
    """``launch(out)`` into rows 1..m of a NaN-filled [m + 2, cols + 8] buffer, twice: its error against ``ref`` (fp32),
    whether it is finite, whether it left the rest of the buffer alone, and whether the two launches are bit-equal."""
    buf = torch.full((m + 2, cols + 8), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = buf[1:m + 1, :cols]
    launch(out)
    torch.cuda.synchronize()
    guard_ok = bool(buf[0].isnan().all() and buf[-1].isnan().all() and buf[1:m + 1, cols:].isnan().all())
    err = mean_relative_error(out.float(), ref)
    again = torch.empty_like(out)
    launch(again)
    finite, det = bool(out.isfinite().all()), bool(torch.equal(out, again))
    return {"rel_err": err, "finite": finite, "guard_ok": guard_ok, "deterministic": det,
            "max_abs_diff": float((out.float() - ref).abs().max()),
            "ok": err <= MAX_REL_ERR and finite and guard_ok and det}


def check(cfg: fp4_ra.RaConfig, n: int, k: int, m: int, bias: bool, gen: torch.Generator) -> dict:
    dense = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    q = quantize(dense)
    w = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    b = (torch.randn(n, device="cuda", generator=gen) * 0.1).to(torch.bfloat16) if bias else None
    result = check_output(lambda out: fp4_ra.linear(x, w.words, w.scales, w.global_scale, b, out, cfg), m, n,
                          reference_matmul(x, q, b).float())
    return {"tok": cfg.tok, "stages": cfg.stages, "n": n, "k": k, "m": m, "bias": bias, **result}


def rotated_weights(n: int, k: int, gen: torch.Generator, l2: int):
    """A random [n, k] weight: bf16, its NVFP4 quantization, and the L2-rotated copies of both that the timings cycle
    through (NVFP4 as ``prepare_fp4_weights`` results)."""
    dense = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    q = quantize(dense)
    kit = [prepare_fp4_weights(q.weight_packed.clone(), q.weight_scale.clone(), q.weight_global_scale.clone())
           for _ in range(rotation_copies(n * k * 0.5625, l2))]
    return q, kit, [dense.clone() for _ in range(rotation_copies(n * k * 2, l2))]


def timed_shapes(models, ms, gen: torch.Generator):
    """For each model's projection shapes and each M: the row with cuBLAS bf16's and ``fp4_linear``'s median device
    times (CUDA graphs, L2-rotated weight copies), and what a caller needs to time its own launches beside them:
    ``x``, the oracle's output (fp32), an output buffer and the rotated NVFP4 weights."""
    l2, ms = l2_cache_bytes(), list(ms)
    for model in models:
        for shape in projection_shapes(model):
            n, k = shape.n, shape.k
            q, kit, bf16 = rotated_weights(n, k, gen, l2)
            for m in ms:
                x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
                out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                row = {"model": model, "proj": shape.name, "layout": shape.layout, "n": n, "k": k, "m": m}
                row["bf16_us"] = time_graph([lambda w=w: torch.nn.functional.linear(x, w) for w in bf16]).median_ms * 1e3
                row["kit_us"] = time_graph([lambda w=w: fp4_linear(x, w, out=out) for w in kit]).median_ms * 1e3
                yield row, x, reference_matmul(x, q).float(), out, kit
            del kit, bf16, q
            torch.cuda.empty_cache()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="qwen2.5-7b")
    p.add_argument("--ms", default="1024,2048,4096")
    # section 72 ran 128:6,256:5,256:4,128:8; with section 74's epilogue staging and scale rows 256:4 and 128:6 fit
    p.add_argument("--configs", default="256:4,128:6")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    configs = [fp4_ra.RaConfig(*map(int, c.split(":"))) for c in args.configs.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    checks = []
    for cfg in configs:
        for n, k, m in CHECKS:
            for bias in (False, True):
                row = check(cfg, n, k, m, bias, gen)
                checks.append(row)
                print(f"check tok={cfg.tok} stages={cfg.stages} N={n} K={k} M={m} bias={bias}: err {row['rel_err']:.2e} "
                      f"guard {row['guard_ok']} det {row['deterministic']} {'ok' if row['ok'] else 'FAIL'}", flush=True)
    rows = []
    for row, x, ref, out, kit in timed_shapes(args.models.split(","), map(int, args.ms.split(",")), gen):
        line = (f"{row['model']} {row['proj']:<18} N={row['n']:<6} K={row['k']:<6} M={row['m']:<5} "
                f"bf16 {row['bf16_us']:8.1f}  kit {row['kit_us']:8.1f} ({row['bf16_us'] / row['kit_us']:.2f}x)")
        for cfg in configs:
            key = f"ra_t{cfg.tok}_s{cfg.stages}"
            fp4_ra.linear(x, kit[0].words, kit[0].scales, kit[0].global_scale, None, out, cfg)
            row[key + "_rel_err"] = mean_relative_error(out.float(), ref)
            row[key + "_us"] = time_graph([lambda w=w: fp4_ra.linear(x, w.words, w.scales, w.global_scale, None, out,
                                                                     cfg) for w in kit]).median_ms * 1e3
            line += f"  {key} {row[key + '_us']:8.1f} ({row['bf16_us'] / row[key + '_us']:.2f}x)"
        rows.append(row)
        print(line, flush=True)
    doc = {"provenance": provenance(" ".join(["dev/sweeps/fp4_ra_sweep.py", *sys.argv[1:]])),
           "checks": checks, "rows": rows}
    write_json_atomic(args.json, doc)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

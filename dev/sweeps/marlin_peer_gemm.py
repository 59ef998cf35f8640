"""dev/LOG.md section 55: vLLM 0.24's NVFP4 GEMM on Hopper (Marlin FP4, weights repacked at load time) beside the
kit's FP4 forward and cuBLAS bf16, at #18's training sizes (M >= 1024), in one process on one GPU.

Run on the GPU machine with vLLM installed (`vllm_peer_gpu.sh vl N` ... `install`), from /tmp/kit:
    PYTHONPATH=/tmp/vsite:/tmp/site:/tmp/kit python3 dev/sweeps/marlin_peer_gemm.py --json OUT.json
The kit's modules used here import neither compressed-tensors nor transformers, so vLLM's pinned copies coming
first on the path is harmless. Every output is checked against the kit's oracle (`reference_matmul`) before timing.
"""
import argparse
import math
import sys

import torch

from qerl_lib.bench.gemm import (MAX_REL_ERR, l2_cache_bytes, mean_relative_error, projection_shapes,
                                 rotation_copies, time_graph)
from qerl_lib.io import provenance, write_json_atomic
from qerl_lib.kernels.fp4_gemm import fp4_linear, prepare_fp4_weights
from qerl_lib.quant.nvfp4 import quantize, reference_matmul


def marlin_layer(q, n: int, k: int, global_scale: torch.Tensor):
    """A stand-in for vLLM's linear layer as `prepare_fp4_layer_for_marlin` expects it; repacked in place."""
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import prepare_fp4_layer_for_marlin

    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(q.weight_packed.clone(), requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(q.weight_scale.clone(), requires_grad=False)
    layer.weight_global_scale = torch.nn.Parameter(global_scale.float().clone(), requires_grad=False)
    layer.output_size_per_partition, layer.input_size_per_partition = n, k
    layer.params_dtype, layer.bias = torch.bfloat16, None
    prepare_fp4_layer_for_marlin(layer)
    return layer


def marlin_call(x, layer, n: int, k: int):
    from vllm.model_executor.layers.quantization.utils.marlin_utils_fp4 import apply_fp4_marlin_linear

    return apply_fp4_marlin_linear(x, layer.weight, layer.weight_scale, layer.weight_global_scale,
                                   layer.workspace, n, k)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="qwen2.5-7b")
    p.add_argument("--ms", default="1024,4096")
    p.add_argument("--json", required=True)
    args = p.parse_args()
    l2, rows = l2_cache_bytes(), []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for model in args.models.split(","):
        for shape in projection_shapes(model):
            n, k = shape.n, shape.k
            dense = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
            q = quantize(dense, name=f"{model}.{shape.name}")
            a = torch.randn(1024, k, device="cuda", generator=gen).to(torch.bfloat16)
            ref = reference_matmul(a, q).float()
            # compressed-tensors divides by its global scale; which convention vLLM's Marlin takes is checked here
            errs = {}
            for name, g in (("as_stored", q.weight_global_scale), ("inverse", 1.0 / q.weight_global_scale)):
                errs[name] = mean_relative_error(marlin_call(a, marlin_layer(q, n, k, g), n, k).float(), ref)
            errs = {c: (e if math.isfinite(e) else None) for c, e in errs.items()}  # null: non-finite output
            finite = [c for c, e in errs.items() if e is not None]
            convention = min(finite, key=errs.get) if finite else "as_stored"
            g = q.weight_global_scale if convention == "as_stored" else 1.0 / q.weight_global_scale
            copies = rotation_copies(n * k * 0.5625, l2)
            marlin = [marlin_layer(q, n, k, g) for _ in range(copies)]
            kit = [prepare_fp4_weights(q.weight_packed.clone(), q.weight_scale.clone(), q.weight_global_scale.clone())
                   for _ in range(copies)]
            bf16 = [dense.clone() for _ in range(rotation_copies(n * k * 2, l2))]
            kit_err = mean_relative_error(fp4_linear(a, kit[0]).float(), ref)
            for m in map(int, args.ms.split(",")):
                x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
                t_bf16 = time_graph([lambda w=w: torch.nn.functional.linear(x, w) for w in bf16]).median_ms
                t_kit = time_graph([lambda w=w: fp4_linear(x, w) for w in kit]).median_ms
                t_marlin = time_graph([lambda L=L: marlin_call(x, L, n, k) for L in marlin]).median_ms
                row = {"model": model, "proj": shape.name, "layout": shape.layout, "n": n, "k": k, "m": m,
                       "bf16_us": t_bf16 * 1e3, "kit_fp4_us": t_kit * 1e3, "marlin_fp4_us": t_marlin * 1e3,
                       "kit_over_bf16": t_bf16 / t_kit, "marlin_over_bf16": t_bf16 / t_marlin,
                       "kit_rel_err": kit_err, "marlin_rel_err": errs[convention],
                       "marlin_global_scale": convention if finite else None, "marlin_rel_err_by_convention": errs,
                       "ok": kit_err <= MAX_REL_ERR,
                       "marlin_ok": errs[convention] is not None and errs[convention] <= MAX_REL_ERR}
                rows.append(row)
                print(f"{model} {shape.name:<18} N={n:<6} K={k:<6} M={m:<5} bf16 {row['bf16_us']:8.1f} us  "
                      f"kit {row['kit_fp4_us']:8.1f} ({row['kit_over_bf16']:.2f}x)  marlin {row['marlin_fp4_us']:8.1f} "
                      f"({row['marlin_over_bf16']:.2f}x)  err kit {kit_err:.1e} marlin {errs[convention]} "
                      f"[{convention}]", flush=True)
                del x
            del marlin, kit, bf16, dense, q, a, ref
            torch.cuda.empty_cache()
    import vllm

    doc = {"provenance": provenance(" ".join(["dev/sweeps/marlin_peer_gemm.py", *sys.argv[1:]])),
           "vllm": vllm.__version__, "rows": rows}
    write_json_atomic(args.json, doc)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Section 34 (dev/LOG.md): the warp-specialized NVFP4 GEMM at training sizes (``kernels/fp4_wgmma_ws.py``)
against bf16 cuBLAS and the dequantize + cuBLAS path, forward (``x @ W.T``) and backward (``dy @ W``), and the
register-A Gluon kernel (``kernels/fp4_wgmma.py``) with 256 rows of x per program, forward only.

One call: correctness of every variant on awkward and real shapes (poisoned outputs, bias, determinism, the
oracles ``reference_matmul`` / ``reference_grad_input``), then device time per (shape, M, direction) with the
benchmark's CUDA-graph + L2-rotation timer. ``PART`` takes any of ``check`` (correctness), ``probe`` (the kernel
with one job taken out, ``probe_module``) and ``time`` (default: ``check,time``); ``MS`` the sizes to time.
Writes $OUT/sweep.jsonl; prints one line per (shape, M, direction).

    OUT=/tmp/out PYTHONPATH=$PWD python dev/sweeps/fp4_ws_sweep.py
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp4_kernel_sweep as sweep  # noqa: E402  (opens $OUT/sweep.jsonl)

from qerl_lib.bench.gemm import mean_relative_error, rotation_copies, time_graph  # noqa: E402
from qerl_lib.kernels import fp4_wgmma_ws as ws  # noqa: E402
from qerl_lib.kernels.fp4_gemm import dequantize_exact, fp4_linear, prepare_fp4_weights  # noqa: E402
from qerl_lib.kernels.fp4_wgmma import WgmmaConfig  # noqa: E402
from qerl_lib.kernels.launch_rule import k_splits  # noqa: E402
from qerl_lib.quant.nvfp4 import reference_grad_input, reference_matmul  # noqa: E402

SHAPES = [("7b.gate_up", 37888, 3584), ("7b.down", 3584, 18944), ("7b.qkv", 4608, 3584), ("7b.o", 3584, 3584),
          ("7b.kv", 1024, 3584), ("32b.gate_up", 55296, 5120), ("32b.down", 5120, 27648)]
MS = [int(v) for v in os.environ.get("MS", "256,1024,2048,4096,8192").split(",")]
CHECK_CASES = [(1, 256, 256), (77, 320, 512), (129, 1000, 1024), (300, 4608, 3584), (1024, 512, 3584),
               (257, 3584, 18944), (2048, 37888, 3584)]  # M, N, K (backward needs N % 64: 1000 runs forward only)
CHECK_CONFIGS = [ws.WsConfig(), ws.WsConfig(2, 2), ws.WsConfig(3, 3, 128), ws.WsConfig(5, 2), ws.WsConfig(4, 3, 64)]
TIME_CONFIGS = [("ws", ws.WsConfig()), ("ws-4/3", ws.WsConfig(4, 3))]
# the register-A Gluon kernel (kernels/fp4_wgmma.py) with 256 rows of x per program (wgmma N = 256), forward only;
# "-split": K-slices for ~1 program per SM where the tiles do not fill the GPU (section 34, run 4)
WG_CONFIGS = [("wg256x2", WgmmaConfig(256, 2, 1, 3)), ("wg256x1", WgmmaConfig(256, 1, 1, 3))]
CHECK_WG = [WgmmaConfig(256, 2, 1, 3), WgmmaConfig(256, 1, 1, 2), WgmmaConfig(256, 2, 3, 3)]
PART = os.environ.get("PART", "check,time")
PROBE_SHAPES = [("7b.gate_up", 37888, 3584), ("7b.down", 3584, 18944)]


def probe_module(kind: str):
    """A copy of ``fp4_wgmma_ws`` with one job taken out, to see which partition limits the kernel (section 34):
    ``nodecode``: the decode warps keep the barrier protocol but neither decode nor store; ``nomma``: the MMA
    warps keep it but issue no wgmma; ``nofence``: no proxy fence between the decoded stores and the hand-over
    (wrong results: timing only). Written to a temporary folder and imported from there (Gluon needs a source
    file)."""
    import importlib.util
    import tempfile
    src = open(ws.__file__).read()
    pad = " " * 12
    edits = {"nodecode": [pad + "w = _decode_tile(q, sb, ROWS, WPR, wl)\n", pad + "dec_smem.index(d).store(w)\n"],
             "nomma": [pad + "acc = warpgroup_mma(a_smem.index(s), b, acc, use_acc=i > 0, is_async=True)\n"],
             "nofence": [pad + "fence_async_shared()  # the generic-proxy stores before wgmma's async-proxy reads\n"]}
    for line in edits[kind]:
        assert src.count(line) == 1, (kind, line)
        src = src.replace(line, "")
    path = os.path.join(tempfile.mkdtemp(), f"fp4_wgmma_ws_{kind}.py")
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(f"fp4_wgmma_ws_{kind}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def probe(l2):
    mods = {"full": ws, **{kind: probe_module(kind) for kind in ("nodecode", "nomma", "nofence")}}
    for name, n, k in PROBE_SHAPES:
        dense, q, _ = sweep.make(n, k, 16)
        for direction in ("fwd", "bwd"):
            m = 4096
            cols_in, cols_out = (k, n) if direction == "fwd" else (n, k)
            sets = [(torch.randn(m, cols_in, device="cuda").to(torch.bfloat16), prepared(q),
                     torch.empty(m, cols_out, dtype=torch.bfloat16, device="cuda")) for _ in range(2)]
            steps = (k if direction == "fwd" else n) // ws.BLOCK_K
            tiles = -(-m // ws.BLOCK_M) * -(-cols_out // ws.BLOCK_N)
            res = []
            for label, mod in mods.items():
                t = time_graph([(lambda s=s, md=mod: md.launch(s[0], s[1].words, s[1].scales, s[1].global_scale, None,
                                                               s[2], direction)) for s in sets])
                us = t.median_ms * 1e3
                step_ns = us * 1e3 / (steps * tiles / 132)  # per step of one program, all SMs busy
                res.append((label, us, step_ns))
                sweep.emit({"kind": "probe", "shape": name, "m": m, "direction": direction, "variant": label, "us": us,
                            "ns_per_step": step_ns})
            print(f"probe {name:<11} {direction} M={m}: " + " | ".join(f"{lab} {us:.0f}us {ns:.0f}ns/step"
                                                                      for lab, us, ns in res), flush=True)
            del sets
        del dense, q


def prepared(q):
    return prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)


def run(direction, a, w, bias, out, cfg):
    if isinstance(cfg, WgmmaConfig):  # forward only
        fp4_linear(a, w, bias, out=out, config=cfg)
    else:
        ws.launch(a, w.words, w.scales, w.global_scale, bias, out, direction, cfg)


def wg_split(m, n, k, cfg):
    """``cfg`` with K-slices for about one program per SM when its tiles leave SMs idle (else None)."""
    tiles = -(-m // cfg.block_m) * -(-n // cfg.block_n)
    split = k_splits(tiles, k // 128, 132, 1)
    return None if split == 1 else WgmmaConfig(cfg.block_m, cfg.warpgroups, split, cfg.stages)


def dequant_cublas(direction, a, w, bias, out):
    deq = dequantize_exact(w, unscale=False)
    if direction == "fwd":
        out.addmm_(a, deq.t(), beta=0.0, alpha=256.0 * w.inv_global_scale)
        if bias is not None:
            out += bias
    else:
        out.addmm_(a, deq, beta=0.0, alpha=256.0 * w.inv_global_scale)


def correctness():
    worst = 0.0
    fails = 0
    for (m, n, k) in CHECK_CASES:
        dense, q, x = sweep.make(n, k, m, seed=m + n + k)
        w = prepared(q)
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        dy = torch.randn(m, n, device="cuda").to(torch.bfloat16)
        refs = {("fwd", True): reference_matmul(x, q, bias), ("fwd", False): reference_matmul(x, q),
                ("bwd", False): reference_grad_input(dy, q)}
        for (direction, with_bias), ref in refs.items():
            if not ws.supported_problem(n, k, direction):
                continue
            a = x if direction == "fwd" else dy
            cols = n if direction == "fwd" else k
            cub = torch.empty(m, cols, dtype=torch.bfloat16, device="cuda")
            dequant_cublas(direction, a, w, bias if with_bias else None, cub)
            for cfg in CHECK_CONFIGS + (CHECK_WG if direction == "fwd" else []):  # every K here is whole 128s
                out = torch.full((m, cols), float("nan"), dtype=torch.bfloat16, device="cuda")
                out2 = torch.empty_like(out)
                run(direction, a, w, bias if with_bias else None, out, cfg)
                run(direction, a, w, bias if with_bias else None, out2, cfg)
                torch.cuda.synchronize()
                rec = {"kind": "correct", "direction": direction, "m": m, "n": n, "k": k, "bias": with_bias,
                       "config": cfg.__dict__, "nan": int(torch.isnan(out).sum()),
                       "rel": mean_relative_error(out.float().nan_to_num(0), ref.float()),
                       "rel_cublas_path": mean_relative_error(cub.float(), ref.float()),
                       "deterministic": bool(torch.equal(out, out2)),
                       "equal_cublas_path": bool(torch.equal(out, cub)),
                       "max_abs": float((out.float() - ref.float()).abs().nan_to_num(1e30).max())}
                worst = max(worst, rec["rel"])
                sweep.emit(rec)
                if rec["nan"] or rec["rel"] > 1e-3 or not rec["deterministic"]:
                    fails += 1
                    print("CORRECTNESS FAIL", rec, flush=True)
        del dense, q, x, w
    print(f"correctness: worst mean rel err {worst:.2e}, {fails} failures  [{time.time() - sweep.T0:.0f}s]", flush=True)


def timing(l2):
    for name, n, k in SHAPES:
        dense, q, _ = sweep.make(n, k, 16)
        for m in MS:
            for direction in ("fwd", "bwd"):
                if not ws.supported_problem(n, k, direction):
                    continue
                cols_in, cols_out = (k, n) if direction == "fwd" else (n, k)
                a0 = torch.randn(m, cols_in, device="cuda").to(torch.bfloat16)
                rows = []
                bf_bytes = n * k * 2 + 2 * m * (k + n)
                sets = [(a0.clone(), dense.clone()) for _ in range(rotation_copies(bf_bytes, l2))]
                bf16_call = (lambda s: torch.nn.functional.linear(s[0], s[1])) if direction == "fwd" else \
                    (lambda s: torch.mm(s[0], s[1]))
                t = time_graph([(lambda s=s: bf16_call(s)) for s in sets])
                rows.append(("bf16", t.median_ms * 1e3))
                del sets
                fp_bytes = n * k * 0.5625 + 2 * m * (k + n)
                sets = [(a0.clone(), prepared(q), torch.empty(m, cols_out, dtype=torch.bfloat16, device="cuda"))
                        for _ in range(rotation_copies(fp_bytes, l2))]
                t = time_graph([(lambda s=s: dequant_cublas(direction, s[0], s[1], None, s[2])) for s in sets])
                rows.append(("dequant+cublas", t.median_ms * 1e3))
                configs = TIME_CONFIGS if m in (1024, 4096) and name in ("7b.gate_up", "7b.down", "7b.o") else TIME_CONFIGS[:1]
                if direction == "fwd":
                    configs = configs + WG_CONFIGS
                    split = wg_split(m, n, k, WG_CONFIGS[0][1])
                    configs += [("wg256x2-split", split)] if split is not None else []
                for label, cfg in configs:
                    try:
                        t = time_graph([(lambda s=s, c=cfg: run(direction, s[0], s[1], None, s[2], c)) for s in sets])
                        rows.append((label, t.median_ms * 1e3))
                    except Exception as e:  # a config that does not compile is a finding, not a crash
                        rows.append((label, float("nan")))
                        sweep.emit({"kind": "error", "shape": name, "m": m, "direction": direction, "variant": label,
                                    "error": repr(e)[:400]})
                del sets, a0
                bf = rows[0][1]
                flops = 2.0 * m * n * k
                for label, us in rows:
                    sweep.emit({"kind": "time", "shape": name, "n": n, "k": k, "m": m, "direction": direction,
                                "variant": label, "us": us, "speedup": bf / us, "tflops": flops / us / 1e6})
                print(f"{name:<12} {direction} M={m:<5} bf16 {bf:8.1f}us | " + " | ".join(
                    f"{lab} {us:.1f} x{bf / us:.2f}" for lab, us in rows[1:]), flush=True)
                torch.cuda.empty_cache()
        del dense, q


if __name__ == "__main__":
    sms, l2, _ = sweep.device_header()
    if "check" in PART:
        correctness()
    if "probe" in PART:
        probe(l2)
    if "time" in PART:
        timing(l2)
    print(f"done [{time.time() - sweep.T0:.0f}s]", flush=True)

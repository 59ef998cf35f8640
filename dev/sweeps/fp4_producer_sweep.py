"""Section 35 (dev/LOG.md): the register-A NVFP4 GEMM with a producer warp and no per-step CTA barrier
(``kernels/fp4_wgmma_producer.py``) against bf16 cuBLAS, dequantize + cuBLAS and ``fp4_wgmma`` with
``WgmmaConfig(256, 2)`` (the same per-warpgroup work with the barrier), forward at training sizes.

One call: correctness on awkward and real shapes (poisoned outputs, bias, determinism, the oracle
``reference_matmul``, bit-equality with ``fp4_wgmma`` 256 x 2, whose warpgroups run the same instructions in
the same K order), then device time per (shape, M) with the benchmark's CUDA-graph + L2-rotation timer.
``PART``: any of ``check``, ``time`` (default both) and ``probe`` (the kernel with its decode taken out,
``probe_module``); ``MS`` the sizes to time; ``CONFIGS`` the producer
launches to time as ``block_m/stages/consumer_regs`` items. Writes $OUT/sweep.jsonl; one line per (shape, M).

    OUT=/tmp/out PYTHONPATH=$PWD python dev/sweeps/fp4_producer_sweep.py
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp4_kernel_sweep as sweep  # noqa: E402  (opens $OUT/sweep.jsonl)

from qerl_lib.bench.gemm import mean_relative_error, rotation_copies, time_graph  # noqa: E402
from qerl_lib.kernels import fp4_wgmma_producer as pc  # noqa: E402
from qerl_lib.kernels.fp4_gemm import dequantize_exact, fp4_linear, prepare_fp4_weights  # noqa: E402
from qerl_lib.kernels.fp4_wgmma import WgmmaConfig, permute_x  # noqa: E402
from qerl_lib.kernels.launch_rule import k_splits  # noqa: E402
from qerl_lib.quant.nvfp4 import reference_matmul  # noqa: E402

SHAPES = [("7b.gate_up", 37888, 3584), ("7b.down", 3584, 18944), ("32b.gate_up", 55296, 5120),
          ("32b.down", 5120, 27648), ("7b.qkv", 4608, 3584), ("7b.o", 3584, 3584)]
MS = [int(v) for v in os.environ.get("MS", "1024,2048,4096,8192").split(",")]
CHECK_CASES = [(1, 128, 256), (77, 320, 512), (129, 1000, 1024), (300, 4608, 3584), (1024, 512, 3584),
               (257, 3584, 18944), (2048, 37888, 3584), (513, 200, 768)]  # M, N, K (K % 256 == 0)
CHECK_CONFIGS = [pc.ProducerConfig(), pc.ProducerConfig(256, 2), pc.ProducerConfig(128, 4), pc.ProducerConfig(128, 2, 56)]
# block_m/stages (runs 3-4 also timed options since removed: natural K order and one tile per program; LOG 35)
CONFIGS = os.environ.get("CONFIGS", "256/3,128/4").split(",")
REF_WG = WgmmaConfig(256, 2, 1, 3)
PART = os.environ.get("PART", "check,time")


def probe_module(kind: str):
    """A copy of ``fp4_wgmma_producer`` with one job taken out (timing only, wrong results): ``nodecode``, the
    consumers issue their MMAs on zeros instead of decoded weights (the words are still copied into the ring).
    Written to a temporary folder and imported from there (Gluon needs a source file)."""
    import importlib.util
    import tempfile
    src = open(pc.__file__).read()
    edits = {"nodecode": ("            a = _decode(q, sb, BN, a_l)\n", "            a = gl.zeros([BN, 128], gl.bfloat16, layout=a_l)\n")}
    old, new = edits[kind]
    assert src.count(old) == 1, (kind, old)
    src = src.replace(old, new)
    path = os.path.join(tempfile.mkdtemp(), f"fp4_wgmma_producer_{kind}.py")
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(f"fp4_wgmma_producer_{kind}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def probe(l2):
    mods = {"full": pc, "nodecode": probe_module("nodecode")}
    for name, n, k in [("7b.gate_up", 37888, 3584), ("7b.down", 3584, 18944)]:
        dense, q, _ = sweep.make(n, k, 16)
        for m in (1024, 4096):
            sets = [(permute_x(torch.randn(m, k, device="cuda").to(torch.bfloat16)), prepared(q),
                     torch.empty(m, n, dtype=torch.bfloat16, device="cuda")) for _ in range(2)]
            res = []
            for label, mod in mods.items():
                t = time_graph([(lambda s=s, md=mod: md.linear(s[0], s[1].words, s[1].scales, s[1].global_scale, None,
                                                               s[2], permuted=True)) for s in sets])
                us = t.median_ms * 1e3
                steps, tiles = k // 128, -(-m // 256) * -(-n // 128)  # the default launch: 256 rows, persistent
                res.append((label, us, us * 1e3 / (steps * tiles / 132)))
                sweep.emit({"kind": "probe", "shape": name, "m": m, "variant": label, "us": us, "ns_per_step": res[-1][2]})
            print(f"probe {name:<11} M={m}: " + " | ".join(f"{lab} {us:.0f}us {ns:.0f}ns/step" for lab, us, ns in res),
                  flush=True)
            del sets
        del dense, q


def prepared(q):
    return prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)


def run_pc(x, w, bias, out, cfg, permuted=False):
    pc.linear(x, w.words, w.scales, w.global_scale, bias, out, cfg, permuted=permuted)


def dequant_cublas(x, w, out):
    deq = dequantize_exact(w, unscale=False)
    out.addmm_(x, deq.t(), beta=0.0, alpha=256.0 * w.inv_global_scale)


def correctness():
    worst, fails = 0.0, 0
    for (m, n, k) in CHECK_CASES:
        dense, q, x = sweep.make(n, k, m, seed=m + n + k)
        w = prepared(q)
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        for with_bias in (False, True):
            b = bias if with_bias else None
            ref = reference_matmul(x, q, b)
            wg = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            fp4_linear(x, w, b, out=wg, config=REF_WG)
            for cfg in CHECK_CONFIGS:
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                out2 = torch.empty_like(out)
                run_pc(x, w, b, out, cfg)
                run_pc(x, w, b, out2, cfg)
                torch.cuda.synchronize()
                rec = {"kind": "correct", "m": m, "n": n, "k": k, "bias": with_bias, "config": cfg.__dict__,
                       "nan": int(torch.isnan(out).sum()), "rel": mean_relative_error(out.float().nan_to_num(0), ref.float()),
                       "deterministic": bool(torch.equal(out, out2)), "equal_wgmma_256x2": bool(torch.equal(out, wg)),
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
            x0 = torch.randn(m, k, device="cuda").to(torch.bfloat16)
            rows = []
            sets = [(x0.clone(), dense.clone()) for _ in range(rotation_copies(n * k * 2 + 2 * m * (k + n), l2))]
            t = time_graph([(lambda s=s: torch.nn.functional.linear(s[0], s[1])) for s in sets])
            rows.append(("bf16", t.median_ms * 1e3))
            del sets
            sets = [(x0.clone(), prepared(q), torch.empty(m, n, dtype=torch.bfloat16, device="cuda"))
                    for _ in range(rotation_copies(n * k * 0.5625 + 2 * m * (k + n), l2))]
            t = time_graph([(lambda s=s: dequant_cublas(s[0], s[1], s[2])) for s in sets])
            rows.append(("dequant+cublas", t.median_ms * 1e3))
            t = time_graph([(lambda s=s: fp4_linear(s[0], s[1], None, out=s[2], config=REF_WG)) for s in sets])
            rows.append(("wg256x2", t.median_ms * 1e3))
            if m < 1024:  # the decode-size Gluon launch widened to these rows: 128 rows, one warpgroup, K-slices
                split = k_splits(-(-m // 128) * -(-n // 64), k // 128, 132, 2)
                cfg = WgmmaConfig(128, 1, split)
                t = time_graph([(lambda s=s, c=cfg: fp4_linear(s[0], s[1], None, out=s[2], config=c)) for s in sets])
                rows.append((f"wg128x1/s{split}", t.median_ms * 1e3))
            for spec in CONFIGS:
                parts = spec.split("/")
                cfg = pc.ProducerConfig(int(parts[0]), int(parts[1]))
                label = f"pc{spec}"
                try:
                    t = time_graph([(lambda s=s, c=cfg: run_pc(s[0], s[1], None, s[2], c)) for s in sets])
                    rows.append((label, t.median_ms * 1e3))
                    # the kernel alone: x already in the K relabeling (the permute is one torch copy per call)
                    xps = [permute_x(s[0]) for s in sets]
                    t = time_graph([(lambda s=s, xp=xp, c=cfg: run_pc(xp, s[1], None, s[2], c, permuted=True))
                                    for s, xp in zip(sets, xps)])
                    rows.append((label + "-kernel", t.median_ms * 1e3))
                    del xps
                except Exception as e:  # a launch that fails is a finding, not a crash
                    rows.append((label, float("nan")))
                    sweep.emit({"kind": "error", "shape": name, "m": m, "variant": label, "error": repr(e)[:400]})
            del sets, x0
            bf = rows[0][1]
            flops = 2.0 * m * n * k
            for label, us in rows:
                sweep.emit({"kind": "time", "shape": name, "n": n, "k": k, "m": m, "direction": "fwd",
                            "variant": label, "us": us, "speedup": bf / us, "tflops": flops / us / 1e6})
            print(f"{name:<12} M={m:<5} bf16 {bf:8.1f}us | " + " | ".join(
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

"""Section 32 (dev/LOG.md): the Gluon NVFP4 GEMM (``kernels/fp4_wgmma.py``: async wgmma, x shared by two
warpgroups) against the Triton fragment kernel and bf16 cuBLAS, at decode batches and at training sizes.

One call: correctness of every variant on awkward and real shapes (poisoned outputs, bias, determinism,
oracle ``reference_matmul``), then device time per (shape, M) with the benchmark's CUDA-graph + L2-rotation
timer (``fp4_kernel_sweep.time_variants``). ``PART=decode`` (M = 16-128), ``PART=train`` (M = 1024-8192) or
both (default); ``PART=mid`` / ``mid2`` / ``wave`` (section 33: M = 32 / 64 / 128, the ring's depth, 2 and 4 warpgroups sharing x,
the 128-register cap that fits two 2-warpgroup programs per SM). Writes $OUT/sweep.jsonl; prints one line per
(shape, M).

    OUT=/tmp/out PYTHONPATH=$PWD python dev/sweeps/fp4_wgmma_sweep.py
    # on the device machine, detached (section 32's run):
    bash dev/sweeps/gpu_job.sh start 'python3 -m pytest -q -m cuda tests/test_fp4_wgmma.py > $OUT/cuda_tests_wgmma.log 2>&1;
        python3 dev/sweeps/fp4_wgmma_sweep.py > $OUT/sweep.log 2>&1'
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp4_kernel_sweep as sweep  # noqa: E402  (opens $OUT/sweep.jsonl)
from fp4_mid_m_sweep import SHAPES  # noqa: E402

from qerl_lib.bench.gemm import mean_relative_error  # noqa: E402
from qerl_lib.kernels.fp4_gemm import fp4_linear, prepare_fp4_weights  # noqa: E402
from qerl_lib.kernels.fp4_wgmma import WgmmaConfig  # noqa: E402
from qerl_lib.kernels.launch_rule import k_splits  # noqa: E402
from qerl_lib.quant.nvfp4 import reference_matmul  # noqa: E402

DECODE_MS = (16, 32, 64, 128)
TRAIN_MS = (1024, 4096, 8192)
CHECK_CASES = [(1, 200, 256), (5, 130, 384), (16, 4608, 3584), (33, 3584, 3584), (64, 1000, 1024),
               (100, 3584, 18944), (128, 5120, 2048), (200, 1000, 1024), (1024, 4608, 3584)]  # M, N, K
CHECK_CONFIGS = [WgmmaConfig(16, 1), WgmmaConfig(16, 2, 3), WgmmaConfig(32, 2, 2), WgmmaConfig(64, 1),
                 WgmmaConfig(64, 2, 4), WgmmaConfig(128, 2), WgmmaConfig(128, 2, 2),
                 WgmmaConfig(64, 4, 1, 6), WgmmaConfig(32, 4, 2, 3), WgmmaConfig(64, 2, 3, 4, 128), WgmmaConfig(128, 1, 1, 2),
                 WgmmaConfig(64, 1, 2, 5)]


def block_m_for(m: int) -> int:
    return max(16, 1 << (m - 1).bit_length())


def decode_variants(m: int, n: int, k: int, sms: int) -> list:
    out = [("auto", False, None)]
    bm = min(block_m_for(m), 128)
    for wg in (1, 2):
        tiles = math.ceil(n / (64 * wg)) * math.ceil(m / bm)
        for per_sm in (1, 2, 4):
            split = k_splits(tiles, k // 128, sms, per_sm)
            label = f"wg{wg}-m{bm}-s{split}"
            if not any(v[0] == label for v in out):
                out.append((label, False, WgmmaConfig(bm, wg, split)))
    return out


def mid_variants(m: int, n: int, k: int, sms: int, second: bool = False) -> list:
    """Section 33's variants: (warpgroups, stages, register cap, programs per SM the split aims at);
    ``second``: the second run's shallower rings (more programs per SM) and finer K-splits, one warpgroup."""
    bm = min(block_m_for(m), 128)
    if second:
        grid = [(1, 4, None, 2), (1, 3, None, 2), (1, 3, None, 3), (1, 2, None, 3), (1, 3, None, 6), (1, 4, None, 6),
                (1, 2, None, 6)] if bm < 128 else [(1, 3, None, 2), (1, 3, None, 4), (1, 2, None, 4)]
    elif bm == 128:
        grid = [(1, 4, None, 2), (1, 3, None, 2), (1, 2, None, 2), (1, 3, None, 4), (2, 3, None, 1), (2, 4, None, 1)]
    else:
        grid = [(1, 4, None, 2), (1, 5, None, 2), (2, 4, 128, 2), (2, 4, 128, 4), (2, 3, 128, 2), (2, 6, None, 1),
                (4, 4, None, 1), (4, 6, None, 1), (4, 4, None, 2), (4, 6, None, 2)]
    out = [("auto", False, None)]
    for wg, stages, regs, per_sm in grid:
        split = k_splits(math.ceil(n / (64 * wg)) * math.ceil(m / bm), k // 128, sms, per_sm)
        label = f"wg{wg}-st{stages}-r{regs or 0}-s{split}"
        if not any(v[0] == label for v in out):
            out.append((label, False, WgmmaConfig(bm, wg, split, stages, regs)))
    return out


def wave_variants(m: int, n: int, k: int, sms: int) -> list:
    """Section 33's third run: the rule with and without wave balancing, and balancing that assumes one
    program per SM fewer than `WGMMA_PROGRAMS_PER_SM` (in case the real occupancy is lower)."""
    from qerl_lib.kernels.launch_rule import WGMMA_PROGRAMS_PER_SM, pick_wgmma_config
    cfg = pick_wgmma_config(m, n, k, sms)
    if cfg is None:
        return [("auto", False, None)]
    fewer = sms * max(1, WGMMA_PROGRAMS_PER_SM[cfg.block_m] - 1)
    return [("auto", False, None), ("nowave", False, dataclasses.replace(cfg, wave_slots=0)),
            ("wave", False, cfg), ("wave-1", False, dataclasses.replace(cfg, wave_slots=fewer))]


def train_variants(m: int, n: int, k: int, sms: int) -> list:
    return [("auto", False, None), ("wg2-m128", False, WgmmaConfig(128, 2)), ("wg2-m64", False, WgmmaConfig(64, 2)),
            ("wg1-m64", False, WgmmaConfig(64, 1))]


def check() -> bool:
    worst, ok_all = 0.0, True
    for m, n, k in CHECK_CASES:
        _, q, x = sweep.make(n, k, m, seed=m + n + k)
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        prep = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
        for b in (None, bias):
            ref = reference_matmul(x, q, b)
            auto = fp4_linear(x, prep, b)
            for cfg in CHECK_CONFIGS:
                out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                fp4_linear(x, prep, b, out=out, config=cfg)
                again = fp4_linear(x, prep, b, config=cfg)
                rel = mean_relative_error(out.float().nan_to_num(0), ref.float())
                ok = not torch.isnan(out).any() and rel < 1e-3 and torch.equal(out, again)
                same = float((out == auto).float().mean())
                worst, ok_all = max(worst, rel), ok_all and ok
                sweep.emit({"kind": "correct", "m": m, "n": n, "k": k, "bias": b is not None, "config": cfg.__dict__,
                            "rel": rel, "ok": bool(ok), "equal_to_auto": same})
                if not ok:
                    print(f"CORRECTNESS FAIL {cfg} M={m} N={n} K={k} bias={b is not None} rel {rel:.2e}", flush=True)
        del q, x
    print(f"correctness: worst mean rel err {worst:.2e} all ok {ok_all} [{time.time() - sweep.T0:.0f}s]", flush=True)
    return ok_all


def main() -> int:
    sms, l2, copy_gbps = sweep.device_header()
    part = os.environ.get("PART", "all")
    if not check():
        print("stopping: a variant is wrong", flush=True)
        return 1
    if part in ("all", "decode"):
        for m in DECODE_MS:
            for name, n, k in SHAPES:
                sweep.time_variants(name, n, k, m, decode_variants(m, n, k, sms), l2, copy_gbps)
    if part in ("mid", "mid2"):
        for m in (64, 32, 128) if part == "mid" else (64, 32, 96, 128):
            for name, n, k in SHAPES:
                sweep.time_variants(name, n, k, m, mid_variants(m, n, k, sms, part == "mid2"), l2, copy_gbps)
    if part == "wave":
        for m in (64, 32, 128):
            for name, n, k in SHAPES:
                sweep.time_variants(name, n, k, m, wave_variants(m, n, k, sms), l2, copy_gbps)
    if part in ("all", "train"):
        for m in TRAIN_MS:
            for name, n, k in SHAPES[:4]:
                sweep.time_variants(name, n, k, m, train_variants(m, n, k, sms), l2, copy_gbps)
    print(f"done [{time.time() - sweep.T0:.0f}s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

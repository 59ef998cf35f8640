"""Arithmetic and summaries behind ``notebooks/03_fp4_kernel.ipynb``: bytes per decoded token, the
GEMM roofline, and the headline numbers of the committed GEMM and rollout benchmarks.

Why weight-only 4-bit speeds up decode
--------------------------------------
One decode step multiplies each weight matrix by a handful of token vectors (M = batch rows). The
GEMM does ``2 * M * N * K`` flops but must read all ``N * K`` weights, so its arithmetic intensity is
about ``2 * M / bytes_per_weight`` flop/byte: 1 flop/byte for bf16 at M = 1, far below an H100's
ridge point (~270 flop/byte). The step is then bound by memory bandwidth, and its time is the bytes
read divided by the bandwidth. NVFP4 stores 4 bits of code plus one 8-bit scale per 16 weights,
4.5 bits instead of 16, so the linear layers read 16 / 4.5 = 3.56x fewer bytes: that is the ceiling
on the speedup, reached only if the FP4 kernel streams its bytes as efficiently as cuBLAS streams
bf16. The embeddings and ``lm_head`` stay bf16 (the official recipe ignores ``lm_head``), so a whole
model's ceiling is lower; the KV cache read is left out here (it is small at 256-2048 tokens of
context for a batch of a few rows).

Everything here is plain Python over ``data/configs`` and the results JSONs; nothing touches a GPU.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from pathlib import Path

from qerl_lib.quant.nvfp4 import GROUP_SIZE
from qerl_lib.paths import CONFIGS_DIR, load_model_config  # noqa: F401 (re-exported)

# the same constants as qerl_lib.bench.gemm (not imported: bench sits on this module's floor)
FP4_BYTES_PER_WEIGHT = 0.5 + 1 / GROUP_SIZE  # 4-bit code + one E4M3 scale per 16 weights
BF16_BYTES_PER_WEIGHT = 2.0
CEILING = BF16_BYTES_PER_WEIGHT / FP4_BYTES_PER_WEIGHT  # 16 / 4.5 = 3.56x

TARGET_SPEEDUP_M_LE_16 = 3.0  # the kernel issue's targets
TARGET_SPEEDUP_M_GE_1024 = 0.95


def current_kernel_hash() -> str:
    """sha256 (12 hex digits) of this tree's fp4_kernel.py, as ``bench_rollout.code_hashes`` records it."""
    return hashlib.sha256((Path(__file__).resolve().parent / "fp4_kernel.py").read_bytes()).hexdigest()[:12]


def decode_bytes_per_token(model: str) -> dict:
    """Weight bytes one decode step reads (batch 1), bf16 vs NVFP4 linears, from ``data/configs/<model>.json``."""
    cfg = load_model_config(model)
    hidden, inter, layers = int(cfg["hidden_size"]), int(cfg["intermediate_size"]), int(cfg["num_hidden_layers"])
    head_dim = int(cfg.get("head_dim") or hidden // int(cfg["num_attention_heads"]))
    q_dim = int(cfg["num_attention_heads"]) * head_dim
    kv_dim = int(cfg["num_key_value_heads"]) * head_dim
    # q, k, v, o, gate, up, down: the seven projections NVFP4 quantizes
    per_layer = hidden * q_dim + 2 * hidden * kv_dim + q_dim * hidden + 3 * hidden * inter
    linear = layers * per_layer
    lm_head = int(cfg["vocab_size"]) * hidden  # bf16 in both formats; read in full every step
    bf16 = linear * BF16_BYTES_PER_WEIGHT + lm_head * BF16_BYTES_PER_WEIGHT
    fp4 = linear * FP4_BYTES_PER_WEIGHT + lm_head * BF16_BYTES_PER_WEIGHT
    return {"model": model, "linear_params": linear, "lm_head_params": lm_head,
            "bf16_bytes": bf16, "nvfp4_bytes": fp4, "linear_ratio": CEILING, "model_ratio": bf16 / fp4}


def gemm_intensity(m: int, n: int, k: int, bytes_per_weight: float) -> float:
    """flop/byte of ``out[m, n] = x[m, k] @ W[n, k].T``: weights + bf16 x + bf16 out moved once."""
    return 2 * m * n * k / (n * k * bytes_per_weight + 2 * m * (k + n))


def roofline_table(n: int, k: int, ms: Sequence[int], copy_gbps: float, peak_tflops: float) -> list[dict]:
    """Per M: intensity bf16/FP4 and the attainable TFLOP/s ``min(peak, bandwidth * intensity)``."""
    rows = []
    for m in ms:
        row = {"m": m}
        for name, bpw in (("bf16", BF16_BYTES_PER_WEIGHT), ("fp4", FP4_BYTES_PER_WEIGHT)):
            ai = gemm_intensity(m, n, k, bpw)
            row[f"{name}_flop_per_byte"] = ai
            row[f"{name}_roof_tflops"] = min(peak_tflops, copy_gbps * 1e9 * ai / 1e12)
        row["roof_speedup"] = row["fp4_roof_tflops"] / row["bf16_roof_tflops"]
        rows.append(row)
    return rows


def gemm_headline(doc: dict) -> dict:
    """Per model, recomputed from the rows: geomean speedup M <= 16, min speedup M >= 1024 (and
    where), best M <= 16 point, bandwidth efficiency of both kernels at M <= 16; plus the targets."""
    out = {}
    for model in sorted({r["model"] for r in doc["rows"]}):
        mine = [r for r in doc["rows"] if r["model"] == model]
        small = [r for r in mine if r["m"] <= 16]
        large = [r for r in mine if r["m"] >= 1024]
        worst = min(large, key=lambda r: r["speedup"]) if large else None
        best = max(small, key=lambda r: r["speedup"]) if small else None
        gm = math.exp(sum(math.log(r["speedup"]) for r in small) / len(small)) if small else None
        out[model] = {
            "geomean_speedup_m_le_16": gm,
            "target_m_le_16": TARGET_SPEEDUP_M_LE_16, "met_m_le_16": gm is not None and gm >= TARGET_SPEEDUP_M_LE_16,
            "min_speedup_m_ge_1024": worst["speedup"] if worst else None,
            "min_speedup_m_ge_1024_at": f"{worst['proj']} M={worst['m']}" if worst else None,
            "target_m_ge_1024": TARGET_SPEEDUP_M_GE_1024,
            "met_m_ge_1024": worst is not None and worst["speedup"] >= TARGET_SPEEDUP_M_GE_1024,
            "best_m_le_16": {k: best[k] for k in ("proj", "m", "speedup", "fp4_pct_copy")} if best else None,
            "median_bf16_pct_copy_m_le_16": _median([r["bf16_pct_copy"] for r in small]),
            "median_fp4_pct_copy_m_le_16": _median([r["fp4_pct_copy"] for r in small]),
            "max_rel_err": max(r["rel_err"] for r in mine),
            "all_ok": all(r["ok"] for r in mine),
        }
    return out


def rollout_headline(doc: dict, current_kernel_hash: str | None = None) -> dict:
    """The rollout JSON's own acceptance checks, its run dates and kernel hashes, and whether the
    kernel those runs used is the file in this tree (``current_kernel_hash``: 12 hex digits)."""
    runs = doc["provenance"] if isinstance(doc["provenance"], list) else [doc["provenance"]]
    codes = doc.get("code") or []
    codes = codes if isinstance(codes, list) else [codes]
    hashes = sorted({c["fp4_kernel.py"] for c in codes if c and "fp4_kernel.py" in c})
    return {
        "device": runs[0]["device"].get("name"),
        "run_dates": [r["date"] for r in runs],
        "fp4_kernel_hashes": hashes,
        "runs_without_code_hash": sum(1 for c in codes if not c) + max(0, len(runs) - len(codes)),
        "kernel_is_current": None if current_kernel_hash is None else hashes == [current_kernel_hash],
        "targets": doc["summary"].get("targets", {}),
        "nvfp4_over_bf16": {k: v for k, v in doc["summary"].items() if k.startswith("nvfp4_over_bf16")},
    }


def _median(values: Sequence[float]) -> float | None:
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2

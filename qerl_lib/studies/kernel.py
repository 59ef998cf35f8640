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

import math
from collections.abc import Sequence
from pathlib import Path

from qerl_lib.io import tree_sha256
from qerl_lib.models.fused import layer_projection_shapes
from qerl_lib.quant.nvfp4 import GROUP_SIZE
from qerl_lib.paths import load_model_config

# the same values as the constants of these names in qerl_lib.bench.gemm
FP4_BYTES_PER_WEIGHT = 0.5 + 1 / GROUP_SIZE  # 4-bit code + one E4M3 scale per 16 weights
BF16_BYTES_PER_WEIGHT = 2.0
CEILING = BF16_BYTES_PER_WEIGHT / FP4_BYTES_PER_WEIGHT  # 16 / 4.5 = 3.56x

TARGET_SPEEDUP_M_LE_16 = 3.0  # the kit's own targets for the kernel; the paper sets none for the GEMM alone
TARGET_SPEEDUP_M_GE_1024 = 0.95


KERNEL_FILE = Path(__file__).resolve().parent.parent / "kernels" / "fp4_gemm.py"
# names under which a rollout JSON's ``code`` block may record that file (it was fp4_kernel.py before the
# library was split into subpackages)
KERNEL_HASH_KEYS = ("kernels/fp4_gemm.py", "fp4_gemm.py", "fp4_kernel.py")


def current_kernel_hash() -> str:
    """sha256 (12 hex digits) of this tree's Triton FP4 kernel, as `qerl_lib.bench.rollout.code_hashes` records it."""
    return tree_sha256(KERNEL_FILE)


def decode_bytes_per_token(model: str) -> dict:
    """Weight bytes one decode step reads (batch 1), bf16 vs NVFP4 linears, from ``data/configs/<model>.json``."""
    cfg = load_model_config(model)
    # q, k, v, o, gate, up, down: the seven projections NVFP4 quantizes
    per_layer = sum(n * k for n, k in layer_projection_shapes(cfg).values())
    linear = int(cfg["num_hidden_layers"]) * per_layer
    lm_head = int(cfg["vocab_size"]) * int(cfg["hidden_size"])  # bf16 in both formats; read in full every step
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


def dispatch_table(model: str, ms: Sequence[int], layouts: Sequence[str] = ("hf", "fused"),
                   num_sms: int = 132) -> list[dict]:
    """Which FP4 kernel ``fp4_gemm.fp4_linear`` runs for each projection of ``model`` at each row count in ``ms``
    on a Hopper GPU with ``num_sms`` SMs (132: an H100 SXM or H200) and the defaults (every kernel on, weights
    TMA-aligned): the CUDA ``mma.sync`` kernel where it takes the call, else ``launch_rule.plan_launch``'s
    choice, by the label the GEMM benchmark gives it. One row per row count: ``m`` and one key per projection
    shape (``bench.gemm.projection_shapes``' names). Computed from the launch rules: what the code does."""
    from qerl_lib.bench.gemm import projection_shapes
    from qerl_lib.kernels import launch_rule

    shapes = projection_shapes(model, layouts)
    rows = []
    for m in ms:
        row = {"m": m}
        for shape in shapes:
            if launch_rule.mma_shape(m, shape.k):
                row[shape.name] = "mma"
            else:
                config = launch_rule.plan_launch(m, shape.n, shape.k, num_sms, gluon=True, producer_aligned=True,
                                                 ra=True)
                row[shape.name] = launch_rule.path_name(config)
        rows.append(row)
    return rows


def gemm_headline(doc: dict) -> dict:
    """Per model, recomputed from the forward-layout rows (rows without a ``direction`` key are
    forward rows): geomean speedup M <= 16, min speedup M >= 1024 (and where), best M <= 16 point,
    bandwidth efficiency of both kernels at M <= 16; the backward layout's min speedup M >= 1024
    (None without backward rows); the correctness numbers over all rows; plus the targets."""
    out = {}
    for model in sorted({r["model"] for r in doc["rows"]}):
        every = [r for r in doc["rows"] if r["model"] == model]
        mine = [r for r in every if r.get("direction", "fwd") == "fwd"]
        small = [r for r in mine if r["m"] <= 16]
        large = [r for r in mine if r["m"] >= 1024]
        worst = min(large, key=lambda r: r["speedup"]) if large else None
        large_bwd = [r for r in every if r.get("direction") == "bwd" and r["m"] >= 1024]
        worst_bwd = min(large_bwd, key=lambda r: r["speedup"]) if large_bwd else None
        best = max(small, key=lambda r: r["speedup"]) if small else None
        gm = _geomean([r["speedup"] for r in small])
        out[model] = {
            "geomean_speedup_m_le_16": gm,
            "geomean_speedup_m_le_8": _geomean([r["speedup"] for r in small if r["m"] <= 8]),
            "geomean_speedup_m_le_16_by_layout": {layout: _geomean([r["speedup"] for r in small
                                                                     if r.get("layout") == layout])
                                                  for layout in sorted({r.get("layout") for r in small} - {None})},
            "target_m_le_16": TARGET_SPEEDUP_M_LE_16, "met_m_le_16": gm is not None and gm >= TARGET_SPEEDUP_M_LE_16,
            "min_speedup_m_ge_1024": worst["speedup"] if worst else None,
            "min_speedup_m_ge_1024_at": f"{worst['proj']} M={worst['m']}" if worst else None,
            "target_m_ge_1024": TARGET_SPEEDUP_M_GE_1024,
            "met_m_ge_1024": worst is not None and worst["speedup"] >= TARGET_SPEEDUP_M_GE_1024,
            "min_speedup_m_ge_1024_bwd": worst_bwd["speedup"] if worst_bwd else None,
            "min_speedup_m_ge_1024_bwd_at": f"{worst_bwd['proj']} M={worst_bwd['m']}" if worst_bwd else None,
            "met_m_ge_1024_bwd": worst_bwd is not None and worst_bwd["speedup"] >= TARGET_SPEEDUP_M_GE_1024,
            "best_m_le_16": {k: best[k] for k in ("proj", "m", "speedup", "fp4_pct_copy")} if best else None,
            "median_bf16_pct_copy_m_le_16": _median([r["bf16_pct_copy"] for r in small]),
            "median_fp4_pct_copy_m_le_16": _median([r["fp4_pct_copy"] for r in small]),
            "max_rel_err": max(r["rel_err"] for r in every),
            "all_ok": all(r["ok"] for r in every),
        }
    return out


def rollout_headline(doc: dict, current_kernel_hash: str | None = None) -> dict:
    """The rollout JSON's own acceptance checks, its run dates and kernel hashes, and whether the
    kernel those runs used is the file in this tree (``current_kernel_hash``: 12 hex digits)."""
    runs = doc["provenance"] if isinstance(doc["provenance"], list) else [doc["provenance"]]
    codes = doc.get("code") or []
    codes = codes if isinstance(codes, list) else [codes]
    hashes = sorted({c[k] for c in codes if c for k in KERNEL_HASH_KEYS if k in c})
    return {
        "device": runs[0]["device"].get("name"),
        "run_dates": [r["date"] for r in runs],
        "fp4_kernel_hashes": hashes,
        "runs_without_code_hash": sum(1 for c in codes if not c) + max(0, len(runs) - len(codes)),
        "kernel_is_current": None if current_kernel_hash is None else hashes == [current_kernel_hash],
        "targets": doc["summary"].get("targets", {}),
        "nvfp4_over_bf16": {k: v for k, v in doc["summary"].items() if k.startswith("nvfp4_over_bf16")},
    }


def step_split(doc: dict, weights: str = "nvfp4", context: int | None = None) -> dict:
    """One row of a decode-step breakdown JSON (``dev/sweeps/rollout_step_breakdown.py``, e.g.
    ``results/rollout_step_breakdown_h200.json``: kernel time per category from a profiler trace): the
    categories sorted by time, each with its share of the step's busy time, plus the idle time between
    kernels. `context` picks the cached length (default: the middle one)."""
    rows = [r for r in doc["rows"] if r["weights"] == weights]
    if not rows:
        raise ValueError(f"no {weights!r} rows (have {sorted({r['weights'] for r in doc['rows']})})")
    contexts = sorted(r["context"] for r in rows)
    context = contexts[len(contexts) // 2] if context is None else context
    row = next((r for r in rows if r["context"] == context), None)
    if row is None:
        raise ValueError(f"no {weights!r} row at context {context} (have {contexts})")
    busy = row["busy_us_per_step"]
    parts = sorted(row["us_per_step"].items(), key=lambda kv: -kv[1])
    return {"model": row["model"], "weights": weights, "batch": row["batch"], "context": context,
            "busy_ms": busy / 1e3, "idle_ms": row["idle_us_per_step"] / 1e3, "kernels": row["kernels_per_step"],
            "parts": [{"category": k, "ms": v / 1e3, "share": v / busy} for k, v in parts]}


def _geomean(values: Sequence[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def _median(values: Sequence[float]) -> float | None:
    xs = sorted(v for v in values if v is not None and not math.isnan(v))
    if not xs:
        return None
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2

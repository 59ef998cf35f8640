"""GPU benchmarks: shared timing helpers and the NVFP4 x BF16 GEMM benchmark (``qerl bench gemm``).

How the numbers are taken (and why)
-----------------------------------
* **Device time, not host time.** Kernels are timed with CUDA events. Small decode GEMMs run for
  a few microseconds, less than it takes Python to launch them, so every timed region is a CUDA
  graph replay: the graph holds one call per input set, back to back, and the time per call is
  the replay time divided by the number of calls. This is how a serving engine (vLLM, SGLang)
  runs decode, and it is the same for the BF16 baseline and the FP4 kernel.
* **Rotating inputs larger than L2.** H100 has 50 MB of L2 (H200: 60 MB). A weight that fits
  would be served from L2 on the second call and the "bandwidth" would be L2's. Every shape is
  therefore timed over enough distinct copies of weights and activations that one pass touches
  more than 3x the L2 size (at least 2 copies), for the BF16 baseline too.
* **Warm-up, then median over repeats** (with the 20th/80th percentiles as the spread). The first
  eager calls compile the Triton kernels and create cuBLAS handles; they are never timed.
* **Ceilings are measured.** Achieved GB/s counts the bytes a call must move (weights + x + out)
  and is reported as a percentage of this device's measured device-to-device copy bandwidth
  (bytes read + bytes written over time), not the datasheet number.
* **Correctness on every shape.** The output is filled with NaN before the run, so an element
  the kernel failed to write stays NaN; then the mean relative error
  ``mean|out - ref| / mean|ref|`` against ``nvfp4.reference_matmul`` (fp32, TF32 off) is stored.
* **Both layouts of training.** ``direction`` "fwd" times ``y = x @ W.T`` (``fp4_linear`` vs
  ``F.linear``); "bwd" times the input gradient ``dx = dy @ W`` (``fp4_grad_input`` vs
  ``torch.mm(dy, W)``, ``dy [M, N]``, checked against ``nvfp4.reference_grad_input``). Both move the
  same bytes (weights + bf16 ``[M, N]`` and ``[M, K]``) and flops. The summary's historical keys
  (geomean at M <= 16, ``min_speedup_m_ge_1024``) are computed from the fwd rows; rows without a
  ``direction`` key (files written before it existed) are fwd rows.

The timing helpers (``time_graph``, ``time_eager``, ``copy_bandwidth_gbps``, ``l2_cache_bytes``,
``rotation_copies``, ``mean_relative_error``, ``TimingStats``) are shared with the sweeps in
``dev/sweeps/``; tables come from ``bench/table.py``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from qerl_lib.bench.table import format_table
from qerl_lib.errors import UserError
from qerl_lib.models.fused import PROJECTIONS, layer_projection_shapes
from qerl_lib.paths import load_model_config

FP4_BYTES_PER_WEIGHT = 0.5 + 1 / 16  # 4-bit code + one E4M3 scale per 16 weights
BF16_BYTES_PER_WEIGHT = 2.0
CEILING = BF16_BYTES_PER_WEIGHT / FP4_BYTES_PER_WEIGHT  # 16 / 4.5 = 3.56x
DEFAULT_MODELS = ("qwen2.5-7b", "qwen2.5-32b")
DEFAULT_MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096)
LAYOUTS = ("hf", "fused")  # one GEMM per HF projection module; vLLM-style fused q|k|v and gate|up
DIRECTIONS = ("fwd", "bwd")  # y = x @ W.T (forward); dx = dy @ W (backward, the input gradient)
MAX_REL_ERR = 1e-3  # acceptance bound on the mean relative error vs the oracle


# ============================================================================ timing helpers
@dataclass(frozen=True)
class TimingStats:
    """Per-call device time in milliseconds: median and 20th/80th percentiles over repeats."""

    median_ms: float
    p20_ms: float
    p80_ms: float
    repeats: int

    @classmethod
    def from_samples(cls, samples_ms: Sequence[float]) -> TimingStats:
        xs = sorted(samples_ms)
        q = statistics.quantiles(xs, n=10, method="inclusive") if len(xs) > 1 else [xs[0]] * 9
        return cls(statistics.median(xs), q[1], q[7], len(xs))


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise UserError("this benchmark needs an NVIDIA GPU (torch.cuda.is_available() is False); "
                        "run it on a GPU machine, CPU timings would mean nothing")


def _event_ms(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _repeat_count(estimate_ms: float, target_ms: float, min_repeats: int, max_repeats: int) -> int:
    return int(min(max_repeats, max(min_repeats, math.ceil(target_ms / max(estimate_ms, 1e-3)))))


def time_graph(calls: Sequence[Callable[[], object]], *, warmup: int = 3, min_repeats: int = 10,
               max_repeats: int = 100, target_ms: float = 100.0) -> TimingStats:
    """Capture ``calls`` (one per input set, run back to back) in a CUDA graph and time its replays.

    Each call is first run eagerly on a side stream (compilation, cuBLAS handles, allocator
    warm-up), as graph capture requires. Returns the per-call time (replay time / len(calls)).
    """
    _require_cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=side):  # a stream of the current device (see engine/cache.py)
        for call in calls:
            call()
    for _ in range(warmup):
        graph.replay()
    estimate = _event_ms(graph.replay)
    repeats = _repeat_count(estimate, target_ms, min_repeats, max_repeats)
    samples = [_event_ms(graph.replay) / len(calls) for _ in range(repeats)]
    del graph
    return TimingStats.from_samples(samples)


def time_eager(calls: Sequence[Callable[[], object]], *, warmup: int = 3, min_repeats: int = 10,
               max_repeats: int = 100, target_ms: float = 100.0) -> TimingStats:
    """Like ``time_graph`` but launching from Python each time (includes launch overhead)."""
    _require_cuda()

    def run_all():
        for call in calls:
            call()

    for _ in range(warmup):
        run_all()
    torch.cuda.synchronize()
    estimate = _event_ms(run_all)
    repeats = _repeat_count(estimate, target_ms, min_repeats, max_repeats)
    return TimingStats.from_samples([_event_ms(run_all) / len(calls) for _ in range(repeats)])


def copy_bandwidth_gbps(nbytes: int = 1 << 31, repeats: int = 20) -> float:
    """Measured device-to-device copy bandwidth in GB/s, counting bytes read + bytes written."""
    _require_cuda()
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = statistics.median(_event_ms(lambda: dst.copy_(src)) for _ in range(repeats))
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms * 1e-3) / 1e9


def l2_cache_bytes() -> int:
    props = torch.cuda.get_device_properties(0)
    return int(getattr(props, "L2_cache_size", 50 * 2**20) or 50 * 2**20)


def geomean(values: Sequence[float]) -> float | None:
    vals = [v for v in values if v is not None and v > 0]
    return math.exp(sum(map(math.log, vals)) / len(vals)) if vals else None


# ============================================================================ GEMM shapes
@dataclass(frozen=True)
class GemmShape:
    """One projection GEMM ``out[M, N] = x[M, K] @ W[N, K].T`` of a model layer."""

    model: str
    name: str  # e.g. "q_proj,o_proj" (HF modules sharing this shape) or "qkv_proj" (fused)
    n: int
    k: int
    layout: str  # "hf": one module per projection (NVFP4Linear); "fused": vLLM-style q|k|v, gate|up


def projection_shapes(model: str, layouts: Sequence[str] = LAYOUTS) -> list[GemmShape]:
    """The distinct (N, K) projection shapes of a decoder layer, from ``data/configs/<model>.json``."""
    shape = layer_projection_shapes(load_model_config(model))
    (q_dim, hidden), (kv_dim, _), (inter, _) = shape["q_proj"], shape["k_proj"], shape["gate_proj"]
    merged: dict[tuple[int, int], list[str]] = {}
    for name in PROJECTIONS:  # k/v and gate/up share a shape, q and o too when q_dim == hidden
        merged.setdefault(shape[name], []).append(name)
    shapes = []
    if "hf" in layouts:
        shapes += [GemmShape(model, ",".join(names), n, k, "hf") for (n, k), names in merged.items()]
    if "fused" in layouts:
        shapes += [GemmShape(model, "qkv_proj", q_dim + 2 * kv_dim, hidden, "fused"),
                   GemmShape(model, "gate_up_proj", 2 * inter, hidden, "fused")]
    return shapes


# ============================================================================ GEMM benchmark
def rotation_copies(bytes_per_copy: float, l2: int, cap: int = 128) -> int:
    """Distinct input sets to rotate through so that one pass touches more than 3x the L2 size
    ``l2`` (at least 2, at most ``cap``), for inputs of ``bytes_per_copy`` bytes each."""
    return int(min(cap, max(2, math.ceil(3 * l2 / bytes_per_copy))))


def mean_relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``mean|out - ref| / mean|ref|`` in float64."""
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).abs().mean() / ref64.abs().mean().clamp_min(1e-300))


def check_directions(directions: Sequence[str]) -> None:
    """UserError unless ``directions`` is a non-empty subset of ``DIRECTIONS``."""
    if not directions or any(d not in DIRECTIONS for d in directions):
        raise UserError(f"--directions accepts {' and '.join(DIRECTIONS)}, got {list(directions)}")


def row_direction(row: dict) -> str:
    """A result row's direction; rows written before the key existed are forward rows."""
    return row.get("direction", "fwd")


def bench_gemm_shape(shape: GemmShape, ms: Sequence[int], *, l2: int, copy_gbps: float, graph: bool = True,
                     config=None, seed: int = 0, progress: Callable[[str], None] | None = None,
                     directions: Sequence[str] = DIRECTIONS) -> list[dict]:
    """Time BF16 and FP4 on one projection shape for every M and direction (module docstring); check
    every FP4 output (NaN-poisoned, vs the oracle). The weight is quantized once per shape. ``config``
    forces the Triton launch of the fwd direction."""
    from qerl_lib.kernels.fp4_gemm import fp4_grad_input, fp4_linear, planned_launch, prepare_fp4_weights, uses_mma
    from qerl_lib.kernels.launch_rule import path_name
    from qerl_lib.kernels.mma import pick_mma_config
    from qerl_lib.quant.nvfp4 import quantize, reference_grad_input, reference_matmul

    check_directions(directions)
    n, k = shape.n, shape.k
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dense = (torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    q = quantize(dense, name=f"{shape.model}.{shape.name}")
    # distinct copies for L2 rotation, enough for the smallest M (the most copies); bf16 copies too
    w_fp4 = [prepare_fp4_weights(q.weight_packed.clone(), q.weight_scale.clone(), q.weight_global_scale.clone())
             for _ in range(rotation_copies(n * k * FP4_BYTES_PER_WEIGHT + 2 * min(ms) * (k + n), l2))]
    w_bf16 = [dense.clone() for _ in range(rotation_copies(n * k * BF16_BYTES_PER_WEIGHT + 2 * min(ms) * (k + n), l2))]
    timer = time_graph if graph else time_eager
    # per direction: input columns, output columns, the FP4 call, the oracle, the bf16 baseline
    ops = {
        "fwd": (k, n, lambda a, w, o: fp4_linear(a, w, out=o, config=config), lambda a: reference_matmul(a, q),
                lambda a, w: torch.nn.functional.linear(a, w)),
        "bwd": (n, k, lambda a, w, o: fp4_grad_input(a, w, out=o), lambda a: reference_grad_input(a, q),
                lambda a, w: torch.mm(a, w)),
    }
    rows = []
    for m in ms:
        for direction in directions:
            cols_in, cols_out, fp4_call, oracle, bf16_call = ops[direction]
            a0 = torch.randn(m, cols_in, device="cuda", generator=gen).to(torch.bfloat16)
            out = torch.full((m, cols_out), float("nan"), dtype=torch.bfloat16, device="cuda")  # poison
            fp4_call(a0, w_fp4[0], out)
            torch.cuda.synchronize()
            unwritten = int(torch.isnan(out).sum())
            rel = mean_relative_error(out.float().nan_to_num(0.0), oracle(a0).float())
            del out

            fp4_bytes = n * k * FP4_BYTES_PER_WEIGHT + 2 * m * (k + n)
            bf16_bytes = n * k * BF16_BYTES_PER_WEIGHT + 2 * m * (k + n)
            sets = [(a0.clone(), w, torch.empty(m, cols_out, dtype=torch.bfloat16, device="cuda"))
                    for w in w_fp4[:rotation_copies(fp4_bytes, l2)]]
            fp4_t = timer([(lambda s=s: fp4_call(*s)) for s in sets])
            sets = [(a0.clone(), w) for w in w_bf16[:rotation_copies(bf16_bytes, l2)]]
            bf16_t = timer([(lambda s=s: bf16_call(*s)) for s in sets])
            del sets, a0
            torch.cuda.empty_cache()

            if direction == "bwd":
                path, cfg_doc = "dequant+cublas", None  # fp4_grad_input has one CUDA path
            elif config is None and uses_mma(m, k, torch.device("cuda")):
                path, cfg_doc = "mma", asdict(pick_mma_config(m, n, k))
            else:
                cfg = config or planned_launch(m, w_fp4[0], torch.device("cuda"))
                path, cfg_doc = path_name(cfg), asdict(cfg)
            rows.append(_result_row(shape, m, direction, fp4_t, bf16_t, fp4_bytes, bf16_bytes, copy_gbps,
                                    rel, unwritten, path, cfg_doc))
            if progress:
                r = rows[-1]
                progress(f"  {shape.model} {shape.name:<17} {direction} N={n:<6} K={k:<6} M={m:<5} "
                         f"bf16 {r['bf16_us']:8.1f} us  fp4 {r['fp4_us']:8.1f} us  x{r['speedup']:.2f}  "
                         f"err {rel:.1e}{'' if r['ok'] else '  FAIL'}")
    del w_fp4, w_bf16, dense, q
    torch.cuda.empty_cache()
    return rows


def _result_row(shape: GemmShape, m: int, direction: str, fp4_t: TimingStats, bf16_t: TimingStats,
                fp4_bytes: float, bf16_bytes: float, copy_gbps: float, rel: float, unwritten: int,
                path: str, cfg_doc: dict | None) -> dict:
    n, k = shape.n, shape.k
    fp4_gbps = fp4_bytes / (fp4_t.median_ms * 1e-3) / 1e9
    bf16_gbps = bf16_bytes / (bf16_t.median_ms * 1e-3) / 1e9
    return {
        "model": shape.model, "proj": shape.name, "layout": shape.layout, "direction": direction,
        "n": n, "k": k, "m": m,
        "bf16_us": bf16_t.median_ms * 1e3, "bf16_us_p20": bf16_t.p20_ms * 1e3, "bf16_us_p80": bf16_t.p80_ms * 1e3,
        "fp4_us": fp4_t.median_ms * 1e3, "fp4_us_p20": fp4_t.p20_ms * 1e3, "fp4_us_p80": fp4_t.p80_ms * 1e3,
        "speedup": bf16_t.median_ms / fp4_t.median_ms, "byte_ceiling": bf16_bytes / fp4_bytes,
        "fp4_gbps": fp4_gbps, "fp4_pct_copy": 100 * fp4_gbps / copy_gbps,
        "bf16_gbps": bf16_gbps, "bf16_pct_copy": 100 * bf16_gbps / copy_gbps,
        "fp4_tflops": 2 * m * n * k / (fp4_t.median_ms * 1e-3) / 1e12,
        "bf16_tflops": 2 * m * n * k / (bf16_t.median_ms * 1e-3) / 1e12,
        "rel_err": rel, "unwritten": unwritten, "ok": unwritten == 0 and rel <= MAX_REL_ERR,
        "path": path, "config": cfg_doc, "repeats": fp4_t.repeats,
    }


def summarize(rows: Sequence[dict]) -> dict:
    """Acceptance view per model: from the fwd rows, the geomean speedup for M <= 16 (per layout and
    all shapes) and the minimum for M >= 1024 (also as ``min_speedup_m_ge_1024_fwd``); the minimum
    for M >= 1024 of the bwd rows (``min_speedup_m_ge_1024_bwd``, None without bwd rows); and the
    worst correctness numbers over every row of both directions."""
    out = {}
    for model in sorted({r["model"] for r in rows}):
        mine = [r for r in rows if r["model"] == model]
        small = [r for r in mine if r["m"] <= 16 and row_direction(r) == "fwd"]

        def min_large(direction):
            return min((r["speedup"] for r in mine if r["m"] >= 1024 and row_direction(r) == direction), default=None)

        out[model] = {
            "geomean_speedup_m_le_16": geomean([r["speedup"] for r in small]),
            "geomean_speedup_m_le_16_hf": geomean([r["speedup"] for r in small if r["layout"] == "hf"]),
            "geomean_speedup_m_le_16_fused": geomean([r["speedup"] for r in small if r["layout"] == "fused"]),
            "min_speedup_m_ge_1024": min_large("fwd"),
            "min_speedup_m_ge_1024_fwd": min_large("fwd"),
            "min_speedup_m_ge_1024_bwd": min_large("bwd"),
            "max_rel_err": max((r["rel_err"] for r in mine), default=None),
            "all_ok": all(r["ok"] for r in mine),
        }
    return out


TABLE_COLUMNS = (("model", "", 11), ("proj", "", 17), ("dir", "", 3), ("n", "d", 6), ("k", "d", 6), ("m", "d", 5),
                 ("bf16_us", ".1f", 9), ("fp4_us", ".1f", 9), ("speedup", ".2f", 7), ("byte_ceiling", ".2f", 12),
                 ("fp4_gbps", ".0f", 8), ("fp4_pct_copy", ".0f", 12), ("rel_err", ".1e", 8), ("path", "", 14))


def run_gemm_benchmark(models: Sequence[str] = DEFAULT_MODELS, ms: Sequence[int] = DEFAULT_MS, *,
                       layouts: Sequence[str] = LAYOUTS, directions: Sequence[str] = DIRECTIONS, graph: bool = True,
                       command: str | None = None, progress: Callable[[str], None] | None = print) -> dict:
    """The full ``qerl bench gemm`` sweep; returns the JSON document (provenance, rows, summary)."""
    from qerl_lib.io import provenance

    _require_cuda()
    if any(m < 1 for m in ms):
        raise UserError(f"--m values must be positive integers, got {list(ms)}")
    check_directions(directions)
    shapes = [s for model in models for s in projection_shapes(model, layouts)]
    torch.backends.cuda.matmul.allow_tf32 = False  # the oracle's fp32 matmul must really be fp32
    copy_gbps = copy_bandwidth_gbps()
    l2 = l2_cache_bytes()
    if progress:
        progress(f"device copy bandwidth {copy_gbps:.0f} GB/s (read+write), L2 {l2 / 2**20:.0f} MiB; "
                 f"{len(shapes)} shapes x {len(ms)} M values x {len(directions)} directions")
    rows = []
    for shape in shapes:
        rows += bench_gemm_shape(shape, ms, l2=l2, copy_gbps=copy_gbps, graph=graph, progress=progress,
                                 directions=directions)
    return {
        "benchmark": "gemm",
        "provenance": provenance(command),
        "settings": {"models": list(models), "ms": list(ms), "layouts": list(layouts), "directions": list(directions),
                     "timing": "cuda-graph replay, median over repeats" if graph else "eager launches, median",
                     "rotation": "distinct weight/activation copies per call, >= 3x L2 per pass",
                     "rel_err_definition": "mean|out-ref| / mean|ref| vs nvfp4.reference_matmul (fwd) or "
                                           "nvfp4.reference_grad_input (bwd), fp32, TF32 off",
                     "max_rel_err": MAX_REL_ERR},
        "device": {"copy_gbps": copy_gbps, "l2_bytes": l2,
                   "sm_count": torch.cuda.get_device_properties(0).multi_processor_count},
        "ceiling": CEILING,
        "rows": rows,
        "summary": summarize(rows),
    }


def render_gemm_report(doc: dict) -> str:
    """The fixed-width table plus the per-model acceptance summary (rows without a direction are fwd)."""
    rows = [{**r, "dir": row_direction(r)} for r in doc["rows"]]
    lines = [format_table(rows, TABLE_COLUMNS), "",
             f"device: {doc['provenance']['device'].get('name')}  copy bandwidth {doc['device']['copy_gbps']:.0f} GB/s  "
             f"ceiling {doc['ceiling']:.2f}x (16/4.5)"]
    def fmt(v, spec=".2f", unit="x"):
        return "-" if v is None else format(v, spec) + unit

    for model, s in doc["summary"].items():
        lines.append(f"{model}: geomean speedup M<=16 {fmt(s['geomean_speedup_m_le_16'])} "
                     f"(hf {fmt(s['geomean_speedup_m_le_16_hf'])}, fused {fmt(s['geomean_speedup_m_le_16_fused'])}); "
                     f"min speedup M>=1024 fwd {fmt(s['min_speedup_m_ge_1024'])}, "
                     f"bwd {fmt(s.get('min_speedup_m_ge_1024_bwd'))}; max rel err {fmt(s['max_rel_err'], '.1e', '')}; "
                     f"{'all correct' if s['all_ok'] else 'CORRECTNESS FAILURES'}")
    return "\n".join(lines)

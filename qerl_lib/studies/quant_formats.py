"""NVFP4 explained on real weights: the E2M1 code table, one block worked through, and an SQNR scan.

This is the analysis behind ``notebooks/02_nvfp4_format.ipynb``. It does not define the format
(`qerl_lib.quant.nvfp4` does, bit-exact with compressed-tensors) and it does not define MXFP4/NF4
(`qerl_lib.quant.formats` does); it takes those apart for display and returns plain dicts of Python
numbers, ready to be written as JSON and plotted by ``qerl_lib.plots.quant``.

* ``e2m1_table()`` decodes the 16 codes from their bits (sign | 2 exponent bits | 1 mantissa
  bit, exponent bias 1, exponent field 0 = subnormal) instead of reading ``nvfp4.E2M1_VALUES``,
  so the test can hold the two against each other.
* ``global_scale_example(values)`` shows CT's two bf16 roundings of ``2688 / amax`` next to the
  one rounding a reader would expect, and counts over every bf16 amax in [1e-4, 1e4] how often
  the two disagree.
* ``explain_block(weight, row, block)`` recomputes one block's scale step by step (``t``, ``p``,
  E4M3 rounding, the 0.125 fallback) and takes the codes, bytes and dequantized values from
  ``nvfp4.quantize``/``dequantize`` of that row, which the test checks against the whole tensor.
* ``sqnr_scan(model, formats_to_scan, layers)`` round-trips every ``nn.Linear`` of the first ``layers``
  decoder layers through each format and reports SQNR in dB against the original weights. NVFP4
  shares one global scale over q/k/v and over gate/up, as llm-compressor does for vLLM's fused
  GEMMs, so the numbers are those of a real checkpoint. Means are means of dB values.

Caveat for the embedded model: its bf16 weights are a dequantized Q4_1 GGUF (16 affine levels
per 32 weights), so they sit on a coarse grid already; ``gaussian_reference`` gives the same
formats on Gaussian weights for comparison.
"""

from __future__ import annotations

import statistics
import struct
import time

import torch
from torch import nn

from qerl_lib.quant import formats

from qerl_lib.quant import nvfp4

SCAN_FORMATS = ("nvfp4", "mxfp4", "nf4")
V5_WEIGHTS = (2.5, 1.25, -0.6, 0.3, 0.1, -0.05, 2.0, -2.4, 1.7, 0.9, -1.1, 0.0, 0.45, -0.2, 1.5, -2.5)  # test vector V5 of docs/nvfp4_format.md
E2M1_THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # midpoints between magnitudes; ties go to even codes


def e2m1_table() -> list[dict]:
    """The 16 E2M1 codes: bit fields and the value they decode to, computed from the bits."""
    rows = []
    for code in range(16):
        sign, exponent, mantissa = code >> 3, (code >> 1) & 0b11, code & 0b1
        if exponent == 0:  # subnormal: no implicit 1, exponent 1 - bias = 0
            magnitude, rule = 0.5 * mantissa, f"{mantissa}/2"
        else:
            magnitude, rule = 2.0 ** (exponent - 1) * (1 + 0.5 * mantissa), f"2^{exponent - 1} * (1 + {mantissa}/2)"
        value = -magnitude if sign else magnitude  # code 8 gives -0.0, a real output of the quantizer
        rows.append({"code": code, "hex": f"0x{code:X}", "bits": f"{sign}|{exponent:02b}|{mantissa}", "sign": sign,
                     "exponent": exponent, "mantissa": mantissa, "rule": ("-" if sign else "+") + rule,
                     "value": value, "subnormal": exponent == 0 and mantissa == 1})
    return rows


def global_scale_example(values=V5_WEIGHTS, dtype: torch.dtype = torch.bfloat16) -> dict:
    """``nvfp4.global_scale`` on one weight block, with its two roundings spelled out."""
    w = torch.tensor([list(values)], dtype=torch.float64).to(dtype)
    amax = w.abs().amax().reshape(1)
    reciprocal = amax.reciprocal()  # rounding 1: fl_d(1 / amax)
    product = float(reciprocal) * nvfp4.GLOBAL_SCALE_NUMERATOR  # exact in float64
    gs = float(nvfp4.global_scale(w))  # rounding 2 happens inside: fl_d(fl_d(1 / amax) * 2688)
    single = float(torch.tensor(nvfp4.GLOBAL_SCALE_NUMERATOR / float(amax), dtype=torch.float64).to(dtype))
    return {"dtype": str(dtype).replace("torch.", ""), "weights": w[0].tolist(), "amax": float(amax),
            "reciprocal": float(reciprocal), "reciprocal_times_2688": product, "global_scale": gs,
            "global_scale_fp32_bytes_le": struct.pack("<f", gs).hex(" "), "single_rounding": single,
            "exact_quotient": nvfp4.GLOBAL_SCALE_NUMERATOR / float(amax),
            "single_rounding_agreement": _single_rounding_agreement(dtype)}


def _single_rounding_agreement(dtype: torch.dtype, low: float = 1e-4, high: float = 1e4) -> dict:
    """Over every positive ``dtype`` value in [low, high]: how often fl_d(2688/a) equals CT's gs."""
    if dtype != torch.bfloat16:
        raise ValueError("the census enumerates bf16 bit patterns; pass dtype=torch.bfloat16")
    amax = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # all positive finites
    amax = amax[(amax.float() >= low) & (amax.float() <= high)]
    ct = (amax.reciprocal() * nvfp4.GLOBAL_SCALE_NUMERATOR).float()
    single = (nvfp4.GLOBAL_SCALE_NUMERATOR / amax.double()).to(torch.bfloat16).float()
    return {"range": [low, high], "count": amax.numel(), "fraction_equal": float((ct == single).double().mean())}


def explain_block(weight: torch.Tensor, row: int, block: int, global_scale: torch.Tensor | None = None) -> dict:
    """Every number of NVFP4 for block ``block`` (16 weights along K) of row ``row`` of ``weight``.

    ``global_scale``: the tensor's encode factor (default: its own; pass the fused group's value
    to see what a real checkpoint stores). Also returns the whole row divided by its blocks'
    effective scales (``row_scaled``, what the E2M1 rounding sees) and block-scale statistics of
    the whole tensor.
    """
    weight = weight.detach()
    n, k = weight.shape if weight.dim() == 2 else (0, 0)
    if weight.dim() != 2 or k % nvfp4.GROUP_SIZE:
        raise ValueError(f"explain_block: expected a 2-D weight with K % 16 == 0, got {list(weight.shape)}")
    if not (0 <= row < n and 0 <= block < k // nvfp4.GROUP_SIZE):
        raise ValueError(f"explain_block: row must be in [0, {n}) and block in [0, {k // nvfp4.GROUP_SIZE}), "
                         f"got row={row}, block={block}")
    gs = nvfp4.global_scale(weight) if global_scale is None else global_scale.to(weight.device, torch.float32)
    lo, hi = block * nvfp4.GROUP_SIZE, (block + 1) * nvfp4.GROUP_SIZE
    values = weight[row, lo:hi]
    # The scale, step by step in CT's dtypes (nvfp4._block_scales does the same for all blocks at once).
    block_amax = values.abs().amax()  # exact in the weight dtype
    target = block_amax / nvfp4.FP4_MAX  # rounded to the weight dtype
    product = (gs * target).clamp(-nvfp4.FP8_E4M3_MAX, nvfp4.FP8_E4M3_MAX)  # fp32
    scale = product.to(torch.float8_e4m3fn).float()  # round to nearest even E4M3
    scale = torch.where(scale == 0, torch.full_like(scale, nvfp4.ZERO_BLOCK_SCALE), scale)
    effective = scale / gs  # fp32: the weight value that E2M1 1.0 stands for in this block
    scaled = values.float() / effective
    # Codes, bytes and dequantized values come from the library (the authority on the format).
    q_row = nvfp4.quantize(weight[row:row + 1], global_scale=gs)
    codes = nvfp4.unpack_fp4(q_row.weight_packed)[0, lo:hi]
    deq_row = nvfp4.dequantize(q_row, weight.dtype)[0]
    dequantized = deq_row[lo:hi]
    row_eff = q_row.weight_scale[0].float() / gs
    row_scaled = (weight[row].float().unflatten(0, (-1, nvfp4.GROUP_SIZE)) / row_eff.unsqueeze(-1)).flatten()
    packed = q_row.weight_packed[0, lo // 2:hi // 2]
    error = dequantized.double() - values.double()
    magnitudes = sorted(set(abs(v) for v in nvfp4.E2M1_VALUES))
    return {
        "shape": [n, k], "dtype": str(weight.dtype).replace("torch.", ""), "row": row, "block": block,
        "columns": [lo, hi], "values": values.float().tolist(), "block_amax": float(block_amax),
        "tensor_amax": float(weight.abs().amax()), "global_scale": float(gs),
        "target": float(target), "scale_product": float(product), "scale": float(scale),
        "scale_byte": int(scale.to(torch.float8_e4m3fn).view(torch.uint8)),
        "library_scale_byte": int(q_row.weight_scale[0, block].view(torch.uint8)),
        "effective_scale": float(effective), "scaled": scaled.tolist(),
        "codes": codes.tolist(), "code_bits": [f"{c >> 3}|{(c >> 1) & 3:02b}|{c & 1}" for c in codes.tolist()],
        "fp4_values": nvfp4.decode_e2m1(codes).tolist(), "dequantized": dequantized.float().tolist(),
        "error": error.tolist(), "max_abs_error": float(error.abs().max()),
        "block_sqnr_db": nvfp4.sqnr_db(values, dequantized),
        "levels": [s * m * float(effective) for m in magnitudes for s in ((1,) if m == 0 else (-1, 1))],
        "packed": packed.tolist(), "packed_hex": " ".join(f"{b:02x}" for b in packed.tolist()),
        "row_scaled": row_scaled.tolist(), "row_sqnr_db": nvfp4.sqnr_db(weight[row], deq_row),
        "tensor_scales": block_scale_stats(nvfp4.quantize(weight, global_scale=gs)),
    }


def block_scale_stats(q: nvfp4.NVFP4Weight) -> dict:
    """How a tensor uses its E4M3 block scales: at the top (448), subnormal (Marlin flushes those), 0.125 fallback."""
    raw = q.weight_scale.view(torch.uint8)
    scales = q.weight_scale.float()
    return {"blocks": raw.numel(), "at_448": int((raw == 0x7E).sum()), "subnormal": int((raw < 0x08).sum()),
            "fallback_0x20": int((raw == 0x20).sum()), "median_scale": float(scales.median()),
            "distinct_bytes": int(torch.unique(raw).numel())}


def storage_accounting(q: nvfp4.NVFP4Weight) -> dict:
    """Bytes of each stored tensor, bits per weight, and the ratio to bf16."""
    n, k = q.shape
    parts = {"weight_packed": q.weight_packed, "weight_scale": q.weight_scale,
             "weight_global_scale": q.weight_global_scale}
    nbytes = {name: t.numel() * t.element_size() for name, t in parts.items()}
    total = sum(nbytes.values())
    return {"shape": [n, k], "bytes": nbytes, "total_bytes": total, "bf16_bytes": 2 * n * k,
            "bits_per_weight": 8 * total / (n * k),
            "formula": {"code": 4.0, "block_scale": 8 / nvfp4.GROUP_SIZE, "global_scale": 32 / (n * k)},
            "bf16_over_nvfp4": 2 * n * k / total}


def layer_weight(model: nn.Module, layer_index: int, projection: str) -> tuple[torch.Tensor, torch.Tensor, str]:
    """(weight, global scale a real checkpoint uses, full name) of ``projection`` in decoder layer ``layer_index``.

    The global scale is shared over the fused group (q/k/v, gate/up) when the layer is in one.
    """
    layers = decoder_layers(model)
    if not 0 <= layer_index < len(layers):
        raise ValueError(f"layer_index must be in [0, {len(layers)}), got {layer_index}")
    linears = _linears(layers[layer_index])
    if projection not in linears:
        raise ValueError(f"no linear {projection!r} in layer {layer_index}; choose one of {sorted(linears)}")
    gs = _shared_global_scales(linears).get(projection)
    weight = linears[projection].weight.detach()
    return weight, (nvfp4.global_scale(weight) if gs is None else gs), f"layers.{layer_index}.{projection}"


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's stack of decoder layers (the first ``nn.ModuleList`` named ``layers``)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rpartition(".")[2] == "layers":
            return module
    raise ValueError("no nn.ModuleList named 'layers' in this model; sqnr_scan expects a decoder-only transformer")


def _linears(layer: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in layer.named_modules() if isinstance(m, nn.Linear)}


def _shared_global_scales(linears: dict[str, nn.Linear]) -> dict[str, torch.Tensor]:
    """Name -> NVFP4 global scale shared by its complete fused group (q/k/v or gate/up)."""
    shared = {}
    for group in nvfp4.FUSED_GROUPS:
        by_prefix: dict[str, list[str]] = {}
        for name in linears:
            prefix, _, leaf = name.rpartition(".")
            if leaf in group:
                by_prefix.setdefault(prefix, []).append(name)
        for members in by_prefix.values():
            if len(members) == len(group):
                gs = nvfp4.global_scale(*(linears[m].weight.detach() for m in members), name=str(members))
                shared.update({m: gs for m in members})
    return shared


def roundtrip(fmt: str, weight: torch.Tensor, global_scale: torch.Tensor | None = None, name: str = "weight"):
    """``weight`` quantized to ``fmt`` and dequantized back to its own dtype."""
    if fmt == "nvfp4":
        return nvfp4.dequantize(nvfp4.quantize(weight, global_scale=global_scale, name=name), weight.dtype)
    if fmt == "mxfp4":
        return formats.mxfp4_dequantize(formats.mxfp4_quantize(weight, name=name), weight.dtype)
    if fmt == "nf4":
        return formats.nf4_roundtrip(weight, name=name)
    raise ValueError(f"unknown format {fmt!r}; choose from {SCAN_FORMATS}")


@torch.no_grad()
def sqnr_scan(model: nn.Module, formats_to_scan=SCAN_FORMATS, layers: int | None = None) -> dict:
    """SQNR (dB) of every linear in the first ``layers`` decoder layers, for each format; the model is not changed.

    Returns ``{"formats", "layers_scanned", "layers_total", "nvfp4_global_scale", "bits_per_weight": {fmt: bits},
    "rows": [{"layer", "name", "projection", "shape", "sqnr_db": {fmt: dB}}], "seconds": {fmt: wall s},
    "cpu_seconds": {fmt: s}, "summary": {...}}`` (``summary``: `summarize`).
    """
    formats_to_scan = tuple(formats_to_scan)
    unknown = [f for f in formats_to_scan if f not in SCAN_FORMATS]
    if unknown or not formats_to_scan:
        raise ValueError(f"formats must be a non-empty subset of {SCAN_FORMATS}, got {formats_to_scan}")
    stack = decoder_layers(model)
    layers = len(stack) if layers is None else layers
    if not 1 <= layers <= len(stack):
        raise ValueError(f"layers_to_scan must be between 1 and {len(stack)} (the model's decoder layers), "
                         f"got {layers}")
    rows, seconds, cpu_seconds = [], dict.fromkeys(formats_to_scan, 0.0), dict.fromkeys(formats_to_scan, 0.0)
    for index in range(layers):
        linears = _linears(stack[index])
        shared = _shared_global_scales(linears)
        for name, module in linears.items():
            w = module.weight.detach()
            row = {"layer": index, "name": f"layers.{index}.{name}", "projection": name.rpartition(".")[2],
                   "shape": list(w.shape), "sqnr_db": {}}
            for fmt in formats_to_scan:
                start, start_cpu = time.perf_counter(), time.process_time()
                approx = roundtrip(fmt, w, shared.get(name), name=row["name"])
                row["sqnr_db"][fmt] = nvfp4.sqnr_db(w, approx)
                seconds[fmt] += time.perf_counter() - start
                cpu_seconds[fmt] += time.process_time() - start_cpu  # all threads; wall time varies with load
            rows.append(row)
    return {"formats": list(formats_to_scan), "layers_scanned": layers, "layers_total": len(stack),
            "nvfp4_global_scale": "shared over q/k/v and over gate/up (llm-compressor's fused groups)",
            "bits_per_weight": {f: formats.FORMAT_BITS[f] for f in formats_to_scan},
            "rows": rows, "seconds": seconds, "cpu_seconds": cpu_seconds, "summary": summarize(rows, formats_to_scan)}


def summarize(rows: list[dict], formats_to_scan) -> dict:
    """Means of dB values: per format, per projection type, per decoder layer; and each format's worst linear."""
    projections = list(dict.fromkeys(r["projection"] for r in rows))
    layer_ids = sorted({r["layer"] for r in rows})

    def mean(selected, fmt):
        return statistics.fmean(r["sqnr_db"][fmt] for r in selected)

    return {
        "mean": {f: mean(rows, f) for f in formats_to_scan},
        "by_projection": {p: {f: mean([r for r in rows if r["projection"] == p], f) for f in formats_to_scan}
                          for p in projections},
        "layers": layer_ids,
        "by_layer": {f: [mean([r for r in rows if r["layer"] == i], f) for i in layer_ids] for f in formats_to_scan},
        "worst": {f: min(({"name": r["name"], "sqnr_db": r["sqnr_db"][f]} for r in rows), key=lambda d: d["sqnr_db"])
                  for f in formats_to_scan},
    }


def gaussian_reference(formats_to_scan=SCAN_FORMATS, shape=(576, 576), seed: int = 0) -> dict:
    """SQNR of each format on a bf16 N(0, 0.02^2) weight: what the formats do on weights with no prior grid."""
    gen = torch.Generator().manual_seed(seed)
    w = (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)
    return {"shape": list(shape), "seed": seed,
            "sqnr_db": {f: nvfp4.sqnr_db(w, roundtrip(f, w)) for f in formats_to_scan}}

"""Comparison formats for the entropy study: MXFP4 and NF4 next to NVFP4, and model fake-quantization.

QeRL's claim is that 4-bit quantization noise raises policy entropy and so helps exploration.
To ask whether the *format* matters we round-trip a model's weights through several 4-bit
formats (quantize -> dequantize back to bf16) and compare. The formats, per weight:

=========  ======================================================  ==============
format     elements and scales                                     bits / weight
=========  ======================================================  ==============
bf16       the original weights                                    16
nvfp4      E2M1, E4M3 scale per 16 along K, fp32 per-tensor scale  4 + 8/16 = 4.5
mxfp4      E2M1, E8M0 (power-of-two) scale per 32 along K          4 + 8/32 = 4.25
nf4        4-bit NormalFloat codebook, fp32 absmax per 64          4 + 32/64 = 4.5
=========  ======================================================  ==============

MXFP4 (OCP Microscaling Formats spec v1.0, section 6.3), implemented here
-------------------------------------------------------------------------
Each block of 32 consecutive weights along K shares one scale ``X = 2^e``, stored as an E8M0
byte ``e + 127`` (E8M0 is exactly an fp32 exponent field: no sign, no mantissa, bias 127;
0xFF is NaN). The OCP recipe:

    e = floor(log2(amax_block)) - emax_elem      # emax_elem = 2 for E2M1 (largest value 6 = 1.5 * 2^2)
    e = clamp(e, -127, 127)                      # an all-zero block gets e = -127 (byte 0x00)
    element = RNE_E2M1(v / X), saturating at +-6 # v / X is exact: X is a power of two

Because ``floor`` puts amax/X in [4, 8), block maxima whose significand is >= 1.5 land
above 6 and are clipped to 6: the convention trades clipping the top of the block
for resolution everywhere else. ``floor(log2(.))`` is computed exactly from the binary exponent
(``torch.frexp``), never through a floating-point log. Dequantization ``fp4 * 2^e`` is exact in
bf16. Deviation: compressed-tensors 0.19's own MXFP4 first rounds amax *up* to the next power of
two when its significand is >= 1.75 (less clipping); we follow the OCP spec, which is what the
format's definition says and what other implementations can be checked against.

NF4 (QLoRA), through bitsandbytes on CPU
----------------------------------------
``bitsandbytes.functional.quantize_4bit(w, blocksize=64, quant_type="nf4")``: each block of 64
consecutive elements (row-major, so along K) is divided by its absmax and snapped to the nearest
of 16 normal-quantile levels. We use bnb's functional default ``compress_statistics=False``
(no double quantization), so each block keeps an fp32 absmax: 4 + 32/64 = 4.5 bits. With
double quantization (absmax stored as 8 bits plus one fp32 per 256 blocks) it would be
4 + 8/64 + 32/(64*256) = 4.127 bits, the figure usually quoted for QLoRA.

Fake quantization of a model
----------------------------
``fake_quantize_(model, fmt)`` overwrites every ``nn.Linear`` weight (except those named in
``ignore``, by default ``lm_head``) with its round-tripped bf16 version and returns one report
row per layer (shape and SQNR in dB). For ``nvfp4`` the q/k/v and gate/up projections of one
block share a global scale, as llm-compressor fuses them for vLLM (``nvfp4.FUSED_GROUPS``).
Embeddings, norms and biases are untouched. With tied embeddings, quantizing ``lm_head``
would also change the input embedding, one more reason to keep it in ``ignore``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from qerl_lib.quant import nvfp4

FORMAT_BITS = {"bf16": 16.0, "nvfp4": 4.5, "mxfp4": 4.25, "nf4": 4.5}

MX_BLOCK_SIZE = 32  # elements per E8M0 scale, along K
E2M1_EMAX = 2  # exponent of E2M1's largest power of two (6 = 1.5 * 2^2)
E8M0_BIAS = 127
_E8M0_MIN_EXP, _E8M0_MAX_EXP = -127, 127  # byte 0x00 .. 0xFE; 0xFF is NaN
NF4_BLOCK_SIZE = 64


@dataclass
class MXFP4Weight:
    """MXFP4 weight: E2M1 codes packed like NVFP4 (low nibble first) plus one E8M0 byte per 32."""

    packed: torch.Tensor  # uint8 [N, K // 2]
    scale_e8m0: torch.Tensor  # uint8 [N, K // 32], biased exponent (scale = 2 ** (byte - 127))

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.packed.shape[0]), int(self.packed.shape[1]) * 2


def e8m0_to_float32(scale_e8m0: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> exact float32 powers of two (the byte IS an fp32 exponent field)."""
    biased = scale_e8m0.to(torch.int32)
    bits = biased << 23
    # Byte 0 is 2^-127, below fp32's smallest normal: it is the subnormal with bit 22 set.
    bits = torch.where(biased == 0, torch.full_like(bits, 1 << 22), bits)
    return bits.view(torch.float32)


def _check_dense(w: torch.Tensor, name: str, block: int, fmt: str) -> None:
    if w.dim() != 2 or not w.is_floating_point():
        raise ValueError(f"{name}: expected a floating-point 2-D [N, K] weight, got {w.dtype} {list(w.shape)}")
    if w.shape[1] % block != 0:
        raise ValueError(
            f"{name}: in_features K = {w.shape[1]} must be a multiple of {block} for {fmt}; leave the layer unquantized"
        )
    if not torch.isfinite(w).all():
        raise ValueError(f"{name}: weight contains NaN or Inf; {fmt} needs finite weights")


def mxfp4_quantize(w: torch.Tensor, name: str = "weight") -> MXFP4Weight:
    """OCP MXFP4: per-32 shared exponent floor(log2(amax)) - 2, elements RNE to E2M1 with saturation."""
    _check_dense(w, name, MX_BLOCK_SIZE, "MXFP4")
    blocks = w.to(torch.float32).unflatten(-1, (-1, MX_BLOCK_SIZE))
    amax = blocks.abs().amax(-1)
    # amax = m * 2^p with m in [0.5, 1)  =>  floor(log2(amax)) = p - 1, exactly (subnormals included).
    _, binary_exp = torch.frexp(amax)
    shared_exp = (binary_exp - 1 - E2M1_EMAX).to(torch.int32)
    shared_exp = torch.where(amax == 0, _E8M0_MIN_EXP, shared_exp).clamp(_E8M0_MIN_EXP, _E8M0_MAX_EXP)
    scale_e8m0 = (shared_exp + E8M0_BIAS).to(torch.uint8)
    scaled = blocks / e8m0_to_float32(scale_e8m0).unsqueeze(-1)  # exact: power-of-two divisor
    codes = nvfp4.encode_e2m1(scaled).flatten(-2)
    return MXFP4Weight(packed=nvfp4.pack_fp4(codes), scale_e8m0=scale_e8m0)


def mxfp4_dequantize(q: MXFP4Weight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """fp4 * 2^e (exact in bf16: a 2-bit significand times a power of two)."""
    values = nvfp4.decode_e2m1(nvfp4.unpack_fp4(q.packed)).unflatten(-1, (-1, MX_BLOCK_SIZE))
    return (values * e8m0_to_float32(q.scale_e8m0).unsqueeze(-1)).flatten(-2).to(dtype)


def nf4_roundtrip(w: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """NF4 quantize -> dequantize through bitsandbytes (CPU), blocksize 64, no double quant.

    Returns a tensor of ``w``'s dtype on ``w``'s device.
    """
    try:
        import bitsandbytes.functional as bnb_functional
    except ImportError as err:  # optional dependency (the `quant` extra)
        raise ImportError("nf4_roundtrip needs bitsandbytes: pip install 'qerl-kit[quant]'") from err
    if not w.is_floating_point() or not torch.isfinite(w).all():
        raise ValueError(f"{name}: NF4 needs a finite floating-point weight")
    w_cpu = w.detach().to("cpu")
    packed, state = bnb_functional.quantize_4bit(
        w_cpu, blocksize=NF4_BLOCK_SIZE, quant_type="nf4", compress_statistics=False
    )
    return bnb_functional.dequantize_4bit(packed, state).to(device=w.device, dtype=w.dtype)


# ----------------------------------------------------------------------------- models
def _is_ignored(name: str, ignore) -> bool:
    for pattern in ignore:
        if pattern.startswith("re:"):  # llm-compressor style regex entries
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False


def _fused_global_scales(linears: dict[str, nn.Linear]) -> dict[str, torch.Tensor]:
    """Layer name -> shared NVFP4 global scale for every complete q/k/v or gate/up group."""
    shared = {}
    for name in linears:
        prefix, _, leaf = name.rpartition(".")
        for group in nvfp4.FUSED_GROUPS:
            if leaf != group[0]:
                continue
            members = [f"{prefix}.{member}" if prefix else member for member in group]
            if all(m in linears for m in members):  # a partly ignored group keeps per-layer scales
                gs = nvfp4.global_scale(*(linears[m].weight.detach() for m in members), name=f"{prefix}.{group}")
                shared.update({m: gs for m in members})
    return shared


def _roundtrip(fmt: str, w: torch.Tensor, name: str, gs: torch.Tensor | None) -> torch.Tensor:
    if fmt == "bf16":
        return w.to(torch.bfloat16)
    if fmt == "nvfp4":
        return nvfp4.dequantize(nvfp4.quantize(w, global_scale=gs, name=name), torch.bfloat16)
    if fmt == "mxfp4":
        return mxfp4_dequantize(mxfp4_quantize(w, name=name), torch.bfloat16)
    return nf4_roundtrip(w, name=name).to(torch.bfloat16)


@torch.no_grad()
def fake_quantize_(model: nn.Module, fmt: str, ignore=("lm_head",)) -> list[dict]:
    """Replace each nn.Linear weight (not in ``ignore``) by its ``fmt`` round-trip, in place.

    Returns ``[{"layer", "shape", "sqnr_db"}, ...]`` in module order (SQNR is ``inf`` for an
    exact round trip, e.g. ``bf16`` on a bf16 model).
    """
    if fmt not in FORMAT_BITS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {sorted(FORMAT_BITS)}")
    if isinstance(ignore, str):
        ignore = (ignore,)
    linears = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and not _is_ignored(name, ignore)
    }
    shared_gs = _fused_global_scales(linears) if fmt == "nvfp4" else {}
    report = []
    for name, module in linears.items():
        original = module.weight.detach()
        roundtrip = _roundtrip(fmt, original, name, shared_gs.get(name))
        report.append({"layer": name, "shape": list(original.shape), "sqnr_db": nvfp4.sqnr_db(original, roundtrip)})
        module.weight.copy_(roundtrip)  # bf16 -> the weight's dtype (exact if that is bf16 or fp32)
    return report

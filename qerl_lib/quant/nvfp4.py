"""NVFP4: the 4-bit weight format QeRL trains on, bit-exact with compressed-tensors 0.19.

How the format works
--------------------
A weight matrix ``W [N, K]`` (``N`` = out_features, ``K`` = in_features, the reduction dim)
is stored in three tensors, exactly as llm-compressor writes an ``NVFP4A16`` checkpoint:

``weight_packed``        uint8 ``[N, K/2]``            two 4-bit E2M1 codes per byte
``weight_scale``         float8_e4m3fn ``[N, K/16]``   one block scale ``s`` per 16 weights along K
``weight_global_scale``  float32 ``[1]``               one encode factor ``gs`` per tensor

and a weight is reconstructed as ``w ~= e2m1(code) * s / gs``.

* **E2M1 elements.** 1 sign bit, 2 exponent bits, 1 mantissa bit. The 8 magnitudes are
  ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (code 0..7); code ``8 + m`` is the negative of code ``m``.
  No Inf/NaN. Rounding is round-to-nearest-even with saturation at +-6: the ties
  0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0 go to the neighbour with an even mantissa
  (0, 1, 1, 2, 2, 4, 4).
* **Blocks of 16 along K.** Contiguous, no permutation, so ``K % 16 == 0`` is a format rule.
* **FP8-E4M3 block scales** (max 448, subnormals down to 2^-9). The block scale is chosen so
  that the block's absmax maps to 6 after the global scale: ``s = e4m3(gs * bf16(amax_b / 6))``.
* **FP32 global scale** ``gs = 448 * 6 / amax = 2688 / amax``: it stretches the tensor so the
  block holding the tensor's absmax gets scale 448 (byte ``0x7E``) and every block uses as much
  of the E4M3 range as possible. compressed-tensors computes it with TWO roundings in the weight
  dtype ``d`` (torch evaluates ``2688.0 / a`` as ``a.reciprocal() * 2688.0``):
  ``gs = fl_d(fl_d(1 / amax) * 2688)``. For amax = 2.5 this gives 1080, not 2688/2.5 = 1075.2
  -> 1072; the naive formula gets ~27% of bf16 amax values wrong. ``gs`` is the *encode* factor
  (vLLM inverts it at load time, ModelOpt stores the reciprocal).
* **Element quantization** is fp32 arithmetic: ``eff = fl32(s / gs)``,
  ``y = clamp(fl32(w / eff), -6, 6)``, ``code = RNE_E2M1(y)``. (It is fp32 only because ``gs``
  has shape ``[1]``; a 0-dim ``gs`` would leave the arithmetic in bf16.)
* **Nibble order.** Element ``(n, 2j)`` is the LOW nibble of byte ``(n, j)``, element
  ``(n, 2j+1)`` the high nibble.
* **4.5 bits per weight**: 4 bits of code + 8 bits of scale per 16 weights (+32 bits per tensor).
  BF16 -> NVFP4 shrinks weight traffic by 16 / 4.5 = 3.56x, the ceiling for a memory-bound GEMM.
* **Special cases.** An all-zero block (or one whose scale underflows E4M3) gets scale 0.125
  (byte ``0x20``, CT's "eps" for E4M3) and all-zero codes. An all-zero tensor gets ``gs = 1``.
  A negative value that rounds to 0 is stored as ``0x8`` (-0); an exact ``-0.0`` input is
  stored as ``0x0``. Decoders treat both as zero. Non-finite weights silently poison CT's
  output (NaN -> gs 1, Inf -> gs 0); we reject them instead.
* **Fused layers share one global scale.** vLLM runs q/k/v (and gate/up) as one GEMM with one
  scalar ``1/gs``, so llm-compressor takes ``amax`` over the whole group (``FUSED_GROUPS``).
  Pass ``global_scale(q, k, v)`` to ``quantize`` for each member to reproduce that.
* **fp16 pitfall (faithfully reproduced).** In fp16, ``fl16(1/amax) * 2688`` overflows for
  amax < 2688/65504 ~= 0.041, CT's ``nan_to_num`` then sets ``gs = 1`` and most blocks get tiny
  or zero scales. bf16 (every current checkpoint) has no such problem.

Where Marlin (and our kernel oracle) differ
-------------------------------------------
CT's dequantizer rounds each weight to bf16: ``bf16(fp4 * fl32(s / gs))``. vLLM's Marlin kernel
instead forms ``fp4 * s`` exactly (<= 6 significant bits, always exact in bf16), accumulates in
fp32 and multiplies the fp32 result by ``fl32(1/gs)`` once in the epilogue. The two differ in
the last bits, so ``reference_matmul`` and ``reference_grad_input`` (the Marlin-style oracles of
`qerl_lib.kernels.fp4_gemm`'s forward ``x @ W.T`` and backward ``dy @ W``) are compared with
tolerances while ``dequantize`` is compared bit-exactly with CT. Marlin also flushes E4M3-subnormal
block scales (bytes 0x01-0x07) to zero; we keep them, as CT does.

docs/nvfp4_format.md walks through the same facts with the on-disk layout and hand-checkable test vectors
(V1-V7, which tests/test_nvfp4.py and tests/test_quant_report.py pin).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

GROUP_SIZE = 16  # weights per block scale, along K
FP4_MAX = 6.0  # largest E2M1 magnitude
FP8_E4M3_MAX = 448.0  # largest E4M3 (fn) magnitude
GLOBAL_SCALE_NUMERATOR = FP8_E4M3_MAX * FP4_MAX  # 2688: amax -> 448 * 6
ZERO_BLOCK_SCALE = 0.125  # CT replaces a zero block scale by E4M3's "eps" (byte 0x20)

# E2M1 value of each 4-bit code; index 8 is -0.0 (a real code the quantizer emits).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Linear layers that run as one fused GEMM in vLLM and therefore share one global scale.
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))

_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CHUNK_ELEMENTS = 1 << 24  # ~64 MB of fp32 temporaries per row chunk (27648x5120 -> 9 chunks)


@dataclass
class NVFP4Weight:
    """One NVFP4 weight in compressed-tensors layout (the names are the checkpoint suffixes)."""

    weight_packed: torch.Tensor  # uint8 [N, K // 2]
    weight_scale: torch.Tensor  # float8_e4m3fn [N, K // 16]
    weight_global_scale: torch.Tensor  # float32 [1], the encode factor ~ 2688 / amax

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the dense weight this represents."""
        return int(self.weight_packed.shape[0]), int(self.weight_packed.shape[1]) * 2

    @property
    def nbytes(self) -> int:
        tensors = (self.weight_packed, self.weight_scale, self.weight_global_scale)
        return sum(t.numel() * t.element_size() for t in tensors)

    def to(self, device) -> NVFP4Weight:
        return NVFP4Weight(*(t.to(device) for t in (self.weight_packed, self.weight_scale, self.weight_global_scale)))

    def validate(self, name: str = "weight") -> None:
        """Raise ValueError naming the offending tensor if dtypes, shapes or devices are wrong."""
        packed, scale, gs = self.weight_packed, self.weight_scale, self.weight_global_scale
        if packed.dtype != torch.uint8 or packed.dim() != 2:
            raise ValueError(f"{name}.weight_packed: expected uint8 [N, K/2], got {packed.dtype} {list(packed.shape)}")
        n, k = self.shape
        if k % GROUP_SIZE != 0:
            raise ValueError(f"{name}.weight_packed: K = 2 * {packed.shape[1]} = {k} must be a multiple of {GROUP_SIZE}")
        if scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (n, k // GROUP_SIZE):
            raise ValueError(
                f"{name}.weight_scale: expected float8_e4m3fn [N, K/16] = [{n}, {k // GROUP_SIZE}], "
                f"got {scale.dtype} {list(scale.shape)}"
            )
        if gs.dtype != torch.float32 or tuple(gs.shape) != (1,):
            # A 0-dim scale would silently switch CT's arithmetic from fp32 to the weight dtype.
            raise ValueError(f"{name}.weight_global_scale: expected float32 [1], got {gs.dtype} {list(gs.shape)}")
        if not (packed.device == scale.device == gs.device):
            raise ValueError(
                f"{name}: weight_packed/weight_scale/weight_global_scale must share one device, "
                f"got {packed.device}/{scale.device}/{gs.device}"
            )


# ----------------------------------------------------------------------------- E2M1 codes
def encode_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round already-scaled values to E2M1 codes (uint8 0..15): RNE, saturating at +-6.

    The sign bit is ``y < 0``, so tiny negatives that round to zero become code 8 (-0) while
    an exact -0.0 stays code 0, as in CT's torch path.
    """
    y = y.float().clamp(-FP4_MAX, FP4_MAX)
    # The code of |y| is the number of rounding thresholds it passes. Ties go to the even code,
    # so 0.75, 1.75 and 3.5 are passed *inclusively* (|y| >= t) and the others strictly (|y| > t).
    # One `bucketize` (count of boundaries strictly below |y|) does all seven comparisons when each
    # inclusive threshold is replaced by its fp32 predecessor: |y| >= t  <=>  |y| > prev(t).
    code = torch.bucketize(y.abs(), _e2m1_boundaries(y.device)).to(torch.uint8)
    code |= (y < 0).to(torch.uint8) << 3
    return code


def _e2m1_boundaries(device: torch.device) -> torch.Tensor:
    strict = torch.tensor([0.25, 1.25, 2.5, 5.0])
    inclusive = torch.nextafter(torch.tensor([0.75, 1.75, 3.5]), torch.tensor(0.0))
    return torch.sort(torch.cat([strict, inclusive])).values.to(device)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (any integer dtype, values 0..15) -> float32 values (code 8 -> -0.0)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., K] -> uint8 [..., K/2]; element 2j is the low nibble of byte j."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 2 != 0:
        raise ValueError(f"pack_fp4: expected uint8 codes with an even last dim, got {codes.dtype} {list(codes.shape)}")
    return (codes[..., 0::2] & 0xF) | (codes[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 codes [..., K] (inverse of ``pack_fp4``)."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4: expected uint8, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


# ----------------------------------------------------------------------------- quantizer
def _row_chunks(n_rows: int, k: int):
    step = max(1, _CHUNK_ELEMENTS // max(k, 1))
    for start in range(0, n_rows, step):
        yield start, min(start + step, n_rows)


def _check_weight(w: torch.Tensor, name: str) -> torch.Tensor:
    """Validate a dense weight and return its absmax in its own dtype (exact)."""
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        shape = list(getattr(w, "shape", []))
        raise ValueError(f"{name}: expected a 2-D [out_features, in_features] tensor, got shape {shape}")
    if w.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"{name}: dtype {w.dtype} not supported; NVFP4 quantizes bfloat16, float16 or float32 weights")
    if w.shape[1] % GROUP_SIZE != 0:
        raise ValueError(
            f"{name}: in_features K = {w.shape[1]} must be a multiple of {GROUP_SIZE} (NVFP4 block size); "
            "pad K or leave this layer unquantized (add it to ignore)"
        )
    if w.numel() == 0:
        raise ValueError(f"{name}: empty weight {list(w.shape)}")
    # amax/amin propagate NaN, and +-Inf shows up as an infinite absmax: one cheap finiteness check.
    amax = torch.maximum(w.amax(), -w.amin())
    if not torch.isfinite(amax):
        raise ValueError(f"{name}: weight contains NaN or Inf; NVFP4 needs finite weights (CT would corrupt them)")
    return amax


def global_scale(*weights: torch.Tensor, name: str = "weights") -> torch.Tensor:
    """Shared encode factor of a tensor or a fused group: float32 [1], bit-exact with CT.

    ``gs = fl_d(fl_d(1 / max(amax, tiny)) * 2688)`` in the weights' dtype ``d``, with NaN/Inf
    (only the all-zero overflow case for finite weights) replaced by 1.0.
    """
    if not weights:
        raise ValueError("global_scale: pass at least one weight tensor")
    weights = tuple(w.detach() for w in weights)
    dtypes = {w.dtype for w in weights}
    if len(dtypes) != 1:
        raise ValueError(f"{name}: fused weights must share one dtype, got {sorted(map(str, dtypes))}")
    amax = torch.stack([_check_weight(w, name).to(weights[0].device) for w in weights]).amax()
    amax = amax.reshape(1).clamp(min=torch.finfo(amax.dtype).tiny)
    # Written out as torch evaluates CT's `2688.0 / amax`: reciprocal, then multiply, both in dtype d.
    gs = amax.reciprocal() * GLOBAL_SCALE_NUMERATOR
    return torch.nan_to_num(gs, nan=1.0, posinf=1.0, neginf=1.0).to(torch.float32)


_global_scale_fn = global_scale  # `quantize` shadows this name with its argument


def _block_scales(w_rows: torch.Tensor, gs: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales (as exact float32) for rows of a weight; CT's calculate_qparams."""
    blocks = w_rows.unflatten(-1, (-1, GROUP_SIZE))
    block_amax = torch.maximum(blocks.amax(-1), -blocks.amin(-1))  # exact, dtype d
    target = block_amax / FP4_MAX  # rounded to dtype d, as CT does
    scale = (gs * target).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)  # [1] fp32 * [n, g] d -> fp32
    scale = scale.to(torch.float8_e4m3fn).to(torch.float32)  # RNE to E4M3
    return torch.where(scale == 0, ZERO_BLOCK_SCALE, scale)


def quantize(w: torch.Tensor, global_scale: torch.Tensor | None = None, name: str = "weight") -> NVFP4Weight:
    """Quantize a dense [N, K] weight to NVFP4, bit-exact with llm-compressor + CT 0.19.

    ``global_scale``: pass the shared value of a fused group (``global_scale(q, k, v)``);
    by default the tensor's own. ``name`` (the layer) appears in every error message.
    Works on CPU and CUDA; processes rows in chunks of ~16M elements, so temporaries stay
    around 0.3 GB whatever the size (a 27648x5120 bf16 weight: ~3.5 s on 2 CPU cores).
    """
    w = w.detach()  # nn.Parameters welcome; no autograd graph through the quantizer
    _check_weight(w, name)
    gs = _global_scale_fn(w, name=name) if global_scale is None else global_scale
    if not isinstance(gs, torch.Tensor) or gs.numel() != 1 or not torch.isfinite(gs).all() or float(gs) <= 0:
        raise ValueError(f"{name}: global_scale must be a positive finite float32 tensor of shape [1], got {gs!r}")
    gs = gs.to(device=w.device, dtype=torch.float32).reshape(1)
    n, k = w.shape
    packed = torch.empty(n, k // 2, dtype=torch.uint8, device=w.device)
    scales = torch.empty(n, k // GROUP_SIZE, dtype=torch.float8_e4m3fn, device=w.device)
    for start, stop in _row_chunks(n, k):
        rows = w[start:stop]
        scale = _block_scales(rows, gs)
        eff = scale / gs  # fp32 effective step per block
        y = rows.unflatten(-1, (-1, GROUP_SIZE)).float() / eff.unsqueeze(-1)
        packed[start:stop] = pack_fp4(encode_e2m1(y).flatten(-2))
        scales[start:stop] = scale.to(torch.float8_e4m3fn)
    return NVFP4Weight(packed, scales, gs.clone())


def dequantize(q: NVFP4Weight, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Dense weight ``dtype(fp4 * fl32(s / gs))``: bit-exact with CT's decompress (bf16)."""
    q.validate("dequantize")
    n, k = q.shape
    out = torch.empty(n, k, dtype=dtype, device=q.weight_packed.device)
    gs = q.weight_global_scale
    for start, stop in _row_chunks(n, k):
        values = decode_e2m1(unpack_fp4(q.weight_packed[start:stop])).unflatten(-1, (-1, GROUP_SIZE))
        eff = q.weight_scale[start:stop].to(torch.float32) / gs
        out[start:stop] = (values * eff.unsqueeze(-1)).flatten(-2).to(dtype)
    return out


# ----------------------------------------------------------------------------- GEMM oracle
def _exact_rows(q: NVFP4Weight, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of W as exact fp32 products ``fp4 * s`` (the global scale not yet applied)."""
    values = decode_e2m1(unpack_fp4(q.weight_packed[start:stop])).unflatten(-1, (-1, GROUP_SIZE))
    return (values * q.weight_scale[start:stop].to(torch.float32).unsqueeze(-1)).flatten(-2)


def reference_matmul(x: torch.Tensor, q: NVFP4Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch oracle of the FP4 x BF16 GEMM: ``x @ W.T (+ bias)`` the way Marlin computes it.

    ``out = cast((x.float() @ (fp4 * s).float().T) * fl32(1 / gs)) + bias``: the products
    ``fp4 * s`` are exact, the sum is fp32, and ``1/gs`` is applied once to the fp32 result.
    That differs in the last bit from ``x @ dequantize(q).T``, which rounds every weight
    ``fp4 * s / gs`` to bf16 before the matmul. Output dtype is ``x.dtype``; like Marlin, the
    bias is added after that cast. ``x`` may have any leading dims. Run with TF32 off (torch's
    default) or the "fp32" accumulation is not fp32.
    """
    q.validate("reference_matmul")
    n, k = q.shape
    if x.shape[-1] != k:
        raise ValueError(f"reference_matmul: x has last dim {x.shape[-1]}, the weight expects K = {k}")
    x2 = x.reshape(-1, k).to(torch.float32)
    inv_gs = torch.reciprocal(q.weight_global_scale.to(torch.float32))  # fl32(1/gs), as Marlin
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    for start, stop in _row_chunks(n, k):  # chunk over output columns to bound weight memory
        out[:, start:stop] = ((x2 @ _exact_rows(q, start, stop).T) * inv_gs).to(x.dtype)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], n)


def reference_grad_input(grad_out: torch.Tensor, q: NVFP4Weight) -> torch.Tensor:
    """Plain-torch oracle of the backward-layout GEMM ``grad_out @ W`` (dL/dx of ``y = x @ W.T``), Marlin-style.

    ``out = cast((grad_out.float() @ (fp4 * s).float()) * fl32(1 / gs))``: the products are exact,
    the sum over N is fp32 (accumulated over row chunks of W, which bounds the fp32 weight
    temporary), and ``1/gs`` is applied once to the fp32 result, as ``reference_matmul`` does for
    the forward. ``grad_out`` is ``[..., N]`` with any leading dims; the result is ``[..., K]`` in
    ``grad_out.dtype``. Run with TF32 off (torch's default) or the "fp32" accumulation is not fp32.
    """
    q.validate("reference_grad_input")
    n, k = q.shape
    if grad_out.shape[-1] != n:
        raise ValueError(f"reference_grad_input: grad_out has last dim {grad_out.shape[-1]}, the weight expects N = {n}")
    g2 = grad_out.reshape(-1, n).to(torch.float32)
    inv_gs = torch.reciprocal(q.weight_global_scale.to(torch.float32))  # fl32(1/gs), as Marlin
    acc = torch.zeros(g2.shape[0], k, dtype=torch.float32, device=grad_out.device)
    for start, stop in _row_chunks(n, k):  # chunk over the reduction (rows of W) to bound weight memory
        acc.addmm_(g2[:, start:stop], _exact_rows(q, start, stop))
    return (acc * inv_gs).to(grad_out.dtype).reshape(*grad_out.shape[:-1], k)


def sqnr_db(reference: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio 10*log10(sum ref^2 / sum (ref - approx)^2) in dB (fp64)."""
    ref = reference.detach().to(torch.float64)
    noise = (ref - approx.detach().to(torch.float64)).square().sum()
    signal = ref.square().sum()
    if noise == 0:
        return float("inf")
    return float(10.0 * torch.log10(signal / noise))

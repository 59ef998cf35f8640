"""Fused NVFP4 x BF16 GEMM (Marlin-style, in Triton): ``out = x @ W.T`` straight from the 4.5-bit weights.

Why a fused kernel
------------------
A decode step reads every weight once for 2 flops per token, so for M <= 16 tokens the GEMM is
bound by memory bandwidth. NVFP4 costs 0.5 + 1/16 = 0.5625 byte per weight instead of 2, so a
kernel that moves only the compressed bytes and expands them *in registers* can be up to
16 / 4.5 = 3.56x faster than BF16; dequantizing to a BF16 copy first (2.56 B/weight) is slower.

How one program works (``_fp4_gemm_kernel``, small-M "fragment" path)
--------------------------------------------------------------------
Each program owns ``BLOCK_N`` output features, ``BLOCK_M`` (16-64) rows of ``x`` and one slice of
K (split-K, below). Per K-step of 128:

1. **Load** ``BLOCK_N x 16`` int32 words of ``weight_packed`` (the compressed-tensors bytes read in place as
   int32, 8 codes per word: 16-byte vector loads, ``evict_first`` as every weight is used once), ``BLOCK_N x 8``
   scale bytes and the ``x`` tile; the next step's loads are issued before this step's math (prefetch).
2. **Decode two codes per 32-bit op** (Marlin's trick, docs/nvfp4_format.md section 6): for a code
   ``c = s e1 e0 m`` the 16 bits ``s<<15 | e1 e0 m << 6`` *are* the bfloat16 ``fp4(c) * 2^-126`` (code 1 = 0.5
   becomes a bf16 subnormal, exactly right). ``fp4_decode.code_pair_bits`` builds codes ``i`` and ``i + 4`` of a word in
   one register with a mask, a multiply by ``2^a + 2^b`` (two shifted copies at once) and a mask.
3. **Apply the block scale exactly.** The E4M3 byte becomes ``s * 2^118`` in bf16 (exact), and one
   packed ``mul.rn.bf16x2`` (inline PTX) per register gives ``W' = fp4 * s * 2^-8`` -- exact,
   because ``fp4 * s`` has at most 6 significant bits (docs/nvfp4_format.md section 6). ``1/gs`` is *not*
   applied here.
4. **Straight into the tensor cores.** ``acc[BLOCK_N, BLOCK_M] += W' @ x.T`` with the operands
   swapped: the weights are the *A* operand, which Hopper's ``wgmma`` reads from registers, and
   the few rows of ``x`` the narrow *B* operand. The rows are loaded through a 4-D index
   (``_frag_rows``) and K is relabeled (``_frag_dequant``) so that every thread's decoded values
   already sit where the A fragment wants them: no shared-memory round trip for the weights
   (staging them there ran at a third of the bandwidth, measured on an H100; see dev/LOG.md).
   A dot product does not care about the order of its terms, so ``x`` is permuted the same way in registers
   (``_frag_x``). M < 16 wastes MMA lanes, which cost nothing here: decoding's issue (~3.2 SASS/weight) does.
5. **Epilogue** (fp32): ``out = bf16(acc * (2^8 / gs))``, then ``+ bias`` (bias after the cast, as
   Marlin and ``nvfp4.reference_matmul`` do). ``1/gs`` is computed in-kernel with correct rounding,
   so no host sync is needed and the call can be captured in a CUDA graph.

Parallelism. Small M gives only ``N / BLOCK_N`` programs (28 for a 3584-wide output), too few for 132 SMs, so K
is split into slices that write fp32 partials; ``splitk.reduce_splits`` sums them in a fixed order (deterministic,
no atomics) and runs the epilogue. ``launch_rule.pick_config`` picks tile width and slices (about 2 programs per SM
for 2 <= M <= 16, measured best on an H100).

Large M (prefill, training forward) is compute-bound. Mostly fastest: one exact ``_fp4_dequant_kernel`` pass to bf16
``fp4 * s * 2^-8`` (~97% of copy bandwidth), then cuBLAS with ``alpha = 2^8/gs`` in its fp32 epilogue (``addmm``), the
oracle's single rounding when cuBLAS sums in fp32 (torch lets it round split-K partials to bf16 unless
``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction`` is False; the CUDA tests that bound this
route elementwise turn it off) (a Gluon kernel beats it on wide shapes at 193-2048 rows, below). The large-tile Triton
kernel (``swap_ab=False``, 0.44-0.55x of cuBLAS) remains for calls without a host copy of ``gs``.

Backward layout (``fp4_grad_input``, oracle ``nvfp4.reference_grad_input``): ``dL/dx = dy @ W`` (``dy [M, N]`` ->
``[M, K]``) of a frozen layer, by the large-M forward's single-rounding arithmetic with W untransposed: a temporary
``_fp4_dequant_kernel`` copy ``W'``, then cuBLAS ``dy @ W'`` with ``alpha = 2^8/gs`` in fp32 (interpreter: CPU
``addmm``).

Where we deviate from Marlin / vLLM: no offline repacking (the fragment layout comes from relabeling K, the
compressed-tensors bytes are read in place); only ``x`` goes through shared memory (wgmma's B operand must), once per
K-step, instead of Marlin's multi-stage ``cp.async`` pipeline with ``mma.sync``; E4M3-subnormal block scales (bytes
0x01-0x07) are kept, as compressed-tensors does, where Marlin flushes them to zero; the global scale (the *encode*
factor ``gs``, ``w = fp4 * s / gs``) is read on device.

Dispatch: CUDA calls with M <= 8 and K % 128 == 0 (the decode step) run the ``mma.sync`` kernel of ``kernels/mma.py``
where it can run (sm_90+ and NVRTC; faster than this one, dev/LOG.md); ``fp4_linear``'s ``small_m_backend`` ("auto",
"mma", "triton") chooses, else ``QERL_FP4_SMALL_M`` read at each call (default "auto"); that kernel can also add a
projection group's LoRA adapters (``lora=``). On an H100/H200 the Gluon kernels run where ``launch_rule`` picks them:
``kernels/fp4_wgmma.py`` at 25-128 rows, ``kernels/fp4_wgmma_producer.py`` at most 24-96-row calls (its decode
spans), on gate/up at 193-2048 and down at 193-512 rows (``QERL_FP4_WGMMA=0`` turns both off, ``QERL_FP4_PRODUCER=0``
the second). On Hopper the register-A CUDA kernel (``kernels/fp4_ra.py``) takes the wide gate/up calls at 1024-2048
rows from the producer kernel (``QERL_FP4_RA=0`` turns it off). Other CUDA calls run the Triton kernel (or
dequantize + cuBLAS for large M); CPU tensors run the plain-torch oracles (``nvfp4.reference_matmul``) unless
``impl="triton"`` forces the kernels, which then need ``TRITON_INTERPRET=1`` set before Triton is imported; the
interpreter cannot run PTX and mishandles bf16 (``_interpreted``), so the kernels multiply in fp32: identical bits.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from qerl_lib.kernels import fp4_ra, fp4_wgmma, fp4_wgmma_producer, mma
from qerl_lib.kernels.fp4_decode import code_pair_bits
from qerl_lib.kernels.fp4_wgmma import num_sms as _num_sms
from qerl_lib.kernels.launch_rule import (SMALL_M_BACKENDS, SMALL_M_ENV, KernelConfig, pick_config,  # noqa: F401
                                          plan_launch, resolve_small_m_backend, uses_mma)
from qerl_lib.kernels.splitk import reduce_splits  # noqa: F401 (callers and tests reach it here)
from qerl_lib.quant.nvfp4 import GROUP_SIZE, NVFP4Weight, reference_grad_input, reference_matmul

try:  # Triton is optional: the CPU reference path works without it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

IMPLS = ("auto", "triton", "reference")
WGMMA_ENV = "QERL_FP4_WGMMA"  # "0": never pick the Gluon kernel (read at each call; default "1")


# ============================================================================ prepared weights
@dataclass
class PreparedFP4Weight:
    """An NVFP4 weight checked once, as the kernel reads it (zero-copy views, nothing repacked); build
    with ``prepare_fp4_weights``. ``words``: int32 ``[N, K/8]`` view of ``weight_packed`` (8 codes per
    word); ``scales``: uint8 view of the E4M3 block scales; ``inv_global_scale``: ``fl32(1/gs)`` as a
    Python float, read once so that the cuBLAS paths need no host sync per call (NaN: not read)."""

    words: torch.Tensor
    scales: torch.Tensor
    global_scale: torch.Tensor
    inv_global_scale: float

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.words.shape[0]), int(self.words.shape[1]) * 8

    @property
    def device(self) -> torch.device:
        return self.words.device

    @functools.cached_property
    def tma_aligned(self) -> bool:
        """Whether TMA can read ``words`` and ``scales`` (16-byte starts and row strides), checked once."""
        return fp4_wgmma_producer.aligned(self.words, self.scales)

    def to_compressed_tensors(self) -> NVFP4Weight:
        """The on-disk layout (views of the same memory)."""
        return NVFP4Weight(self.words.view(torch.uint8), self.scales.view(torch.float8_e4m3fn), self.global_scale)


def prepare_fp4_weights(weight_packed: torch.Tensor, weight_scale: torch.Tensor,
                        weight_global_scale: torch.Tensor) -> PreparedFP4Weight:
    """Validate an NVFP4 weight once; the result is what ``fp4_linear`` and ``fp4_grad_input`` take.
    Call once per layer at load time and cache it (``NVFP4Linear`` does): it reads ``gs`` to the host
    (one sync), so build it before capturing CUDA graphs. Zero-copy: the kernels read
    ``weight_packed`` and ``weight_scale`` in place."""
    _check_weight(weight_packed, weight_scale, weight_global_scale)
    gs = weight_global_scale.reshape(1)
    inv = float(torch.reciprocal(gs.to(torch.float32)).item())  # fl32(1/gs), as the oracle
    return PreparedFP4Weight(weight_packed.view(torch.int32), weight_scale.view(torch.uint8), gs, inv)


# ============================================================================ public entry points
def fp4_matmul(x: torch.Tensor, weight_packed: torch.Tensor, weight_scale: torch.Tensor,
               weight_global_scale: torch.Tensor, bias: torch.Tensor | None = None, *,
               impl: str = "auto", out: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for an NVFP4 weight in compressed-tensors layout. ``x``: bf16 ``[..., K]``.
    ``weight_packed``: uint8 ``[N, K/2]``; ``weight_scale``: float8_e4m3fn ``[N, K/16]``;
    ``weight_global_scale``: float32 ``[1]`` (the encode factor gs). Returns bf16 ``[..., N]``.
    ``impl``: ``"auto"`` (Triton on CUDA, reference on CPU), ``"triton"`` or ``"reference"``. ``out``:
    optional bf16 ``[..., N]`` contiguous tensor to write into. Layers should call
    ``prepare_fp4_weights`` once and use ``fp4_linear``."""
    impl = _resolve_impl(impl, x)
    _check_weight(weight_packed, weight_scale, weight_global_scale)
    n, k = int(weight_packed.shape[0]), int(weight_packed.shape[1]) * 2
    _check_x_bias(x, bias, n, k, weight_packed.device)
    out = _check_out(out, x, n)
    if impl == "reference":
        res = reference_matmul(x, NVFP4Weight(weight_packed, weight_scale, weight_global_scale.reshape(1)), bias)
        return res if out is None else out.copy_(res)
    prepared = PreparedFP4Weight(weight_packed.view(torch.int32), weight_scale.view(torch.uint8),
                                 weight_global_scale.reshape(1), float("nan"))
    return _triton_linear(x, prepared, bias, out, allow_cublas=False)


def fp4_linear(x: torch.Tensor, weight: PreparedFP4Weight, bias: torch.Tensor | None = None, *,
               impl: str = "auto", out: torch.Tensor | None = None,
               config: KernelConfig | fp4_wgmma.WgmmaConfig | fp4_wgmma_producer.ProducerConfig | fp4_ra.RaConfig
               | None = None,
               small_m_backend: str | None = None, mma_rule: Callable[[int, int, int], mma.MmaConfig] | None = None,
               lora: mma.LoraEpilogue | None = None, x_relabeled: torch.Tensor | None = None,
               defer_reduce: list | None = None, dense: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T (+ bias)`` for a ``prepare_fp4_weights`` result; the path ``NVFP4Linear`` uses.
    ``out``: optional bf16 ``[..., N]`` contiguous tensor to write into. ``config`` forces one launch of the
    Triton kernel (``KernelConfig``), a Gluon one (``fp4_wgmma.WgmmaConfig``, ``fp4_wgmma_producer.ProducerConfig``)
    or the register-A CUDA kernel (``fp4_ra.RaConfig``).
    ``small_m_backend``: which kernel runs M <= 8 ("auto", "mma", "triton"; None: ``QERL_FP4_SMALL_M``,
    default "auto"). ``mma_rule``: the mma.sync kernel's launch shape as a function
    of ``(m, n, k)`` (None: ``pick_mma_config``). ``lora``: adapters the mma.sync kernel adds itself;
    only where ``uses_mma`` (else a ValueError). ``x_relabeled``: the same ``x`` already in the Gluon kernels'
    K relabeling (``fp4_wgmma.permute_x``'s layout, contiguous ``[M, K]``; the decode step's glue kernels write
    it), which a Gluon launch then reads instead of permuting ``x`` itself; other launches ignore it.
    ``defer_reduce``: a list that takes ``(ws, global_scale, bias, out)`` for each K-split reduction instead of
    running it (``out``, or its columns, then unwritten until the caller sums ``ws`` with ``reduce_splits`` or
    ``kernels/lora.expand_(..., base=)``, which adds the adapters in the same pass). ``dense``: this weight's
    ``dequantize_exact(weight, unscale=False)``, if the caller holds it; the dequantize + cuBLAS launch
    (``takes_dense``) then reads it instead of dequantizing again; other launches ignore it."""
    impl = _resolve_impl(impl, x)
    if not isinstance(weight, PreparedFP4Weight):
        raise ValueError(f"fp4_linear: weight must be a PreparedFP4Weight (use prepare_fp4_weights), got {type(weight).__name__}")
    n, k = weight.shape
    _check_x_bias(x, bias, n, k, weight.device)
    out = _check_out(out, x, n)
    if lora is not None and (impl == "reference" or config is not None or not uses_mma(x.numel() // k, k, x.device, small_m_backend)):
        raise ValueError("fp4_linear: a LoRA epilogue runs only on the mma.sync path (check uses_mma first)")
    xr = x_relabeled
    if xr is not None and (xr.shape != (x.numel() // k, k) or not xr.is_contiguous() or xr.dtype != x.dtype):
        raise ValueError(f"fp4_linear: x_relabeled must be a contiguous {x.dtype} [{x.numel() // k}, {k}] tensor "
                         f"(x's rows in fp4_wgmma.permute_x's layout), got {xr.dtype} {list(xr.shape)}")
    if impl == "reference":
        res = reference_matmul(x, weight.to_compressed_tensors(), bias)
        return res if out is None else out.copy_(res)
    return _triton_linear(x, weight, bias, out, allow_cublas=True, config=config, small_m_backend=small_m_backend,
                          mma_rule=mma_rule, lora=lora, x_relabeled=x_relabeled, dense=dense,
                          reduce=reduce_splits if defer_reduce is None else lambda *job: defer_reduce.append(job))


def takes_dense(m: int, weight: PreparedFP4Weight, x: torch.Tensor, small_m_backend: str | None = None) -> bool:
    """Whether ``fp4_linear`` of ``m`` rows of ``x`` dequantizes the weight for cuBLAS (and so can take ``dense``)."""
    if m == 0 or _resolve_impl("auto", x) != "triton" or uses_mma(m, weight.shape[1], x.device, small_m_backend):
        return False
    config = planned_launch(m, weight, x.device)
    return isinstance(config, KernelConfig) and config.cublas


def takes_relabeled_x(m: int, weight: PreparedFP4Weight, device: torch.device,
                      small_m_backend: str | None = None) -> bool:
    """Whether ``fp4_linear`` of ``m`` rows runs a Gluon launch, which reads ``x_relabeled`` instead of permuting x."""
    n, k = weight.shape
    if m == 0 or uses_mma(m, k, device, small_m_backend):
        return False
    return isinstance(planned_launch(m, weight, device), (fp4_wgmma.WgmmaConfig, fp4_wgmma_producer.ProducerConfig))


def fp4_grad_input(grad_out: torch.Tensor, weight: PreparedFP4Weight, *, impl: str = "auto",
                   out: torch.Tensor | None = None, dense: torch.Tensor | None = None) -> torch.Tensor:
    """``grad_out @ W``, the input gradient of ``y = x @ W.T``, for a ``prepare_fp4_weights`` result
    (module docstring, "Backward layout"): bf16 ``[..., N]`` -> bf16 ``[..., K]``. ``impl`` as in
    ``fp4_matmul``. ``out``: optional bf16 ``[..., K]`` contiguous tensor to write into. ``dense``: as in
    ``fp4_linear`` (read instead of dequantizing)."""
    impl = _resolve_impl(impl, grad_out)
    if not isinstance(weight, PreparedFP4Weight):
        raise ValueError(f"fp4_grad_input: weight must be a PreparedFP4Weight (use prepare_fp4_weights), got {type(weight).__name__}")
    n, k = weight.shape
    _check_x_bias(grad_out, None, k, n, weight.device, name="grad_out", dim="N (out_features)")
    out = _check_out(out, grad_out, k)
    if impl == "reference":
        res = reference_grad_input(grad_out, weight.to_compressed_tensors())
        return res if out is None else out.copy_(res)
    g2 = grad_out.reshape(-1, n)
    res = torch.empty(g2.shape[0], k, dtype=torch.bfloat16, device=g2.device) if out is None else out.view(g2.shape[0], k)
    if g2.shape[0]:
        w = dense if dense is not None else dequantize_exact(weight, unscale=False)  # fp4 * s * 2^-8, exact
        if math.isnan(weight.inv_global_scale):  # no host copy of 1/gs: fp32 product, * 2^8/gs on device
            res.copy_(torch.mm(g2.float(), w.float()) * (256.0 / weight.global_scale))
        else:  # alpha = 2^8/gs applied in fp32 before the single rounding; beta = 0: `res` is not read
            res.addmm_(g2, w, beta=0.0, alpha=256.0 * weight.inv_global_scale)
    return res.reshape(*grad_out.shape[:-1], k)


def dequantize_exact(weight: PreparedFP4Weight, unscale: bool = True) -> torch.Tensor:
    """bf16 ``[N, K]`` holding ``fp4 * s`` exactly (no ``1/gs``; ``unscale=False``: the kernel's
    ``fp4 * s * 2^-8``), via the Triton dequant kernel."""
    n, k = weight.shape
    out = torch.empty(n, k, dtype=torch.bfloat16, device=weight.device)
    block_n, block_k = 64, 128
    grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
    _fp4_dequant_kernel[grid](weight.words, weight.scales, out, n, k,
                              weight.words.stride(0), weight.scales.stride(0), out.stride(0),
                              BLOCK_N=block_n, BLOCK_K=block_k, UNSCALE=unscale,
                              INTERPRETED=_interpreted(out), num_warps=4)
    return out


def planned_launch(m: int, weight: PreparedFP4Weight, device: torch.device, allow_cublas: bool = True,
                   ra: bool = True):
    """The launch ``fp4_linear`` gives ``m`` rows of x on ``device`` where the mma.sync kernel does not run them
    (``launch_rule.plan_launch``: the register-A CUDA kernel's, a Gluon kernel's config or a ``KernelConfig``;
    ``ra=False`` leaves the first out); benchmarks read its path from it."""
    n, k = weight.shape
    gluon = os.environ.get(WGMMA_ENV, "1") != "0" and fp4_wgmma.available(device)
    ra = ra and device.type == "cuda" and weight.tma_aligned and \
        fp4_ra.available(device.index if device.index is not None else torch.cuda.current_device())
    return plan_launch(m, n, k, _num_sms(device), gluon=gluon,
                       producer_aligned=gluon and weight.tma_aligned,
                       allow_cublas=allow_cublas and not math.isnan(weight.inv_global_scale), ra=ra)


# ============================================================================ validation
def _resolve_impl(impl: str, x: torch.Tensor) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    on_gpu = bool(getattr(x, "is_cuda", False))
    if impl == "auto":
        return "triton" if (on_gpu and triton is not None) else "reference"
    if impl == "triton":
        if triton is None:
            raise ValueError("impl='triton' needs the triton package; install it or use impl='reference'")
        if not on_gpu and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 set before triton is imported")
    return impl


def _check_weight(packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor) -> None:
    def desc(t):
        return f"{getattr(t, 'dtype', type(t))} {list(getattr(t, 'shape', []))}"

    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.dim() != 2 or packed.numel() == 0:
        raise ValueError(f"weight_packed must be a non-empty uint8 [N, K/2] tensor, got {desc(packed)}")
    n, k = int(packed.shape[0]), int(packed.shape[1]) * 2
    if k % GROUP_SIZE != 0:
        raise ValueError(f"K = 2 * weight_packed.shape[1] = {k} must be a multiple of {GROUP_SIZE} (NVFP4 block size)")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float8_e4m3fn or tuple(scale.shape) != (n, k // GROUP_SIZE):
        raise ValueError(f"weight_scale must be float8_e4m3fn [N, K/16] = [{n}, {k // GROUP_SIZE}], got {desc(scale)}")
    if not (packed.is_contiguous() and scale.is_contiguous()):
        raise ValueError("weight_packed and weight_scale must be contiguous (call .contiguous() once at load time)")
    if not isinstance(gs, torch.Tensor) or gs.dtype != torch.float32 or gs.numel() != 1:
        raise ValueError(f"weight_global_scale must be a float32 tensor with one element, got {desc(gs)}")
    if not (packed.device == scale.device == gs.device):
        raise ValueError(f"weight tensors must share a device, got {packed.device}, {scale.device}, {gs.device}")


def _check_out(out: torch.Tensor | None, x: torch.Tensor, n: int) -> torch.Tensor | None:
    if out is None:
        return None
    want = (*x.shape[:-1], n)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or tuple(out.shape) != want \
            or not out.is_contiguous() or out.device != x.device:
        raise ValueError(f"out must be a contiguous bfloat16 tensor of shape {list(want)} on {x.device}, got "
                         f"{getattr(out, 'dtype', type(out))} {list(getattr(out, 'shape', []))}")
    return out


def _check_x_bias(x: torch.Tensor, bias: torch.Tensor | None, n: int, k: int, device: torch.device,
                  name: str = "x", dim: str = "K") -> None:  # x [..., k]: the activation (or dy) operand
    if not isinstance(x, torch.Tensor) or x.dtype != torch.bfloat16:
        raise ValueError(f"{name} must be a bfloat16 tensor, got {getattr(x, 'dtype', type(x))}; convert with {name}.to(torch.bfloat16)")
    if x.dim() < 1 or x.shape[-1] != k:
        raise ValueError(f"{name} has shape {list(x.shape)}; its last dim must equal the weight's {dim} = {k}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but the weight is on {device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dtype != torch.bfloat16 or tuple(bias.shape) != (n,):
            raise ValueError(f"bias must be a bfloat16 [N] = [{n}] tensor, got "
                             f"{getattr(bias, 'dtype', type(bias))} {list(getattr(bias, 'shape', []))}")
        if bias.device != device:
            raise ValueError(f"bias is on {bias.device} but the weight is on {device}")


# ============================================================================ launch
def _interpreted(t: torch.Tensor) -> bool:
    """CPU tensors reach the Triton kernels only under TRITON_INTERPRET=1. The interpreter cannot
    run inline PTX, flushes bf16 subnormals and (Triton 3.6-3.9) miscomputes bf16 ``tl.dot``, so
    the kernels then multiply in fp32 instead -- the same exact products, a different route."""
    return not t.is_cuda


def _triton_linear(x: torch.Tensor, weight: PreparedFP4Weight, bias: torch.Tensor | None,
                   out: torch.Tensor | None, allow_cublas: bool, config=None,
                   small_m_backend: str | None = None, mma_rule=None, lora=None,
                   x_relabeled: torch.Tensor | None = None, reduce=None, dense=None) -> torch.Tensor:
    n, k = weight.shape
    reduce = reduce or reduce_splits  # (or fp4_linear's defer_reduce)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or x2.data_ptr() % 16 or (x2.shape[0] > 1 and x2.stride(0) % 8):
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x.device) if out is None else out.view(m, n)
    if m == 0:
        return out.reshape(*lead, n)
    if config is None and uses_mma(m, k, x2.device, small_m_backend):  # x2 already meets its alignment needs
        bias_c = bias.contiguous() if bias is not None else None
        mma.mma_linear(x2, weight.words, weight.scales, weight.global_scale, bias_c, out,
                       mma_rule(m, n, k) if mma_rule is not None else None, lora=lora)
        return out.reshape(*lead, n)
    config = config or planned_launch(m, weight, x2.device, allow_cublas)
    if isinstance(config, fp4_ra.RaConfig):  # the register-A CUDA kernel (the rule's or forced)
        if out.data_ptr() % 16 == 0:  # x2 is 16-byte aligned already; the weights were checked (tma_aligned)
            fp4_ra.linear(x2, weight.words, weight.scales, weight.global_scale,
                          bias.contiguous() if bias is not None else None, out, config)
            return out.reshape(*lead, n)
        config = planned_launch(m, weight, x2.device, allow_cublas, ra=False)
    if isinstance(config, fp4_wgmma_producer.ProducerConfig):  # the producer-warp Gluon kernel (rule's or forced)
        fp4_wgmma_producer.linear(x2 if x_relabeled is None else x_relabeled, weight.words, weight.scales,
                                  weight.global_scale, bias, out, config, permuted=x_relabeled is not None,
                                  reduce_splits=reduce)
        return out.reshape(*lead, n)
    if isinstance(config, fp4_wgmma.WgmmaConfig):  # the Gluon kernel (the rule's or forced)
        fp4_wgmma.linear(x2 if x_relabeled is None else x_relabeled, weight.words, weight.scales, weight.global_scale,
                         bias, out, config, reduce, permuted=x_relabeled is not None)
        return out.reshape(*lead, n)
    cfg = config
    if cfg.cublas:
        w = dense if dense is not None else dequantize_exact(weight, unscale=False)  # fp4 * s * 2^-8, exact
        # alpha = 2^8/gs is applied by cuBLAS in fp32 before the single bf16 rounding (beta = 0:
        # the uninitialised `out` is never read); the bias is added after the cast, as the oracle does
        out.addmm_(x2, w.t(), beta=0.0, alpha=256.0 * weight.inv_global_scale)
        if bias is not None:
            out += bias
        return out.reshape(*lead, n)
    k_iters = triton.cdiv(k, cfg.block_k)
    iters_per_split = triton.cdiv(k_iters, cfg.split_k)
    split = triton.cdiv(k_iters, iters_per_split)
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else out
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
    bias_arg = bias if bias is not None else out  # never read when HAS_BIAS is False
    _fp4_gemm_kernel[grid](
        x2, weight.words, weight.scales, weight.global_scale, bias_arg, out, ws,
        m, n, k, x2.stride(0), weight.words.stride(0), weight.scales.stride(0), out.stride(0), iters_per_split,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split > 1, EVEN_K=k % cfg.block_k == 0,
        SWAP_AB=cfg.swap_ab, HAS_BIAS=bias is not None, FRAG=cfg.fragment, PREFETCH=cfg.prefetch,
        INTERPRETED=_interpreted(x2), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split > 1:
        reduce(ws, weight.global_scale, bias, out)
    return out.reshape(*lead, n)


# ============================================================================ Triton kernels
if triton is not None:
    from qerl_lib.kernels.splitk import epilogue

    @triton.jit
    def _scaled_codes(q, s_byte, BLOCK_N: tl.constexpr, WORDS: tl.constexpr, INTERPRETED: tl.constexpr):
        """uint32 words [BLOCK_N, WORDS] + E4M3 scale bytes [BLOCK_N, WORDS/2] -> bf16
        [BLOCK_N, WORDS, 2, 2, 2] of ``fp4 * s * 2^-8`` (exact); code number x + 2y + 4z of each word."""
        # E4M3 -> fp32 is exact (subnormal scales too); * 2^118 keeps fp4 * s * 2^-8 a normal bf16
        s = s_byte.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 2.0**118
        s_word = tl.reshape(tl.join(s, s), [BLOCK_N, WORDS]).to(tl.bfloat16)  # word w is in group w // 2
        p0, p1, p2, p3 = code_pair_bits(q, 0), code_pair_bits(q, 1), code_pair_bits(q, 2), code_pair_bits(q, 3)
        # tl.join appends a new *innermost* dim, so the lo/hi join goes last: each 32-bit register
        # then holds exactly one decoded pair (code i, code i + 4) -- no repacking.
        lows = tl.join(tl.join(p0.to(tl.uint16), p1.to(tl.uint16)), tl.join(p2.to(tl.uint16), p3.to(tl.uint16)))
        highs = tl.join(tl.join((p0 >> 16).to(tl.uint16), (p1 >> 16).to(tl.uint16)),
                        tl.join((p2 >> 16).to(tl.uint16), (p3 >> 16).to(tl.uint16)))
        bits = tl.join(lows, highs)  # [BLOCK_N, WORDS, x, y, z]
        scale = tl.broadcast_to(s_word[:, :, None, None, None], [BLOCK_N, WORDS, 2, 2, 2])
        if INTERPRETED:  # widen the (possibly subnormal) bf16 to fp32 by a shift and multiply there
            return ((bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True) * scale.to(tl.float32)).to(tl.bfloat16)
        # one packed bf16x2 multiply per register; exact, so the rounding mode is moot
        return tl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r",
                                         [bits.to(tl.bfloat16, bitcast=True), scale],
                                         dtype=tl.bfloat16, is_pure=True, pack=2)

    @triton.jit
    def _dequant_tile(q, s_byte, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
        """W' bf16 [BLOCK_N, BLOCK_K] in the decoder's K order (3-bit bit reversal inside each 8)."""
        return tl.reshape(_scaled_codes(q, s_byte, BLOCK_N, BLOCK_K // 8, INTERPRETED), [BLOCK_N, BLOCK_K])

    @triton.jit
    def _mma(a, b, acc, INTERPRETED: tl.constexpr):
        """acc += a @ b.T; in the interpreter in fp32 ("ieee"), which holds the bf16 values exactly."""
        if INTERPRETED:
            return tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc, input_precision="ieee")
        return tl.dot(a, tl.trans(b), acc)

    @triton.jit
    def _bitreverse_k(t, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, INTERPRETED: tl.constexpr):
        """Permute the K axis of ``t [ROWS, BLOCK_K]`` by 3-bit bit reversal inside every 8 (an involution:
        kernel order <-> natural order), in registers. The identity inline-PTX ``mov`` hides the permute from
        Triton 3.6's dot-operand optimizer, which would fold it into a shared layout and abort ("Illegal shared
        layout")."""
        t = tl.reshape(t, [ROWS, BLOCK_K // 8, 2, 2, 2])
        t = tl.reshape(tl.permute(t, [0, 1, 4, 3, 2]), [ROWS, BLOCK_K])
        if not INTERPRETED:
            t = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [t], dtype=t.dtype, is_pure=True, pack=2)
        return t

    @triton.jit
    def _frag_rows(pid_n, N, BLOCK_N: tl.constexpr):
        """Row indices shaped (l, w, h, r) = [8, 4, 2, BLOCK_N/64], row = 64r + 16w + 8h + l, clamped. Loading
        through it makes Triton give lanes to (word group, l), warps to w and registers to h, r: the rows of
        Hopper's wgmma A fragment (warp w: rows 16w.., lane/4: row, +8: 2nd reg)."""
        r = (tl.arange(0, 8)[:, None, None, None] + tl.arange(0, 4)[None, :, None, None] * 16
             + tl.arange(0, 2)[None, None, :, None] * 8 + tl.arange(0, BLOCK_N // 64)[None, None, None, :] * 64)
        return tl.minimum(pid_n * BLOCK_N + r, N - 1)

    @triton.jit
    def _frag_to_rows(t, BLOCK_N: tl.constexpr, COLS: tl.constexpr):
        """[l, w, h, r, COLS] -> [BLOCK_N, COLS] with row = 64 r + 16 w + 8 h + l (a relabel, no data moves)."""
        return tl.reshape(tl.permute(t, [3, 1, 2, 0, 4]), [BLOCK_N, COLS])

    @triton.jit
    def _frag_dequant(q, sb, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
        """words [BLOCK_N, 16] + scale bytes [BLOCK_N, 8] (one 128-wide K-step) -> W' bf16 [BLOCK_N, 128]
        with K relabeled so each thread already holds its wgmma A-fragment values. Thread lane
        t (= lane % 4) loaded words 4t..4t+3 (j = 0..3) of its rows; the decoder yields each word's
        codes as (x, y, z) with code number x + 2y + 4z. Logical K index kappa = 32 j + 16 x + 8 y + 2 t + z
        is exactly the fragment's 16 c + 8 a + 2 t + b: no shuffle or shared-memory round trip.
        x is permuted to match (``_frag_x``)."""
        w = tl.reshape(_scaled_codes(q, sb, BLOCK_N, 16, INTERPRETED), [BLOCK_N, 4, 4, 2, 2, 2])  # [n, t, j, x, y, z]
        return tl.reshape(tl.permute(w, [0, 2, 3, 4, 1, 5]), [BLOCK_N, 128])  # [n, j, x, y, t, z]

    @triton.jit
    def _frag_x(xt, BLOCK_M: tl.constexpr, INTERPRETED: tl.constexpr):
        """x [BLOCK_M, 128] (natural K) -> the K relabeling of ``_frag_dequant``: kappa (j, x, y, t, z)
        reads element 8 (4t + j) + x + 2y + 4z."""
        xt = tl.reshape(xt, [BLOCK_M, 4, 4, 2, 2, 2])  # [m, t, j, z, y, x]
        xt = tl.reshape(tl.permute(xt, [0, 2, 5, 4, 1, 3]), [BLOCK_M, 128])
        if not INTERPRETED:  # keep Triton 3.6 from folding the permute into a shared layout
            xt = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [xt], dtype=xt.dtype, is_pure=True, pack=2)
        return xt

    @triton.jit
    def _load_step(w_ptr, s_ptr, x_ptr, rows, offs_m, m_mask, kk, K, stride_wn, stride_sn, stride_xm,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, FRAG: tl.constexpr):
        """Words [BLOCK_N, BLOCK_K/8], scale bytes [BLOCK_N, BLOCK_K/16] and x [BLOCK_M, BLOCK_K] of the K-step at
        ``kk``; ``rows``: [BLOCK_N] or, with FRAG, the 4-D ``_frag_rows`` index. Weights are read once: evict_first."""
        offs_w = kk // 8 + tl.arange(0, BLOCK_K // 8)
        offs_g = kk // 16 + tl.arange(0, BLOCK_K // 16)
        offs_k = kk + tl.arange(0, BLOCK_K)
        if FRAG:
            w_ptrs = w_ptr + rows[:, :, :, :, None] * stride_wn + offs_w[None, None, None, None, :]
            s_ptrs = s_ptr + rows[:, :, :, :, None] * stride_sn + offs_g[None, None, None, None, :]
        else:
            w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_w[None, :]
            s_ptrs = s_ptr + rows[:, None] * stride_sn + offs_g[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]
        if EVEN_K:
            q = tl.load(w_ptrs, eviction_policy="evict_first")
            sb = tl.load(s_ptrs, eviction_policy="evict_first")
            xt = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
        else:  # masks broadcast along the trailing (K) axis of either pointer shape
            q = tl.load(w_ptrs, mask=offs_w < K // 8, other=0, eviction_policy="evict_first")
            sb = tl.load(s_ptrs, mask=offs_g < K // 16, other=0, eviction_policy="evict_first")
            xt = tl.load(x_ptrs, mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        if FRAG:  # one return statement: Triton wants one return type
            q, sb = _frag_to_rows(q, BLOCK_N, BLOCK_K // 8), _frag_to_rows(sb, BLOCK_N, BLOCK_K // 16)
        return q, sb, xt

    @triton.jit
    def _fp4_gemm_kernel(
        x_ptr, w_ptr, s_ptr, gs_ptr, bias_ptr, out_ptr, ws_ptr,
        M, N, K, stride_xm, stride_wn, stride_sn, stride_om, iters_per_split,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
        EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr,
        HAS_BIAS: tl.constexpr, INTERPRETED: tl.constexpr, FRAG: tl.constexpr = False, PREFETCH: tl.constexpr = True,
    ):
        """One (BLOCK_N x BLOCK_M) output tile over one K-slice. FRAG: the small-M fragment path (module docstring).
        Otherwise the generic path: W' is built in the decoder's K order (3-bit bit reversal inside each 8), x is
        permuted the same way in registers, and the tensor-core operands are W' (A) and x (B) if SWAP_AB, else x (A)
        and W' (B) for large M. With PREFETCH (the default) both issue the next K-step's loads before this step's
        decode, so DRAM latency overlaps math; without it, Triton's pipeliner stages the loads (num_stages > 1)."""
        pid_n, pid_m, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.minimum(offs_n, N - 1)  # clamp instead of masking: weight loads stay unpredicated
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < M
        it_begin = pid_k * iters_per_split
        it_end = tl.minimum(it_begin + iters_per_split, tl.cdiv(K, BLOCK_K))

        acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], dtype=tl.float32)
        if FRAG:  # small M: W' decoded straight into the wgmma A-fragment layout (BLOCK_K = 128)
            rows = _frag_rows(pid_n, N, BLOCK_N)
        q, sb, xt = _load_step(w_ptr, s_ptr, x_ptr, rows, offs_m, m_mask, it_begin * BLOCK_K, K,
                               stride_wn, stride_sn, stride_xm, BLOCK_N, BLOCK_K, EVEN_K, FRAG)
        for it in range(it_begin, it_end):  # PREFETCH: the last step re-reads its own block (an L2 hit)
            # PREFETCH=False: load this step's block here; Triton's pipeliner (num_stages > 1) stages it
            q_n, sb_n, xt_n = _load_step(w_ptr, s_ptr, x_ptr, rows, offs_m, m_mask,
                                         (tl.minimum(it + 1, it_end - 1) if PREFETCH else it) * BLOCK_K,
                                         K, stride_wn, stride_sn, stride_xm, BLOCK_N, BLOCK_K, EVEN_K, FRAG)
            if not PREFETCH:
                q, sb, xt = q_n, sb_n, xt_n
            if FRAG:
                acc = _mma(_frag_dequant(q.to(tl.uint32, bitcast=True), sb, BLOCK_N, INTERPRETED),
                           _frag_x(xt, BLOCK_M, INTERPRETED), acc, INTERPRETED)
            elif SWAP_AB:  # [BLOCK_N, BLOCK_K] x [BLOCK_K, BLOCK_M]
                acc = _mma(_dequant_tile(q.to(tl.uint32, bitcast=True), sb, BLOCK_N, BLOCK_K, INTERPRETED),
                           _bitreverse_k(xt, BLOCK_M, BLOCK_K, INTERPRETED), acc, INTERPRETED)
            else:  # [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N]
                acc = _mma(_bitreverse_k(xt, BLOCK_M, BLOCK_K, INTERPRETED),
                           _dequant_tile(q.to(tl.uint32, bitcast=True), sb, BLOCK_N, BLOCK_K, INTERPRETED), acc, INTERPRETED)
            q, sb, xt = q_n, sb_n, xt_n

        res = tl.trans(acc) if SWAP_AB else acc  # [BLOCK_M, BLOCK_N]
        out_mask = m_mask[:, None] & (offs_n < N)[None, :]
        tile_offs = offs_m[:, None] * N + offs_n[None, :]
        if SPLIT:  # the slice's raw partial: reduce_splits sums the slices (kernels/splitk.py)
            tl.store(ws_ptr + pid_k * M * N + tile_offs, res, mask=out_mask)
        else:
            epilogue(res, gs_ptr, bias_ptr, out_ptr, offs_m, offs_n, out_mask, N, stride_om, HAS_BIAS, INTERPRETED)

    @triton.jit
    def _fp4_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_on,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, UNSCALE: tl.constexpr, INTERPRETED: tl.constexpr):
        """bf16 [N, K] = fp4 * s * 2^-8 (or fp4 * s with UNSCALE), exact, natural K order."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        kb = tl.program_id(1) * BLOCK_K
        offs_w = kb // 8 + tl.arange(0, BLOCK_K // 8)
        offs_g = kb // 16 + tl.arange(0, BLOCK_K // 16)
        offs_k = kb + tl.arange(0, BLOCK_K)
        n_ok = (offs_n < N)[:, None]
        rows = tl.minimum(offs_n, N - 1)
        q = tl.load(w_ptr + rows[:, None] * stride_wn + offs_w[None, :], mask=(offs_w < K // 8)[None, :], other=0)
        sb = tl.load(s_ptr + rows[:, None] * stride_sn + offs_g[None, :], mask=(offs_g < K // 16)[None, :], other=0)
        w = _dequant_tile(q.to(tl.uint32, bitcast=True), sb, BLOCK_N, BLOCK_K, INTERPRETED)
        # decoder order -> natural K order (the bit reversal is its own inverse)
        w = tl.reshape(tl.permute(tl.reshape(w, [BLOCK_N, BLOCK_K // 8, 2, 2, 2]), [0, 1, 4, 3, 2]), [BLOCK_N, BLOCK_K])
        if UNSCALE:
            w = (w.to(tl.float32) * 256.0).to(tl.bfloat16)  # exact: a power of two
        tl.store(out_ptr + offs_n[:, None] * stride_on + offs_k[None, :], w, mask=n_ok & (offs_k < K)[None, :])

"""Split-K: summing the fp32 partials of a GEMM whose K was cut into slices, in a fixed order.

At decode batch sizes a GEMM has too few output tiles to fill an H100's 132 SMs, so the NVFP4 kernels
(``fp4_gemm``'s Triton kernel, the Gluon kernels) cut K into ``S`` slices: program ``(tile, s)`` writes
the fp32 partial product of slice ``s`` to a workspace ``ws [S, M, N]``. Something must then sum the
partials, scale by ``2^8/gs``, round to bf16 once and add the bias. Two ways, with the same bits:

1. **A second launch** (``reduce_splits``): ``out = bf16(sum_s ws[s] * 2^8/gs) (+ bias)``, starting from
   zero and adding slices 0, 1, ..., S-1 in that order. One extra kernel per GEMM; at batch 32 the 7B decode
   step has three of them per layer (84 a step, dev/LOG.md section 38), each a launch of its own.

2. **In the GEMM, by the slice that finishes a tile last** (``last_slice_sums``, ``QERL_FP4_SPLITK_IN_KERNEL``,
   default on). After writing its partial, every program takes a ticket from a per-tile counter (an atomic
   add with acquire-release order at GPU scope, after a barrier so that all of the program's stores come
   before it). The program that draws ticket ``S - 1`` knows every other slice's partial is written; it
   reads them back (``.cg``: from L2, past this SM's L1) and sums them *in slice order*, exactly as
   the second launch does, whichever slice happened to finish last, then runs the epilogue and resets
   the counter to zero. So the result does not depend on scheduling: bit-equal to (1), deterministic.
   (CUTLASS calls this a serial split-K reduction; it saves the launch and the workspace's second pass
   through a separate kernel's programs.)

The counters (``tile_counters``): one int32 per output tile, zero between launches (each launch leaves
them as it found them), one buffer per device that only grows. Two launches that split K must therefore
not run at the same time on one device (different streams): the kit's engine and trainer run their
GEMMs on one stream, and these kernels are not launched with programmatic dependent launch, so a launch
starts only when the one before it has finished. A CUDA graph captures the buffer's address; the buffer
is never freed.

The opt-in fold of ``kernels/lora`` (``QERL_LORA_SUMS_SPLITS``) is a third way: the LoRA expand sums the
partials (``fp4_gemm.fp4_linear(..., defer_reduce=)``); the GEMM then leaves them unsummed.
"""

from __future__ import annotations

import os

import torch

from qerl_lib.kernels.fp4_decode import round_bf16 as _round_bf16

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None

IN_KERNEL_ENV = "QERL_FP4_SPLITK_IN_KERNEL"  # "0": sum the slices in a second launch (read at each call)
_COUNTERS: dict[tuple[str, int | None], torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # buffers a CUDA graph may still hold the address of
_MIN_COUNTERS = 4096


def in_kernel() -> bool:
    """Whether K-split GEMMs sum their partials in the last slice to finish a tile (``QERL_FP4_SPLITK_IN_KERNEL``,
    read now; default 1) rather than in ``reduce_splits``'s second launch."""
    value = os.environ.get(IN_KERNEL_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{IN_KERNEL_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def tile_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` int32 zeros on ``device`` for ``last_slice_sums``'s tickets (module docstring): the
    device's buffer, grown (never shrunk or freed) when a launch has more tiles than it holds."""
    key = (device.type, device.index)
    buf = _COUNTERS.get(key)
    if buf is None or buf.numel() < count:
        buf = torch.zeros(max(count, _MIN_COUNTERS, 0 if buf is None else 2 * buf.numel()),
                          dtype=torch.int32, device=device)
        if key in _COUNTERS:
            _OUTGROWN.append(_COUNTERS[key])
        _COUNTERS[key] = buf
    return buf


def reduce_splits(ws: torch.Tensor, global_scale: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out (rows ``out.stride(0)`` apart) = bf16(sum of the fp32 partials ``ws [S, M, N]`` * 2^8/gs) (+ bias), in order."""
    split, m, n = ws.shape
    _splitk_reduce_kernel[(triton.cdiv(m * n, 1024),)](
        ws, global_scale, bias if bias is not None else out, out, m * n, n, out.stride(0), SPLIT=split,
        HAS_BIAS=bias is not None, BLOCK=1024, INTERPRETED=not out.is_cuda, num_warps=4)


if triton is not None:

    @triton.jit
    def epilogue(acc, gs_ptr, bias_ptr, out_ptr, offs_m, offs_n, out_mask, N, stride_om,
                 HAS_BIAS: tl.constexpr, INTERPRETED: tl.constexpr):
        """Store ``bf16(acc * 2^8/gs)`` (2^8 undoes the decoded weights' scaling), then ``+ bias`` after the cast,
        for an ``[rows, cols]`` fp32 tile at ``offs_m x offs_n`` of ``out`` (rows ``stride_om`` apart)."""
        factor = tl.math.div_rn(256.0, tl.load(gs_ptr))  # correctly rounded, as the oracle's 1/gs
        y = _round_bf16(acc * factor, INTERPRETED)
        if HAS_BIAS:
            b = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            y = _round_bf16(y.to(tl.float32) + b.to(tl.float32)[None, :], INTERPRETED)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y, mask=out_mask)

    @triton.jit
    def last_slice_sums(ws_ptr, counter_ptr, slice_stride, tile_offs, out_mask, layout_like,
                        gs_ptr, bias_ptr, out_ptr, offs_m, offs_n, N, stride_om, SLICES: tl.constexpr,
                        HAS_BIAS: tl.constexpr, INTERPRETED: tl.constexpr):
        """Call after storing this program's partial at ``ws_ptr + s * slice_stride + tile_offs``: take a ticket
        from the tile's counter; the last of the ``SLICES`` programs sums all partials in slice order (as
        ``reduce_splits``), writes the epilogue and resets the counter (module docstring, way 2).
        ``layout_like``: an fp32 tensor of the tile's shape (the accumulator), for the zeros the sum starts from."""
        tl.debug_barrier()  # every thread's partial is stored before the ticket is taken
        ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
        if ticket == SLICES - 1:
            total = tl.zeros_like(layout_like)
            for s in tl.static_range(SLICES):  # unrolled: every slice's loads in flight at once
                total += tl.load(ws_ptr + s * slice_stride + tile_offs, mask=out_mask, other=0.0,
                                 cache_modifier=".cg")
            tl.atomic_xchg(counter_ptr, 0)  # as found, for the next launch
            epilogue(total, gs_ptr, bias_ptr, out_ptr, offs_m, offs_n, out_mask, N, stride_om, HAS_BIAS,
                     INTERPRETED)

    @triton.jit
    def _splitk_reduce_kernel(ws_ptr, gs_ptr, bias_ptr, out_ptr, MN, N, stride_om, SPLIT: tl.constexpr,
                              HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
        """out = bf16(sum over K-slices of the fp32 partials * 2^8/gs) (+ bias); fixed order."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(ws_ptr + s * MN + offs, mask=mask, other=0.0)
        y = _round_bf16(acc * tl.math.div_rn(256.0, tl.load(gs_ptr)), INTERPRETED)
        if HAS_BIAS:
            b = tl.load(bias_ptr + offs % N, mask=mask, other=0.0)
            y = _round_bf16(y.to(tl.float32) + b.to(tl.float32), INTERPRETED)
        tl.store(out_ptr + (offs // N) * stride_om + offs % N, y, mask=mask)  # out: [M, N] rows, stride_om apart

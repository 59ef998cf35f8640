"""Split-K: summing the fp32 partials of a GEMM whose K was cut into slices, in a fixed order.

At decode batch sizes a GEMM has too few output tiles to fill an H100's 132 SMs, so the NVFP4 kernels
(``fp4_gemm``'s Triton kernel, the Gluon kernels) cut K into ``S`` slices: program ``(tile, s)`` writes
the fp32 partial product of slice ``s`` to a workspace ``ws [S, M, N]``. ``reduce_splits`` then sums them
in a second launch, ``out = bf16(sum_s ws[s] * 2^8/gs) (+ bias)``, starting from zero and adding slices
0, 1, ..., S-1 in that order (deterministic: no atomics), with one rounding before the bias and one after,
as the unsplit kernels' ``epilogue`` does.

Two other homes for that sum, measured on an H100 (dev/LOG.md sections 38-39): the LoRA expand kernel of the
same projection group (``kernels/lora``, ``QERL_LORA_SUMS_SPLITS``), and the GEMM itself, with the last slice to
finish each tile summing the others' partials after an atomic ticket (CUTLASS's "serial" split-K). The second
was bit-equal to the launch and 3.8% / 1.9% slower per decode step at batch 32 / 64, and is not kept.
The sum is a plain launch, not a PDL one (``kernels/pdl.py``): launched early after its GEMM it measured
0.6% slower per decode step at batch 32 and 64 without adapters (dev/LOG.md section 40).
"""

from __future__ import annotations

import torch

from qerl_lib.kernels.fp4_decode import round_bf16 as _round_bf16

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only on installs without triton
    triton = None
    tl = None


def reduce_splits(ws: torch.Tensor, global_scale: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """out (rows ``out.stride(0)`` apart) = bf16(sum of the fp32 partials ``ws [S, M, N]`` * 2^8/gs) (+ bias), in
    order."""
    split, m, n = ws.shape
    _splitk_reduce_kernel[(triton.cdiv(m * n, 1024),)](
        ws, global_scale, bias if bias is not None else out, out, m * n, n, out.stride(0), SPLIT=split,
        HAS_BIAS=bias is not None, BLOCK=1024, INTERPRETED=not out.is_cuda, num_warps=4)


if triton is not None:

    @triton.jit
    def finish(acc, gs_ptr, bias_ptr, bias_offs, bias_mask, HAS_BIAS: tl.constexpr, INTERPRETED: tl.constexpr):
        """``bf16(acc * 2^8/gs)`` (2^8 undoes the decoded weights' scaling; one rounding, as the oracle), then
        ``+ bias`` after the cast, rounded again; the bias read at ``bias_offs`` (shaped to broadcast against acc)."""
        y = _round_bf16(acc * tl.math.div_rn(256.0, tl.load(gs_ptr)), INTERPRETED)  # div_rn: the oracle's 1/gs
        if HAS_BIAS:
            b = tl.load(bias_ptr + bias_offs, mask=bias_mask, other=0.0)
            y = _round_bf16(y.to(tl.float32) + b.to(tl.float32), INTERPRETED)
        return y

    @triton.jit
    def summed_slices(ws_ptr, offs, mask, slice_stride, SLICES: tl.constexpr):
        """The fp32 partials at ``offs`` of slices ``0 .. SLICES-1`` (``slice_stride`` apart), added from zero in
        that order: the fixed order every sum of a K-split GEMM's slices uses, so all of them give the same bits."""
        acc = tl.zeros(offs.shape, dtype=tl.float32)
        for s in tl.static_range(SLICES):
            acc += tl.load(ws_ptr + s * slice_stride + offs, mask=mask, other=0.0)
        return acc

    @triton.jit
    def epilogue(acc, gs_ptr, bias_ptr, out_ptr, offs_m, offs_n, out_mask, N, stride_om,
                 HAS_BIAS: tl.constexpr, INTERPRETED: tl.constexpr):
        """Store ``finish(acc)`` for an ``[rows, cols]`` fp32 tile at ``offs_m x offs_n`` of ``out`` (rows
        ``stride_om`` apart)."""
        y = finish(acc, gs_ptr, bias_ptr, offs_n[None, :], (offs_n < N)[None, :], HAS_BIAS, INTERPRETED)
        tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y, mask=out_mask)

    @triton.jit
    def _splitk_reduce_kernel(ws_ptr, gs_ptr, bias_ptr, out_ptr, MN, N, stride_om, SPLIT: tl.constexpr,
                              HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, INTERPRETED: tl.constexpr):
        """out = bf16(sum over K-slices of the fp32 partials * 2^8/gs) (+ bias); fixed order."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        y = finish(summed_slices(ws_ptr, offs, mask, MN, SPLIT), gs_ptr, bias_ptr, offs % N, mask, HAS_BIAS,
                   INTERPRETED)
        tl.store(out_ptr + (offs // N) * stride_om + offs % N, y, mask=mask)  # out: [M, N] rows, stride_om apart

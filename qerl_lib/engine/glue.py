"""The decode step's elementwise glue as Triton kernels that take part in programmatic dependent launch.

Why not leave it to ``torch.compile``
-------------------------------------
Between the matmuls of a decode step sit small kernels: residual add + RMSNorm (before q/k/v and
before gate/up) and SiLU(gate) * up (before down). ``torch.compile`` fuses each into one kernel,
and that is what ``engine/forward.py`` runs without these (``glue_kernels=False``). At batch 8
each takes a few microseconds, and so do the gaps around it: a kernel is launched only when the
one before has finished. On Hopper a kernel can be launched early (programmatic dependent launch,
``qerl_lib.kernels.pdl``) if the one before lets it; ``torch.compile``'s kernels do not. These
do: launched with PDL, they wait (``gdc_wait``) for the previous kernel's output, then at once
allow the next kernel to launch (``gdc_launch_dependents``), so the NVFP4 matmul after them
(``kernels/mma.py``, PDL too) loads its first weights meanwhile.
Without PDL (``QERL_PDL=0``, older GPUs) they are plain kernels.

SiLU x up can also add the gate/up group's LoRA adapters (``silu_mul(..., lora=)``): the group's
shrink (``kernels/lora.shrink_``) has run after the GEMM, and this kernel, which reads gate and up
anyway, adds ``scale * xa @ B^T`` to its tile of each before the activation -- the expand kernel's
arithmetic (one fp32 sum, rounded to the activation dtype) without its launch and without writing
the group's output back. The engine does this above 8 rows (``lora_fold``): on an H100 it saved
0.7-1.3 points of step time at batch 32 / 64 and cost 6 at batch 8 (dev/LOG.md section 29).

The norms and SiLU x up can also store their output a second time in the Gluon FP4 GEMMs' K relabeling
(``relabeled=True``; ``kernels/fp4_decode.relabel_tile`` permutes each 128-column block in registers, then the
rows are stored contiguously), which the next GEMM reads instead of launching its own permute of x. Storing
each element at its relabeled column directly (a 2-byte scatter) measured 4-6x slower in the LoRA variant of
SiLU x up on an H100 (dev/LOG.md section 38).

The norms can also make the next group's LoRA shrink (``norm_shrink``): ``xa = bf16(h @ A_cat^T)`` for the normed
rows ``h``, as float32 values, which the group's mma.sync GEMM then adds in its own epilogue
(``kernels/lora.GroupPlan.epilogue(given=)``), so that neither the shrink nor the expand is a launch of its own. Its
programs are (row, block of ranks): each loads its few rows of ``A_cat`` (``SHRINK_TILE`` elements) and the norm's
weight before waiting for the previous kernel, then makes its row's norm in one pass, as the plain norm kernel does
(one more read of a row that is in L2), and dots it with those rows; the first rank block's programs store the norm's
outputs.

The prefill (``engine/forward.py``'s ``prefill_glue_ops``) runs the norms and SiLU x up too, and RoPE as ``rope_qk``:
``rotate``, one program per (sequence, position) over all heads of q or of k, each product rounded to the activation
dtype before the sum as torch rounds it (compiled without fused multiply-add), so its outputs are transformers' bit
for bit; the trainer's rotary embedding (``train/fused_layers.py``) runs the same kernel, and its gradient.

Numerics follow ``engine/reference_ops.py``'s functions (transformers' order): ``x + delta`` rounded to the
activation dtype; RMSNorm in float32 on that, rounded, *then* times the weight (one more rounding);
SiLU in float32 rounded to the activation dtype, times ``up`` rounded. Sums run in a different
order than torch's, so results may differ by one rounding step now and then (tests: within
1 unit of bf16 rounding on the normalized values).
"""

from __future__ import annotations

import torch

try:  # Triton is optional: the CPU paths do not need it.
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    gdc_launch_dependents = gdc_wait = None

from qerl_lib.engine import reference_ops
from qerl_lib.kernels import lora as lora_kernels
from qerl_lib.kernels import pdl

if triton is not None:
    from qerl_lib.kernels.fp4_decode import relabel_row, relabel_tile

SILU_BLOCK = 2048
SHRINK_TILE = 16384  # norm_shrink: elements of A per program (ranks per program = SHRINK_TILE / the row's block)
LORA_BLOCK_N = 128  # columns of gate (and of up) per program of the SiLU x up kernel that adds the LoRA


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, relabeled: bool = False):
    """``reference_ops.rms_norm`` as one kernel: ``x [..., H]`` -> normed ``[..., H]``. ``relabeled``: also return
    a copy in the FP4 GEMM's K relabeling (``relabeled_copy``): ``(normed, copy)``."""
    h = torch.empty_like(x)
    hr = relabeled_copy(x) if relabeled else None
    _launch_norm(x, None, weight, eps, None, h, hr)
    return (h, hr) if relabeled else h


def residual_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, relabeled: bool = False):
    """``reference_ops.residual_rms_norm`` as one kernel: returns ``(x + delta, rms_norm(x + delta))``, and with
    ``relabeled`` a third item, the normed rows in the FP4 GEMM's K relabeling (``relabeled_copy``)."""
    summed, h = torch.empty_like(x), torch.empty_like(x)
    hr = relabeled_copy(x) if relabeled else None
    _launch_norm(x, delta, weight, eps, summed, h, hr)
    return (summed, h, hr) if relabeled else (summed, h)


def norm_shrink(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, a_cat: torch.Tensor):
    """``(x + delta, h, xa)`` (``(x, h, xa)`` without a delta, where nothing is added or stored) with ``h`` the
    RMSNorm of the rows as `residual_rms_norm` makes it and ``xa [rows, R]`` float32 holding ``h @ a_cat^T`` rounded
    once to the activation dtype (products exact in float32, summed in float32): the shrink of the group that reads
    ``h``, as the torch path's ``xa`` tensor rounds it."""
    width = x.shape[-1]
    if a_cat.dim() != 2 or a_cat.shape[1] != width or a_cat.stride(-1) != 1 or a_cat.dtype != x.dtype:
        raise ValueError(f"norm_shrink: A_cat must be [R, {width}] with a unit last stride in {x.dtype}, got "
                         f"{list(a_cat.shape)} {a_cat.dtype}")
    summed = torch.empty_like(x) if delta is not None else x
    h = torch.empty_like(x)
    x2, d2, s2, h2 = _norm_rows(x, delta, weight, summed, h, "norm_shrink")
    r, block = a_cat.shape[0], triton.next_power_of_2(width)
    ranks_per_program = max(1, min(16, SHRINK_TILE // block))
    xa = torch.empty(x2.shape[0], r, dtype=torch.float32, device=x.device)
    early = pdl.use_for(x.device)
    _norm_shrink_kernel[(x2.shape[0], triton.cdiv(r, ranks_per_program))](
        x2, d2, weight, s2, h2, a_cat, xa, float(eps), width, r, x2.stride(0), d2.stride(0), s2.stride(0),
        h2.stride(0), a_cat.stride(0), HAS_DELTA=delta is not None, BLOCK=block, RB=ranks_per_program,
        PDL=early, launch_pdl=early, num_warps=8 if block >= 4096 else 4)
    return summed, h, xa


def relabeled_copy(like: torch.Tensor) -> torch.Tensor:
    """An empty contiguous ``[rows, width]`` tensor for a glue kernel's second output: its rows in the Gluon FP4
    kernels' K relabeling (``fp4_decode.relabeled_column``), which ``fp4_linear(..., x_relabeled=)`` reads
    instead of launching ``fp4_wgmma.permute_x``. The width must be a multiple of 128."""
    width = like.shape[-1]
    if width % 128:
        raise ValueError(f"relabeled copy: the width must be a multiple of 128 (the relabeling's block), got {width}")
    return torch.empty(like.numel() // width, width, dtype=like.dtype, device=like.device)


def silu_mul(act, gate: torch.Tensor, up: torch.Tensor, lora: "lora_kernels.Shrunk | None" = None,
             relabeled: bool = False):
    """``reference_ops.gated_act`` for SiLU as one kernel (``act`` is the model's SiLU module). ``lora``: the
    gate/up group's ``kernels/lora.shrink_`` result, whose expand this kernel adds to gate and up first;
    gate and up must then be the two halves of the group's fused output (columns ``[0, I)`` and ``[I, 2I)``).
    ``relabeled``: return ``(out, copy)``, the copy in the FP4 GEMM's K relabeling (``relabeled_copy``)."""
    if gate.shape != up.shape:
        raise ValueError(f"silu_mul: gate {list(gate.shape)} and up {list(up.shape)} differ")
    width = gate.shape[-1]
    g2, u2 = gate.reshape(-1, width), up.reshape(-1, width)
    if g2.stride(-1) != 1 or u2.stride(-1) != 1:
        raise ValueError("silu_mul: gate and up need a unit stride in their last dimension")
    out = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device)
    outr = relabeled_copy(out) if relabeled else None
    if lora is not None:
        _silu_mul_lora(g2, u2, out, lora, outr)
    else:
        grid = (g2.shape[0], triton.cdiv(width, SILU_BLOCK))
        early = pdl.use_for(gate.device)
        _silu_mul_kernel[grid](g2, u2, out, out if outr is None else outr, width, g2.stride(0), u2.stride(0),
                               out.stride(0), BLOCK=SILU_BLOCK, RELABELED=relabeled, PDL=early, launch_pdl=early,
                               num_warps=4)
    return (out.view(gate.shape), outr) if relabeled else out.view(gate.shape)


def _silu_mul_lora(g2: torch.Tensor, u2: torch.Tensor, out: torch.Tensor, lora: "lora_kernels.Shrunk",
                   outr: torch.Tensor | None) -> None:
    plan, (m, width) = lora.plan, g2.shape
    if plan.n_total != 2 * width or lora.m != m or u2.data_ptr() - g2.data_ptr() != width * g2.element_size():
        raise ValueError(f"silu_mul: with lora=, gate and up must be the halves of one [{m}, {plan.n_total}] group "
                         f"output its plan covers; got gate/up [{m}, {width}] of a {lora.m}-row shrink")
    r_gate, rank_gate, scale_gate = lora.member(0)
    r_up, rank_up, scale_up = lora.member(width)
    grid = (triton.cdiv(width, LORA_BLOCK_N), triton.cdiv(m, lora.block_m))
    _silu_mul_lora_kernel[grid](
        g2, u2, out, out if outr is None else outr, lora.src, plan.b_cat, width, m, plan.a_cat.shape[0],
        lora.row_stride, g2.stride(0),
        u2.stride(0), out.stride(0), plan.b_cat.stride(0), r_gate, rank_gate, scale_gate, r_up, rank_up, scale_up,
        SPLITS=lora.splits, BLOCK_M=lora.block_m, BLOCK_N=LORA_BLOCK_N, RP=plan.padded_rank, PRECISION=lora.precision,
        RELABELED=outr is not None, PDL=lora.early, launch_pdl=lora.early, num_warps=lora_kernels.EXPAND_WARPS)


def _norm_rows(x, delta, weight, summed, h, name: str):
    """The norm kernels' 2-D views ``(x, delta, summed, h)`` (x for an absent delta, h for an absent sum), checked
    for the unit last stride they assume."""
    width = x.shape[-1]
    x2, h2 = x.reshape(-1, width), h.view(-1, width)
    d2 = delta.reshape(-1, width) if delta is not None else x2
    s2 = summed.view(-1, width) if summed is not None else h2
    if x2.stride(-1) != 1 or d2.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"{name}: inputs need a unit stride in their last dimension")
    return x2, d2, s2, h2


def _launch_norm(x, delta, weight, eps, summed, h, hr=None) -> None:
    width = x.shape[-1]
    x2, d2, s2, h2 = _norm_rows(x, delta, weight, summed, h, "rms_norm")
    block = triton.next_power_of_2(width)
    early = pdl.use_for(x.device)
    _rms_norm_kernel[(x2.shape[0],)](x2, d2, weight, s2, h2, h2 if hr is None else hr, float(eps), width,
                                     x2.stride(0), d2.stride(0), s2.stride(0), h2.stride(0),
                                     HAS_DELTA=delta is not None, BLOCK=block, RELABELED=hr is not None,
                                     PDL=early, launch_pdl=early, num_warps=8 if block >= 4096 else 4)


def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``reference_ops.rope_qk`` (q and k rotated, transformers' roundings) as one ``rotate`` launch each where the
    inputs fit (``rotary_fits``), the reference's torch ops otherwise: the prefill's 10 elementwise launches a
    layer become 2."""
    if triton is None or not q.is_cuda or not rotary_fits(q, k, cos, sin):
        return reference_ops.rope_qk(q, k, cos, sin)
    return rotate(q, cos, sin, backward=False), rotate(k, cos, sin, backward=False)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` (or, ``backward``, its gradient given ``x`` = dy) as one
    kernel over ``x [B, H, L, D]`` (any strides, unit last) with ``cos``/``sin`` ``[B or 1, L, D]``, bit for bit.
    ``L`` is not specialized on: a continuous call's refills prefill at lengths that change from refill to refill,
    and Triton would otherwise compile a second variant mid-rollout for lengths divisible by 16 (dev/LOG.md 137)."""
    batch, heads, positions, width = x.shape
    out = torch.empty_like(x)  # x's memory layout, as transformers' elementwise ops keep it
    if out.numel() == 0:
        return out
    (cb, cl, _), (sb, sl, _) = cos.stride(), sin.stride()
    _rotary_kernel[(batch * positions,)](
        x, cos, sin, out, heads, positions, x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1),
        out.stride(2), cb if cos.shape[0] > 1 else 0, cl, sb if sin.shape[0] > 1 else 0, sl, HALF=width // 2,
        BLOCK_H=triton.next_power_of_2(heads), BACKWARD=backward, num_warps=4,
        enable_fp_fusion=False)  # each product rounded before the sum, as torch: no fused multiply-add
    return out


def rotary_fits(q, k, cos, sin) -> bool:
    """Whether `rotate` takes q and k with these cos and sin: 4-d with unit-stride heads of a power-of-two half, cos
    and sin ``[B or 1, L, D]`` without gradients, one dtype and device."""
    tensors = (q, k, cos, sin)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or q.dim() != 4 or k.dim() != 4 or cos.dim() != 3:
        return False
    batch, _, positions, width = q.shape
    half = width // 2
    return (k.shape[0], k.shape[2:]) == (batch, q.shape[2:]) and cos.shape == sin.shape and \
        cos.shape[0] in (1, batch) and tuple(cos.shape[1:]) == (positions, width) and width % 2 == 0 and \
        half & (half - 1) == 0 and len({t.dtype for t in tensors}) == 1 and q.dtype.is_floating_point and \
        all(t.stride(-1) == 1 and t.device == q.device for t in tensors) and \
        not (cos.requires_grad or sin.requires_grad)


if triton is not None:

    @triton.jit
    def _residual_row(x_ptr, d_ptr, s_ptr, row, cols, ok, store, sx, sd, ss, HAS_DELTA: tl.constexpr):
        """A row of x, or of x + delta rounded to the activation dtype and stored where ``store`` says."""
        x = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0)
        if HAS_DELTA:
            d = tl.load(d_ptr + row * sd + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + d.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(s_ptr + row * ss + cols, x, mask=store)
        return x

    @triton.jit
    def _rms_normed(x, w, eps, width, out_dtype: tl.constexpr):
        """transformers' RMSNorm of a row: float32 statistics, rounded to x's dtype, then times the weight, rounded."""
        hf = x.to(tl.float32)
        variance = tl.sum(hf * hf, axis=0) / width
        normed = (hf * (1.0 / tl.sqrt_rn(variance + eps))).to(x.dtype)
        return (w.to(tl.float32) * normed.to(tl.float32)).to(out_dtype)

    @triton.jit
    def _norm_shrink_kernel(x_ptr, d_ptr, w_ptr, s_ptr, h_ptr, a_ptr, xa_ptr, eps, width, R, sx, sd, ss, sh, sa,
                            HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, RB: tl.constexpr, PDL: tl.constexpr):
        """Program (row, rank block), the whole row at once: its ``RB`` rows of ``A`` and the norm's weight are loaded
        before the wait for the previous kernel (neither is written during a decode step), then the row as
        ``_rms_norm_kernel`` makes it (the first rank block's programs store it) and ``RB`` ranks of ``h @ A^T``."""
        row, rb = tl.program_id(0), tl.program_id(1)
        cols = tl.arange(0, BLOCK)
        ok = cols < width
        ranks = rb * RB + tl.arange(0, RB)
        ok_r = ranks < R
        a = tl.load(a_ptr + ranks[:, None] * sa + cols[None, :], mask=ok_r[:, None] & ok[None, :], other=0.0)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        first = ok & ((cols * 0 + rb) == 0)
        x = _residual_row(x_ptr, d_ptr, s_ptr, row, cols, ok, first, sx, sd, ss, HAS_DELTA)
        h = _rms_normed(x, w, eps, width, h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * sh + cols, h, mask=first)
        xa = tl.sum(a.to(tl.float32) * h.to(tl.float32)[None, :], axis=1).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(xa_ptr + row * R + ranks, xa, mask=ok_r)

    @triton.jit
    def _rms_norm_kernel(x_ptr, d_ptr, w_ptr, s_ptr, h_ptr, hr_ptr, eps, width, sx, sd, ss, sh,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, RELABELED: tl.constexpr, PDL: tl.constexpr):
        """One program per row: (x + delta) and its RMSNorm times the weight (with RELABELED also stored
        at the FP4 GEMM's relabeled columns of contiguous ``hr``)."""
        if PDL:  # launched early: wait for the previous kernel, then let the next one launch
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < width
        x = _residual_row(x_ptr, d_ptr, s_ptr, row, cols, ok, ok, sx, sd, ss, HAS_DELTA)
        h = _rms_normed(x, tl.load(w_ptr + cols, mask=ok, other=0.0), eps, width, h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * sh + cols, h, mask=ok)
        if RELABELED:  # the row's blocks of 128 columns permuted in registers, stored contiguously
            tl.store(hr_ptr + row * width + cols, relabel_row(h, BLOCK), mask=ok)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, or_ptr, width, sg, su, so, BLOCK: tl.constexpr, RELABELED: tl.constexpr,
                         PDL: tl.constexpr):
        """Program (row, block of columns): silu(gate) rounded, times up, rounded (with RELABELED also stored at
        the FP4 GEMM's relabeled columns of contiguous ``or``)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        row, blk = tl.program_id(0), tl.program_id(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        g = tl.load(g_ptr + row * sg + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su + cols, mask=ok, other=0.0)
        a = (g / (1.0 + tl.exp(-g))).to(o_ptr.dtype.element_ty)
        o = (a.to(tl.float32) * u.to(tl.float32)).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + row * so + cols, o, mask=ok)
        if RELABELED:
            tl.store(or_ptr + row * width + cols, relabel_row(o, BLOCK), mask=ok)

    @triton.jit
    def _silu_mul_lora_kernel(g_ptr, u_ptr, o_ptr, or_ptr, xa_ptr, b_ptr, width, M, R, sxa, sg, su, so, sb,
                              r_gate, rank_gate, scale_gate, r_up, rank_up, scale_up, SPLITS: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RP: tl.constexpr, PRECISION: tl.constexpr,
                              RELABELED: tl.constexpr, PDL: tl.constexpr):
        """Program (block of columns, block of rows): gate and up each plus its adapter's
        ``scale * xa @ B^T`` (rounded once, as the expand kernel does), then silu(gate) rounded, times up, rounded.
        A member without an adapter has rank 0 and zero ``B`` rows: it adds exactly nothing."""
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ok_n = cols < width
        rr = tl.arange(0, RP)
        # B is constant during a rollout: loaded before the wait, while the shrink kernel still runs
        b_gate = tl.load(b_ptr + cols[:, None] * sb + rr[None, :], mask=ok_n[:, None], other=0.0)
        b_up = tl.load(b_ptr + (width + cols)[:, None] * sb + rr[None, :], mask=ok_n[:, None], other=0.0)
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        ok_m = rows < M
        dtype = o_ptr.dtype.element_ty
        xa_gate = lora_kernels.member_xa(xa_ptr, rows, ok_m, r_gate, rank_gate, M, R, sxa, SPLITS, BLOCK_M, RP)
        xa_up = lora_kernels.member_xa(xa_ptr, rows, ok_m, r_up, rank_up, M, R, sxa, SPLITS, BLOCK_M, RP)
        xa_gate, xa_up = xa_gate.to(dtype), xa_up.to(dtype)
        ok = ok_m[:, None] & ok_n[None, :]
        g = tl.load(g_ptr + rows[:, None] * sg + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + rows[:, None] * su + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        g = (g + scale_gate * tl.dot(xa_gate, tl.trans(b_gate), input_precision=PRECISION)).to(dtype).to(tl.float32)
        u = (u + scale_up * tl.dot(xa_up, tl.trans(b_up), input_precision=PRECISION)).to(dtype)
        a = (g / (1.0 + tl.exp(-g))).to(dtype)
        o = (a.to(tl.float32) * u.to(tl.float32)).to(dtype)
        tl.store(o_ptr + rows[:, None] * so + cols[None, :], o, mask=ok)
        if RELABELED:
            tl.store(or_ptr + rows[:, None] * width + cols[None, :], relabel_tile(o, BLOCK_M, BLOCK_N // 128), mask=ok)

    @triton.jit(do_not_specialize=["positions"])  # a refill's longest prompt: one variant at every length
    def _rotary_kernel(x_ptr, c_ptr, s_ptr, o_ptr, heads, positions, sxb, sxh, sxl, sob, soh, sol, scb, scl, ssb, ssl,
                       HALF: tl.constexpr, BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr):
        """Program (sequence, position): every head's rotation (or its gradient), each product rounded as torch."""
        pid = tl.program_id(0)
        b, pos = pid // positions, pid % positions
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, HALF)[None, :]
        ok = (h < heads) & (d < HALF)
        dtype = o_ptr.dtype.element_ty
        x = x_ptr + b * sxb + pos * sxl + h * sxh + d
        x1 = tl.load(x, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x + HALF, mask=ok, other=0.0).to(tl.float32)
        c = c_ptr + b * scb + pos * scl + d
        s = s_ptr + b * ssb + pos * ssl + d
        c1, c2 = tl.load(c).to(tl.float32), tl.load(c + HALF).to(tl.float32)
        s1, s2 = tl.load(s).to(tl.float32), tl.load(s + HALF).to(tl.float32)
        a1, a2 = (x1 * c1).to(dtype).to(tl.float32), (x2 * c2).to(dtype).to(tl.float32)
        if BACKWARD:  # the gradient reaches x through both products; rotate_half's cat sends it back swapped
            o1 = a1 + (x2 * s2).to(dtype).to(tl.float32)
            o2 = a2 - (x1 * s1).to(dtype).to(tl.float32)
        else:
            o1 = a1 - (x2 * s1).to(dtype).to(tl.float32)
            o2 = a2 + (x1 * s2).to(dtype).to(tl.float32)
        o = o_ptr + b * sob + pos * sol + h * soh + d
        tl.store(o, o1.to(dtype), mask=ok)
        tl.store(o + HALF, o2.to(dtype), mask=ok)

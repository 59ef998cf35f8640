"""One-token decode attention over the engine's KV cache as a split-KV Triton kernel (flash-decoding).

Why kernels
-----------
In a decode step each row has one query token, and attention reads every cached key and value
of the row once: with Qwen2.5-7B's 4 KV heads at 1,300 cached tokens that is ~21 MB per layer (keys and
values) for batch 8. Written with torch ops (``matmul_decode_attention``: scores matmul, float32 softmax,
probabilities matmul) it costs three kernels and a round trip of the scores through memory per
layer, and cuBLAS handles the tiny ``[7, D] x [D, L]`` products poorly. Here one program handles
one (row, KV head, slice of the cache): the ``G = heads / kv_heads`` query heads that share the KV
head are the rows of its ``tl.dot`` (K and V are read once, never repeated), and an online softmax
(running max and sum, as in FlashAttention) walks the slice in blocks of columns (``AttentionLaunch``).
Slices ("split-KV", as in flash-decoding) give the GPU enough programs at batch 8; a second small
kernel merges the slices' partial results. Both run inside the engine's CUDA graphs: the current
column is read from a device tensor, so a graph captured once serves every step of its length bucket.
``rope_and_cache`` does the step before in one launch too: RoPE on the new q and k, k and v written
into the cache column (instead of two RoPE kernels and two ``index_copy_`` per layer);
``rope_cache_attention``, what the engine calls, does both inside the attention kernel.

Masking matches the engine's layout: row ``b`` attends to cache columns ``pad[b] .. column``
(left padding before, not-yet-written columns after).

Numerics, and where this deviates from transformers: scores and the softmax are float32 from end
to end and the probabilities are rounded to the activation dtype only as the second product's
input (as FlashAttention/SDPA do); transformers' eager attention rounds the scores to bf16 first.
The results therefore differ from ``matmul_decode_attention`` by bf16 rounding, which is why the
engine uses this kernel on CUDA only (``decode_attention="kernel"``) and keeps HF's exact
arithmetic on CPU. ``reference_decode_attention`` is the plain-torch oracle of the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

try:  # Triton is optional: the CPU paths do not need it.
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    gdc_launch_dependents = gdc_wait = None

from qerl_lib.kernels import pdl

if triton is not None:
    from qerl_lib.kernels.fp4_decode import relabel_row, relabel_tile, relabeled_column


@dataclass(frozen=True)
class AttentionLaunch:
    """Launch shape of the decode-attention kernel: ``block`` cache columns per step of the online
    softmax, ``warps`` per program, ``stages`` (Triton's software pipelining depth of the K/V block
    loads) and ``programs``, how many programs the split-KV slices aim for in all.

    The defaults are the few-rows shape (``pick_launch``): within 1% of the fastest of 108 shapes
    swept on an H200 (Qwen2.5-7B heads, batch 8, 1,280 and 2,240 cached tokens;
    ``dev/sweeps/rollout_attention_depth_sweep.py``, dev/LOG.md) and ~3% faster than 3 stages with
    ~2 programs per SM.
    """

    block: int = 64
    warps: int = 4
    stages: int = 2
    programs: int = 528  # ~4 per SM on an H100/H200; more slices than this only add merge work

    def __post_init__(self):
        if self.block < 16 or self.block & (self.block - 1) or self.warps not in (1, 2, 4, 8, 16) \
                or self.stages < 1 or self.programs < 1:
            raise ValueError(f"AttentionLaunch{(self.block, self.warps, self.stages, self.programs)}: block must "
                             "be a power of two >= 16, warps 1/2/4/8/16, stages and programs >= 1")


DEFAULT_LAUNCH = AttentionLaunch()
# From MANY_PAIRS (row, KV head) pairs on, each program is one pair's whole row or half of it: the
# slices' merge and the short runs per program cost more than the parallelism they buy. On an H100
# (dev/LOG.md section 30; 7B heads, 640-2,000 cached tokens) this shape was the fastest of 60 at
# batch 32 and 64 and within 0.2% at 128, 9-15% below the few-rows shape in isolation and 2-3% of
# the engine's decode step; at batch 8 (32 pairs) it was 4% slower than the few-rows shape.
MANY_PAIRS = 128
MANY_PAIRS_LAUNCH = AttentionLaunch(block=64, warps=8, stages=3, programs=132)


def pick_launch(batch: int, kv_heads: int) -> AttentionLaunch:
    """The launch shape ``decode_attention`` uses when none is given: ``MANY_PAIRS_LAUNCH`` from
    ``MANY_PAIRS`` (row, KV head) pairs on, else ``DEFAULT_LAUNCH``."""
    return MANY_PAIRS_LAUNCH if batch * kv_heads >= MANY_PAIRS else DEFAULT_LAUNCH


def reference_decode_attention(q, k, v, pad, column, scaling):
    """Plain torch, float32: ``q [B, H, D]``, ``k, v [B, KV, L, D]``, ``pad [B]``, ``column`` (int or
    1-element tensor). Row ``b`` attends to columns ``pad[b] .. column``. Returns ``[B, H, D]`` float32."""
    b, h, d = q.shape
    kv, length = k.shape[1], k.shape[2]
    col = int(column)
    idx = torch.arange(length, device=q.device)
    allowed = (idx[None, :] >= pad[:, None]) & (idx[None, :] <= col)  # [B, L]
    qg = q.float().reshape(b, kv, h // kv, d)
    scores = torch.einsum("bkgd,bkld->bkgl", qg, k.float()) * scaling
    scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("bkgl,bkld->bkgd", probs, v.float()).reshape(b, h, d)


def num_splits(batch: int, kv_heads: int, kv_len: int, block: int | None = None, target: int | None = None) -> int:
    """Cache slices per (row, KV head): about ``target`` programs in all (default: ``DEFAULT_LAUNCH``'s),
    each slice at least one ``block`` of columns."""
    block, target = block or DEFAULT_LAUNCH.block, target or DEFAULT_LAUNCH.programs
    blocks = max(1, math.ceil(kv_len / block))
    return max(1, min(blocks, math.ceil(target / max(1, batch * kv_heads))))


# The merge kernel's tile of slices (``SPLITS_P``, a compile-time constant) is sized by what the batch can need, not
# by the slices the current cache length has: a longer length bucket then reuses the compiled merge instead of
# compiling another one mid-rollout (~0.13 s each on an H200, dev/LOG.md sections 120 and 122). Tiles above this many
# slices are only met at a few rows with long caches, and only then does the width follow the slice count.
MERGE_WIDTH_CAP = 32


def merge_width(splits: int, batch: int, kv_heads: int, programs: int) -> int:
    """Rows of the merge kernel's tile for ``splits`` slices: the power of two covering the most slices
    ``num_splits`` gives this batch at any length (up to ``MERGE_WIDTH_CAP``), or ``splits`` if more."""
    most = min(MERGE_WIDTH_CAP, math.ceil(programs / max(1, batch * kv_heads)))
    return 1 << (max(splits, most) - 1).bit_length()


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: torch.Tensor, column: torch.Tensor,
                     scaling: float, out: torch.Tensor | None = None, splits: int | None = None,
                     launch: AttentionLaunch | None = None, _rope: tuple | None = None,
                     out_relabeled: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one query token per row over the cache, on the GPU (or the Triton interpreter).

    ``q [B, H, D]`` (any strides with unit last stride), ``k, v [B, KV, L, D]`` cache views (the
    first ``L`` columns), ``pad [B]`` int64, ``column`` int64 ``[1]`` on the device (the column this
    step wrote), ``scaling`` the softmax scale. Returns ``[B, H, D]`` in q's dtype (``out`` if given).
    ``H`` must be a multiple of ``KV`` and ``D`` a power of two (16 to 256). ``splits``: cache slices
    per (row, KV head) (default: ``num_splits``); ``launch``: the kernel's launch shape (default:
    ``pick_launch``'s for this batch).
    """
    if triton is None:
        raise ValueError("decode_attention needs the triton package; use the engine's 'matmul' attention instead")
    b, h, d = q.shape
    kv, length = k.shape[1], k.shape[2]
    launch = launch or pick_launch(b, kv)
    if h % kv or d & (d - 1) or not 16 <= d <= 256 or k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"decode_attention: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not fit "
                         "[B, H, D] / [B, KV, L, D] with H a multiple of KV and D a power of two in [16, 256]")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("decode_attention: q, k and v need a unit stride in their last (head_dim) dimension")
    groups = h // kv
    splits = splits or num_splits(b, kv, length, launch.block, launch.programs)
    per_split = triton.cdiv(triton.cdiv(length, splits), launch.block) * launch.block
    splits = triton.cdiv(length, per_split)
    out = torch.empty(b, h, d, dtype=q.dtype, device=q.device) if out is None else out
    relabeled = out_relabeled is not None
    if relabeled and (out_relabeled.shape != (b, h * d) or not out_relabeled.is_contiguous() or (h * d) % 128):
        raise ValueError(f"decode_attention: out_relabeled must be a contiguous [{b}, {h * d}] tensor with a width "
                         f"that is a multiple of 128, got {list(out_relabeled.shape)}")
    outr = out_relabeled if relabeled else out  # (unused without RELABELED)
    interpreted = not q.is_cuda
    early = pdl.use_for(q.device)  # programmatic dependent launch (qerl_lib.kernels.pdl)
    if splits == 1:
        part_acc = part_ml = out  # unused
    else:
        part_acc = torch.empty(b, h, splits, d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(b, h, splits, 2, dtype=torch.float32, device=q.device)
    k_new, v_new, cos, sin = _rope if _rope is not None else (k, v, q, q)  # (unused without ROPE)
    _decode_attention_kernel[(b, kv, splits)](
        q, k, v, pad, column, out, outr, part_acc, part_ml, scaling, length, per_split,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), k_new, v_new, cos, sin, k_new.stride(0), k_new.stride(1), v_new.stride(0),
        v_new.stride(1), cos.stride(0), sin.stride(0),
        GROUPS=groups, GROUPS_P=max(16, triton.next_power_of_2(groups)), D=d, BLOCK=launch.block, SPLIT=splits > 1,
        ROPE=_rope is not None, RELABELED=relabeled, INTERPRETED=interpreted, PDL=early, launch_pdl=early,
        num_warps=launch.warps, num_stages=launch.stages)
    if splits > 1:
        _merge_splits_kernel[(b, h)](part_acc, part_ml, out, outr, out.stride(0), out.stride(1), h,
                                     splits, SPLITS_P=merge_width(splits, b, kv, launch.programs), D=d,
                                     RELABELED=relabeled,
                                     PDL=early, launch_pdl=early, num_warps=4)
    return out


def rope_cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, pad: torch.Tensor, column: torch.Tensor,
                         scaling: float, splits: int | None = None, launch: AttentionLaunch | None = None,
                         out_relabeled: torch.Tensor | None = None) -> torch.Tensor:
    """``rope_and_cache`` and ``decode_attention`` in one kernel launch (what the engine runs): each
    program rotates its own query heads; the program whose slice holds ``column`` also rotates the
    new key, writes it and the new value into the cache, and uses them for that column directly.
    Same arithmetic and roundings as the two calls, so the same output bits; one kernel less per layer.

    ``q [B, H, 1, D]``, ``k, v [B, KV, 1, D]`` (un-rotated views with unit last stride), ``cos, sin
    [B, 1, D]``, caches ``[B, KV, L, D]`` (the first ``L`` columns are attended). Returns ``[B, H, D]``.
    ``splits``, ``launch`` and ``out_relabeled`` as for ``decode_attention``.
    """
    if q.shape[-1] % 2 or k.stride(-1) != 1 or v.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rope_cache_attention: head_dim must be even and every last dimension unit-stride")
    return decode_attention(q[:, :, 0], k_cache, v_cache, pad, column, scaling, splits=splits, launch=launch,
                            _rope=(k[:, :, 0], v[:, :, 0], cos[:, 0], sin[:, 0]), out_relabeled=out_relabeled)


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """One kernel for what precedes decode attention: RoPE on the new token's q and k, then k and v
    written into cache column ``column`` (a 1-element device tensor). Replaces two RoPE kernels and
    two ``index_copy_`` launches per layer.

    ``q [B, H, 1, D]``, ``k, v [B, KV, 1, D]`` (views with a unit last stride), ``cos, sin [B, 1, D]``,
    caches ``[B, KV, L, D]``. Returns the rotated q as a new ``[B, H, D]`` tensor. Arithmetic: float32,
    one rounding to the activation dtype at the end (as the ``torch.compile``d glue it replaces;
    transformers rounds ``q * cos`` and ``rotate_half(q) * sin`` separately).
    """
    if triton is None:
        raise ValueError("rope_and_cache needs the triton package")
    b, h, _, d = q.shape
    kv = k.shape[1]
    if d % 2 or d & (d - 1) or q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 \
            or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError("rope_and_cache: head_dim must be a power of two and every last dimension unit-stride")
    q_out = torch.empty(b, h, d, dtype=q.dtype, device=q.device)
    early = pdl.use_for(q.device)
    _rope_cache_kernel[(b, h + kv)](
        q, k, v, cos, sin, column, q_out, k_cache, v_cache, h,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        q_out.stride(0), q_out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), D=d, PDL=early, launch_pdl=early, num_warps=1)
    return q_out


if triton is not None:

    @triton.jit
    def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, col_ptr, qo_ptr, kc_ptr, vc_ptr, H,
                           sqb, sqh, skb, skh, svb, svh, scb, ssb, sob, soh, skcb, skch, skcl, svcb, svch, svcl,
                           D: tl.constexpr, PDL: tl.constexpr):
        """Program (row b, head h): h < H rotates query head h; h >= H rotates key head h - H into the
        cache and copies value head h - H. rotate_half pairs dimension i with i + D/2."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        b, h = tl.program_id(0), tl.program_id(1)
        d = tl.arange(0, D)
        partner = (d + D // 2) % D
        sign = tl.where(d < D // 2, -1.0, 1.0)
        cos = tl.load(cos_ptr + b * scb + d).to(tl.float32)
        sin = tl.load(sin_ptr + b * ssb + d).to(tl.float32)
        if h < H:
            base = q_ptr + b * sqb + h * sqh
            x = tl.load(base + d).to(tl.float32)
            xp = tl.load(base + partner).to(tl.float32)
            tl.store(qo_ptr + b * sob + h * soh + d, (x * cos + sign * xp * sin).to(qo_ptr.dtype.element_ty))
        else:
            j = h - H
            col = tl.load(col_ptr)
            base = k_ptr + b * skb + j * skh
            x = tl.load(base + d).to(tl.float32)
            xp = tl.load(base + partner).to(tl.float32)
            tl.store(kc_ptr + b * skcb + j * skch + col * skcl + d, (x * cos + sign * xp * sin).to(kc_ptr.dtype.element_ty))
            tl.store(vc_ptr + b * svcb + j * svch + col * svcl + d, tl.load(v_ptr + b * svb + j * svh + d))

    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, pad_ptr, col_ptr, out_ptr, or_ptr, acc_ptr, ml_ptr, scaling, L,
                                 per_split,
                                 sqb, sqh, skb, skh, skl, svb, svh, svl, sob, soh,
                                 kn_ptr, vn_ptr, cos_ptr, sin_ptr, sknb, sknh, svnb, svnh, scb, ssb,
                                 GROUPS: tl.constexpr, GROUPS_P: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                                 SPLIT: tl.constexpr, ROPE: tl.constexpr, RELABELED: tl.constexpr,
                                 INTERPRETED: tl.constexpr, PDL: tl.constexpr):
        """Program (row b, KV head j, slice s): the GROUPS query heads of KV head j over columns
        [s * per_split, (s + 1) * per_split) intersected with [pad[b], column]. With ROPE, q is
        rotated here, and the slice holding the column writes the rotated new key and the new value
        into the cache and uses them for that column (the rope_cache kernel's arithmetic). With RELABELED the
        output is also stored in row b of contiguous ``or [B, H * D]`` at the FP4 GEMM's relabeled columns."""
        if PDL:  # launched early: wait for the previous kernel, then let the next one launch
            gdc_wait()
            gdc_launch_dependents()
        b, j, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        first = tl.load(pad_ptr + b).to(tl.int32)
        last = tl.load(col_ptr).to(tl.int32)  # inclusive
        lo = tl.maximum(s * per_split, (first // BLOCK) * BLOCK)
        hi = tl.minimum((s + 1) * per_split, tl.minimum(last + 1, L))
        g = tl.arange(0, GROUPS_P)
        dd = tl.arange(0, D)
        heads = j * GROUPS + g
        g_ok = g < GROUPS
        q = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + dd[None, :], mask=g_ok[:, None], other=0.0)
        if ROPE:
            partner = (dd + D // 2) % D
            sign = tl.where(dd < D // 2, -1.0, 1.0)
            cos = tl.load(cos_ptr + b * scb + dd).to(tl.float32)
            sin = tl.load(sin_ptr + b * ssb + dd).to(tl.float32)
            qp = tl.load(q_ptr + b * sqb + heads[:, None] * sqh + partner[None, :], mask=g_ok[:, None], other=0.0)
            q = (q.to(tl.float32) * cos[None, :] + sign[None, :] * qp.to(tl.float32) * sin[None, :]).to(q_ptr.dtype.element_ty)
            kx = tl.load(kn_ptr + b * sknb + j * sknh + dd).to(tl.float32)
            kxp = tl.load(kn_ptr + b * sknb + j * sknh + partner).to(tl.float32)
            k_new = (kx * cos + sign * kxp * sin).to(k_ptr.dtype.element_ty)
            v_new = tl.load(vn_ptr + b * svnb + j * svnh + dd)
            if (last >= s * per_split) & (last < (s + 1) * per_split):  # this slice holds the new column
                tl.store(k_ptr + b * skb + j * skh + last * skl + dd, k_new)
                tl.store(v_ptr + b * svb + j * svh + last * svl + dd, v_new)
        m_i = tl.full([GROUPS_P], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUPS_P], tl.float32)
        acc = tl.zeros([GROUPS_P, D], tl.float32)
        k_base = k_ptr + b * skb + j * skh
        v_base = v_ptr + b * svb + j * svh
        for start in range(lo, hi, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            ok = (cols >= first) & (cols < hi)
            kb = tl.load(k_base + cols[:, None] * skl + dd[None, :], mask=ok[:, None], other=0.0)  # [BLOCK, D]
            if ROPE:  # the new column comes from registers (its cache store may not be visible yet)
                kb = tl.where(cols[:, None] == last, k_new[None, :], kb)
            if INTERPRETED:  # the interpreter mishandles bf16 dots: multiply in float32 there
                scores = tl.dot(q.to(tl.float32), tl.trans(kb.to(tl.float32)), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(kb))
            scores = tl.where(ok[None, :], scores * scaling, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with nothing allowed yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            vt = tl.load(v_base + cols[:, None] * svl + dd[None, :], mask=ok[:, None], other=0.0)  # [BLOCK, D]
            if ROPE:
                vt = tl.where(cols[:, None] == last, v_new[None, :], vt)
            if INTERPRETED:
                acc = acc * alpha[:, None] + tl.dot(p, vt.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
        if SPLIT:
            row = (b * (tl.num_programs(1) * GROUPS) + heads) * tl.num_programs(2) + s  # [B, H, SPLITS] index
            tl.store(acc_ptr + row[:, None] * D + dd[None, :], acc, mask=g_ok[:, None])
            tl.store(ml_ptr + row * 2, m_i, mask=g_ok)
            tl.store(ml_ptr + row * 2 + 1, l_i, mask=g_ok)
        else:
            o = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + b * sob + heads[:, None] * soh + dd[None, :], o, mask=g_ok[:, None])
            if RELABELED:
                row_r = or_ptr + b * (tl.num_programs(1) * GROUPS * D)
                if D % 128 == 0:  # each head's columns are whole blocks: permuted in registers, stored contiguously
                    tl.store(row_r + heads[:, None] * D + dd[None, :], relabel_tile(o, GROUPS_P, D // 128),
                             mask=g_ok[:, None])
                else:  # a block spans several heads: each element to its relabeled column
                    tl.store(row_r + relabeled_column(heads[:, None] * D + dd[None, :]), o, mask=g_ok[:, None])

    @triton.jit(do_not_specialize=["SPLITS"])
    def _merge_splits_kernel(acc_ptr, ml_ptr, out_ptr, or_ptr, sob, soh, H, SPLITS, SPLITS_P: tl.constexpr,
                             D: tl.constexpr, RELABELED: tl.constexpr, PDL: tl.constexpr):
        """out[b, h] = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s (empty slices: m = -inf, l = 0); with
        RELABELED also stored in contiguous ``or [B, H * D]`` at the FP4 GEMM's relabeled columns. ``SPLITS`` is
        a plain argument (its value and its divisibility compile nothing new); ``SPLITS_P >= SPLITS`` the tile."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        b, h = tl.program_id(0), tl.program_id(1)
        s = tl.arange(0, SPLITS_P)
        dd = tl.arange(0, D)
        row = (b * H + h) * SPLITS + s
        ok = s < SPLITS
        m = tl.load(ml_ptr + row * 2, mask=ok, other=float("-inf"))
        l_s = tl.load(ml_ptr + row * 2 + 1, mask=ok, other=0.0)
        top = tl.max(m, axis=0)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - top))
        acc = tl.load(acc_ptr + row[:, None] * D + dd[None, :], mask=ok[:, None], other=0.0)
        o = (tl.sum(acc * w[:, None], axis=0) / tl.sum(l_s * w, axis=0)).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + b * sob + h * soh + dd, o)
        if RELABELED:
            if D % 128 == 0:
                tl.store(or_ptr + b * H * D + h * D + dd, relabel_row(o, D))
            else:
                tl.store(or_ptr + b * H * D + relabeled_column(h * D + dd), o)

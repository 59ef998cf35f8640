"""The NVFP4 GEMM at training sizes: weights decoded into shared memory by their own warps (Gluon, Hopper).

Why another kernel
------------------
At training sizes (thousands of tokens per call) a GEMM is bound by the tensor cores, not by bytes. Until this
kernel the frozen NVFP4 matmuls there ran as one exact dequantization pass into a bf16 temporary followed by
cuBLAS: the pass reads 0.56 and writes 2 bytes per weight, about a quarter of the GEMM's own time at 1024
tokens (H100: 0.72-0.82x of a bf16 GEMM at M = 1024, parity only from M ~ 4096; dev/LOG.md). The decode
kernels (``fp4_gemm``, ``fp4_wgmma``) decode the weights in the same warps that issue the MMAs, and at large M
they ran the tensor cores at under half of cuBLAS's rate.

What it does
------------
One program computes a ``[128 rows of the activations, 256 output columns]`` tile with two groups of warps
(``gl.warp_specialize``) that hand work on through two rings of shared-memory stages, whose mbarriers say
"full" and "free":

1. **MMA** (8 warps, two warpgroups of 64 rows; the default partition): one elected thread issues, per
   K-step of 64, the TMA copies of the activation tile (the wgmma A operand), of the step's FP4 weight words
   and of its scale bytes into a ring of ``stages``; the warps wait for the stage and for its decoded tile,
   issue ``wgmma`` from shared memory, keep one step in flight, free the step before, and at the end write
   ``bf16(acc * 2^8 / gs)`` (``+ bias``), the single output rounding of ``nvfp4.reference_matmul``.
2. **Decode** (4 warps, a worker partition): read a stage's words and scale bytes from shared memory, turn
   them into the exact bf16 values ``fp4 * s * 2^-8`` (the pair trick of ``fp4_decode``, one byte permute per
   pair to put the codes in natural K order, one packed ``mul.rn.bf16x2`` by the block scale), free the stage
   and store the tile into a ring of ``decoded_stages`` bf16 tiles in the 128-byte swizzled layout wgmma reads.
   The decode warps load nothing from global memory: the proxy fence before each hand-over compiles to a
   ``MEMBAR`` that would wait for such loads.

The scale bytes come by TMA, whose boxes are at least 16 bytes wide and must start on 16 bytes (a box at
another offset is an illegal instruction): backward, a step's 64 rows x 256 K need exactly 16 bytes a row;
forward, a step needs 4 bytes a row, so the box holds four steps' and the decode picks its step's 4.

The same kernel runs both layouts of a frozen layer's training step. Forward (``y = x @ W.T``): the decoded
tile is 256 weight rows x 64 K, read by wgmma transposed (K-major). Backward (``dx = dy @ W``): the reduction
runs over the weight rows, so the decoded tile is 64 weight rows x 256 K columns and wgmma reads it as it is
(MN-major): no transposed copy of the weights exists anywhere, and nothing outlives the call. Each decode
thread holds 4 consecutive words of a row beside one other thread and 16 rows per warp, so that the 8 threads
of a 16-byte shared-memory phase hit 8 different bank groups, both reading the backward's words (whose rows
of 128 bytes are swizzled for it) and storing decoded units.

Programs are ordered in groups of 8 row tiles, so that the activations of a group stay in L2 while the
weights stream past (each weight tile is decoded once per 128 rows of activations).

Where it stands (H100, Qwen2.5-7B/32B shapes at M = 1024-8192, dev/LOG.md section 34): correct (mean relative
error 1.7e-5 against the oracles), and 0.42-0.72x of bf16 forward on the gate/up and down shapes (0.23-0.57x on
the attention ones), 0.45-0.75x backward: below dequantize + cuBLAS (0.68-1.08x), so no launch rule uses it.
Each partition alone runs near cuBLAS's pace per step (MMA without the decode ~750-890 ns per 128 x 256 x 64 step,
decode without the MMA ~800-950 ns); together they take ~1140-1270 ns. ptxas needs >= 154 registers a thread for
the m64n256 wgmma, so 12 warps (maxnreg 168) is the most the kernel can have: more decode warps do not compile.

Where we deviate from CUTLASS's and Machete's mixed-input GEMMs: they convert in registers and feed wgmma's A
operand from there (the weights must then sit on the M side, and the backward layout needs a transposed
repack; ``fp4_wgmma`` is the kit's kernel of that kind); here the decoded tile goes through shared memory, so
one kernel serves both layouts of the unrepacked compressed-tensors bytes. K must be a multiple of 256 (the
scales' rows are read by TMA, whose row strides are whole 16 bytes). Gluon is experimental in Triton 3.6; this
module imports without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl_lib.kernels.fp4_wgmma import available  # noqa: F401  (the same needs: Gluon importable, a Hopper GPU)

try:  # Gluon ships with Triton >= 3.5; the CPU reference paths never need it
    import triton
    from qerl_lib.kernels.fp4_decode import code_pair_bits
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - exercised only on installs without Gluon
    gluon = None
else:  # tma.async_copy_global_to_shared (Triton 3.6, the GPU image's) became tma.async_load
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    A_SMEM_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    # forward words: rows of 8 words (32 bytes), unswizzled; backward: rows of 32 words (128 bytes), swizzled so
    # that the 8 threads of one 16-byte access phase (``_WORDS_LAYOUT``) read 8 different bank groups
    WORDS_SMEM_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    WORDS_BWD_SMEM_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    SCALES_SMEM_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=8, rank=2)
    DECODED_SMEM_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)

BLOCK_M = 128  # activation rows per program: two warpgroups of 64
BLOCK_N = 256  # output columns per program (the widest wgmma)
BLOCK_K = 64  # reduction per step: 128 bytes of bf16 activations per row, one 128-byte swizzle atom
SCALE_BOX = 16  # bytes of scales per weight row and step: TMA's narrowest box, 16-byte aligned (the forward
# needs 4 of them a step: its box holds four steps' and is fetched again for each)
GROUP_M = 8  # row tiles per group of programs (L2 reuse of the activations)
STAGES = 4
DECODED_STAGES = 2
SHARED_MEMORY_BYTES = 227 * 1024
MMA_WARPS = 8  # the kernel's num_warps: two warpgroups
DECODE_WARPS = 4  # more cannot be: ptxas needs >= 154 registers a thread for the m64n256 wgmma at launch, and
# 16 warps leave 128 (Triton 3.6's offline compile: C7602)
MAX_REGISTERS = (65536 // (32 * (MMA_WARPS + DECODE_WARPS))) // 8 * 8  # 168
DIRECTIONS = ("fwd", "bwd")


def shared_memory_bytes(stages: int, decoded_stages: int) -> int:
    """Per program: per stage an activation tile [128, 64] bf16, the step's words (256 x 64 codes, 8 KB) and
    its scale box (at most 256 rows x 16 bytes), per decoded stage a bf16 tile of 256 x 64, and 8 bytes per
    mbarrier."""
    per_stage = BLOCK_M * BLOCK_K * 2 + BLOCK_N * BLOCK_K // 2 + BLOCK_N * SCALE_BOX + 16
    return stages * per_stage + decoded_stages * (BLOCK_N * BLOCK_K * 2 + 16)


@dataclass(frozen=True)
class WsConfig:
    """One launch of ``_fp4_ws_kernel``: ``stages`` of loads in flight (2-8), ``decoded_stages`` decoded tiles
    (2-4), the decode warps' register budget ``decode_registers`` (Gluon's ``worker_num_regs``) and the kernel's
    ``max_registers`` at launch (``maxnreg``: 12 warps x it must fit the SM's 64K, and ptxas needs ~154 for the
    MMA warps)."""

    stages: int = STAGES
    decoded_stages: int = DECODED_STAGES
    decode_registers: int = 96
    max_registers: int = MAX_REGISTERS

    def __post_init__(self):
        if not 2 <= self.stages <= 8:
            raise ValueError(f"WsConfig.stages must be 2..8, got {self.stages}")
        if not 2 <= self.decoded_stages <= 4:  # with one, the MMA warps free a tile only after the next one
            raise ValueError(f"WsConfig.decoded_stages must be 2..4, got {self.decoded_stages}")
        if self.decode_registers % 8 or not 24 <= self.decode_registers <= self.max_registers:
            raise ValueError(f"WsConfig.decode_registers must be a multiple of 8 in 24..max_registers, "
                             f"got {self.decode_registers}")
        if self.max_registers % 8 or not 160 <= self.max_registers <= MAX_REGISTERS:
            raise ValueError(f"WsConfig.max_registers must be a multiple of 8 in 160..{MAX_REGISTERS} (the MMA "
                             f"needs ~154; 12 warps share 64K registers), got {self.max_registers}")
        need = shared_memory_bytes(self.stages, self.decoded_stages)
        if need > SHARED_MEMORY_BYTES:
            raise ValueError(f"WsConfig{(self.stages, self.decoded_stages)} needs {need // 1024} KB of shared memory "
                             f"(an SM gives {SHARED_MEMORY_BYTES // 1024}); use fewer stages")


def supported_problem(n: int, k: int, direction: str) -> bool:
    """Both directions need K a multiple of 256 (the scales, K/16 bytes a row, are read by TMA, whose row strides
    are whole 16 bytes; that also makes K whole forward steps of 64); backward also needs N (its reduction) in
    whole steps of 64."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    if n <= 0 or k <= 0 or k % (16 * SCALE_BOX):
        return False
    return direction == "fwd" or n % BLOCK_K == 0


def aligned(*tensors: torch.Tensor) -> bool:
    """TMA reads a tensor from a 16-byte aligned start with 16-byte aligned row strides."""
    return all(t.data_ptr() % 16 == 0 and (t.dim() < 2 or t.stride(0) * t.element_size() % 16 == 0)
               for t in tensors)


def launch(a: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
           bias: torch.Tensor | None, out: torch.Tensor, direction: str, config: WsConfig | None = None) -> None:
    """``out = a @ W.T (+ bias)`` (``direction="fwd"``: ``a`` is ``x [M, K]``, ``out [M, N]``) or ``out = a @ W``
    (``"bwd"``: ``a`` is ``dy [M, N]``, ``out [M, K]``; no bias) for the compressed-tensors bytes ``words``
    (int32 ``[N, K/8]``) and ``scales`` (``[N, K/16]`` E4M3 bytes) of ``W``, global scale ``gs`` on device.
    ``a`` and ``out`` bf16 with unit column stride; shapes are the caller's to check (``supported_problem``); a
    tensor TMA cannot read (``aligned``) is a ValueError."""
    config = config or WsConfig()
    if not aligned(a, words, scales):
        raise ValueError("fp4_wgmma_ws.launch: a, words and scales must start on 16 bytes with rows a multiple of "
                         "16 bytes apart (TMA); use fp4_gemm.fp4_linear or fp4_grad_input instead")
    n, k = words.shape[0], words.shape[1] * 8
    m = a.shape[0]
    transposed = direction == "bwd"
    if transposed and bias is not None:
        raise ValueError("fp4_wgmma_ws.launch: the backward layout takes no bias")
    red, n_out = (n, k) if transposed else (k, n)
    a_desc = TensorDescriptor(a, [m, red], [a.stride(0), 1], [BLOCK_M, BLOCK_K], A_SMEM_LAYOUT)
    w_box = [BLOCK_K, BLOCK_N // 8] if transposed else [BLOCK_N, BLOCK_K // 8]
    w_desc = TensorDescriptor(words, [n, k // 8], [words.stride(0), 1], w_box,
                              WORDS_BWD_SMEM_LAYOUT if transposed else WORDS_SMEM_LAYOUT)
    s_desc = TensorDescriptor(scales, [n, k // 16], [scales.stride(0), 1], [w_box[0], SCALE_BOX], SCALES_SMEM_LAYOUT)
    tiles_m, tiles_n = triton.cdiv(m, BLOCK_M), triton.cdiv(n_out, BLOCK_N)
    _fp4_ws_kernel[(tiles_m * tiles_n,)](
        a_desc, w_desc, s_desc, global_scale, bias if bias is not None else out, out,
        m, n_out, out.stride(0), red // BLOCK_K, tiles_m, tiles_n,
        TRANSPOSED=transposed, HAS_BIAS=bias is not None, STAGES=config.stages, DSTAGES=config.decoded_stages,
        DECODE_REGS=config.decode_registers, num_warps=MMA_WARPS, maxnreg=config.max_registers)


# ============================================================================ Gluon kernel
if gluon is not None:

    # the tile, as constants the kernels may read (Triton refuses plain module globals)
    _BM = gl.constexpr(BLOCK_M)
    _BN = gl.constexpr(BLOCK_N)
    _BK = gl.constexpr(BLOCK_K)
    _GM = gl.constexpr(GROUP_M)
    _DW = gl.constexpr(DECODE_WARPS)
    _SB = gl.constexpr(SCALE_BOX)

    # Words [rows, words per row] of one step: each thread holds 4 consecutive words (16 bytes, 32 consecutive K)
    # of a row, two threads side by side, 16 rows per warp, the decode warps stacked; the backward's rows of 32 words
    # repeat that in 8-word blocks. The 8 threads of one 16-byte phase (4 rows x 2) are thus meant to store their
    # decoded 16-byte units into 8 different bank groups of the 128-byte swizzled tile. Scale bytes [rows, words / 2]:
    # the 2 bytes of each thread's 4 words, on the same threads.
    _WORDS_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 4], [16, 2], [DECODE_WARPS, 1], [1, 0]))
    _SCALES_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 2], [16, 2], [DECODE_WARPS, 1], [1, 0]))

    @gluon.jit
    def _prmt(a, b, SELECTOR: gl.constexpr):
        return gl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {SELECTOR};", "=r,r,r", [a, b], dtype=gl.uint32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _scaled(p, sw):
        # fp4 * 2^-126 times s * 2^118 in both halves: exact (at most 6 significant bits), so the rounding is moot
        return gl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [p, sw], dtype=gl.uint32,
                                         is_pure=True, pack=1)

    @gluon.jit
    def _decode_tile(q, sb, ROWS: gl.constexpr, WPR: gl.constexpr, wl: gl.constexpr):
        """Words [ROWS, WPR] (code i of word w is K = 8w + i) and their scale bytes [ROWS, WPR / 2] -> bf16
        ``fp4 * s * 2^-8`` [ROWS, 8 WPR] in natural K order."""
        s = sb.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 2.0**118  # exact, subnormal scales too
        sv = s.to(gl.bfloat16).to(gl.uint16, bitcast=True).to(gl.uint32)
        sv = sv | (sv << 16)
        sw = gl.convert_layout(gl.reshape(gl.join(sv, sv), [ROWS, WPR]), wl)  # word w is in scale group w // 2
        p0 = code_pair_bits(q, 0)  # codes (0, 4) in the (low, high) halves
        p1 = code_pair_bits(q, 1)  # (1, 5)
        p2 = code_pair_bits(q, 2)  # (2, 6)
        p3 = code_pair_bits(q, 3)  # (3, 7)
        n0 = _scaled(_prmt(p0, p1, 0x5410), sw)  # (0, 1): both low halves
        n1 = _scaled(_prmt(p2, p3, 0x5410), sw)  # (2, 3)
        n2 = _scaled(_prmt(p0, p1, 0x7632), sw)  # (4, 5): both high halves
        n3 = _scaled(_prmt(p2, p3, 0x7632), sw)  # (6, 7)
        v = gl.join(gl.join(n0, n2), gl.join(n1, n3))  # [.., i, j] holds pair 2i + j
        v = gl.join((v & 0xFFFF).to(gl.uint16), (v >> 16).to(gl.uint16))  # [.., i, j, h]: code 4i + 2j + h
        return gl.reshape(v, [ROWS, 8 * WPR]).to(gl.bfloat16, bitcast=True)

    @gluon.jit
    def _issue_loads(a_desc, w_desc, s_desc, a_smem, w_smem, s_smem, ready, step, k_steps, off_m, off_n,
                     TRANSPOSED: gl.constexpr, STAGES: gl.constexpr):
        """TMA copies of step ``step``'s activation tile, weight words and scale box into stage ``step % STAGES``
        (none past the last step)."""
        slot = step % STAGES
        ok = step < k_steps
        bar = ready.index(slot)
        mbarrier.expect(bar, a_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes, pred=ok)
        _tma_load(a_desc, [off_m, step * _BK], bar, a_smem.index(slot), pred=ok)
        if TRANSPOSED:  # weight rows are the reduction: 64 rows x 256 output columns (32 words, 16 scale bytes)
            _tma_load(w_desc, [step * _BK, off_n // 8], bar, w_smem.index(slot), pred=ok)
            _tma_load(s_desc, [step * _BK, off_n // 16], bar, s_smem.index(slot), pred=ok)
        else:  # 256 weight rows (output columns) x 64 K (8 words; 4 scale bytes, in the aligned 16-byte box of
            # four steps: a box must start on 16 bytes, else the TMA is an illegal instruction)
            _tma_load(w_desc, [off_n, step * (_BK // 8)], bar, w_smem.index(slot), pred=ok)
            _tma_load(s_desc, [off_n, (step * (_BK // 16)) // _SB * _SB], bar, s_smem.index(slot), pred=ok)

    @gluon.jit
    def _step_scales(box, i, WPR: gl.constexpr):
        """Step ``i``'s scale bytes [rows, WPR / 2] from its stage's box: the whole box backward; forward, the 4
        bytes of this step among the box's four steps (four small loads, one kept: the slice needs a constant)."""
        if WPR // 2 == _SB:
            sb = box.load(_SCALES_LAYOUT)
        else:
            sb = box.slice(0, WPR // 2, dim=1).load(_SCALES_LAYOUT)
            for c in gl.static_range(1, _SB // (WPR // 2)):
                sb = gl.where(i % (_SB // (WPR // 2)) == c,
                              box.slice(c * (WPR // 2), WPR // 2, dim=1).load(_SCALES_LAYOUT), sb)
        return sb

    @gluon.jit
    def _decode_partition(w_smem, s_smem, dec_smem, ready, empty, dec_ready, dec_empty, k_steps):
        """4 warps: words and scales of a stage -> exact bf16 tile in the decoded ring. No global loads here: the
        proxy fence before each hand-over (a MEMBAR) would wait for them."""
        DSTAGES: gl.constexpr = dec_smem.type.shape[0]  # worker arguments carry no constexprs: read them off types
        STAGES: gl.constexpr = w_smem.type.shape[0]
        ROWS: gl.constexpr = w_smem.type.shape[1]
        WPR: gl.constexpr = w_smem.type.shape[2]
        wl: gl.constexpr = _WORDS_LAYOUT
        for i in range(k_steps):
            s = i % STAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            q = w_smem.index(s).load(wl).to(gl.uint32, bitcast=True)
            sb = _step_scales(s_smem.index(s), i, WPR)
            w = _decode_tile(q, sb, ROWS, WPR, wl)
            # the stage's words and scales are in registers and used: the TMA may refill it (a generic read
            # followed by an async-proxy write needs no proxy fence, only the barrier's ordering)
            mbarrier.arrive(empty.index(s))
            d = i % DSTAGES
            mbarrier.wait(dec_empty.index(d), ((i // DSTAGES) & 1) ^ 1)
            dec_smem.index(d).store(w)
            fence_async_shared()  # the generic-proxy stores before wgmma's async-proxy reads
            mbarrier.arrive(dec_ready.index(d))

    @gluon.jit
    def _mma_partition(a_desc, w_desc, s_desc, a_smem, w_smem, s_smem, dec_smem, ready, empty, dec_ready, dec_empty,
                       gs_ptr, bias_ptr, out_ptr, M, N_out, stride_om, off_m, off_n, k_steps,
                       TRANSPOSED: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr, DSTAGES: gl.constexpr):
        """8 warps: the TMA issue (one elected thread) and wgmma from both rings, one step in flight; then the
        epilogue, stored from the MMA layout."""
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                        instr_shape=[16, _BN, 16])
        for j in gl.static_range(STAGES):
            _issue_loads(a_desc, w_desc, s_desc, a_smem, w_smem, s_smem, ready, j, k_steps, off_m, off_n, TRANSPOSED,
                         STAGES)
        acc = gl.zeros([_BM, _BN], gl.float32, layout=mma_l)
        for i in range(k_steps):
            s = i % STAGES
            d = i % DSTAGES
            mbarrier.wait(ready.index(s), (i // STAGES) & 1)
            mbarrier.wait(dec_ready.index(d), (i // DSTAGES) & 1)
            if TRANSPOSED:
                b = dec_smem.index(d)  # [64 reduction rows, 256 outputs], MN-major
            else:
                b = dec_smem.index(d).permute((1, 0))  # [256 outputs, 64 K] read as [64, 256], K-major
            acc = warpgroup_mma(a_smem.index(s), b, acc, use_acc=i > 0, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if i > 0:  # step i - 1's MMAs have retired: its decoded tile is free, and its stage once the
                p = i - 1  # decode warps have read its words
                mbarrier.arrive(dec_empty.index(p % DSTAGES))
                mbarrier.wait(empty.index(p % STAGES), (p // STAGES) & 1)
                _issue_loads(a_desc, w_desc, s_desc, a_smem, w_smem, s_smem, ready, p + STAGES, k_steps, off_m, off_n,
                             TRANSPOSED, STAGES)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        offs_m = off_m + gl.arange(0, _BM, layout=gl.SliceLayout(1, mma_l))
        offs_n = off_n + gl.arange(0, _BN, layout=gl.SliceLayout(0, mma_l))
        y = (acc * gl.div_rn(256.0, gl.load(gs_ptr))).to(gl.bfloat16)  # correctly rounded 2^8/gs
        if HAS_BIAS:
            b = gl.load(bias_ptr + offs_n, mask=offs_n < N_out, other=0.0)
            y = (y.to(gl.float32) + b.to(gl.float32)[None, :]).to(gl.bfloat16)
        mask = (offs_m < M)[:, None] & (offs_n < N_out)[None, :]
        gl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y, mask=mask)

    @gluon.jit
    def _fp4_ws_kernel(a_desc, w_desc, s_desc, gs_ptr, bias_ptr, out_ptr, M, N_out, stride_om, k_steps, tiles_m,
                       tiles_n, TRANSPOSED: gl.constexpr, HAS_BIAS: gl.constexpr, STAGES: gl.constexpr,
                       DSTAGES: gl.constexpr, DECODE_REGS: gl.constexpr):
        """One [128, 256] output tile (module docstring); programs in groups of ``GROUP_M`` row tiles."""
        pid = gl.program_id(0)
        per_group = _GM * tiles_n
        first_m = (pid // per_group) * _GM
        group_rows = gl.minimum(tiles_m - first_m, _GM)
        pid_m = first_m + (pid % per_group) % group_rows
        pid_n = (pid % per_group) // group_rows
        off_m = pid_m * _BM
        off_n = pid_n * _BN

        DEC_SHAPE: gl.constexpr = [_BK, _BN] if TRANSPOSED else [_BN, _BK]
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, _BM, _BK], a_desc.layout)
        w_smem = gl.allocate_shared_memory(gl.int32, [STAGES] + w_desc.block_type.shape, w_desc.layout)
        s_smem = gl.allocate_shared_memory(gl.uint8, [STAGES] + s_desc.block_type.shape, s_desc.layout)
        dec_smem = gl.allocate_shared_memory(gl.bfloat16, [DSTAGES] + DEC_SHAPE, DECODED_SMEM_LAYOUT)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        dec_ready = gl.allocate_shared_memory(gl.int64, [DSTAGES, 1], mbarrier.MBarrierLayout())
        dec_empty = gl.allocate_shared_memory(gl.int64, [DSTAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)  # the decode warps have read the stage's words
        for i in gl.static_range(DSTAGES):
            mbarrier.init(dec_ready.index(i), count=1)
            mbarrier.init(dec_empty.index(i), count=1)
        fence_async_shared()

        gl.warp_specialize([
            (_mma_partition, (a_desc, w_desc, s_desc, a_smem, w_smem, s_smem, dec_smem, ready, empty, dec_ready,
                              dec_empty, gs_ptr, bias_ptr, out_ptr, M, N_out, stride_om, off_m, off_n, k_steps,
                              TRANSPOSED, HAS_BIAS, STAGES, DSTAGES)),
            (_decode_partition, (w_smem, s_smem, dec_smem, ready, empty, dec_ready, dec_empty, k_steps)),
        ], [_DW], [DECODE_REGS])

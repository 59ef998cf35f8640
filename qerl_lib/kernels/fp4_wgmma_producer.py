"""The register-A NVFP4 GEMM at training sizes, with a producer warp: no CTA barrier per K-step (Gluon, Hopper).

Why another kernel
------------------
``fp4_wgmma`` decodes each K-step of FP4 weights straight into the registers of the ``wgmma`` A operand
(weights on the MMA's M side, rows of ``x`` on its N side) and keeps one step's MMAs in flight while the next
step decodes. At training sizes its best launch is 256 rows of ``x`` and two warpgroups of 64 weight rows
(``WgmmaConfig(256, 2)``), and there Nsight Compute finds its largest stall at the CTA barrier each step ends
with: one elected thread refills the stage the step before used, so it must first know that *both*
warpgroups have retired that step's MMAs, and whichever warpgroup is ahead waits for the other instead of
decoding its next step (dev/LOG.md section 34: tensor pipe 76% busy against cuBLAS's 94%).

What it does
------------
The same per-warpgroup work as ``fp4_wgmma`` (the fragment layouts, the K relabeling of ``x``, the exact
decode ``fp4 * s * 2^-8`` into the A registers, the loop unrolled by two so that the A registers of the MMAs
in flight are never rewritten), arranged as three partitions of ``gl.warp_specialize`` that meet only at
mbarriers, as CUTLASS's warp-specialized kernels do:

1. **Producer** (1 warp, a worker partition): for each K-step, waits until the step's ring stage is
   ``empty``, then issues the TMA copies of the stage's ``x`` tile (``[block_m, 128]`` bf16, shared by both
   consumers) and of each consumer's 64 rows of weight words; the copies complete the stage's ``ready``
   mbarrier.
2. **Two consumers** (one warpgroup each: the default partition and a worker partition): wait for
   ``ready``, decode their 64 weight rows into registers, issue the wgmma, wait until only it is in flight,
   and arrive on the ``empty`` mbarrier of the stage the step before used (the barrier completes when both
   have arrived). Their scale bytes come through registers two steps ahead, as in ``fp4_wgmma``. Each
   stores its own ``[64 outputs, block_m rows]`` from the accumulator registers:
   ``bf16(acc * 2^8 / gs)`` then ``+ bias``, the single rounding of ``nvfp4.reference_matmul``.

The consumers are separate partitions, not one of 8 warps, because Gluon (Triton 3.6) lowers
``mbarrier.arrive`` to a barrier of the whole partition followed by one thread's arrive: one 8-warp partition
would bring back the coupling this kernel removes. Three partitions on 9 warps leave 224 registers a thread
at launch; ``warp_specialize``'s register budgets (``setmaxnreg``) give the consumers ``consumer_registers``
and the producer ``producer_registers``.

Where it stands: see dev/LOG.md section 35 (measured against bf16 cuBLAS, dequantize + cuBLAS and
``fp4_wgmma``). Forward layout only (``x @ W.T``); K a multiple of 128; no K-slices (at training sizes the
output tiles fill the GPU many times over). Gluon is experimental in Triton 3.6: this module imports
without it (``available()`` is then False).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl_lib.kernels.fp4_wgmma import available, permute_x  # noqa: F401  (same needs: Gluon, a Hopper GPU)

try:  # Gluon ships with Triton >= 3.5; the CPU reference paths never need it
    import triton
    from qerl_lib.kernels.fp4_wgmma import W_SMEM_LAYOUT, X_SMEM_LAYOUT, _decode, _scales_layout, _words_layout
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - exercised only on installs without Gluon
    gluon = None
else:
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

BLOCK_K = 128  # one K-step: 16 int32 words and 8 scale bytes per weight row, 128 columns of x
BLOCK_N = 128  # weight rows (outputs) per program: two consumers of 64
BLOCK_MS = (128, 256)  # rows of x per program (the wgmma N)
SHARED_MEMORY_BYTES = 227 * 1024
LAUNCH_WARPS = 9  # 4 + 4 consumers, 1 producer
MAX_REGISTERS = 512 - 24  # two consumer warpgroups and the producer's (padded) one share 64K registers: 2 x 232 + 24


def shared_memory_bytes(block_m: int, stages: int) -> int:
    """Per stage: the bf16 x tile [block_m, 128] and the words [128, 16] int32; two mbarriers per stage."""
    return stages * (block_m * BLOCK_K * 2 + BLOCK_N * 16 * 4 + 16)


@dataclass(frozen=True)
class ProducerConfig:
    """One launch of ``_fp4_wgmma_producer_kernel``: ``block_m`` rows of x per program (128 or 256),
    ``stages`` K-steps in the shared-memory ring (2-8, within an SM's shared memory), the registers a thread of
    each consumer warpgroup (``consumer_registers``) and of the producer (``producer_registers``) get through
    ``setmaxnreg`` (multiples of 8, 24-256; two consumers and the producer's warpgroup share 512)."""

    block_m: int = 256
    stages: int = 3
    consumer_registers: int = 232
    producer_registers: int = 40

    def __post_init__(self):
        if self.block_m not in BLOCK_MS:
            raise ValueError(f"ProducerConfig.block_m must be one of {BLOCK_MS}, got {self.block_m}")
        if not 2 <= self.stages <= 8:
            raise ValueError(f"ProducerConfig.stages must be 2..8, got {self.stages}")
        for name in ("consumer_registers", "producer_registers"):
            v = getattr(self, name)
            if v % 8 or not 24 <= v <= 256:
                raise ValueError(f"ProducerConfig.{name} must be a multiple of 8 in 24..256, got {v}")
        if 2 * self.consumer_registers + self.producer_registers > 512:
            raise ValueError(f"ProducerConfig: 2 x consumer_registers + producer_registers must be <= 512 (64K "
                             f"registers over three warpgroups), got {2 * self.consumer_registers + self.producer_registers}")
        need = shared_memory_bytes(self.block_m, self.stages)
        if need > SHARED_MEMORY_BYTES:
            raise ValueError(f"ProducerConfig{(self.block_m, self.stages)} needs {need // 1024} KB of shared memory "
                             f"(an SM gives {SHARED_MEMORY_BYTES // 1024}); use fewer stages or block_m=128")


def supported_problem(k: int) -> bool:
    """K must be whole K-steps of 128 (every Qwen2.5 projection is)."""
    return k > 0 and k % BLOCK_K == 0


def aligned(*tensors: torch.Tensor) -> bool:
    """TMA reads a tensor from a 16-byte aligned start with 16-byte aligned row strides."""
    return all(t.data_ptr() % 16 == 0 and (t.dim() < 2 or t.stride(0) * t.element_size() % 16 == 0)
               for t in tensors)


def linear(x2: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
           bias: torch.Tensor | None, out: torch.Tensor, config: ProducerConfig | None = None,
           permuted: bool = False) -> None:
    """``out[M, N] = x2[M, K] @ W.T (+ bias)`` for the compressed-tensors bytes ``words`` (int32 ``[N, K/8]``)
    and ``scales`` (``[N, K/16]`` E4M3 bytes) of ``W``, global scale ``gs`` on device. ``x2`` and ``out`` bf16
    with unit column stride (``out``'s rows ``out.stride(0)`` apart); ``permuted``: ``x2`` is already
    ``fp4_wgmma.permute_x``'s copy. Raises a ValueError for a K this kernel cannot run or a tensor TMA cannot
    read."""
    config = config or ProducerConfig()
    m, k = x2.shape
    n = words.shape[0]
    if not supported_problem(k):
        raise ValueError(f"fp4_wgmma_producer: K must be a positive multiple of {BLOCK_K}, got {k}; "
                         "use fp4_gemm.fp4_linear instead")
    xp = x2 if permuted else permute_x(x2)
    if not aligned(xp, words):
        raise ValueError("fp4_wgmma_producer: x and the words must start on 16 bytes with rows a multiple of 16 "
                         "bytes apart (TMA); use fp4_gemm.fp4_linear instead")
    x_desc = TensorDescriptor(xp, [m, k], [xp.stride(0), 1], [config.block_m, BLOCK_K], X_SMEM_LAYOUT)
    w_desc = TensorDescriptor(words, [n, k // 8], [words.stride(0), 1], [BLOCK_N // 2, BLOCK_K // 8], W_SMEM_LAYOUT)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, BLOCK_N))
    _fp4_wgmma_producer_kernel[grid](
        x_desc, w_desc, scales, global_scale, bias if bias is not None else out, out,
        m, n, k, scales.stride(0), out.stride(0), int(bias is not None),
        BLOCK_M=config.block_m, STAGES=config.stages, CONSUMER_REGS=config.consumer_registers,
        PRODUCER_REGS=config.producer_registers, num_warps=4)


# ============================================================================ Gluon kernel
if gluon is not None:

    @gluon.jit
    def _producer(x_desc, w_desc, x_smem, w_lo, w_hi, ready, empty, off_m, off_n, k_steps):
        """1 warp: per K-step, wait until its stage is empty, then TMA the x tile and both consumers' words."""
        STAGES: gl.constexpr = x_smem.type.shape[0]  # worker arguments carry no constexprs: read them off types
        ROWS: gl.constexpr = w_lo.type.shape[1]
        for i in range(k_steps):
            s = i % STAGES
            mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
            bar = ready.index(s)
            mbarrier.expect(bar, x_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes)
            _tma_load(x_desc, [off_m, i * 128], bar, x_smem.index(s))
            _tma_load(w_desc, [off_n, i * 16], bar, w_lo.index(s))
            _tma_load(w_desc, [off_n + ROWS, i * 16], bar, w_hi.index(s))

    @gluon.jit
    def _load_scales(s_ptrs, i, k_steps):
        """Scale bytes of K-step ``i`` (clamped to the last step), read into registers ahead of use."""
        return gl.load(s_ptrs + gl.minimum(i, k_steps - 1) * 8, eviction_policy="evict_first")

    @gluon.jit
    def _consume_step(x_smem, w_smem, ready, empty, sb, acc, a_prev, i, wl: gl.constexpr, a_l: gl.constexpr):
        """K-step ``i`` of one consumer: wait for the stage, decode (while step i - 1's MMAs run), issue the MMAs,
        wait until only they are in flight, then free step i - 1's stage. Returns (acc, A registers)."""
        STAGES: gl.constexpr = x_smem.type.shape[0]
        s = i % STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        q = w_smem.index(s).load(wl).to(gl.uint32, bitcast=True)
        a = _decode(q, sb, 64, a_l)
        acc = warpgroup_mma(a, x_smem.index(s).permute((1, 0)), acc, use_acc=i > 0, is_async=True)
        acc, a_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_prev))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
        return acc, a

    @gluon.jit
    def _consumer(x_smem, w_smem, ready, empty, s_ptr, gs_ptr, bias_ptr, out_ptr, M, N, stride_sn, stride_om,
                  off_m, row0, k_steps, has_bias):
        """One warpgroup: weight rows ``row0 .. row0 + 63`` against the program's rows of x (module docstring)."""
        BLOCK_M: gl.constexpr = x_smem.type.shape[1]
        wl: gl.constexpr = _words_layout(1)
        sl: gl.constexpr = _scales_layout(1)
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)

        rows_s = gl.minimum(row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, sl)), N - 1)  # extra rows: not stored
        s_ptrs = s_ptr + rows_s[:, None] * stride_sn + gl.arange(0, 8, layout=gl.SliceLayout(0, sl))[None, :]
        sb0 = _load_scales(s_ptrs, 0, k_steps)
        sb1 = _load_scales(s_ptrs, 1, k_steps)
        acc = gl.zeros([64, BLOCK_M], gl.float32, layout=mma_l)
        a_odd = gl.zeros([64, 128], gl.bfloat16, layout=a_l)
        for i in range(0, k_steps - 1, 2):
            sb2 = _load_scales(s_ptrs, i + 2, k_steps)
            acc, a_even = _consume_step(x_smem, w_smem, ready, empty, sb0, acc, a_odd, i, wl, a_l)
            sb0 = _load_scales(s_ptrs, i + 3, k_steps)
            acc, a_odd = _consume_step(x_smem, w_smem, ready, empty, sb1, acc, a_even, i + 1, wl, a_l)
            sb0, sb1 = sb2, sb0
        if k_steps % 2 == 1:  # the last step alone (sb0 holds its scales)
            acc, a_odd = _consume_step(x_smem, w_smem, ready, empty, sb0, acc, a_odd, k_steps - 1, wl, a_l)
        acc, a_odd = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_odd))

        offs_n = row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, mma_l))
        offs_m = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_l))
        y = (acc * gl.div_rn(256.0, gl.load(gs_ptr))).to(gl.bfloat16)  # correctly rounded 2^8/gs
        if has_bias != 0:
            b = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
            y = (y.to(gl.float32) + b.to(gl.float32)[:, None]).to(gl.bfloat16)
        mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        gl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], y, mask=mask)

    @gluon.jit
    def _fp4_wgmma_producer_kernel(x_desc, w_desc, s_ptr, gs_ptr, bias_ptr, out_ptr, M, N, K, stride_sn, stride_om,
                                   has_bias, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                                   CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
        """One [128 weight rows, BLOCK_M rows of x] output tile over all of K (module docstring)."""
        off_m = gl.program_id(0) * BLOCK_M
        off_n = gl.program_id(1) * 128
        k_steps = K // 128
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, 128], x_desc.layout)
        w_lo = gl.allocate_shared_memory(gl.int32, [STAGES, 64, 16], w_desc.layout)
        w_hi = gl.allocate_shared_memory(gl.int32, [STAGES, 64, 16], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # one arrive per consumer
        fence_async_shared()
        gl.warp_specialize([
            (_consumer, (x_smem, w_lo, ready, empty, s_ptr, gs_ptr, bias_ptr, out_ptr, M, N, stride_sn, stride_om,
                         off_m, off_n, k_steps, has_bias)),
            (_consumer, (x_smem, w_hi, ready, empty, s_ptr, gs_ptr, bias_ptr, out_ptr, M, N, stride_sn, stride_om,
                         off_m, off_n + 64, k_steps, has_bias)),
            (_producer, (x_desc, w_desc, x_smem, w_lo, w_hi, ready, empty, off_m, off_n, k_steps)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

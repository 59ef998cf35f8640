"""The register-A NVFP4 GEMM with a producer warp issuing the loads, at training and decode sizes (Gluon, Hopper).

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
in flight are never rewritten), with the loads taken off the MMA warps by ``gl.warp_specialize``:

1. **Producer** (1 warp, a worker partition): for each K-step, waits until the step's ring stage is
   ``empty``, then issues the TMA copies of the stage: the ``x`` tile (``[block_m, 128]`` bf16), the 128
   weight rows' words and their scale box. A TMA box must be 16 bytes wide and start on 16 bytes, and a
   step has 8 scale bytes a row, so the box holds the scales of steps ``2j`` and ``2j + 1`` and is fetched
   for both; the even step decodes with its first half, the odd one with its second (constant offsets,
   because the loop is unrolled by two). The copies complete the stage's ``ready`` mbarrier.
2. **Consumers** (two warpgroups of 64 weight rows, the default partition): wait for ``ready``, decode,
   issue the wgmma, wait until only it is in flight, and arrive on the ``empty`` mbarrier of the stage the
   step before used. Then each stores its ``[64 outputs, block_m rows]`` from the accumulator registers:
   ``bf16(acc * 2^8 / gs)`` then ``+ bias``, the single rounding of ``nvfp4.reference_matmul``.

The scale bytes thus reach the consumers through shared memory, not through registers loaded two steps
ahead, and no thread of theirs issues a copy. Launched with programmatic dependent launch (``kernels/pdl.py``),
the producer issues the words and scale boxes of its first ``STAGES`` steps, then waits for the previous
kernel, lets the next one launch, and only then copies x: the first weights arrive under the kernel before,
and the LoRA shrink after the GEMM runs beside it (+7.7% / +3.5% of the 7B decode step at batch 32 / 64 with
LoRA r16 on an H100, dev/LOG.md section 40). Programs are persistent (at most ``programs_per_sm`` per SM): a
program takes tiles ``pid, pid + grid, ...`` (rows of ``x`` fastest), and the ring position runs on across them,
so the producer loads a tile's first stages while the consumers finish and store the one before.

What did not work (Triton 3.6, dev/LOG.md section 35): two
consumer partitions of one warpgroup each, which would let one warpgroup run ahead of the other (Gluon's
``mbarrier.arrive`` is a barrier of the whole partition plus one thread's arrive, so the two warpgroups of
one partition still meet once a step). ptxas then serializes every wgmma of both (its C7512, "insufficient
register resources"; a wgmma in any worker partition gets it), and the kernel ran no faster than
``fp4_wgmma``. The loop's first two steps are peeled: a loop that might run no step makes ptxas serialize
the wgmmas too (C7515).

Where it stands (H100, dev/LOG.md section 35): the decode costs 3-10% over the MMAs alone, which keep close to
cuBLAS's pace. With the per-call permute of ``x`` (``fp4_wgmma.permute_x``, 1-12% of a call: it grows with K), the
kernel is faster than dequantize + cuBLAS on the gate/up shapes from 256 to 2048 rows of ``x`` (Qwen2.5-7B and
32B: 1.9-2.1x at 256, 1.2-1.6x at 384-768, 1.10-1.16x at 1024, 0.98-1.13x at 2048), and slower from 4096; on the
long-K down shapes at 256-512 rows (1.12-1.47x); not on q/k/v and o. So ``fp4_gemm.fp4_linear`` runs it there
(``launch_rule.pick_producer_config``, with the tile height of ``launch_rule.producer_block_m``). Against bf16
cuBLAS on gate/up: 0.72-1.0x in the sweeps; ``qerl bench gemm``'s rows say ``gluon-producer``. Decoding the
weights byte by byte instead, so that ``x`` needs no permute, cost more than the permute saves except where N is
small.

At decode batch sizes (24-96 rows, dev/LOG.md section 37) the same kernel runs with one consumer warpgroup
(``warpgroups=1``: its partition barrier is then the warpgroup's own) and two programs per SM (``programs_per_sm``,
which caps the launch's registers so that both fit), on 32- or 64-row tiles of ``x`` (``block_m`` 32 / 64: every
MMA row is paid for, so the tile height follows M). There it is 1.05-1.75x faster than ``fp4_wgmma``'s one-warpgroup
launch or the Triton fragment kernel on most Qwen2.5 shapes; the long-K down shapes, which have too few output tiles
to fill the SMs, take K-slices (``split_k``: slices of an even number of steps, starting on an even step, because a
scale box holds two; fp32 partials summed by the caller's fixed-order reduction), and so do the small q/k/v and o
shapes at 25-32 rows, there with three programs per SM (given ``x`` already relabeled: 1.02-1.41x of the Triton
kernel on Qwen2.5-7B/32B, dev/LOG.md section 39). Two consumer warpgroups sharing the ``x`` tile were slower, and
so were three programs per SM (136 consumer registers) on the shapes with enough output tiles. Forward layout only
(``x @ W.T``); K a multiple of 256. Gluon is experimental in Triton 3.6: this module imports without it
(``available()`` is then False).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl_lib.kernels import pdl as pdl_switch
from qerl_lib.kernels.fp4_wgmma import available, num_sms, permute_x  # noqa: F401  (same needs: Gluon, Hopper)
from qerl_lib.kernels.fp4_wgmma_ws import aligned  # TMA reads 16-byte starts and row strides

try:  # Gluon ships with Triton >= 3.5; the CPU reference paths never need it
    import triton
    from qerl_lib.kernels.fp4_wgmma import (W_SMEM_LAYOUT, X_SMEM_LAYOUT, _decode, _scales_layout, _words_layout,
                                            grid_dependency_wait_then_release)
    from qerl_lib.kernels.fp4_wgmma_ws import SCALES_SMEM_LAYOUT
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
BLOCK_MS = (32, 64, 128, 256)  # rows of x per program (the wgmma N)
WARPGROUPS = (1, 2)  # consumer warpgroups per program, 64 weight rows each
SHARED_MEMORY_BYTES = 227 * 1024
SCALE_BOX = 16  # scale bytes per weight row in one TMA box: two K-steps' (TMA's narrowest box, 16-byte aligned)


def shared_memory_bytes(block_m: int, stages: int, warpgroups: int = 2) -> int:
    """Per stage: the bf16 x tile [block_m, 128], the words [64 x warpgroups, 16] int32 and the scale boxes
    [64 x warpgroups, 16] bytes; two mbarriers per stage."""
    rows = 64 * warpgroups
    return stages * (block_m * BLOCK_K * 2 + rows * 16 * 4 + rows * SCALE_BOX + 16)


@dataclass(frozen=True)
class ProducerConfig:
    """One launch of ``_fp4_wgmma_producer_kernel``: ``block_m`` rows of x per program (32, 64, 128 or 256),
    ``stages`` K-steps in the shared-memory ring (2-8, within an SM's shared memory), the registers a
    thread of the producer's warpgroup gets through ``setmaxnreg`` (``producer_registers``, a multiple of 8 in
    24-56; the consumers get Triton's share of the rest: 232 at 40, 224 at 56; from 64 on, ptxas serializes
    the wgmmas for want of registers, its C7512), the consumer ``warpgroups`` (1 or 2, 64 weight rows each),
    the persistent ``programs_per_sm`` (1-4; their rings must fit an SM's shared memory together; four programs, or
    two of two warpgroups, leave so few registers that ptxas serializes the wgmmas, C7512) and ``split_k``
    K-slices (1-16, as ``k_slices`` rounds them), whose fp32 partials the caller's ``reduce_splits`` sums."""

    block_m: int = 256
    stages: int = 3
    producer_registers: int = 40
    warpgroups: int = 2
    programs_per_sm: int = 1
    split_k: int = 1

    @property
    def block_n(self) -> int:
        """Weight rows (outputs) per program."""
        return 64 * self.warpgroups

    @property
    def max_registers(self) -> int | None:
        """Registers per thread the launch may use so that ``programs_per_sm`` programs fit an SM's 64K (None: one
        program, no cap). A program runs its consumer warpgroups plus one warpgroup for the producer warp (Gluon
        pads a worker partition to a whole warpgroup); ``setmaxnreg`` then moves the producer's spare registers
        to the consumers."""
        if self.programs_per_sm == 1:
            return None
        threads = 128 * (self.warpgroups + 1)
        return min(255, 65536 // (self.programs_per_sm * threads)) // 8 * 8

    def __post_init__(self):
        if self.block_m not in BLOCK_MS:
            raise ValueError(f"ProducerConfig.block_m must be one of {BLOCK_MS}, got {self.block_m}")
        if not 2 <= self.stages <= 8:
            raise ValueError(f"ProducerConfig.stages must be 2..8, got {self.stages}")
        if self.producer_registers % 8 or not 24 <= self.producer_registers <= 56:
            raise ValueError(f"ProducerConfig.producer_registers must be a multiple of 8 in 24..56 (more leaves the "
                             f"consumers too few registers to keep a wgmma in flight), got {self.producer_registers}")
        if self.warpgroups not in WARPGROUPS:
            raise ValueError(f"ProducerConfig.warpgroups must be one of {WARPGROUPS}, got {self.warpgroups}")
        if not 1 <= self.programs_per_sm <= 4:
            raise ValueError(f"ProducerConfig.programs_per_sm must be 1..4, got {self.programs_per_sm}")
        if not 1 <= self.split_k <= 16:
            raise ValueError(f"ProducerConfig.split_k must be 1..16, got {self.split_k}")
        need = shared_memory_bytes(self.block_m, self.stages, self.warpgroups) * self.programs_per_sm
        if need > SHARED_MEMORY_BYTES:
            raise ValueError(f"ProducerConfig{(self.block_m, self.stages)} x {self.programs_per_sm} program(s) per SM "
                             f"needs {need // 1024} KB of shared memory (an SM gives {SHARED_MEMORY_BYTES // 1024}); "
                             "use fewer stages, programs or rows of x")


def supported_problem(k: int) -> bool:
    """K must be a multiple of 256: whole K-steps of 128, and rows of scales (K/16 bytes) that TMA can read
    (row strides of whole 16 bytes). Every Qwen2.5 projection is."""
    return k > 0 and k % (16 * SCALE_BOX) == 0


def k_slices(k: int, split_k: int) -> tuple[int, int]:
    """``(K-steps per slice, slices)`` for ``split_k`` requested slices of ``k / 128`` steps: every slice starts on
    an even step (a scale box holds two steps) and has an even number of them, at least two (the peeled steps),
    so fewer slices may result."""
    steps = k // BLOCK_K
    per = -(-steps // max(1, min(split_k, steps // 2)))
    per += per % 2
    return per, -(-steps // per)


def linear(x2: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
           bias: torch.Tensor | None, out: torch.Tensor, config: ProducerConfig | None = None,
           permuted: bool = False, reduce_splits=None, pdl: bool | None = None) -> None:
    """``out[M, N] = x2[M, K] @ W.T (+ bias)`` for the compressed-tensors bytes ``words`` (int32 ``[N, K/8]``)
    and ``scales`` (``[N, K/16]`` E4M3 bytes) of ``W``, global scale ``gs`` on device. ``x2`` and ``out`` bf16
    with unit column stride (``out``'s rows ``out.stride(0)`` apart); ``permuted``: ``x2`` is already
    ``fp4_wgmma.permute_x``'s copy. With K-slices the kernel writes fp32 partials to a temporary workspace
    that ``reduce_splits(ws, global_scale, bias, out)`` sums (``fp4_gemm``'s fixed-order reduction, as for
    ``fp4_wgmma``). ``pdl``: launch with programmatic dependent launch (None: ``kernels/pdl.py``'s switch for
    this device); the kernel then reads the weights, their scales and ``gs`` before its grid-dependency wait,
    so they must not be written by the kernel just before it (true of a prepared weight). Raises a ValueError
    for a K this kernel cannot run or a tensor TMA cannot read."""
    config = config or ProducerConfig()
    early = pdl_switch.use_for(x2.device, pdl)
    m, k = x2.shape
    n = words.shape[0]
    if not supported_problem(k):
        raise ValueError(f"fp4_wgmma_producer: K must be a positive multiple of {16 * SCALE_BOX}, got {k}; "
                         "use fp4_gemm.fp4_linear instead")
    xp = x2 if permuted else permute_x(x2)
    if not aligned(xp, words, scales):
        raise ValueError("fp4_wgmma_producer: x, the words and the scales must start on 16 bytes with rows a multiple "
                         "of 16 bytes apart (TMA); use fp4_gemm.fp4_linear instead")
    x_desc = TensorDescriptor(xp, [m, k], [xp.stride(0), 1], [config.block_m, BLOCK_K], X_SMEM_LAYOUT)
    bn = config.block_n
    w_desc = TensorDescriptor(words, [n, k // 8], [words.stride(0), 1], [bn, BLOCK_K // 8], W_SMEM_LAYOUT)
    s_desc = TensorDescriptor(scales, [n, k // 16], [scales.stride(0), 1], [bn, SCALE_BOX], SCALES_SMEM_LAYOUT)
    per, slices = k_slices(k, config.split_k)
    ws = None
    if slices > 1:
        if reduce_splits is None:
            raise ValueError("fp4_wgmma_producer.linear: a config with K-slices needs reduce_splits (fp4_gemm's)")
        ws = torch.empty(slices, m, n, dtype=torch.float32, device=x2.device)
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, bn) * slices
    grid = (min(tiles, num_sms(x2.device) * config.programs_per_sm),)  # persistent
    _fp4_wgmma_producer_kernel[grid](
        x_desc, w_desc, s_desc, global_scale, bias if bias is not None else out, out, ws if ws is not None else out,
        m, n, k, out.stride(0), int(bias is not None), per, slices, int(early),
        BLOCK_M=config.block_m, STAGES=config.stages, PRODUCER_REGS=config.producer_registers, WG=config.warpgroups,
        num_warps=4 * config.warpgroups, launch_pdl=early,
        **({"maxnreg": config.max_registers} if config.max_registers else {}))
    if ws is not None:
        reduce_splits(ws, global_scale, bias, out)


# ============================================================================ Gluon kernel
if gluon is not None:

    @gluon.jit
    def _producer(x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, tiles_m, num_tiles, total_steps,
                  per, slices, early):
        """1 warp: for each K-step of each of the program's tiles (an output tile and a K-slice), wait until its
        stage is empty, then TMA the x tile, the words and the scale box (the box of steps 2j and 2j + 1 for
        either of them). ``early`` (launched with PDL): the words and scale boxes of the first tile's first
        ``STAGES`` steps are issued before the grid-dependency wait, the x tiles only after it."""
        STAGES: gl.constexpr = x_smem.type.shape[0]  # worker arguments carry no constexprs: read them off types
        BLOCK_M: gl.constexpr = x_smem.type.shape[1]
        BN: gl.constexpr = w_smem.type.shape[1]
        nbytes: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes + s_desc.block_type.nbytes
        ahead = 0  # ring stages whose weights went out before the wait (the grid never exceeds the tiles)
        if early != 0:
            t = gl.program_id(0)
            off_n = (t // tiles_m // slices) * BN
            k0 = ((t // tiles_m) % slices) * per
            ahead = gl.minimum(gl.minimum(k0 + per, total_steps) - k0, STAGES)
            for j in range(0, ahead):  # fresh stages: nothing to wait for
                bar = ready.index(j)
                mbarrier.expect(bar, nbytes)  # the x tile's bytes too: the stage completes when it lands
                _tma_load(w_desc, [off_n, (k0 + j) * 16], bar, w_smem.index(j))
                _tma_load(s_desc, [off_n, ((k0 + j) // 2) * 16], bar, s_smem.index(j))
            grid_dependency_wait_then_release()
        c = 0  # K-steps issued by this program so far: the ring position
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            off_m = (t % tiles_m) * BLOCK_M
            off_n = (t // tiles_m // slices) * BN
            k0 = ((t // tiles_m) % slices) * per  # the slice's first K-step (even)
            for i in range(k0, gl.minimum(k0 + per, total_steps)):
                s = c % STAGES
                bar = ready.index(s)
                if c >= ahead:
                    mbarrier.wait(empty.index(s), ((c // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1 at once
                    mbarrier.expect(bar, nbytes)
                    _tma_load(w_desc, [off_n, i * 16], bar, w_smem.index(s))
                    _tma_load(s_desc, [off_n, (i // 2) * 16], bar, s_smem.index(s))
                _tma_load(x_desc, [off_m, i * 128], bar, x_smem.index(s))
                c += 1

    @gluon.jit
    def _consume_step(x_smem, w_smem, s_smem, ready, empty, acc, a_prev, c, FIRST: gl.constexpr, ODD: gl.constexpr,
                      BN: gl.constexpr, wl: gl.constexpr, sl: gl.constexpr, a_l: gl.constexpr):
        """The program's K-step ``c`` (``FIRST``: the first of its tile; ``ODD``: an odd step of the tile, whose
        scales are the second half of the stage's box): wait for the stage, decode (while the step before's
        MMAs run), issue the MMAs, wait until only they are in flight, then free the step before's stage (of
        the same tile). Returns (acc, A registers)."""
        STAGES: gl.constexpr = x_smem.type.shape[0]
        s = c % STAGES
        mbarrier.wait(ready.index(s), (c // STAGES) & 1)
        q = w_smem.index(s).load(wl).to(gl.uint32, bitcast=True)
        sb = s_smem.index(s).slice(8 * ODD, 8, dim=1).load(sl)
        a = _decode(q, sb, BN, a_l)
        acc = warpgroup_mma(a, x_smem.index(s).permute((1, 0)), acc, use_acc=not FIRST, is_async=True)
        acc, a_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_prev))
        if not FIRST:
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES))
        return acc, a

    @gluon.jit
    def _consumers(x_smem, w_smem, s_smem, ready, empty, gs_ptr, bias_ptr, out_ptr, ws_ptr, M, N, stride_om,
                   tiles_m, num_tiles, total_steps, per, slices, has_bias, BLOCK_M: gl.constexpr, WG: gl.constexpr):
        """The default partition, ``WG`` warpgroups of 64 weight rows each, over the program's tiles (module
        docstring)."""
        STAGES: gl.constexpr = x_smem.type.shape[0]
        BN: gl.constexpr = 64 * WG
        wl: gl.constexpr = _words_layout(WG)
        sl: gl.constexpr = _scales_layout(WG)
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * WG, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
        inv_gs = gl.div_rn(256.0, gl.load(gs_ptr))  # correctly rounded 2^8/gs

        c = 0  # the producer's count, step for step
        for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
            slice_ = (t // tiles_m) % slices
            k_steps = gl.minimum(per, total_steps - slice_ * per)  # even, >= 2 (k_slices)
            acc = gl.zeros([BN, BLOCK_M], gl.float32, layout=mma_l)
            a_odd = gl.zeros([BN, 128], gl.bfloat16, layout=a_l)
            # unrolled by two: the A registers of the MMAs in flight are never rewritten (fp4_wgmma, point 3), and
            # each step's half of the scale box is a constant. Steps 0 and 1 peeled (K >= 256): a loop that might
            # run no step makes ptxas serialize every wgmma (C7515).
            acc, a_even = _consume_step(x_smem, w_smem, s_smem, ready, empty, acc, a_odd, c, True, 0,
                                        BN, wl, sl, a_l)
            acc, a_odd = _consume_step(x_smem, w_smem, s_smem, ready, empty, acc, a_even, c + 1, False, 1,
                                       BN, wl, sl, a_l)
            for i in range(2, k_steps, 2):  # K % 256 == 0: an even number of steps
                acc, a_even = _consume_step(x_smem, w_smem, s_smem, ready, empty, acc, a_odd, c + i, False, 0,
                                            BN, wl, sl, a_l)
                acc, a_odd = _consume_step(x_smem, w_smem, s_smem, ready, empty, acc, a_even, c + i + 1, False, 1,
                                           BN, wl, sl, a_l)
            acc, a_odd = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_odd))
            c += k_steps
            mbarrier.arrive(empty.index((c + STAGES - 1) % STAGES))  # the tile's last stage

            offs_n = (t // tiles_m // slices) * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_l))
            offs_m = (t % tiles_m) * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_l))
            mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
            if slices > 1:  # the slice's raw fp32 partial: the caller's reduction scales, rounds and adds the bias
                gl.store(ws_ptr + (slice_ * M + offs_m[None, :]) * N + offs_n[:, None], acc, mask=mask)
            else:
                y = (acc * inv_gs).to(gl.bfloat16)
                if has_bias != 0:
                    b = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
                    y = (y.to(gl.float32) + b.to(gl.float32)[:, None]).to(gl.bfloat16)
                gl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], y, mask=mask)

    # M unspecialized, as `fp4_wgmma._permute_x_kernel`'s: a prefill's token count changes with its prompts
    @gluon.jit(do_not_specialize=["M"])
    def _fp4_wgmma_producer_kernel(x_desc, w_desc, s_desc, gs_ptr, bias_ptr, out_ptr, ws_ptr, M, N, K, stride_om,
                                   has_bias, per, slices, early, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                                   PRODUCER_REGS: gl.constexpr, WG: gl.constexpr):
        """[64 x WG weight rows, BLOCK_M rows of x] output tiles, each over one of ``slices`` K-slices of ``per``
        steps, tile ``t`` of the grid's stride (rows of x fastest, then slices; module docstring)."""
        tiles_m = gl.cdiv(M, BLOCK_M)
        num_tiles = tiles_m * gl.cdiv(N, 64 * WG) * slices
        total_steps = K // 128
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, 128], x_desc.layout)
        w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, 64 * WG, 16], w_desc.layout)
        s_smem = gl.allocate_shared_memory(gl.uint8, [STAGES, 64 * WG, 16], s_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)  # the consumers' partition arrives once (after its own barrier)
        fence_async_shared()
        gl.warp_specialize([
            (_consumers, (x_smem, w_smem, s_smem, ready, empty, gs_ptr, bias_ptr, out_ptr, ws_ptr, M, N, stride_om,
                          tiles_m, num_tiles, total_steps, per, slices, has_bias, BLOCK_M, WG)),
            (_producer, (x_desc, w_desc, s_desc, x_smem, w_smem, s_smem, ready, empty, tiles_m, num_tiles, total_steps,
                         per, slices, early)),
        ], [1], [PRODUCER_REGS])

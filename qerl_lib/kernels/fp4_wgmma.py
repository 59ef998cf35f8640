"""The NVFP4 x BF16 GEMM with the tensor cores kept busy while the next weights decode (Gluon, Hopper).

Why another kernel
------------------
``fp4_gemm``'s Triton fragment kernel decodes each 128-wide K-step of FP4 weights straight into the
registers of Hopper's ``wgmma`` A operand, but Triton 3.6 waits for every ``wgmma`` before the next
step's decode starts (``warp_group_dot_wait pendings=0``), so a warpgroup alternates between decoding
and multiplying. From 32 rows of ``x`` on, the multiply is no longer free, and Nsight Compute shows
that kernel latency-bound at 2 programs per SM (dev/LOG.md, section 31). Triton also gives no way to
let two warpgroups share one staged tile of ``x`` while each keeps its weights in registers.

Gluon (``triton.experimental.gluon``, Triton's tile language with explicit layouts, shared memory and
``wgmma``) gives both, so this kernel does what the Triton one could not:

1. **Weights decoded in the fragment's own layout.** The words of a K-step are read from shared memory
   through an explicit linear layout (``_words_layout``): lane ``4g + t`` of warp ``w`` holds words
   ``4t..4t+3`` (one 16-byte load) of rows ``16w + g`` and ``16w + g + 8``, and the scale bytes of those
   words (``_scales_layout``). Decoding (``_decode``: ``fp4_decode.code_pair_bits`` and the exact bf16x2
   scale multiply) then leaves every value where the wgmma A fragment wants it;
   ``convert_layout(..., assert_trivial=True)`` makes the compiler prove that no data moves. K is relabeled
   as in ``fp4_gemm`` (fragment K index ``32j + 16x + 8y + 2t + z`` holds code ``x + 2y + 4z`` of word
   ``4t + j``), and ``x`` is permuted to match once per call (``permute_x``, one copy).
2. **Loads several steps ahead, by TMA.** A ring of ``STAGES`` shared-memory stages, each one K-step's
   tile of the permuted ``x`` (the wgmma B operand, as TMA writes it) and of the weight words, each
   with an mbarrier the copies complete; step ``i`` refills the stage step ``i - 1`` used with step
   ``i + STAGES - 1`` (after a CTA barrier: every warpgroup has retired step ``i - 1``'s MMAs). The
   scale bytes (8 per row and step, below TMA's 16-byte minimum) come through registers two steps ahead.
   Rows past M or N read as zeros (TMA's bounds); the extra outputs are never stored.
3. **The multiply left in flight.** ``warpgroup_mma(..., is_async=True)`` then
   ``warpgroup_mma_wait(num_outstanding=1)``: step ``i``'s MMAs run while step ``i+1``'s weights decode.
   The A operand lives in registers, which PTX forbids rewriting before the wait that retires its MMAs;
   a rolled loop would decode every step into the same registers, so the loop is unrolled by two
   (``a_even``, ``a_odd``), each wait keeping the other step's registers alive (``deps``).
4. **Several warpgroups per x tile** (``warpgroups`` 2 or 4: 64 weight rows each) can share each staged
   tile of ``x``, halving or quartering its reads from L2. One warpgroup per program measured faster at
   every point, even with two 2-warpgroup programs per SM (``max_registers=128``), so the launch rule
   (``launch_rule.pick_wgmma_config``) uses one: at 64 rows the kernel is not bound by L2 (Nsight Compute:
   L2 42% busy, tensor pipe 31%, issue slots 36%), but by each warpgroup's chain of wait, decode and MMA.

5. **Waves balanced** (``wave_slots``, set by the launch rule): when the output tiles overflow the last
   whole wave of resident programs, ``wave_plan`` runs the whole waves unsplit and the leftover tiles in
   K-slices that fill one more wave (H100: 7B gate/up at 128 rows -6%, at 32 rows -4%, at 64 rows no gain).
6. **Programmatic dependent launch** (``kernels/pdl.py``; ``PDL``): the prologue copies the weight words of
   the first ``STAGES - 1`` steps, waits for the previous kernel (``grid_dependency_wait_then_release``, which
   also lets the next one launch), then copies their x tiles; ``permute_x``'s kernel waits first. On an H100
   the 7B decode step at batch 128 gained 1-2% (dev/LOG.md section 40).

Where it runs (H100, dev/LOG.md sections 32-33): at 65-128 rows of ``x`` it is 1.1-1.9x faster than the
Triton kernel on the Qwen2.5-7B/32B shapes, at 25-64 rows on the large ones only; on small shapes at
M <= 64 the permute's launch and the ring's prologue cost more than it saves. At training sizes
(M >= 1024, section 34) its best launch is 256 rows of x and two warpgroups (``WgmmaConfig(256, 2)``,
216 KB of shared memory at 3 stages): 0.58-0.95x of bf16 on the gate/up and down shapes (0.27-0.71x on the
attention ones), ahead of dequantize + cuBLAS only on the gate/up shapes at M = 1024 (7B 1.08x, 32B 1.17x),
level at 2048, behind from 4096 and on the down and attention shapes, so the launch rule does not pick it there
(``pick_wgmma_config`` stops at 128 rows). Its per-step CTA barrier (point 2) is where Nsight Compute finds the
most stalls at that size.

Output: fp32 partials of one K-slice (``split_k > 1``; ``fp4_gemm`` sums them in a fixed order) or the
epilogue ``bf16(acc * 2^8 / gs)`` then ``+ bias`` after the cast, the same single rounding as
``nvfp4.reference_matmul``, stored straight from the accumulator's registers (8 lanes hold 8
consecutive output features of one row: 16-byte runs of the row-major output).

Where we deviate from Marlin and CUTLASS: no offline repacking (the compressed-tensors bytes are read
in place), no producer warp (one elected thread issues the TMA copies; Gluon's ``warp_specialize`` is
not used), and ``x`` is copied once per call into the K relabeling (a Marlin-style kernel permutes the
weights offline instead). K must be a multiple of 128; ``fp4_gemm`` runs other shapes on its Triton kernel.
Gluon is experimental in Triton 3.6: this module imports without it (``available()`` is then False).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from qerl_lib.kernels import pdl as pdl_switch

try:  # Gluon ships with Triton >= 3.5; the CPU reference paths never need it
    import triton
    import triton.language as tl
    from qerl_lib.kernels.fp4_decode import code_pair_bits
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - exercised only on installs without Gluon
    gluon = None
else:  # names that changed after Triton 3.6 (the GPU image's): gl.thread_barrier -> gl.barrier,
    # tma.async_copy_global_to_shared -> tma.async_load
    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # shared-memory layouts the TMA writes and the kernel reads: x tiles (the wgmma B operand) and weight words
    X_SMEM_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    W_SMEM_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=32, rank=2)

BLOCK_K = 128  # one K-step: 16 int32 words (128 codes) and 8 scale bytes per weight row
# rows of x per program; 256 (wgmma N = 256) compiles to 229 registers a thread without spills (Triton 3.6)
BLOCK_MS = (16, 32, 64, 128, 256)
WARPGROUPS = (1, 2, 4)
STAGES = 3  # default ring depth (module docstring, point 2): 3 measured faster than 2, 4 or 5 (dev/LOG.md section 33)
MAX_STAGES = 8
SHARED_MEMORY_BYTES = 227 * 1024  # what one program of an sm_90 SM may allocate


def shared_memory_bytes(block_m: int, warpgroups: int, stages: int) -> int:
    """Shared memory of one program: per stage a bf16 x tile [block_m, 128] and int32 words [64 WG, 16],
    plus one 8-byte mbarrier per stage."""
    return stages * (block_m * BLOCK_K * 2 + 64 * warpgroups * 16 * 4 + 8)


@dataclass(frozen=True)
class WgmmaConfig:
    """One launch of ``_fp4_wgmma_kernel``: ``block_m`` rows of ``x`` per program (the MMA's N),
    ``warpgroups`` (1, 2 or 4) of 64 weight rows each, ``split_k`` K-slices (fp32 partials when > 1),
    ``stages`` K-steps of loads in the shared-memory ring (2-8, within an SM's shared memory),
    ``max_registers`` per thread (None: the compiler's choice; 128 lets two 2-warpgroup programs share an SM),
    ``wave_slots``: the programs the GPU runs at once with this launch (SMs x programs per SM; 0: no wave
    balancing): ``linear`` then runs the output tiles that overflow the last whole wave in K-slices (``wave_plan``)."""

    block_m: int
    warpgroups: int = 2
    split_k: int = 1
    stages: int = STAGES
    max_registers: int | None = None
    wave_slots: int = 0

    def __post_init__(self):
        if self.block_m not in BLOCK_MS:
            raise ValueError(f"WgmmaConfig.block_m must be one of {BLOCK_MS}, got {self.block_m}")
        if self.warpgroups not in WARPGROUPS:
            raise ValueError(f"WgmmaConfig.warpgroups must be one of {WARPGROUPS}, got {self.warpgroups}")
        if self.split_k < 1:
            raise ValueError(f"WgmmaConfig.split_k must be >= 1, got {self.split_k}")
        if not 2 <= self.stages <= MAX_STAGES:
            raise ValueError(f"WgmmaConfig.stages must be 2..{MAX_STAGES}, got {self.stages}")
        if self.max_registers is not None and not (self.max_registers % 8 == 0 and 64 <= self.max_registers <= 255):
            raise ValueError(f"WgmmaConfig.max_registers must be None or a multiple of 8 in 64..255, "
                             f"got {self.max_registers}")
        if self.wave_slots < 0:
            raise ValueError(f"WgmmaConfig.wave_slots must be >= 0, got {self.wave_slots}")
        need = shared_memory_bytes(self.block_m, self.warpgroups, self.stages)
        if need > SHARED_MEMORY_BYTES:
            raise ValueError(f"WgmmaConfig{(self.block_m, self.warpgroups, self.stages)} needs {need // 1024} KB of "
                             f"shared memory (an SM gives {SHARED_MEMORY_BYTES // 1024}); use fewer stages or a smaller block_m")

    @property
    def block_n(self) -> int:
        return 64 * self.warpgroups

    @property
    def num_warps(self) -> int:
        return 4 * self.warpgroups


def available(device: torch.device | None = None) -> bool:
    """Whether this kernel can run on ``device`` (default: the current CUDA device): Gluon importable
    and a Hopper-class GPU (sm_90; wgmma does not exist on other generations)."""
    if gluon is None or (device is not None and device.type != "cuda") or not torch.cuda.is_available():
        return False
    return _is_sm90(torch.cuda.current_device() if device is None or device.index is None else device.index)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (132 elsewhere: the H100's, for launch rules off the GPU)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


@functools.lru_cache(maxsize=None)
def _is_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


def supported_problem(k: int) -> bool:
    """K must be whole K-steps of 128 (every Qwen2.5 projection is)."""
    return k % BLOCK_K == 0 and k > 0


def k_slices(k: int, split_k: int) -> tuple[int, int]:
    """``(steps per slice, slices)`` for ``split_k`` requested slices of ``k / 128`` steps: slices
    are whole steps, so fewer may result (never an empty one)."""
    steps = k // BLOCK_K
    per = -(-steps // max(1, min(split_k, steps)))
    return per, -(-steps // per)


def wave_plan(m: int, n: int, k: int, config: WgmmaConfig) -> list[tuple[int, int, int]]:
    """The launches of one ``linear`` call as ``(first weight row, rows, split_k)``. One launch, unless
    ``config.wave_slots`` is set, the call has one tile of rows of x and one K-slice, and its output tiles
    (``block_n`` weight rows each) overflow the last whole wave of programs: 592 tiles on 396 slots run as 1.5
    waves, the last one half full. Then the whole waves run first (unsplit) and the remaining tiles run in as
    many K-slices as fill one wave (196 tiles x 2 slices on 396 slots): one and a half waves of work
    take one wave and a half-length one, and only the tail's partials go through fp32."""
    slots, tiles = config.wave_slots, -(-n // config.block_n)
    plan = [(0, n, config.split_k)]
    if not slots or config.split_k != 1 or m > config.block_m or tiles <= slots or tiles % slots == 0:
        return plan
    tail_split = min(slots // (tiles % slots), (k // BLOCK_K) // 2)
    if tail_split < 2:
        return plan
    head = (tiles // slots) * slots * config.block_n
    return [(0, head, 1), (head, n - head, tail_split)]


def linear(x2: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
           bias: torch.Tensor | None, out: torch.Tensor, config: WgmmaConfig, reduce_splits,
           permuted: bool = False, pdl: bool | None = None) -> None:
    """``out = x2 @ W.T (+ bias)`` by this kernel, in the launches of ``wave_plan``; a launch with several
    K-slices writes its fp32 partials to a temporary workspace that ``reduce_splits(ws, global_scale, bias,
    out)`` sums (``fp4_gemm``'s fixed-order reduction). ``permuted``: ``x2`` is already ``permute_x``'s copy.
    ``pdl``: as ``launch``'s. Raises a ValueError if K is not a multiple of 128."""
    m, k = x2.shape
    if not supported_problem(k):
        raise ValueError(f"fp4_wgmma: K must be a positive multiple of {BLOCK_K}, got {k}; use a KernelConfig instead")
    xp = x2 if permuted else permute_x(x2)
    for row0, rows, split_k in wave_plan(m, words.shape[0], k, config):
        cfg = config if split_k == config.split_k else dataclasses.replace(config, split_k=split_k)
        part = slice(row0, row0 + rows)
        w, s, o, b = words[part], scales[part], out[:, part], None if bias is None else bias[part]
        slices = k_slices(k, split_k)[1]
        ws = torch.empty(slices, m, rows, dtype=torch.float32, device=x2.device) if slices > 1 else None
        launch(xp, w, s, global_scale, b, o, ws, cfg, permuted=True, pdl=pdl)
        if ws is not None:
            reduce_splits(ws, global_scale, b, o)


PERMUTE_BLOCK_M = 32  # rows of x per program of the permute kernel (one 128-column block each)


def permute_x(x2: torch.Tensor) -> torch.Tensor:
    """x ``[M, K]`` -> a copy in the kernel's K relabeling, per 128 columns (module docstring, point 1):
    position ``32j + 16x + 8y + 2t + z`` holds natural column ``32t + 8j + 4z + 2y + x``. On CUDA a Triton
    kernel makes the copy (each program a [32, 128] tile, permuted in registers; a torch permute + copy of the
    7-D view ran at a third of copy bandwidth, dev/LOG.md section 35); elsewhere torch does."""
    m, k = x2.shape
    if gluon is None or not x2.is_cuda or x2.stride(-1) != 1:
        return x2.reshape(m, k // 128, 4, 4, 2, 2, 2).permute(0, 1, 3, 6, 5, 2, 4).reshape(m, k)
    out = torch.empty(m, k, dtype=x2.dtype, device=x2.device)
    if m:
        early = pdl_switch.use_for(x2.device)
        _permute_x_kernel[(triton.cdiv(m, PERMUTE_BLOCK_M), k // 128)](x2, out, m, x2.stride(0), BLOCK_M=PERMUTE_BLOCK_M,
                                                                        PDL=early, launch_pdl=early)
    return out


def launch(x2: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
           bias: torch.Tensor | None, out: torch.Tensor, workspace: torch.Tensor | None, config: WgmmaConfig,
           permuted: bool = False, pdl: bool | None = None) -> None:
    """Run the kernel for ``out[M, N] = x2[M, K] @ W.T``: writes ``out`` (bf16, epilogue applied; rows
    ``out.stride(0)`` apart) when ``config.split_k`` gives one slice, else ``workspace`` (fp32 ``[slices, M, N]``,
    raw partials; the caller sums them). ``permuted``: ``x2`` is already ``permute_x``'s copy. ``pdl``: launch
    with programmatic dependent launch (None: ``kernels/pdl.py``'s switch for this device); the kernel then
    copies the weight words of its first stages before its grid-dependency wait (their scales and ``gs`` after
    it), so the weights must not be written by the kernel just before it (true of a prepared weight). Shapes and
    alignment are the caller's to check (``fp4_gemm._triton_linear``)."""
    early = pdl_switch.use_for(x2.device, pdl)
    m, k = x2.shape
    n = words.shape[0]
    per, slices = k_slices(k, config.split_k)
    split = slices > 1
    if split and (workspace is None or tuple(workspace.shape) != (slices, m, n)):
        raise ValueError(f"fp4_wgmma.launch: split_k={config.split_k} needs an fp32 workspace of shape "
                         f"{(slices, m, n)}")
    xp = x2 if permuted else permute_x(x2)
    x_desc = TensorDescriptor(xp, [m, k], [k, 1], [config.block_m, BLOCK_K], X_SMEM_LAYOUT)
    w_desc = TensorDescriptor(words, [n, k // 8], [words.stride(0), 1], [config.block_n, BLOCK_K // 8], W_SMEM_LAYOUT)
    grid = (triton.cdiv(m, config.block_m), triton.cdiv(n, config.block_n), slices)
    _fp4_wgmma_kernel[grid](
        x_desc, w_desc, scales, global_scale, bias if bias is not None else out, out, workspace if split else out,
        m, n, k, scales.stride(0), out.stride(0), per,
        BLOCK_M=config.block_m, WG=config.warpgroups, SPLIT=split, HAS_BIAS=bias is not None, STAGES=config.stages,
        PDL=early, num_warps=config.num_warps, launch_pdl=early,
        **({} if config.max_registers is None else {"maxnreg": config.max_registers}))


# ============================================================================ Gluon kernel
if gluon is not None:

    # M is a token count (a prefill's changes with its prompts): left unspecialized, a new count's divisibility by 16
    # does not compile the kernel again in the middle of a rollout (dev/LOG.md 118)
    @triton.jit(do_not_specialize=["M"])
    def _permute_x_kernel(x_ptr, out_ptr, M, stride_xm, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
        """``permute_x`` for one [BLOCK_M, 128] tile: natural column ``32a + 8b + 4c + 2d + e`` goes to position
        ``32b + 16e + 8d + 2a + c`` (the same permute as the torch view, done in registers). ``out`` is contiguous."""
        if PDL:  # launched early: wait for x, then let the next kernel launch
            gdc_wait()
            gdc_launch_dependents()
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1) * 128 + tl.arange(0, 128)
        mask = (rows < M)[:, None]
        v = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask)
        v = tl.reshape(tl.permute(tl.reshape(v, [BLOCK_M, 4, 4, 2, 2, 2]), [0, 2, 5, 4, 1, 3]), [BLOCK_M, 128])
        tl.store(out_ptr + rows[:, None] * (tl.num_programs(1) * 128) + cols[None, :], v, mask=mask)

    @gluon.constexpr_function
    def _warp_bases(WG):
        return [[16, 0], [32, 0]] + ([[64, 0]] if WG >= 2 else []) + ([[128, 0]] if WG == 4 else [])

    @gluon.constexpr_function
    def _words_layout(WG):
        """int32 words [64 WG, 16] of one K-step: lane 4g + t of warp w holds words 4t..4t+3 (registers,
        one 16-byte load) of rows 16w + g and 16w + g + 8: the wgmma A fragment's rows."""
        return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                          lane_bases=[[0, 4], [0, 8], [1, 0], [2, 0], [4, 0]],
                                          warp_bases=_warp_bases(WG), block_bases=[], shape=[64 * WG, 16])

    @gluon.constexpr_function
    def _scales_layout(WG):
        """E4M3 scale bytes [64 WG, 8] of one K-step, in the rows and groups of ``_words_layout``'s words."""
        return gl.DistributedLinearLayout(reg_bases=[[0, 1], [8, 0]],
                                          lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
                                          warp_bases=_warp_bases(WG), block_bases=[], shape=[64 * WG, 8])

    @gluon.jit
    def _code_pair(q, sw, I: gl.constexpr):
        """Codes I and I + 4 of each word as bf16 ``fp4 * s * 2^-8`` (low, high half), split into a trailing
        pair dimension; ``sw``: the word's scale as bf16 ``s * 2^118`` in both halves."""
        p = code_pair_bits(q, I)
        # fp4 * 2^-126 times s * 2^118, both halves at once; exact, so the rounding mode is moot
        p = gl.inline_asm_elementwise("mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [p, sw], dtype=gl.uint32,
                                      is_pure=True, pack=1)
        return gl.join((p & 0xFFFF).to(gl.uint16), (p >> 16).to(gl.uint16))

    @gluon.jit
    def _decode(q, sb, BN: gl.constexpr, a_layout: gl.constexpr):
        """Words [BN, 16] + scale bytes [BN, 8] -> bf16 W' [BN, 128] in the A-fragment layout, K relabeled
        (module docstring, point 1); the final layout conversion is checked to move nothing."""
        s = sb.to(gl.float8e4nv, bitcast=True).to(gl.float32) * 2.0**118  # exact, subnormal scales too
        sv = s.to(gl.bfloat16).to(gl.uint16, bitcast=True).to(gl.uint32)
        sv = sv | (sv << 16)
        sw = gl.reshape(gl.join(sv, sv), [BN, 16])  # word w is in scale group w // 2
        lo = gl.join(_code_pair(q, sw, 0), _code_pair(q, sw, 1))  # [n, word, z, x] with y = 0
        hi = gl.join(_code_pair(q, sw, 2), _code_pair(q, sw, 3))  # y = 1
        w = gl.reshape(gl.join(lo, hi), [BN, 4, 4, 2, 2, 2])  # [n, t, j, z, x, y]
        w = gl.reshape(gl.permute(w, [0, 2, 4, 5, 1, 3]), [BN, 128])  # [n, (j, x, y, t, z)]
        return gl.convert_layout(w.to(gl.bfloat16, bitcast=True), a_layout, assert_trivial=True)

    @gluon.jit
    def grid_dependency_wait_then_release():
        """``griddepcontrol.wait`` (the previous kernel has finished and its writes are visible), then
        ``griddepcontrol.launch_dependents`` (the next kernel may launch); both no-ops without PDL."""
        gl.inline_asm_elementwise("griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _issue_loads(x_desc, w_desc, x_smem, w_smem, bars, step, it_begin, it_end, off_m, off_n,
                     STAGES: gl.constexpr, X: gl.constexpr = True, W: gl.constexpr = True, EXPECT: gl.constexpr = True):
        """TMA copies of K-step ``step``'s x tile and weight words into stage ``(step - it_begin) % STAGES``
        (nothing past the slice's last step); ``X`` / ``W`` / ``EXPECT`` pick the parts (the stage's barrier
        always expects both copies' bytes)."""
        slot = (step - it_begin) % STAGES
        ok = step < it_end
        bar = bars.index(slot)
        if EXPECT:
            mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes, pred=ok)
        if X:
            _tma_load(x_desc, [off_m, step * 128], bar, x_smem.index(slot), pred=ok)
        if W:
            _tma_load(w_desc, [off_n, step * 16], bar, w_smem.index(slot), pred=ok)

    @gluon.jit
    def _mma_step(x_desc, w_desc, x_smem, w_smem, bars, sb, acc, a_prev, step, it_begin, it_end, off_m, off_n,
                  BN: gl.constexpr, wl: gl.constexpr, a_l: gl.constexpr, STAGES: gl.constexpr):
        """K-step ``step``: wait for its stage, decode its weights (while the previous step's MMAs run), issue
        its MMAs, wait until only they are in flight, then (after a CTA barrier: every warpgroup has retired
        the previous step's MMAs) refill the previous step's stage with step + STAGES - 1. ``a_prev``: the
        previous step's A registers, kept alive to the wait that retires their MMAs. Returns (acc, A)."""
        slot = (step - it_begin) % STAGES
        mbarrier.wait(bars.index(slot), ((step - it_begin) // STAGES) & 1)
        q = w_smem.index(slot).load(wl).to(gl.uint32, bitcast=True)
        a = _decode(q, sb, BN, a_l)
        acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, use_acc=step > it_begin, is_async=True)
        acc, a_prev = warpgroup_mma_wait(num_outstanding=1, deps=(acc, a_prev))
        _cta_barrier()
        _issue_loads(x_desc, w_desc, x_smem, w_smem, bars, step + STAGES - 1, it_begin, it_end, off_m, off_n, STAGES)
        return acc, a

    @gluon.jit
    def _load_scales(s_ptrs, step, it_end):
        """Scale bytes of K-step ``step`` (clamped to the slice's last step), read into registers ahead of use."""
        return gl.load(s_ptrs + gl.minimum(step, it_end - 1) * 8, eviction_policy="evict_first")

    @gluon.jit
    def _fp4_wgmma_kernel(x_desc, w_desc, s_ptr, gs_ptr, bias_ptr, out_ptr, ws_ptr,
                          M, N, K, stride_sn, stride_om, iters_per_split,
                          BLOCK_M: gl.constexpr, WG: gl.constexpr, SPLIT: gl.constexpr, HAS_BIAS: gl.constexpr,
                          STAGES: gl.constexpr, PDL: gl.constexpr):
        """One [64 WG weight rows, BLOCK_M rows of x] output tile over one K-slice (module docstring); ``PDL``:
        the first stages' weights go out before the grid-dependency wait, their x tiles after it."""
        BN: gl.constexpr = 64 * WG
        NW: gl.constexpr = 4 * WG
        wl: gl.constexpr = _words_layout(WG)
        sl: gl.constexpr = _scales_layout(WG)
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NW, 1],
                                                        instr_shape=[16, BLOCK_M, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)

        pid_m = gl.program_id(0)
        pid_n = gl.program_id(1)
        pid_k = gl.program_id(2)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BN
        it_begin = pid_k * iters_per_split
        it_end = gl.minimum(it_begin + iters_per_split, K // 128)  # the host never makes an empty slice

        x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, 128], x_desc.layout)
        w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN, 16], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()
        for i in gl.static_range(STAGES - 1):  # the weights first (constants), x after the wait under PDL
            _issue_loads(x_desc, w_desc, x_smem, w_smem, bars, it_begin + i, it_begin, it_end, off_m, off_n, STAGES,
                         X=False)
        if PDL:
            grid_dependency_wait_then_release()
        for i in gl.static_range(STAGES - 1):
            _issue_loads(x_desc, w_desc, x_smem, w_smem, bars, it_begin + i, it_begin, it_end, off_m, off_n, STAGES,
                         W=False, EXPECT=False)

        # scale bytes: a register ring two steps deep (clamped rows: the extra rows are never stored)
        rows_s = gl.minimum(off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, sl)), N - 1)
        s_ptrs = s_ptr + rows_s[:, None] * stride_sn + gl.arange(0, 8, layout=gl.SliceLayout(0, sl))[None, :]
        sb0 = _load_scales(s_ptrs, it_begin, it_end)
        sb1 = _load_scales(s_ptrs, it_begin + 1, it_end)

        acc = gl.zeros([BN, BLOCK_M], gl.float32, layout=mma_l)
        # Unrolled by two, so that the A registers of the MMAs in flight are never rewritten before the wait
        # that retires them (module docstring, point 3): even steps decode into a_even, odd steps into a_odd.
        a_odd = gl.zeros([BN, 128], gl.bfloat16, layout=a_l)
        for it in range(it_begin, it_end - 1, 2):
            sb2 = _load_scales(s_ptrs, it + 2, it_end)
            acc, a_even = _mma_step(x_desc, w_desc, x_smem, w_smem, bars, sb0, acc, a_odd, it, it_begin, it_end,
                                    off_m, off_n, BN, wl, a_l, STAGES)
            sb0 = _load_scales(s_ptrs, it + 3, it_end)
            acc, a_odd = _mma_step(x_desc, w_desc, x_smem, w_smem, bars, sb1, acc, a_even, it + 1, it_begin, it_end,
                                   off_m, off_n, BN, wl, a_l, STAGES)
            sb0, sb1 = sb2, sb0
        if (it_end - it_begin) % 2 == 1:  # the last step alone (sb0 holds its scales)
            acc, a_odd = _mma_step(x_desc, w_desc, x_smem, w_smem, bars, sb0, acc, a_odd, it_end - 1, it_begin,
                                   it_end, off_m, off_n, BN, wl, a_l, STAGES)
        acc, a_odd = warpgroup_mma_wait(num_outstanding=0, deps=(acc, a_odd))

        # stored from the MMA layout: converting it first (through shared memory) makes ptxas serialize
        # every wgmma of the loop (its warning C7515: accumulator registers defined while MMAs are in flight)
        offs_n = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma_l))
        offs_m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_l))
        mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        if SPLIT:
            gl.store(ws_ptr + pid_k * M * N + offs_m[None, :] * N + offs_n[:, None], acc, mask=mask)
        else:
            y = (acc * gl.div_rn(256.0, gl.load(gs_ptr))).to(gl.bfloat16)  # correctly rounded 2^8/gs
            if HAS_BIAS:
                b = gl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
                y = (y.to(gl.float32) + b.to(gl.float32)[:, None]).to(gl.bfloat16)
            gl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], y, mask=mask)

"""The NVFP4 GEMM at training sizes in CUDA: register-A ``wgmma`` with a producer warp, no barrier between consumers.

Why another kernel
------------------
At training sizes (M = thousands of tokens) the frozen NVFP4 matmuls run as an exact dequantization pass into a bf16
temporary and then cuBLAS (``fp4_gemm``), which costs a quarter more than a bf16 GEMM at M = 1024, or as the Gluon
register-A kernel (``fp4_wgmma_producer``) on the wide gate/up shapes. That kernel's MMAs alone keep cuBLAS's pace,
but Triton 3.6's Gluon couples its two consumer warpgroups once a K-step (a partition-wide barrier before every
mbarrier wait and arrive; a wgmma in a worker partition is serialized), and it reads ``x`` in a K relabeling that
costs a permuted copy of ``x`` per call (up to a quarter of the call on the long-K down projection). This kernel is
the same design written in CUDA for NVRTC (``fp4_ra.cu``, read it beside this docstring), without either cost.

How one CTA works
-----------------
Three warpgroups. One thread of the first (the *producer*) streams K-steps of 64 through a ring of ``stages``
shared-memory stages by TMA: the ``x`` tile (``tok`` rows x 64, with the 128-byte swizzle that ``wgmma`` reads as
its B operand) and the 128 weight rows' 32 bytes (the compressed-tensors bytes as they are on disk). Each of the
producer's 128 threads also turns one weight row's 4 E4M3 block scales of the step into bf16x2 words of the exact
``s * 2^118`` (twice) in the stage, so that a consumer reads a row's scales with one 16-byte load. The other two
(the *consumers*, 64 weight rows each) hold the weights as ``wgmma``'s A operand in registers (swap-AB: the output
is computed transposed, weight rows on the MMA's M side, rows of ``x`` on its N side). Per K-step a consumer:

1. waits on the stage's ``full`` mbarrier (the TMA copies and one arrive per producer warp complete it);
2. reads its rows' bytes and scales from shared memory and decodes the bytes into 4 k16 fragments in **natural K
   order**: the fragment pair ``(2t, 2t + 1)`` of lane ``4g + t`` is the two nibbles of byte ``t`` of a 4-byte word.
   A table in shared memory (256-byte entries, one word per lane so that each lane reads its own bank) holds for
   every byte value its two codes as bf16 bits of ``fp4 * 2^-126`` (``mma.cu``'s pair trick, computed once per
   CTA); one ``prmt`` turns (byte, lane) into the address, and one packed ``mul.rn.bf16x2`` by the scale makes
   ``fp4 * s * 2^-8`` (exact: at most 6 significant bits): three instructions a fragment register;
3. issues the 4 ``wgmma`` of the step it decoded the iteration before as one group, then waits until only that
   group is in flight: the decode of step ``i + 1`` runs under step ``i - 1``'s MMAs, and three sets of A registers
   rotate. (ptxas serializes every wgmma, warning C7513, when a register that a wgmma reads is written while an
   earlier group whose wait comes after that wgmma is in flight; decoding step ``i + 1`` after issuing step ``i`` did.)
4. signals the step before ``empty`` with one ``mbarrier.arrive`` per warp (count 8): nothing makes the two
   consumer warpgroups wait for each other, and the producer refills a stage once both have retired it.

Which tiles a CTA takes
-----------------------
A tile is 128 weight rows x ``tok`` rows of ``x``. By default (``RaConfig.schedule = "split"``) the kernel is
persistent: one CTA per SM walks a list of *units* (``RaSchedule.units`` spells out the kernel's ``unit_of``), builds
its decode table once, and the producer's ring runs on from unit to unit, so the next tile's first stages load while
the consumers finish the last one. Whole waves of tiles are taken whole; the tiles that would fill only part of a last
wave (all of them when there are fewer tiles than SMs) are flattened into K-steps and shared out evenly, so the
busiest SM runs ``ceil(rest * K / 64 / SMs)`` K-steps instead of a whole tile's. A CTA that does only part of a tile's
K-steps writes its fp32 partial sums to a workspace and counts itself in on the tile's counter; the last to arrive adds
all of the tile's partial sums in CTA order (the same order whoever arrives last, so launches are bit-equal) and
writes the tile. Stream-K (Osama et al., 2023) splits every tile's K this way; here only the tail is split, as
CUTLASS's hybrid stream-K does, so most tiles pay no fixup.

The epilogue is the oracle's single rounding, ``bf16(acc * 2^8 / gs)`` then ``+ bias`` after the cast
(``nvfp4.reference_matmul``), staged through each consumer warpgroup's own shared-memory buffer (the ring is busy
with the next tile by then) so that each output row is stored as 16-byte runs.
The producer warpgroup gives registers to the consumers (``setmaxnreg``: 40 against 232), which need 128 for the
accumulators of a 256-row tile of ``x``.

Where we deviate from CUTLASS and Machete (vLLM's Hopper mixed-input GEMM for int4): no offline repack of the
weights into the fragment order (they read one 16-byte load per fragment; here the compressed-tensors bytes are
read in place and each lane looks its byte up in the table), and no 2-CTA cluster multicasting the ``x`` tile.
E4M3-subnormal block scales are kept, as compressed-tensors does.

The backward layout
-------------------
``grad_input`` runs ``dx = dy @ W`` from the same bytes (``RaConfig(backward=True)``, ``BACKWARD`` in the source): a
tile is 128 columns of W x ``tok`` rows of ``dy``, a K-step 64 rows of W. W^T's fragment pair (2t, 2t + 1) is one column
of two W rows with two block scales, so the producer warpgroup repacks every K-step: the raw W tile and its scale bytes
come by TMA into a ring of their own, and the producer writes each consumer lane's 16 values as table addresses and
its scale pairs as bf16x2 words, after which the consumer's decode is the forward's three instructions a register.
Measured on an H200 (dev/LOG.md section 76) the repack bounds it at 0.5-0.85x of bf16, below dequantize + cuBLAS, so
``fp4_grad_input`` does not call it; it stays for the next attempt (the section's queue) and its tests.

Requirements: an sm_90 GPU (``wgmma`` and ``setmaxnreg`` need ``sm_90a``), K % 64 == 0, N % 8 == 0, 16-byte aligned
rows of ``x``, ``out`` and the weight bytes, 4-byte aligned scale rows. ``available()`` says whether it can run;
``fp4_gemm.fp4_linear`` runs it where ``launch_rule.pick_ra_config`` picks it (dev/LOG.md sections 72 and 74 measure
it).
"""

from __future__ import annotations

import ctypes
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from qerl_lib.kernels import mma

SOURCE_PATH = Path(__file__).with_name("fp4_ra.cu")
# The layout numbers fp4_ra.cu is compiled with (kernel_source defines them), so that shared_bytes and the kernel agree.
BLOCK_K = 64  # K per stage
ROWS_PER_CTA = 128  # weight rows: two consumer warpgroups of 64
EPI_TOK = 32  # rows of x per epilogue chunk
STAGED_STRIDE = 64 + 8  # bf16 per staged output row of a consumer warpgroup (the padding spreads the banks)
TABLE_BYTES = 256 * 256  # the decode table: 256 byte values x 256-byte entries (32 lanes' code words)
TABLE_BYTES_BACKWARD = 256 * 128  # packed to 128-byte entries (the producer writes whole addresses)
RAW_SLOTS = 4  # backward: raw W tiles in flight, loaded RAW_SLOTS - 2 K-steps ahead of the repack
RAW_SLOT_BYTES = BLOCK_K * ROWS_PER_CTA // 2 + BLOCK_K * 16  # a raw W tile (64 rows x 64 bytes) and its scale box
STAGING_BYTES = EPI_TOK * STAGED_STRIDE * 2  # one consumer warpgroup's epilogue staging
THREADS = 384
SHARED_MEMORY_LIMIT = 227 * 1024  # dynamic shared memory one CTA of an sm_90 SM may use


SCHEDULES = ("one_tile", "persistent", "split")


@dataclass(frozen=True)
class RaConfig:
    """One launch shape: ``tok`` rows of ``x`` per tile (the wgmma N: 64, 128 or 256) and ``stages`` in the ring (both
    compiled in), and how tiles are spread over the SMs (``schedule``, a launch argument):

    - ``"one_tile"``: one CTA per tile, as many CTAs as tiles;
    - ``"persistent"``: one CTA per SM, each taking whole tiles in turn (its table built once, the next tile's first
      stages loaded under the previous tile's epilogue);
    - ``"split"``: persistent, and the tiles that would fill only part of a last wave are shared along K by up to one
      CTA per SM, at least ``min_split_steps`` K-steps of 64 each; the last CTA of a tile to finish sums the partial
      sums (fp32, through global memory) in a fixed order, so launches stay bit-equal; only when those tiles fill
      at most ``split_max_fill`` of the SMs (above it, the fixup's traffic costs more than the idle SMs do).

    ``backward`` compiles the backward layout (``grad_input``: ``dy @ W``) instead of the forward.
    """

    tok: int = 256
    stages: int = 4
    schedule: str = "split"
    min_split_steps: int = 8
    split_max_fill: float = 0.5
    backward: bool = False

    def __post_init__(self):
        if self.tok not in (64, 128, 256):
            raise ValueError(f"RaConfig.tok must be 64, 128 or 256, got {self.tok!r}")
        if not isinstance(self.stages, int) or not 2 <= self.stages <= 12:
            raise ValueError(f"RaConfig.stages must be an int in [2, 12], got {self.stages!r}")
        if self.shared_bytes > SHARED_MEMORY_LIMIT:
            raise ValueError(f"RaConfig: {self.shared_bytes} B of shared memory > {SHARED_MEMORY_LIMIT}; lower stages or tok")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"RaConfig.schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if not isinstance(self.min_split_steps, int) or self.min_split_steps < 1:
            raise ValueError(f"RaConfig.min_split_steps must be a positive int, got {self.min_split_steps!r}")
        if not 0.0 <= self.split_max_fill <= 1.0:
            raise ValueError(f"RaConfig.split_max_fill must be in [0, 1], got {self.split_max_fill!r}")
        if not isinstance(self.backward, bool):
            raise ValueError(f"RaConfig.backward must be a bool, got {self.backward!r}")

    @property
    def stage_bytes(self) -> int:
        """The x tile, the weight bytes and the weight rows' block scales as bf16x2 words (4 a row); backward, the
        repacked weights (a halfword table address per fragment register) and the scale pairs (8 per lane column
        of each 16-column block)."""
        if self.backward:
            return self.tok * BLOCK_K * 2 + ROWS_PER_CTA * BLOCK_K + ROWS_PER_CTA * 8
        return self.tok * BLOCK_K * 2 + ROWS_PER_CTA * BLOCK_K // 2 + ROWS_PER_CTA * 16

    @property
    def table_bytes(self) -> int:
        return TABLE_BYTES_BACKWARD if self.backward else TABLE_BYTES

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory: 1024-byte alignment slack, the ring, the decode table, the two consumer warpgroups'
        epilogue staging, (backward) the raw weight ring, the mbarriers and two flags."""
        raw = RAW_SLOTS * (RAW_SLOT_BYTES + 16) if self.backward else 0
        return 1023 + self.stages * self.stage_bytes + self.table_bytes + 2 * STAGING_BYTES + raw + 16 * self.stages + 8

    @property
    def name(self) -> str:
        """The compiled kernel's name (and cache key): the schedule is a launch argument, not compiled in."""
        return f"qerl_fp4_ra{'_bwd' if self.backward else ''}_t{self.tok}_s{self.stages}"


@dataclass(frozen=True)
class RaSchedule:
    """The launch's work split (``plan_schedule``), as the kernel's ``unit_of`` reads it: ``grid`` CTAs; ``tiles``
    tiles, numbered with the ``m_tiles`` tiles of ``x`` fastest; the first ``dp_tiles`` whole, CTA ``c`` taking tiles
    ``c, c + grid, ...``; then the K-steps of the remaining tiles, flattened, ``sk_per`` to each of CTAs
    ``0 .. sk_ctas - 1``."""

    grid: int
    m_tiles: int
    tiles: int
    n_steps: int
    dp_tiles: int
    sk_per: int = 0
    sk_ctas: int = 0

    @property
    def split_tiles(self) -> int:
        return self.tiles - self.dp_tiles

    def units(self, cta: int) -> list[tuple[int, int, int, int]]:
        """CTA ``cta``'s ``(tile, first K-step, end K-step, partial-sum slot)`` in order: ``unit_of`` in fp4_ra.cu,
        written out for the tests and for reading."""
        out = [(t, 0, self.n_steps, 0) for t in range(cta, self.dp_tiles, self.grid)]
        if cta < self.sk_ctas:
            start = cta * self.sk_per
            end = min(start + self.sk_per, self.split_tiles * self.n_steps)
            pos, v = start, 0
            while pos < end:
                local, kb = divmod(pos, self.n_steps)
                ke = min(self.n_steps, kb + end - pos)
                out.append((self.dp_tiles + local, kb, ke, 0 if v == 0 else 1))
                v += 1
                pos = (start // self.n_steps + v) * self.n_steps
        return out


def plan_schedule(m: int, n: int, k: int, cfg: RaConfig, sms: int) -> RaSchedule:
    """How ``cfg.schedule`` spreads an ``[m, k] x [n, k]^T`` product over ``sms`` SMs (see ``RaConfig``)."""
    m_tiles, n_steps = math.ceil(m / cfg.tok), k // BLOCK_K
    tiles = m_tiles * math.ceil(n / ROWS_PER_CTA)
    if cfg.schedule == "one_tile":
        return RaSchedule(tiles, m_tiles, tiles, n_steps, tiles)
    whole = RaSchedule(min(sms, tiles), m_tiles, tiles, n_steps, tiles)
    full_waves, rest = divmod(tiles, sms)
    if cfg.schedule == "persistent" or rest == 0 or rest > cfg.split_max_fill * sms:
        return whole
    steps = rest * n_steps
    ctas = min(sms, max(1, steps // cfg.min_split_steps))
    per = math.ceil(steps / ctas)
    ctas = math.ceil(steps / per)
    if ctas <= rest:  # no CTA would get less than a tile's K-steps: nothing to gain
        return whole
    return RaSchedule(sms if full_waves else ctas, m_tiles, tiles, n_steps, full_waves * sms, per, ctas)


def _wgmma_macro(tok: int) -> str:
    """``WGMMA(acc, a, desc)``: one m64n{tok}k16 bf16 wgmma, A (4 registers) from registers, B by descriptor."""
    n = tok // 2
    regs = ", ".join(f"%{i}" for i in range(n))
    asm = ("{\\n .reg .pred p;\\n setp.ne.b32 p, 1, 0;\\n"
           f" wgmma.mma_async.sync.aligned.m64n{tok}k16.f32.bf16.bf16 {{{regs}}}, "
           f"{{%{n}, %{n + 1}, %{n + 2}, %{n + 3}}}, %{n + 4}, p, 1, 1, 0;\\n}}\\n")
    outs = ", ".join(f'"+f"(ACC[{i}])' for i in range(n))
    return (f'#define WGMMA(ACC, A, DESC) asm volatile("{asm}" : {outs} : "r"(A[0]), "r"(A[1]), "r"(A[2]), '
            f'"r"(A[3]), "l"(DESC))\n')


def kernel_source(cfg: RaConfig) -> str:
    layout = {"BK": BLOCK_K, "ROWS": ROWS_PER_CTA, "EPI_TOK": EPI_TOK, "STAGED_STRIDE": STAGED_STRIDE,
              "TABLE_BYTES": cfg.table_bytes, "TOK": cfg.tok, "STAGES": cfg.stages, "KERNEL_NAME": cfg.name,
              "BACKWARD": int(cfg.backward), "RAW_SLOTS": RAW_SLOTS}
    return "".join(f"#define {k} {v}\n" for k, v in layout.items()) + _wgmma_macro(cfg.tok) + SOURCE_PATH.read_text()


def compile_cubin(cfg: RaConfig, log: list[str] | None = None) -> bytes:
    """NVRTC: the kernel for ``cfg`` as an sm_90a cubin (raises with the compiler's log); ``log`` receives ptxas's
    report (registers, spills, and any C75xx warning that it serialized the wgmmas)."""
    return mma.compile_cubin(kernel_source(cfg), cfg.name, "sm_90a", options=("--ptxas-options=-v",), log=log)


# ============================================================================ availability
def supported_problem(n: int, k: int) -> bool:
    """Shapes this kernel takes: K a multiple of 64, N a multiple of 8."""
    return k > 0 and k % BLOCK_K == 0 and n > 0 and n % 8 == 0


@functools.lru_cache(maxsize=None)
def unavailable_reason(device_index: int = 0) -> str | None:
    """Why the kernel cannot run here (one line), or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability(device_index)
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]}: wgmma with setmaxnreg is compiled for sm_90a (Hopper) only"
    return mma.unavailable_reason(device_index)


def available(device_index: int = 0) -> bool:
    return unavailable_reason(device_index) is None


# ============================================================================ TMA descriptors
_BF16, _UINT8 = 9, 0  # CUtensorMapDataType
_SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}  # CUtensorMapSwizzle
_L2_PROMOTION_128B = 2


def encode_tensor_map(ptr: int, dtype_code: int, inner: int, outer: int, row_bytes: int, box_inner: int,
                      box_outer: int, swizzle: int) -> ctypes.Array:
    """A 2-D ``CUtensorMap`` (128 bytes, 64-byte aligned) for a row-major ``[outer, inner]`` tensor whose rows start
    ``row_bytes`` apart, read in ``[box_outer, box_inner]`` boxes with a ``swizzle``-byte swizzle; rows and columns past
    the tensor read as zeros. Returns the buffer (keep it alive until the launch)."""
    holder = ctypes.create_string_buffer(128 + 64)
    addr = (ctypes.addressof(holder) + 63) & ~63
    u64x2, u32x2 = ctypes.c_uint64 * 2, ctypes.c_uint32 * 2
    drv = mma._driver()
    mma._cu_check(drv.cuTensorMapEncodeTiled(
        ctypes.c_void_p(addr), ctypes.c_int(dtype_code), ctypes.c_uint(2), ctypes.c_void_p(ptr),
        u64x2(inner, outer), (ctypes.c_uint64 * 1)(row_bytes), u32x2(box_inner, box_outer), u32x2(1, 1),
        ctypes.c_int(0), ctypes.c_int(_SWIZZLE[swizzle]), ctypes.c_int(_L2_PROMOTION_128B), ctypes.c_int(0)),
        "cuTensorMapEncodeTiled")
    view = (ctypes.c_char * 128).from_address(addr)
    view._holder = holder  # the aligned view keeps its buffer alive
    return view


# ============================================================================ launch
def _get_kernel(cfg: RaConfig, index: int) -> mma._Kernel:
    return mma.load_kernel(("fp4_ra", index, cfg.name), index, lambda: compile_cubin(cfg), cfg.name,
                           cfg.shared_bytes, caller="fp4_ra.grad_input" if cfg.backward else "fp4_ra.linear")


def _check_operands(who: str, a: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, out: torch.Tensor,
                    out_cols: int):
    if out.dim() != 2 or tuple(out.shape) != (a.shape[0], out_cols):
        raise ValueError(f"{who}: out must be [{a.shape[0]}, {out_cols}], got {tuple(out.shape)}")
    if a.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or words.dtype != torch.int32 or scales.dtype != torch.uint8:
        raise ValueError(f"{who}: activations and out must be bf16, words int32 and scales uint8 (a PreparedFP4Weight's)")
    if a.stride(1) != 1 or out.stride(1) != 1 or words.stride(1) != 1 or scales.stride(1) != 1:
        raise ValueError(f"{who}: activations, out, words and scales need unit column stride")
    m = a.shape[0]
    aligned16 = [a.data_ptr(), out.data_ptr(), words.data_ptr(), 2 * a.stride(0) if m > 1 else 16,
                 2 * out.stride(0) if m > 1 else 16, 4 * words.stride(0)]
    if any(v % 16 for v in aligned16) or scales.data_ptr() % 4 or scales.stride(0) % 4:
        raise ValueError(f"{who} needs 16-byte aligned rows of activations, out and words, and 4-byte aligned scale rows")


def _launch(cfg: RaConfig, a: torch.Tensor, w_map, s_map, scales: torch.Tensor, global_scale: torch.Tensor,
            bias: torch.Tensor | None, out: torch.Tensor, n_out: int, k_red: int) -> torch.Tensor:
    """One launch of ``cfg``'s kernel: ``a [m, k_red]`` (read by TMA) against the weight's tensor maps (``s_map``: the
    backward's scale boxes; the forward reads ``scales`` directly), ``out [m, n_out]``."""
    m = a.shape[0]
    x_map = encode_tensor_map(a.data_ptr(), _BF16, k_red, m, 2 * a.stride(0), BLOCK_K, cfg.tok, 128)
    index = a.device.index if a.device.index is not None else torch.cuda.current_device()
    kern = _get_kernel(cfg, index)
    sched = plan_schedule(m, n_out, k_red, cfg, mma._device_sms(index))
    partial = arrived = None
    if sched.sk_ctas:
        partial = torch.empty(sched.sk_ctas * 4 * cfg.tok * 64, dtype=torch.float32, device=a.device)
        arrived = mma._counters(a.device, 4 * sched.split_tiles)
    kern((sched.grid, 1), THREADS, [x_map, w_map, s_map, scales, global_scale, bias, out, partial, arrived, m, n_out,
                                    k_red, out.stride(0), scales.stride(0), sched.m_tiles, sched.dp_tiles, sched.sk_per,
                                    sched.sk_ctas])
    return out


def linear(x2: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
           bias: torch.Tensor | None, out: torch.Tensor, config: RaConfig | None = None) -> torch.Tensor:
    """``out[m, n] = bf16(x2 @ W.T * 2^8/gs ...)`` (+ bias) for bf16 ``x2 [m, k]``: ``words`` int32 ``[N, K/8]`` and
    ``scales`` uint8 ``[N, K/16]`` (the compressed-tensors bytes, read in place), ``global_scale`` float32 ``[1]`` on
    the device, ``out`` bf16 ``[m, N]`` with unit column stride. One launch; the ``"split"`` schedule also takes an
    fp32 workspace for the partial sums (``4 * tok * 256`` bytes per splitting CTA) and the arrival counters that
    ``mma.py``'s K-slices use (one device, one stream at a time; warm up before CUDA-graph capture)."""
    m, k = x2.shape
    n = words.shape[0]
    cfg = config or RaConfig()
    if cfg.backward:
        raise ValueError("fp4_ra.linear runs the forward layout: pass a RaConfig with backward=False")
    if not supported_problem(n, k):
        raise ValueError(f"fp4_ra.linear takes K % {BLOCK_K} == 0 and N % 8 == 0, got N={n}, K={k}")
    _check_operands("fp4_ra.linear", x2, words, scales, out, n)
    if m == 0:
        return out
    w_map = encode_tensor_map(words.data_ptr(), _UINT8, k // 2, n, 4 * words.stride(0), BLOCK_K // 2, ROWS_PER_CTA, 32)
    return _launch(cfg, x2, w_map, w_map, scales, global_scale, bias, out, n, k)


def supported_backward_problem(n: int, k: int) -> bool:
    """Backward shapes: N (the reduction) and K (the output) multiples of 64."""
    return n > 0 and k > 0 and n % BLOCK_K == 0 and k % BLOCK_K == 0


def grad_input(dy2: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
               out: torch.Tensor, config: RaConfig | None = None) -> torch.Tensor:
    """The backward layout, ``out[m, k] = bf16(dy2 @ W * 2^8/gs ...)`` for bf16 ``dy2 [m, N]`` (the input gradient of
    ``y = x @ W.T``), from the same compressed-tensors bytes as ``linear`` (no transposed copy); ``out`` bf16
    ``[m, K]``. ``config`` must have ``backward=True`` (the default one does). Same workspace and counters as
    ``linear``."""
    m, n = dy2.shape
    k = 8 * words.shape[1]
    cfg = config or RaConfig(backward=True)
    if not cfg.backward:
        raise ValueError("fp4_ra.grad_input runs the backward layout: pass a RaConfig with backward=True")
    if words.shape[0] != n or not supported_backward_problem(n, k):
        raise ValueError(f"fp4_ra.grad_input takes dy [m, N] with N % {BLOCK_K} == 0 and K % {BLOCK_K} == 0 "
                         f"for a weight [N, K], got dy {tuple(dy2.shape)} and a weight [{words.shape[0]}, {k}]")
    _check_operands("fp4_ra.grad_input", dy2, words, scales, out, k)
    if scales.data_ptr() % 16 or scales.stride(0) % 16:
        raise ValueError("fp4_ra.grad_input reads the block scales by TMA: it needs 16-byte aligned scale rows "
                         "(K % 256 == 0 for contiguous scales; PreparedFP4Weight.tma_aligned says whether they are)")
    if m == 0:
        return out
    w_map = encode_tensor_map(words.data_ptr(), _UINT8, k // 2, n, 4 * words.stride(0), BLOCK_K, BLOCK_K, 64)
    s_map = encode_tensor_map(scales.data_ptr(), _UINT8, k // 16, n, scales.stride(0), 16, BLOCK_K, 0)
    return _launch(cfg, dy2, w_map, s_map, scales, global_scale, None, out, k, n)

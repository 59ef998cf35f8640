"""Which kernel and launch of the NVFP4 GEMM runs a given problem (``fp4_gemm.fp4_linear``'s dispatch).

The choice is a fixed rule, not autotuning, so the same problem always runs the same kernel and gives the
same bits. The rules and their thresholds come from GPU sweeps on an H100 and an H200 (``dev/sweeps/``;
results and reasoning in dev/LOG.md): the decode step (M <= 8) runs the mma.sync kernel where it can
(``uses_mma``); at 25-128 rows the Gluon kernel (``pick_wgmma_config``), except where the producer-warp Gluon
kernel (``pick_producer_config``) runs: most shapes at 24-96 rows, the wide gate/up shapes at 193-2048 rows and
the long-K down shapes at 193-512, except that the register-A CUDA kernel (``pick_ra_config``) takes the wide
ones at 1024-2048; everything else the Triton kernel,
whose small-M launches want enough programs in flight (K-splits) without overflowing one wave, or from 193
rows one exact dequantization pass and cuBLAS (``pick_config``). ``plan_launch`` chains the last four, the
register-A rule first.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch

from qerl_lib.kernels import fp4_ra, fp4_wgmma_producer, mma
from qerl_lib.kernels.fp4_ra import RaConfig
from qerl_lib.kernels.fp4_wgmma import WgmmaConfig, supported_problem
from qerl_lib.kernels.fp4_wgmma_producer import ProducerConfig


@dataclass(frozen=True)
class KernelConfig:
    """One launch shape of ``_fp4_gemm_kernel`` (or the dequantize + cuBLAS path).

    ``swap_ab``: the weights are the MMA's A operand and ``x`` its narrow B operand (small M), else
    ``x`` is A (large M). ``fragment``: the small-M path decoding straight into the wgmma A fragment
    (``block_k`` 128, 4 warps). ``prefetch=False`` hands the loads to Triton's cp.async pipeliner
    (``num_stages > 1``) instead of the register prefetch; the rule never picks it (no faster than
    the register prefetch on an H100). Also measured and dropped: gathering ``x``, a load-time
    repack, a one-launch split-K reduction (dev/LOG.md).
    """

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    cublas: bool = False  # True: dequantize to bf16, then torch.addmm
    swap_ab: bool = True
    fragment: bool = False
    prefetch: bool = True  # False: no register prefetch; Triton's pipeliner (num_stages > 1) stages loads

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, got {v}")
        if self.block_n < 64:
            raise ValueError("KernelConfig.block_n must be >= 64 (one warpgroup MMA)")
        if self.split_k < 1:
            raise ValueError("KernelConfig.split_k must be >= 1")
        if self.fragment and not (self.swap_ab and self.block_k == 128 and self.num_warps == 4 and self.block_m <= 64):
            raise ValueError("KernelConfig.fragment needs swap_ab, block_k=128, num_warps=4 and block_m <= 64")


SMALL_M_BACKENDS = ("auto", "mma", "triton")  # the kernels that may run the decode step (M <= 8)
SMALL_M_ENV = "QERL_FP4_SMALL_M"  # the user's switch, read when no backend is passed


def resolve_small_m_backend(name: str | None = None) -> str:
    """The small-M backend a call uses: ``name`` if given, else the environment variable
    ``QERL_FP4_SMALL_M`` as it is now (default ``"auto"``). ``"mma"``: the CUDA mma.sync kernel of
    ``kernels/mma.py`` (error if this machine cannot run it); ``"triton"``: ``fp4_gemm``'s Triton
    kernel; ``"auto"``: mma where available, else Triton."""
    value = os.environ.get(SMALL_M_ENV, "auto") if name is None else name
    if value not in SMALL_M_BACKENDS:
        what = SMALL_M_ENV if name is None else "small-M backend"
        raise ValueError(f"{what} must be one of {SMALL_M_BACKENDS}, got {value!r}")
    return value


def mma_shape(m: int, k: int) -> bool:
    """Whether the mma.sync kernel takes a call of this shape under the "auto" small-M rule (rows <= AUTO_MAX_M and a
    reduction it supports); whether this machine can run it is ``uses_mma``'s further question."""
    return m <= mma.AUTO_MAX_M and mma.supported_problem(m, k)


def uses_mma(m: int, k: int, device: torch.device, backend: str | None = None) -> bool:
    """Whether an ``fp4_linear`` call with ``m`` rows, reduction ``k`` on ``device`` (and no Triton
    ``config``) runs the mma.sync kernel under small-M ``backend`` (None: the environment's, see
    ``resolve_small_m_backend``); raises if the backend is "mma" but this machine cannot run it."""
    backend = resolve_small_m_backend(backend)
    if backend == "triton" or device.type != "cuda" or not mma_shape(m, k):
        return False
    index = device.index if device.index is not None else (torch.cuda.current_device() if torch.cuda.is_available() else 0)
    if mma.available(index):
        return True
    if backend == "mma":
        raise RuntimeError(f"small-M backend 'mma' cannot run here: {mma.unavailable_reason(index)}; "
                           f"pass small_m_backend='auto' or set {SMALL_M_ENV}=auto")
    return False


# M from which the prepared path dequantizes once and calls cuBLAS (None: never); see pick_config.
CUBLAS_MIN_M: int | None = 193
FRAGMENT_MAX_BLOCK_M = 64  # the fragment path's widest tile of x rows; larger M runs several tiles along M


def pick_config(m: int, n: int, k: int, num_sms: int = 132, allow_cublas: bool = True) -> KernelConfig:
    """Deterministic kernel choice for an ``[m, k] x [k, n]`` problem (no autotuning, so results
    are reproducible bit for bit), from sweeps on an H100 and an H200 (dev/LOG.md):

    * M = 1: the fragment path, 64-wide tiles, K-splits for ~4 programs per SM;
    * 2 <= M <= 16: 128-wide tiles and ~2 programs per SM (on an H100 5-20% faster than the
      M = 1 rule), except the shapes in ``SMALL_M_TUNED``; 17 <= M <= 64: as M = 1;
    * 65 <= M < ``CUBLAS_MIN_M``: as M = 1 with 64-row tiles of x, each of which decodes and streams
      W again (H100, Qwen2.5-7B/32B shapes at M = 96, 128, 192: gate/up and down 1.14-1.90x
      faster than dequantize + cuBLAS, whose cuBLAS is memory-bound there so the extra pass costs more
      than the GEMM; the small q/k/v and o shapes 0.88-1.10x of it; all still 0.48-0.80x of bf16);
    * M >= ``CUBLAS_MIN_M``: dequantize once + cuBLAS (the fused large-tile kernel measured
      0.44-0.55x of cuBLAS, dequant + cuBLAS 0.80-0.95x at M >= 1024);
    * M >= ``CUBLAS_MIN_M`` when cuBLAS is not allowed: 128x128 fused tiles.
    """
    if allow_cublas and CUBLAS_MIN_M is not None and m >= CUBLAS_MIN_M:
        return KernelConfig(128, 128, 64, cublas=True)
    if m < (CUBLAS_MIN_M or 65):
        block_m = 16 if m <= 16 else min(FRAGMENT_MAX_BLOCK_M, 1 << (m - 1).bit_length())
        block_n, per_sm = SMALL_M_TUNED.get((n, k), (128, 2)) if 2 <= m <= 16 else (64, 4)
        tiles = math.ceil(n / block_n) * math.ceil(m / block_m)
        split = k_splits(tiles, math.ceil(k / 128), num_sms, per_sm)
        return KernelConfig(block_m, block_n, 128, split, 4, 1, fragment=True)
    tiles = math.ceil(n / 128) * math.ceil(m / 128)
    return KernelConfig(128, 128, 64, k_splits(tiles, math.ceil(k / 64), num_sms), 8, 3, swap_ab=False)


# (N, K) -> (tile width, programs per SM) where 2 <= M <= 16 measured better than (128, 2) on an H100:
# Qwen2.5-32B's fused gate_up, whose 432 128-wide tiles overflow one wave (88 vs 96+ us).
SMALL_M_TUNED = {(55296, 5120): (64, 2)}


# The Gluon kernel (kernels/fp4_wgmma.py) where it measured faster than the Triton one (dev/LOG.md sections 32-33,
# H100, Qwen2.5-7B/32B decode shapes, one warpgroup, 3 stages): every shape at 65 <= M <= 128 (1.1-1.9x); at
# 33 <= M <= 64 the shapes of >= 50M weights (M = 64, Triton -> Gluon: 7B gate/up 79.8 -> 64.5 us, 7B down 47.0 -> 41.9,
# 32B gate/up 150.3 -> 118.8, 32B down 93.0 -> 71.6; the small q/k/v and o lose there to the permute's launch); at
# 25 <= M <= 32 those of >= 100M (7B gate/up 1.08x, 32B gate/up 1.12x, 32B down 1.10x; measured at M = 32, where the
# 7B down projection only ties).
WGMMA_MID_M_MIN_WEIGHTS = 50_000_000
WGMMA_LOW_M_MIN_WEIGHTS = 100_000_000
# Programs of the rule's launches (one warpgroup, 3 stages) that fit one SM at once, by the offline compile
# (Triton 3.6, sm_90a): 32 rows of x, 115 registers x 128 threads -> 4; 64 rows, 61 KB of shared memory and
# 135 registers -> 3; 128 rows, 110 KB -> 2 (an SM has 228 KB and 64K registers). It sets `wave_slots`.
WGMMA_PROGRAMS_PER_SM = {32: 4, 64: 3, 128: 2}
WAVE_SPLIT_ENV = "QERL_FP4_WAVE_SPLIT"  # "0": no wave balancing (fp4_wgmma.wave_plan)


def pick_wgmma_config(m: int, n: int, k: int, num_sms: int = 132) -> WgmmaConfig | None:
    """The Gluon kernel's launch for an ``[m, k] x [k, n]`` problem, or None where the Triton rule
    (``pick_config``) runs it: one warpgroup per program (faster than two or four at every measured point),
    the default ring of ``fp4_wgmma.STAGES`` (3) stages, 128 rows of x at 65 <= M <= 128, 64 at 33 <= M <= 64
    when ``n * k`` >= ``WGMMA_MID_M_MIN_WEIGHTS``, 32 at 25 <= M <= 32 when ``n * k`` >=
    ``WGMMA_LOW_M_MIN_WEIGHTS``, K-slices for ~2 programs per SM, and wave balancing (``wave_slots``) unless
    ``QERL_FP4_WAVE_SPLIT=0``."""
    if not supported_problem(k):
        return None
    if 64 < m <= 128:
        block_m = 128
    elif 32 < m <= 64 and n * k >= WGMMA_MID_M_MIN_WEIGHTS:
        block_m = 64
    elif 24 < m <= 32 and n * k >= WGMMA_LOW_M_MIN_WEIGHTS:
        block_m = 32
    else:
        return None
    slots = num_sms * WGMMA_PROGRAMS_PER_SM[block_m] if os.environ.get(WAVE_SPLIT_ENV, "1") != "0" else 0
    return WgmmaConfig(block_m, 1, k_splits(math.ceil(n / 64), k // 128, num_sms, 2), wave_slots=slots)


def k_splits(tiles: int, k_iters: int, num_sms: int, programs_per_sm: int = 4) -> int:
    """The rule's K-slices for ``tiles`` output tiles over ``k_iters`` K-steps on ``num_sms`` SMs:
    tiles * slices ~ programs_per_sm * SMs, each slice >= 2 K-steps, none empty."""
    if tiles >= programs_per_sm * num_sms:
        return 1
    split = max(1, min(math.ceil(programs_per_sm * num_sms / tiles), max(1, k_iters // 2)))
    return math.ceil(k_iters / math.ceil(k_iters / split))


# The producer-warp kernel (kernels/fp4_wgmma_producer.py) where it measured faster than dequantize + cuBLAS,
# permute of x included (H100, dev/LOG.md section 35): on the wide gate/up shapes (N >= PRODUCER_MIN_N) from 193 rows
# to PRODUCER_MAX_M (Qwen2.5-7B/32B: 1.9-2.1x at M = 256, 1.2-1.6x at 384-768, 1.10-1.16x at 1024, 0.98-1.13x at
# 2048; slower from 4096), and on the long-K down shapes (K >= PRODUCER_LONG_K) up to PRODUCER_LONG_K_MAX_M rows
# (1.12-1.47x at 256-512). The other narrow shapes (q/k/v, o) stayed on dequantize + cuBLAS (level or slower).
PRODUCER_MAX_M = 2048
PRODUCER_MIN_N = 16384
PRODUCER_LONG_K = 16384
PRODUCER_LONG_K_MAX_M = 512
# Relative speed per output of 128-row tiles against 256-row ones at full occupancy (7B gate/up, M = 4096: 0.76x vs
# 0.91x of bf16), for choosing the tile height (producer_block_m).
PRODUCER_128_ROW_SPEED = 0.84
PRODUCER_ENV = "QERL_FP4_PRODUCER"  # "0": never pick it (read at each call; default "1")
# Decode batch sizes (H100, dev/LOG.md section 37, permute included): one consumer warpgroup, two programs
# per SM, 5 stages, against the rule before (fp4_wgmma with one warpgroup, or the Triton fragment kernel). Spans of
# rows (first, last, tile height, least N): 64-row tiles at 33-64 rows win on the K < 16384 shapes of Qwen2.5-7B/32B
# with N >= 3584 (1.03-1.26x on gate/up, 1.04-1.75x on q/k/v and o); 32-row tiles at 24-32 rows only on gate/up
# (1.11-1.35x; q/k/v and o lost there with the permute and no K-slices: PRODUCER_NARROW_SPAN below) and at 65-96 rows
# in three tiles (1.02-1.32x). The separate k and v
# projections (N = 512 / 1024: 8-16 output tiles) lose (7B at 64 rows: 13.1 against 6.8 us, `qerl bench gemm`).
# The long-K down shapes (56-80 output tiles) need K-slices: as many as fill the two programs per SM of
# one wave, at most 4; 32-row tiles at 24-32 rows (1.00-1.30x), 64-row ones at 33-64 (1.06-1.25x); from 65 rows
# they keep the rule before.
PRODUCER_DECODE_MIN_N = 3584
PRODUCER_DECODE_SPANS = ((24, 32, 32, PRODUCER_MIN_N), (33, 64, 64, PRODUCER_DECODE_MIN_N),
                         (65, 96, 32, PRODUCER_DECODE_MIN_N))
PRODUCER_DECODE_LONG_K_SPANS = ((24, 32, 32), (33, 64, 64))  # N >= PRODUCER_DECODE_MIN_N too
PRODUCER_DECODE_MAX_SPLIT = 4
# The q/k/v and o shapes of Qwen2.5-7B/14B/32B (N >= 3584, <= PRODUCER_NARROW_MAX_WEIGHTS) at 25-32 rows, with x
# handed over already relabeled (no permute, dev/LOG.md section 39): 32-row tiles, 4 stages, three programs per SM,
# and the most K-slices of 4, 2, 1 whose programs fit one wave of them (7B q/k/v, 7B o, 32B o: 4; 32B q/k/v: 2, which
# measured faster than 3 or 4 there). Against the Triton rule at 32 rows: 7B o 8.0 / 9.0 us (1.12x), 7B q/k/v 9.9 /
# 10.1 (1.02x), 32B o 11.4 / 13.6 (1.19x), 32B q/k/v 13.2 / 18.6 (1.41x; 14B has the same shapes). At 24 rows the 32B
# shapes won too (1.14x / 1.28x) but 7B q/k/v lost (10.1 / 9.0), so the span starts at 25. With LoRA the engine's
# expand also sums those <= 4 slices (kernels/lora.EXPAND_SUMS_SLICES_UP_TO), which the Triton rule's 7-10 slices
# are too many for. QERL_FP4_PRODUCER_NARROW=0 keeps the Triton rule there.
PRODUCER_NARROW_SPAN = (25, 32)
PRODUCER_NARROW_MAX_WEIGHTS = 40_000_000
PRODUCER_NARROW_ENV = "QERL_FP4_PRODUCER_NARROW"


def pick_producer_decode_config(m: int, n: int, k: int, num_sms: int = 132) -> ProducerConfig | None:
    """The producer kernel's launch at decode batch sizes (``PRODUCER_DECODE_SPANS`` below ``PRODUCER_LONG_K``,
    ``PRODUCER_DECODE_LONG_K_SPANS`` with K-slices from it, ``PRODUCER_NARROW_SPAN`` with K-slices on the
    q/k/v and o shapes; K a multiple of 256), else None."""
    def launch(block_m: int) -> ProducerConfig:
        return ProducerConfig(block_m, stages=5, warpgroups=1, programs_per_sm=2)

    def sliced(cfg: ProducerConfig) -> ProducerConfig:  # K-slices filling one wave of the programs, at most 4
        tiles = math.ceil(m / cfg.block_m) * math.ceil(n / cfg.block_n)
        return replace(cfg, split_k=max(1, min(PRODUCER_DECODE_MAX_SPLIT, cfg.programs_per_sm * num_sms // tiles)))

    if not fp4_wgmma_producer.supported_problem(k):
        return None
    if k >= PRODUCER_LONG_K and n >= PRODUCER_DECODE_MIN_N:
        for first, last, block_m in PRODUCER_DECODE_LONG_K_SPANS:
            if first <= m <= last:
                return sliced(launch(block_m))
        return None
    for first, last, block_m, min_n in PRODUCER_DECODE_SPANS:
        if first <= m <= last and n >= min_n:
            return launch(block_m)
    if (PRODUCER_NARROW_SPAN[0] <= m <= PRODUCER_NARROW_SPAN[1] and PRODUCER_DECODE_MIN_N <= n
            and n * k <= PRODUCER_NARROW_MAX_WEIGHTS and os.environ.get(PRODUCER_NARROW_ENV, "1") != "0"):
        cfg = ProducerConfig(32, stages=4, producer_registers=24, warpgroups=1, programs_per_sm=3)
        tiles = math.ceil(m / cfg.block_m) * math.ceil(n / cfg.block_n)
        return replace(cfg, split_k=next(s for s in (4, 2, 1) if tiles * s <= cfg.programs_per_sm * num_sms or s == 1))
    return None


def producer_block_m(m: int, n: int, num_sms: int = 132) -> int:
    """The tile height (rows of x) with the most useful work per SM-wave: the rows the tiles cover that are real
    (``m / (tiles_m * b)``) times the share of the last wave of programs that is busy, times
    ``PRODUCER_128_ROW_SPEED`` for 128-row tiles. This reproduces every best height the sweeps found (e.g. 128 rows
    at M = 384 on gate/up and at M = 256-512 on the 7B down shape, 256 rows elsewhere)."""
    def useful(b: int) -> float:
        tiles_m = math.ceil(m / b)
        tiles = tiles_m * math.ceil(n / 128)
        return (m / (tiles_m * b)) * (tiles / (math.ceil(tiles / num_sms) * num_sms)) * \
            (PRODUCER_128_ROW_SPEED if b == 128 else 1.0)
    return 128 if useful(128) > useful(256) else 256


def pick_producer_config(m: int, n: int, k: int, num_sms: int = 132) -> ProducerConfig | None:
    """The producer kernel's launch for an ``[m, k] x [k, n]`` problem where the rule picks it (rows where
    ``pick_config`` would dequantize and call cuBLAS, up to ``PRODUCER_MAX_M`` for N >= ``PRODUCER_MIN_N`` or up to
    ``PRODUCER_LONG_K_MAX_M`` for K >= ``PRODUCER_LONG_K``; K a multiple of 256), else None: the tile height of
    ``producer_block_m`` (256 rows: 3 stages, 128: 4); at decode batch sizes ``pick_producer_decode_config``'s.
    ``QERL_FP4_PRODUCER=0`` turns it off."""
    if os.environ.get(PRODUCER_ENV, "1") == "0":
        return None
    if CUBLAS_MIN_M is None or m < CUBLAS_MIN_M:
        return pick_producer_decode_config(m, n, k, num_sms)
    wide = n >= PRODUCER_MIN_N and m <= PRODUCER_MAX_M
    long_k = k >= PRODUCER_LONG_K and m <= PRODUCER_LONG_K_MAX_M
    if not (wide or long_k) or not fp4_wgmma_producer.supported_problem(k):
        return None
    return ProducerConfig(128, 4) if producer_block_m(m, n, num_sms) == 128 else ProducerConfig()


# The register-A CUDA kernel (kernels/fp4_ra.py: persistent, the part-empty last wave split along K) on the wide gate/up
# shapes (N >= PRODUCER_MIN_N) from RA_MIN_M to RA_MAX_M rows, where the producer kernel ran before: faster in the same
# run on an H200 (dev/LOG.md section 74: 7B gate/up +2-4% at M = 1024 and +8-20% at 2048, fused gate/up
# +2-12%, 32B level to +10%; `qerl bench gemm` with and without it: fp4 time 1.02-1.11x shorter on those rows against
# 0.98-1.06x on the unchanged ones). Also faster there at M = 1024 but not adopted: the long-K down shapes (+10-18%
# against dequantize + cuBLAS) and 32B's fused q/k/v (+8-14%), which lost or tied at 2048 in the bench; q/o, k/v and
# 7B's fused q/k/v were level or slower, and at M = 4096 dequantize + cuBLAS (0.93-1.00x of bf16) beat it (0.84-0.97x).
# Not yet measured on an H100.
RA_MIN_M = 1024
RA_MAX_M = 2048
RA_ENV = "QERL_FP4_RA"  # "0": never pick it (read at each call; default "1")


def pick_ra_config(m: int, n: int, k: int) -> RaConfig | None:
    """The register-A CUDA kernel's launch (``fp4_ra.RaConfig()``: 256 rows of x, 4 stages, split tail) where the rule
    picks it (``RA_MIN_M`` <= m <= ``RA_MAX_M`` and N >= ``PRODUCER_MIN_N``), else None. ``QERL_FP4_RA=0`` turns it
    off."""
    if not RA_MIN_M <= m <= RA_MAX_M or os.environ.get(RA_ENV, "1") == "0" or not fp4_ra.supported_problem(n, k):
        return None
    return RaConfig() if n >= PRODUCER_MIN_N else None


def plan_launch(m: int, n: int, k: int, num_sms: int = 132, *, gluon: bool = False, producer_aligned: bool = False,
                allow_cublas: bool = True, ra: bool = False) -> RaConfig | ProducerConfig | WgmmaConfig | KernelConfig:
    """The launch ``fp4_gemm`` gives an ``[m, k] x [k, n]`` problem that its mma.sync kernel does not take: the
    register-A CUDA kernel's where ``ra`` (it can run here and its weights meet TMA's alignment) and its rule picks it;
    else the producer kernel's or the Gluon kernel's config where ``gluon`` (they can run here and are not turned off)
    and their rules pick them (the producer kernel only where ``producer_aligned``), else ``pick_config``'s."""
    if ra:
        config = pick_ra_config(m, n, k)
        if config is not None:
            return config
    if gluon:
        config = (producer_aligned and pick_producer_config(m, n, k, num_sms)) or pick_wgmma_config(m, n, k, num_sms)
        if config is not None:
            return config
    return pick_config(m, n, k, num_sms, allow_cublas)


def path_name(config: RaConfig | ProducerConfig | WgmmaConfig | KernelConfig) -> str:
    """A launch's kernel as benchmarks label it."""
    if isinstance(config, RaConfig):
        return "cuda-register-a"
    if isinstance(config, ProducerConfig):
        return "gluon-producer"
    if isinstance(config, WgmmaConfig):
        return "gluon-wgmma"
    return "dequant+cublas" if config.cublas else ("fused-fragment" if config.fragment else "fused")

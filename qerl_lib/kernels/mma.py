"""The small-M NVFP4 GEMM as a CUDA kernel on ``mma.sync``, compiled at run time by NVRTC.

Why a second kernel
-------------------
The Triton kernel (``kernels/fp4_gemm.py``) streams the weights at ~55% of copy bandwidth on an
H100 for M <= 16: Hopper's ``wgmma`` wants its B operand (``x``) in shared memory, so every K-step
stages ``x``, waits on a barrier and then on the MMA, with few programs per SM. This kernel streams
the big 32B shapes at 69-81% at M <= 8 (measured on an H100 and an H200; see dev/LOG.md). Marlin's
answer, which plain Triton cannot express, is ``mma.sync``: a warp-synchronous MMA whose operands
all live in registers, so nothing waits but the loads. This module is that design in ~290 lines of
CUDA (``mma.cu``, read it next to this docstring):

* the compressed-tensors bytes are read **in place** (no repacked copy, no extra memory): K is
  relabelled so that each thread's A fragment comes from one 16-byte load per row and chunk of
  128 codes, and ``x`` is permuted the same way in registers (a dot product ignores term order);
* decoding is Marlin's bit trick (docs/nvfp4_format.md section 6) -- one multiply places two
  codes as bf16 -- and the E4M3 block scale is applied exactly by one packed ``mul.rn.bf16x2``,
  as in the Triton kernel;
* loads run ``depth - 1`` chunks ahead in a register ring (the role of Marlin's multi-stage
  ``cp.async`` pipeline), and several warps split K inside a CTA, so many bytes are in flight;
* the kernel is bound by the integer pipe as much as by DRAM, so decoding is cut to two integer
  ops per code pair and the E4M3 scales come from a 256-entry table in shared memory;
* K-slices across CTAs meet through fp32 partials that the *last* CTA of a row block adds (an
  atomic counter), in a fixed order: one launch, deterministic bits;
* it is launched with programmatic dependent launch (``qerl_lib.kernels.pdl``, ``cuLaunchKernelEx``):
  its CTAs may start while the previous kernel runs, build the scale table and load their first
  weights, then ``griddepcontrol.wait`` before reading x; weight loads ask L2 for 128-byte fetches
  (``l2_hint``). Both raise decode throughput (7B on an H200: the hint ~2% tokens/s, PDL on every
  decode kernel ~3%; dev/LOG.md).

Optionally (``mma_linear(lora=)``, off in the engine by default) the same launch also adds a projection
group's LoRA adapters: its first CTAs compute ``x @ A^T`` and the GEMM CTAs add ``xa @ B^T`` in their
epilogue (``mma.cu``, "LoRA"); on an H100 this measured slower than ``kernels/lora.py``'s two launches.
With ``LoraEpilogue(expand=False)`` the launch only makes ``xa`` in those first CTAs, the GEMM CTAs being the
plain kernel's, and ``kernels/lora.py``'s expand follows (its shrink launch saved; dev/LOG.md section 47).

Where we deviate from Marlin (and the paper's vLLM): only M <= 8 comes here (at 9-16 the Triton
kernel is as fast; a build for up to 64 rows ran 1.5-2x slower than it at 32-64, x waiting on L1 in
the inner loop; dev/LOG.md section 26); no offline repack (Marlin permutes weights into its fragment
order at load time; we relabel K instead, keeping the checkpoint layout and memory); E4M3-subnormal scales are
kept (Marlin flushes them); register prefetch instead of a ``cp.async`` ring (measured slower: the
shared-memory round trip costs more issue slots than it saves).

Compilation: NVRTC (the ``libnvrtc`` that CUDA builds of PyTorch ship) turns the source into a
cubin for the GPU's architecture the first time a launch shape is used; ``cuModuleLoadData`` and
``cuLaunchKernel`` (driver API through ``ctypes``) run it on PyTorch's current stream, so it is
captured by CUDA graphs like any kernel. It needs sm_90 (Hopper) or newer (``mul.rn.bf16x2``);
``available()`` says whether this machine can run it, and ``kernels/fp4_gemm.py`` falls back to
Triton.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import glob
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from qerl_lib.kernels import pdl as pdl_switch

SOURCE_PATH = Path(__file__).with_name("mma.cu")
# files the .cu sources include, handed to NVRTC by name (compile_cubin)
HEADERS = ("mma_lora.cuh", "fp4_device.cuh", "fp4_ra_backward.cuh")
MIN_CAPABILITY = (9, 0)
CHUNK = 128  # codes per row per load step; K must be a multiple
MAX_M = 16
AUTO_MAX_M = 8  # fp4_gemm sends M <= 8 here; at 9-16 the Triton kernel measured as fast or faster
SMEM_LIMIT = 48 * 1024  # static shared memory per CTA


@dataclass(frozen=True)
class MmaConfig:
    """One launch shape of the mma.sync kernel.

    ``tiles``: m16 tiles of rows per warp; ``warps_r`` x ``warps_k``: warps per CTA along rows
    and along K (their partials meet in shared memory); ``depth``: chunks in the register ring
    (``depth - 1`` loads ahead); ``split_k``: K-slices across CTAs (1 = no partials);
    ``min_ctas``: resident CTAs per SM the compiler must allow (caps registers; 1 = no cap);
    ``l2_hint``: L2 fetch size of the weight loads on a miss (0 = the hardware's default, 1 = 128 B,
    2 = 256 B); the launch rule uses 1 everywhere, the default here;
    ``prefetch``: chunks (of each warp's own, after the ring's) prefetched into L2 before the
    kernel waits on the previous one (programmatic dependent launch); the launch rule uses 0 (none),
    the default here: prefetching measured slower in the engine (dev/LOG.md).
    Neither ``l2_hint`` nor ``prefetch`` changes the result bits, only the speed.
    """

    tiles: int = 2
    warps_r: int = 1
    warps_k: int = 8
    depth: int = 2
    split_k: int = 1
    min_ctas: int = 2
    prefetch: int = 0
    l2_hint: int = 1

    def __post_init__(self):
        for name, lo, hi in (("tiles", 1, 4), ("warps_r", 1, 8), ("warps_k", 1, 8), ("depth", 2, 4), ("split_k", 1, 64),
                               ("min_ctas", 1, 8), ("prefetch", 0, 16), ("l2_hint", 0, 2)):
            v = getattr(self, name)
            if not isinstance(v, int) or not lo <= v <= hi:
                raise ValueError(f"MmaConfig.{name} must be an int in [{lo}, {hi}], got {v!r}")
        if self.warps_r * self.warps_k > 16:
            raise ValueError(f"MmaConfig: warps_r * warps_k = {self.warps_r * self.warps_k} > 16 warps per CTA")
        self.check_shared(1)

    def check_shared(self, nb: int, lora_r: int = 0, lora_expand: bool = True) -> None:
        need = self.shared_bytes(nb, lora_r, lora_expand)
        if need > SMEM_LIMIT:
            raise ValueError(f"MmaConfig: {need} B of shared memory per CTA for M <= {8 * nb} > {SMEM_LIMIT}; "
                             "lower depth, tiles or warps")

    @property
    def rows_per_cta(self) -> int:
        return 16 * self.tiles * self.warps_r

    @property
    def threads(self) -> int:
        return 32 * self.warps_r * self.warps_k

    def shared_bytes(self, nb: int, lora_r: int = 0, lora_expand: bool = True) -> int:
        """Static shared memory of one CTA: the per-warp partial sums, the scale table, and a LoRA
        epilogue's ``xa`` rows (none where the launch only makes ``xa``: ``lora_expand=False``)."""
        lora = (8 * nb * lora_r * 4 if lora_expand else 0) + 8 if lora_r else 0  # xa rows, ticket, last-slice flag
        return self.warps_k * 8 * nb * (self.rows_per_cta + 4) * 4 + 256 * 4 + 16 + lora


# Gate/up-shaped launch shapes, in order of preference, each with the CTAs per SM it runs at
# (registers as NVRTC 13 allocates them for sm_90, checked by a test; threads and shared memory
# allow more). 48-row CTAs of 4 warps, three per SM, beat 8-warp CTAs of 64 rows (7B) and 128 rows
# (32B) on the gate/up at M = 8 (measured on an H200: 28.0 vs 30.2 us and 53.6 vs 57.5 us); four
# per SM (128 registers) where that fills the waves better, as on the 3B gate/up (dev/LOG.md).
WIDE_SHAPES: tuple[tuple[MmaConfig, int], ...] = (
    (MmaConfig(tiles=3, warps_r=1, warps_k=4, depth=2, split_k=1, min_ctas=3), 3),
    (MmaConfig(tiles=3, warps_r=1, warps_k=4, depth=2, split_k=1, min_ctas=4), 4),
    (MmaConfig(tiles=2, warps_r=2, warps_k=4, depth=2, split_k=1, min_ctas=2), 2),
    (MmaConfig(tiles=2, warps_r=1, warps_k=8, depth=2, split_k=1, min_ctas=2), 2),
)
DEFAULT_SMS = 132  # H100 SXM and H200; the rule asks the current GPU when there is one


def wave_fill(ctas: int, slots: int) -> float:
    """Busy fraction of the CTA slots over a launch of ``ctas`` CTAs on ``slots`` resident slots:
    1.0 when the CTAs fill whole waves, 0.58 for 459 CTAs on 396 slots (a second wave 16% full)."""
    return ctas / (math.ceil(ctas / slots) * slots)


@functools.lru_cache(maxsize=None)
def _device_sms(index: int | None = None) -> int:
    """SMs of CUDA device ``index`` (default: the current one); ``DEFAULT_SMS`` without a GPU."""
    if not torch.cuda.is_available():
        return DEFAULT_SMS
    device = torch.cuda.current_device() if index is None else index
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def pick_mma_config(m: int, n: int, k: int, sms: int | None = None) -> MmaConfig:
    """Launch shape for ``[m, k] x [k, n]`` on a GPU of ``sms`` SMs (default: the current one): a
    fixed rule from sweeps on the Qwen2.5 7B/32B decode shapes on an H100 and an H200 (dev/LOG.md;
    no autotuning, so a problem always runs the same kernel and gives the same bits):

    * default: 32-row CTAs of 8 warps that split K (``tiles=2, warps_k=8``), at most 128
      registers (``min_ctas=2``): best or within 5% on every q/k/v and o shape;
    * deep (K >= 4N, down): the same, with K-slices that leave each warp about 8 chunks (more
      slices starve the register ring: a warp with 1-2 chunks has nothing to prefetch; an
      occupancy-driven split rule measured 1.2-2.3x slower);
    * wide (N >= 8K, gate/up): the first of ``WIDE_SHAPES`` whose CTAs fill the GPU's resident
      slots within 5% as well as the best-filling one does (``wave_fill``). A part-empty last wave
      costs nearly a full wave's time: 7B's 592 CTAs of 64 rows on 264 slots are 2.24 waves,
      its 790 CTAs of 48 rows on 396 slots 1.99 (7% faster alone, ~4% more tokens/s in the engine
      on an H200; 32B ~2%). Of 9 shapes timed on the 3B, 7B and 32B gate/up, the rule picks the
      fastest on each;
    * every shape: weight loads ask L2 for 128-byte fetches (``l2_hint=1``, the ``MmaConfig``
      default; 1-7% faster on all eight 7B/32B shapes on an H200, most on gate/up and down; 256 B
      gained less).
    """
    chunks = k // CHUNK
    if n >= 8 * k:
        sms = sms or _device_sms()
        fills = [wave_fill(math.ceil(n / cfg.rows_per_cta), per_sm * sms) for cfg, per_sm in WIDE_SHAPES]
        best = max(fills)
        return next(cfg for (cfg, _), fill in zip(WIDE_SHAPES, fills) if fill >= best - 0.05)
    split = min(64, max(1, chunks // 64)) if k >= 4 * n else 1
    return MmaConfig(tiles=2, warps_r=1, warps_k=8, depth=2, split_k=split, min_ctas=2)


# ============================================================================ availability
def supported_problem(m: int, k: int) -> bool:
    """Shapes this kernel takes: 1 <= M <= 16 and K a multiple of 128."""
    return 1 <= m <= MAX_M and k % CHUNK == 0


@functools.lru_cache(maxsize=None)
def available(device_index: int = 0) -> bool:
    """True when a CUDA device of compute capability >= 9.0 is present and NVRTC + the driver
    library load (the kernel is then compiled on first use)."""
    return unavailable_reason(device_index) is None


@functools.lru_cache(maxsize=None)
def unavailable_reason(device_index: int = 0) -> str | None:
    """Why ``available`` is False (one line), or None."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability(device_index)
    if cap < MIN_CAPABILITY:
        return f"compute capability {cap[0]}.{cap[1]} < 9.0 (mul.rn.bf16x2 needs Hopper or newer)"
    try:
        _nvrtc()
        _driver()
    except OSError as err:
        return str(err)
    return None


# ============================================================================ NVRTC + driver
@functools.lru_cache(maxsize=None)
def _nvrtc() -> ctypes.CDLL:
    """libnvrtc: PyTorch's own (CUDA wheels ship it), else ``QERL_NVRTC`` or the system one."""
    try:
        from torch.cuda._utils import _get_nvrtc_library  # private, but the best-matched copy
        return _get_nvrtc_library()
    except Exception:  # noqa: BLE001 - any failure means: look elsewhere
        pass
    names = [os.environ.get("QERL_NVRTC", "")] + _pip_nvrtc() + \
        ["libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12", ctypes.util.find_library("nvrtc") or ""]
    for name in filter(None, names):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("libnvrtc not found: install a CUDA build of PyTorch (it ships NVRTC) or set QERL_NVRTC=/path/libnvrtc.so")


def _pip_nvrtc() -> list[str]:
    """libnvrtc from the ``nvidia-cuda-nvrtc`` wheel (requirements.txt installs it on CPU machines,
    so tests can compile the kernel for sm_90 without a GPU)."""
    try:
        import nvidia  # namespace package of NVIDIA's CUDA wheels
    except ImportError:
        return []
    found = []
    for base in getattr(nvidia, "__path__", []):
        for pattern in ("cu13/lib/libnvrtc.so.*", "cuda_nvrtc/lib/libnvrtc.so.*", "cu12/lib/libnvrtc.so.*"):
            found += sorted(glob.glob(os.path.join(base, pattern)))
    return found


@functools.lru_cache(maxsize=None)
def _driver() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        raise OSError(f"CUDA driver library libcuda.so.1 not loadable: {err}") from err


def kernel_name(cfg: MmaConfig, nb: int, lora_r: int = 0, lora_expand: bool = True, lora_given: bool = False) -> str:
    extra = (f"_p{cfg.prefetch}" if cfg.prefetch else "") + (f"_h{cfg.l2_hint}" if cfg.l2_hint else "")
    extra += (f"_l{lora_r}" + ("" if lora_expand else "s") + ("g" if lora_given else "")) if lora_r else ""
    return f"qerl_fp4_mma_t{cfg.tiles}_r{cfg.warps_r}_k{cfg.warps_k}_n{nb}_d{cfg.depth}_o{cfg.min_ctas}{extra}"


def kernel_source(cfg: MmaConfig, nb: int, lora_r: int = 0, lora_expand: bool = True, lora_given: bool = False) -> str:
    """The CUDA source for one launch shape (``nb`` n8 blocks: 1 for M <= 8, 2 for M <= 16; ``lora_r``:
    the stacked rank of a LoRA epilogue, 0 for none; ``lora_expand=False``: the launch only makes ``xa``;
    ``lora_given``: the epilogue adds the adapters to an ``xa`` an earlier kernel wrote, no LoRA CTAs)."""
    defines = (f"#define T_TILES {cfg.tiles}\n#define WARPS_R {cfg.warps_r}\n#define WARPS_K {cfg.warps_k}\n"
               f"#define NB {nb}\n#define DEPTH {cfg.depth}\n#define MIN_CTAS {cfg.min_ctas}\n"
               f"#define PREFETCH {cfg.prefetch}\n#define L2_HINT {cfg.l2_hint}\n#define LORA_R {lora_r}\n"
               f"#define LORA_EXPAND {int(lora_expand)}\n#define LORA_GIVEN {int(lora_given)}\n"
               f"#define LORA_MAX_SLICES {LORA_SLICES}\n"
               f"#define KERNEL_NAME {kernel_name(cfg, nb, lora_r, lora_expand, lora_given)}\n")
    return defines + SOURCE_PATH.read_text()


LORA_MAX_R = 384  # stacked ranks of a LoRA epilogue: three members of rank 128
LORA_SLICES = 16  # the most K-slices (of 512 columns or a multiple) of the LoRA CTAs, each with 16 ranks


@dataclass(frozen=True)
class LoraEpilogue:
    """A projection group's adapters, added by the GEMM itself (``mma.cu``, "LoRA"): ``out[:, n0:n1] +=
    scale * bf16(x @ A^T)[:, r0:r0 + rank] @ B[n0:n1]^T`` per member. ``a_cat``: bf16 ``[R, K]``
    contiguous; ``b_cat``: bf16 ``[N, RP]`` contiguous, zero past each member's rank; ``bounds``: int32
    ``[members, 4]`` = (n0, n1, r0, rank); ``scale``: float32 ``[members]``; ``sync``: int32 ``[4 + R / 16]``
    or more, zero between launches (the kernel resets it). ``kernels.lora.GroupPlan.epilogue()`` builds one.

    ``expand=False``: the launch only makes ``xa = bf16(x @ A^T)`` (as float32 values) into ``workspace``
    (float32, at least ``workspace_numel(8, R)`` elements), read back with ``xa(m, k)``; the output is the
    plain GEMM's, and the caller adds ``xa @ B^T`` (``kernels/lora.given_xa`` then ``expand_``).

    ``given``: ``xa [>= m, R]`` float32 (bf16 values), contiguous, written by an earlier kernel of the stream (the
    norm before the group, ``engine/glue.py``): the launch has no LoRA CTAs and only adds ``xa @ B^T`` per member
    in its epilogue, which reads ``xa`` after the launch's wait for the previous kernel."""

    a_cat: torch.Tensor
    b_cat: torch.Tensor
    bounds: torch.Tensor
    scale: torch.Tensor
    sync: torch.Tensor
    expand: bool = True
    workspace: torch.Tensor | None = None
    given: torch.Tensor | None = None

    @staticmethod
    def slices(k: int) -> tuple[int, int]:
        """``(K-slices of the LoRA CTAs, columns per slice)`` at reduction length ``k``."""
        per_slice = 512 * math.ceil(k / (512 * LORA_SLICES))
        return math.ceil(k / per_slice), per_slice

    @staticmethod
    def workspace_numel(m: int, r: int) -> int:
        """Float32 elements of the LoRA CTAs' partials and summed ``xa`` at ``m`` rows, ``r`` stacked ranks."""
        return (LORA_SLICES + 1) * m * r

    def partials(self, m: int, k: int) -> torch.Tensor:
        """``[slices + 1, m, R]`` float32: the LoRA CTAs' K-slice partials, then the summed ``xa``."""
        slices, r = self.slices(k)[0], self.a_cat.shape[0]
        if self.workspace is None:
            return torch.empty(slices + 1, m, r, dtype=torch.float32, device=self.a_cat.device)
        return self.workspace[:(slices + 1) * m * r].view(slices + 1, m, r)

    def xa(self, m: int, k: int) -> torch.Tensor:
        """``[m, R]``: the ``xa`` that an ``expand=False`` launch of ``m`` rows wrote (float32 holding bf16 values)."""
        return self.partials(m, k)[-1]

    def supported(self, m: int, k: int) -> bool:
        a, b = self.a_cat, self.b_cat
        return (m <= 8 and a.dtype == b.dtype == torch.bfloat16 and a.is_contiguous() and b.is_contiguous()
                and a.shape[1] == k and 1 <= a.shape[0] <= LORA_MAX_R and b.shape[1] % 8 == 0
                and self.sync.numel() >= 4 + math.ceil(a.shape[0] / 16)
                and (self.expand or (self.workspace is not None and self.workspace.dtype == torch.float32
                                     and self.workspace.numel() >= self.workspace_numel(m, a.shape[0])))
                and (self.given is None or (self.expand and self.given.dtype == torch.float32
                                            and self.given.is_contiguous() and self.given.dim() == 2
                                            and self.given.shape[0] >= m and self.given.shape[1] == a.shape[0])))


def compile_cubin(source: str, name: str, arch: str, lib: ctypes.CDLL | None = None, options: tuple[str, ...] = (),
                  log: list[str] | None = None) -> bytes:
    """NVRTC: CUDA source -> cubin for ``arch`` (e.g. ``"sm_90"``), with ``HEADERS`` available to its ``#include``s.
    ``options``: extra NVRTC options (e.g. ``"--ptxas-options=-v"``); ``log``: a list that receives the compiler's log
    on success. Raises with the log on failure."""
    lib = lib or _nvrtc()
    prog = ctypes.c_void_p()
    texts = [SOURCE_PATH.with_name(h).read_text().encode() for h in HEADERS]
    headers = (ctypes.c_char_p * len(HEADERS))(*texts)
    names = (ctypes.c_char_p * len(HEADERS))(*(h.encode() for h in HEADERS))
    _nvrtc_check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(),
                                             len(HEADERS), headers, names))
    try:
        opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", b"-lineinfo", *(o.encode() for o in options)]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        res = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        text = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, text)
        if res != 0:
            raise RuntimeError(f"NVRTC could not compile {name} for {arch}:\n{text.value.decode(errors='replace')}")
        if log is not None:
            log.append(text.value.decode(errors="replace"))
        size = ctypes.c_size_t()
        _nvrtc_check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)))
        buf = ctypes.create_string_buffer(size.value)
        _nvrtc_check(lib, lib.nvrtcGetCUBIN(prog, buf))
        return buf.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvrtc_check(lib: ctypes.CDLL, res: int) -> None:
    if res != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        raise RuntimeError(f"NVRTC error {res}: {lib.nvrtcGetErrorString(res).decode()}")


def _cu_check(res: int, what: str) -> None:
    if res != 0:
        msg = ctypes.c_char_p()
        _driver().cuGetErrorString(res, ctypes.byref(msg))
        raise RuntimeError(f"CUDA driver error {res} in {what}: {(msg.value or b'?').decode()}")


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: id, 4 bytes of padding, a 64-byte value union
    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int), ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_bytes", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_DEFAULT_SHARED_LIMIT = 48 * 1024  # dynamic shared memory a kernel gets without opting in


class _Kernel:
    """A loaded cubin function and a lean launcher on PyTorch's current stream; ``shared_bytes``: the dynamic
    shared memory of every launch (opted in past 48 KB)."""

    def __init__(self, cubin: bytes, name: str, shared_bytes: int = 0):
        drv = _driver()
        self._module = ctypes.c_void_p()
        _cu_check(drv.cuModuleLoadData(ctypes.byref(self._module), cubin), "cuModuleLoadData")
        self._func = ctypes.c_void_p()
        _cu_check(drv.cuModuleGetFunction(ctypes.byref(self._func), self._module, name.encode()), "cuModuleGetFunction")
        if shared_bytes > _DEFAULT_SHARED_LIMIT:
            _cu_check(drv.cuFuncSetAttribute(self._func, _MAX_DYNAMIC_SHARED_SIZE_BYTES, shared_bytes),
                      "cuFuncSetAttribute")
        self.shared_bytes = shared_bytes
        self._launch = drv.cuLaunchKernel
        self._launch_ex = drv.cuLaunchKernelEx

    def ctas_per_sm(self, threads: int) -> int:
        """Resident CTAs per SM for this kernel (driver occupancy calculator)."""
        n = ctypes.c_int()
        _cu_check(_driver().cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(n), self._func, threads, 0),
                  "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        return n.value

    def __call__(self, grid: tuple[int, int], threads: int, args: list, pdl: bool = False) -> None:
        """Launch; ``args``: tensors (their pointers), None (a null pointer), ints, or ctypes arrays passed by
        value (a ``CUtensorMap``); ``pdl``: programmatic dependent launch (the CTAs may start while the previous
        kernel in the stream runs, and wait for it in the kernel before touching its outputs)."""
        vals = [ctypes.c_void_p(a.data_ptr()) if isinstance(a, torch.Tensor) else
                ctypes.c_void_p(0) if a is None else a if isinstance(a, ctypes.Array) else ctypes.c_int(a) for a in args]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        if not pdl:
            _cu_check(self._launch(self._func, grid[0], grid[1], 1, threads, 1, 1, self.shared_bytes, stream, params,
                                   None), "cuLaunchKernel")
            return
        attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        config = _LaunchConfig(grid[0], grid[1], 1, threads, 1, 1, self.shared_bytes, stream, ctypes.pointer(attr), 1)
        _cu_check(self._launch_ex(ctypes.byref(config), self._func, params, None), "cuLaunchKernelEx")


_KERNELS: dict[tuple, _Kernel] = {}
_COUNTERS: dict[int, torch.Tensor] = {}
_LOCK = threading.Lock()


def _get_kernel(cfg: MmaConfig, nb: int, device: torch.device, lora_r: int = 0, lora_expand: bool = True,
                lora_given: bool = False) -> _Kernel:
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, cfg.tiles, cfg.warps_r, cfg.warps_k, cfg.depth, cfg.min_ctas, cfg.prefetch, cfg.l2_hint, nb, lora_r,
           lora_expand, lora_given)
    kern = _KERNELS.get(key)
    if kern is None:
        name = kernel_name(cfg, nb, lora_r, lora_expand, lora_given)
        arch = "sm_%d%d" % torch.cuda.get_device_capability(index)
        kern = load_kernel(key, index, lambda: compile_cubin(kernel_source(cfg, nb, lora_r, lora_expand, lora_given),
                                                             name, arch), name)
    return kern


def load_kernel(key: tuple, index: int, build: Callable[[], bytes], name: str, shared_bytes: int = 0,
                caller: str = "mma_linear") -> _Kernel:
    """The kernel cached under ``key``, else ``build()``'s cubin loaded on CUDA device ``index`` (compiled once per
    process; the first use of a launch shape may not happen inside CUDA-graph capture)."""
    kern = _KERNELS.get(key)
    if kern is None:
        with _LOCK, torch.cuda.device(index):
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"{caller}: first use of a launch shape inside CUDA-graph capture; "
                                   "run the call once before capturing (warm-up)")
            cubin = build()
            torch.cuda.synchronize(index)  # makes PyTorch's primary context current on this thread
            kern = _KERNELS[key] = _Kernel(cubin, name, shared_bytes)
    return kern


def ctas_per_sm(cfg: MmaConfig, nb: int, device: torch.device) -> int:
    """Resident CTAs per SM of launch shape ``cfg`` (``nb`` n8 blocks: 1 for M <= 8, 2 for M <= 16)
    on ``device``, from the driver's occupancy calculator (compiles the shape on first use)."""
    cfg.check_shared(nb)
    return _get_kernel(cfg, nb, device).ctas_per_sm(cfg.threads)


def _counters(device: torch.device, blocks: int) -> torch.Tensor:
    """Arrival counters for K-slices (mma.cu) and split tiles (fp4_ra.cu); zero between launches (the kernels
    reset them)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    buf = _COUNTERS.get(index)
    if buf is None or buf.numel() < blocks:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("NVFP4 arrival counters (mma_linear's K-slices, fp4_ra's split tiles) would have to "
                               "grow inside CUDA-graph capture; run the call once before capturing (warm-up)")
        buf = _COUNTERS[index] = torch.zeros(max(blocks, 4096), dtype=torch.int32, device=device)
    return buf


# ============================================================================ launch

def mma_linear(x2: torch.Tensor, words: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor,
               bias: torch.Tensor | None, out: torch.Tensor, config: MmaConfig | None = None,
               pdl: bool | None = None, lora: LoraEpilogue | None = None) -> torch.Tensor:
    """``out[m, n] = bf16(x2 @ W.T * 2^8/gs ...)`` (+ bias) for bf16 ``x2 [m, k]`` (unit column stride), ``m <= 16``.

    ``words``: int32 ``[N, K/8]``, ``scales``: uint8 ``[N, K/16]`` (the compressed-tensors bytes),
    ``out``: bf16 ``[m, N]`` contiguous. Validation of dtypes/shapes is ``fp4_gemm``'s job; this
    checks only what the kernel itself assumes. K-sliced launches share one arrival-counter buffer
    per device: run them on one stream at a time (the engine and the benchmarks do). ``lora``: the
    group's adapters added in the same launch (``LoraEpilogue``; M <= 8), or with ``expand=False`` only
    their ``xa`` (``lora.xa(m, k)`` after the call); its ``sync`` counters must not be shared by two launches
    in flight at once.
    """
    m, k = x2.shape
    n = words.shape[0]
    if not supported_problem(m, k):
        raise ValueError(f"mma_linear takes 1 <= M <= {MAX_M} and K % {CHUNK} == 0, got M={m}, K={k}")
    if x2.stride(1) != 1 or (m > 1 and x2.stride(0) % 8) or x2.data_ptr() % 16 or words.data_ptr() % 16 \
            or scales.data_ptr() % 2:
        raise ValueError("mma_linear needs 16-byte aligned x rows (stride % 8 == 0) and weights, 2-byte aligned scales")
    nb = 1 if m <= 8 else 2
    if lora is not None and (not lora.supported(m, k) or lora.b_cat.shape[0] != n):
        raise ValueError(f"mma_linear: this LoRA epilogue needs M <= 8, bf16 contiguous A [R <= {LORA_MAX_R}, K = {k}] "
                         f"and B [N = {n}, RP % 8 == 0]; take kernels/lora.py's path instead")
    lora_r = lora.a_cat.shape[0] if lora is not None else 0
    lora_expand = lora is None or lora.expand
    lora_given = lora is not None and lora.given is not None
    cfg = config or pick_mma_config(m, n, k, _device_sms(x2.device.index))
    cfg.check_shared(nb, lora_r, lora_expand)
    kern = _get_kernel(cfg, nb, x2.device, lora_r, lora_expand, lora_given)
    blocks = math.ceil(n / cfg.rows_per_cta)
    chunks = k // CHUNK
    per_split = math.ceil(chunks / cfg.split_k)
    split = math.ceil(chunks / per_split)
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x2.device) if split > 1 else out
    counters = _counters(x2.device, blocks)
    lora_args: list = [None, None, None, None, None, None, 0, 0, 0, 0]
    grid = (blocks, split)
    if lora_given:  # the plain grid: the epilogue reads the given xa (no LoRA CTAs, no counters)
        lora_args = [lora.a_cat, lora.b_cat, lora.given, lora.sync, lora.bounds, lora.scale, lora.bounds.shape[0], 0, 0,
                     lora.b_cat.shape[1]]
    elif lora is not None:
        slices, k_per_slice = lora.slices(k)
        partials = lora.partials(m, k)  # + the summed xa
        lora_args = [lora.a_cat, lora.b_cat, partials, lora.sync, lora.bounds, lora.scale, lora.bounds.shape[0], slices,
                     k_per_slice, lora.b_cat.shape[1]]
        # 1-D: the LoRA CTAs (K-slices x blocks of 16 ranks) first; with the epilogue the kernel hands out roles
        # by ticket, without it by blockIdx.x
        grid = (slices * math.ceil(lora_r / 16) + blocks * split, 1)
    kern(grid, cfg.threads,
         [x2, words, scales, global_scale, bias, out, ws, counters, m, n, k, x2.stride(0), out.stride(0), per_split,
          blocks, split, *lora_args],
         pdl=pdl_switch.use_for(x2.device) if pdl is None else pdl)
    return out

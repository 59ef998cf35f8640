"""The CUDA mma.sync NVFP4 kernel (qerl_lib/kernels/mma.{py,cu}).

Without a GPU we check what the kernel's correctness rests on, with a bit-level NumPy emulator
that follows kernels/mma.cu line by line (the same integer formulas, the same K relabelling,
the PTX fragment layouts of mma.m16n8k16 and prmt): every E4M3 scale and every code pair decodes
exactly, and the emulated GEMM matches the plain-torch oracle. NVRTC compiles the source for
sm_90 when a libnvrtc is found. On a Hopper GPU the real kernel runs against the oracle.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from qerl_lib.kernels import mma
from qerl_lib.kernels.fp4_gemm import fp4_linear, prepare_fp4_weights, resolve_small_m_backend, uses_mma
from qerl_lib.quant.nvfp4 import dequantize, quantize, reference_matmul
from tests.conftest import nvrtc_or_none

HAS_MMA = mma.available() if torch.cuda.is_available() else False


# ============================================================================ bit-level emulator
def f32_bits_to_float(bits: np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def bf16_half_to_float(h: np.ndarray) -> np.ndarray:
    return f32_bits_to_float(np.asarray(h, dtype=np.uint32) << np.uint32(16))


def round_to_bf16_bits(v: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits, round to nearest even (cvt.rn.bf16.f32; no NaNs here)."""
    u = np.asarray(v, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return rounded.astype(np.uint32)


def scale_bits(b: np.ndarray) -> np.ndarray:
    """mma.cu scale_bits: E4M3 byte -> bf16 bits of s * 2^118."""
    b = np.asarray(b, dtype=np.uint32)
    mag = b & 0x7F
    normal = (mag << 4) + 0x7700
    sub = (mag.astype(np.float32) * np.float32(2.0 ** 109)).view(np.uint32) >> 16
    return np.where(mag >= 8, normal, sub) | ((b & 0x80) << 8)


def code_pair(v: np.ndarray, i: int) -> np.ndarray:
    """mma.cu code_pair (uint32 arithmetic wraps like the GPU's)."""
    v = np.asarray(v, dtype=np.uint32)
    return (((v >> np.uint32(4 * i)) & np.uint32(0x000F000F)) * np.uint32(0x1040)) & np.uint32(0x81C081C0)


def code_pair_even(v: np.ndarray) -> np.ndarray:
    """mma.cu code_pair_even: codes (0, 4) of v, masked in place."""
    v = np.asarray(v, dtype=np.uint32)
    return ((v & np.uint32(0x000F000F)) * np.uint32(0x1040)) & np.uint32(0x81C081C0)


def code_pair_odd(v: np.ndarray) -> np.ndarray:
    """mma.cu code_pair_odd: codes (1, 5) of v; the multiplier absorbs nibble 1's offset."""
    v = np.asarray(v, dtype=np.uint32)
    return ((v & np.uint32(0x00F000F0)) * np.uint32(0x104)) & np.uint32(0x81C081C0)


def mul_bf16x2(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """mul.rn.bf16x2, asserting the product is exact (the kernel's claim: fp4 * s fits bf16)."""
    out = np.zeros_like(a, dtype=np.uint32)
    for shift in (0, 16):
        x = bf16_half_to_float((a >> shift) & 0xFFFF)
        y = bf16_half_to_float((b >> shift) & 0xFFFF)
        p = (x.astype(np.float64) * y.astype(np.float64)).astype(np.float32)
        assert np.all((p.view(np.uint32) & 0xFFFF) == 0) and np.all(p.astype(np.float64) == x.astype(np.float64) * y), \
            "bf16 product not exact"
        out |= (p.view(np.uint32) >> 16) << shift
    return out


def prmt(a: np.ndarray, b: np.ndarray, sel: int) -> np.ndarray:
    pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    out = np.zeros_like(a, dtype=np.uint32)
    for j in range(4):
        out |= pool[(sel >> (4 * j)) & 0x7] << (8 * j)
    return out


def mma_m16n8k16(acc: np.ndarray, a: list, b: list) -> None:
    """acc[32 lanes, 4] += A @ B with the PTX fragment layouts (float64 stands in for fp32)."""
    g, t = np.arange(32) // 4, np.arange(32) % 4
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for reg, (dr, dc) in enumerate(((0, 0), (8, 0), (0, 8), (8, 8))):
        for half in (0, 1):
            A[g + dr, 2 * t + dc + half] = bf16_half_to_float((a[reg] >> (16 * half)) & 0xFFFF)
    for reg, dk in enumerate((0, 8)):
        for half in (0, 1):
            B[2 * t + dk + half, g] = bf16_half_to_float((b[reg] >> (16 * half)) & 0xFFFF)
    C = A @ B
    for q, (dr, dc) in enumerate(((0, 0), (0, 1), (8, 0), (8, 1))):
        acc[:, q] += C[g + dr, 2 * t + dc]


def emulate(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor,
            cfg: mma.MmaConfig) -> np.ndarray:
    """The kernel's result (bf16 bits [M, N]) computed the kernel's way: per CTA, K-slice, warp,
    chunk, word and step, from the raw bytes. Rows past N are clamped as in the kernel."""
    m, k = x.shape
    n = packed.shape[0]
    words = packed.contiguous().view(torch.int32).numpy().view(np.uint32)
    sc = scale.contiguous().view(torch.uint8).numpy().astype(np.uint32)
    xb = x.contiguous().view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    xb = np.concatenate([xb, np.zeros((16 - m, k), np.uint32)])  # tokens >= M read as zero
    xw = xb[:, 0::2] | (xb[:, 1::2] << 16)  # u32 words: 2 bf16 each
    g, t = np.arange(32) // 4, np.arange(32) % 4
    nb_count = 1 if m <= 8 else 2
    chunks = k // mma.CHUNK
    per_split = math.ceil(chunks / cfg.split_k)
    split = math.ceil(chunks / per_split)
    rows_cta = cfg.rows_per_cta
    result = np.zeros((m, n), np.float64)
    for bx in range(math.ceil(n / rows_cta)):
        total = np.zeros((rows_cta, 16))
        for by in range(split):
            c_begin, c_end = by * per_split, min(by * per_split + per_split, chunks)
            part = np.zeros((rows_cta, 16))
            for wr in range(cfg.warps_r):
                for wk in range(cfg.warps_k):
                    n_mine = (c_end - c_begin - wk + cfg.warps_k - 1) // cfg.warps_k if c_end - c_begin > wk else 0
                    for i in range(cfg.tiles):
                        base = bx * rows_cta + wr * 16 * cfg.tiles + i * 16
                        rows = [np.minimum(base + g + 8 * h, n - 1) for h in (0, 1)]
                        acc = np.zeros((nb_count, 32, 4))
                        for j in range(n_mine):
                            c = c_begin + wk + j * cfg.warps_k
                            pair = [sc[r, c * 8 + 2 * t] | (sc[r, c * 8 + 2 * t + 1] << 8) for r in rows]
                            s2 = [[(lambda s: s | (s << 16))(scale_bits((pr >> (8 * grp)) & 0xFF)) for grp in (0, 1)]
                                  for pr in pair]
                            for w in range(4):
                                b = []
                                for nb in range(nb_count):
                                    tok = nb * 8 + g
                                    u = [xw[tok, (c * 128 + 32 * t + 8 * w) // 2 + e] for e in range(4)]
                                    b.append([[prmt(u[0], u[2], 0x5410), prmt(u[0], u[2], 0x7632)],
                                              [prmt(u[1], u[3], 0x5410), prmt(u[1], u[3], 0x7632)]])
                                v0 = words[rows[0], c * 16 + 4 * t + w]
                                v1 = words[rows[1], c * 16 + 4 * t + w]
                                sg, sg8 = s2[0][w >> 1], s2[1][w >> 1]
                                for p in (0, 1):  # as the kernel: pairs (2p, 2p+4), (2p+1, 2p+5)
                                    u0, u1 = (v0 >> 8, v1 >> 8) if p else (v0, v1)
                                    a = [mul_bf16x2(code_pair_even(u0), sg), mul_bf16x2(code_pair_even(u1), sg8),
                                         mul_bf16x2(code_pair_odd(u0), sg), mul_bf16x2(code_pair_odd(u1), sg8)]
                                    for nb in range(nb_count):
                                        mma_m16n8k16(acc[nb], a, b[nb][p])
                        for nb in range(nb_count):
                            for q in range(4):
                                rl = wr * 16 * cfg.tiles + i * 16 + g + (8 if q >= 2 else 0)
                                part[rl, nb * 8 + 2 * t + (q & 1)] += acc[nb, :, q]
            total += part
        rows = np.arange(bx * rows_cta, min(n, (bx + 1) * rows_cta))
        result[:, rows] = total[: len(rows), :m].T
    factor = np.float32(256.0) / gs.numpy().astype(np.float32)[0]
    return round_to_bf16_bits(result.astype(np.float32) * factor)


# ============================================================================ CPU tests
def test_scale_bits_is_exact_for_every_e4m3_byte():
    codes = np.array([b for b in range(256) if b & 0x7F != 0x7F])  # 0x7F / 0xFF are NaN
    want = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).float() * 2.0 ** 118
    want_bits = want.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert torch.equal(want.to(torch.bfloat16).float(), want), "s * 2^118 must be exact in bf16"
    np.testing.assert_array_equal(scale_bits(codes), want_bits.astype(np.uint32))


def test_code_pair_decodes_both_codes_of_every_word_position():
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2 ** 32, size=4096, dtype=np.uint64).astype(np.uint32)
    words[:256] = np.array([(a | (b << 16)) * 0x1111 & 0xFFFFFFFF for a in range(16) for b in range(16)], np.uint32)
    fast = {0: code_pair_even(words), 1: code_pair_odd(words), 2: code_pair_even(words >> 8),
            3: code_pair_odd(words >> 8)}  # the forms the kernel evaluates
    for i in range(4):
        pair = code_pair(words, i)
        np.testing.assert_array_equal(fast[i], pair)
        lo = bf16_half_to_float(pair & 0xFFFF).astype(np.float64) * 2.0 ** 126
        hi = bf16_half_to_float(pair >> 16).astype(np.float64) * 2.0 ** 126
        np.testing.assert_array_equal(lo, e2m1[(words >> (4 * i)) & 0xF])
        np.testing.assert_array_equal(hi, e2m1[(words >> (4 * i + 16)) & 0xF])


@pytest.mark.parametrize("n,k,m,cfg", [
    (32, 256, 5, mma.MmaConfig(tiles=1, warps_r=2, warps_k=2)),
    (40, 384, 8, mma.MmaConfig(tiles=1, warps_r=1, warps_k=4, split_k=2)),   # N not a multiple of 16
    (64, 512, 13, mma.MmaConfig(tiles=2, warps_r=1, warps_k=2, split_k=3)),  # two n8 blocks, uneven slices
    (16, 128, 1, mma.MmaConfig(tiles=1, warps_r=1, warps_k=1)),
    (100, 512, 8, mma.MmaConfig(tiles=3, warps_r=1, warps_k=4, min_ctas=3)),  # the wide rule's 48-row CTAs
])
def test_emulated_kernel_matches_the_oracle(n, k, m, cfg):
    gen = torch.Generator().manual_seed(n * 7 + m)
    dense = torch.randn(n, k, generator=gen) * 0.05
    dense[0, :16] = 0.0  # an all-zero block (scale 0)
    dense[1, 16:32] *= 1e-4  # a tiny block (E4M3-subnormal scale)
    q = quantize(dense.to(torch.bfloat16))
    x = (torch.randn(m, k, generator=gen) * 2).to(torch.bfloat16)
    got = emulate(x, q.weight_packed, q.weight_scale, q.weight_global_scale, cfg)
    got = torch.from_numpy(got.astype(np.uint16).view(np.int16)).view(torch.bfloat16).float()
    ref = reference_matmul(x, q).float()
    # same exact products, fp32 sums in another order, one bf16 rounding: at most 1 bf16 ulp apart
    ulp = torch.finfo(torch.bfloat16).eps * ref.abs().clamp_min(1e-30)
    assert bool(((got - ref).abs() <= ulp * 1.01 + 1e-6 * ref.abs().max()).all())


def test_configs_validate_and_the_rule_never_leaves_an_empty_slice():
    with pytest.raises(ValueError, match="tiles"):
        mma.MmaConfig(tiles=0)
    with pytest.raises(ValueError, match="16 warps"):
        mma.MmaConfig(warps_r=8, warps_k=4)
    for n, k in [(4608, 3584), (3584, 18944), (37888, 3584), (5120, 27648), (200, 256), (64, 128), (64, 8192)]:
        cfg = mma.pick_mma_config(8, n, k)
        chunks = k // mma.CHUNK
        per = math.ceil(chunks / cfg.split_k)
        assert (cfg.split_k - 1) * per < chunks, (n, k, cfg)
    assert mma.supported_problem(16, 256) and not mma.supported_problem(17, 256) and not mma.supported_problem(8, 200)


def test_wave_fill_counts_the_part_empty_last_wave():
    assert mma.wave_fill(264, 264) == 1.0
    assert mma.wave_fill(592, 264) == pytest.approx(592 / 792)  # 7B gate/up, 64-row CTAs: 2.24 waves
    assert mma.wave_fill(790, 396) == pytest.approx(790 / 792)  # 48-row CTAs, three per SM
    assert mma.wave_fill(100, 264) == pytest.approx(100 / 264)  # less than one wave


def test_the_wide_rule_picks_the_best_filling_shape_in_order_of_preference():
    shapes = [cfg for cfg, _ in mma.WIDE_SHAPES]
    # the fastest of 9 shapes timed on an H200 (132 SMs) on each of these gate/up problems (dev/LOG.md)
    assert mma.pick_mma_config(8, 37888, 3584, 132) == shapes[0]  # Qwen2.5-7B
    assert mma.pick_mma_config(8, 55296, 5120, 132) == shapes[0]  # 32B
    assert mma.pick_mma_config(8, 22016, 2048, 132) == shapes[1]  # 3B: 459 CTAs, four per SM
    for sms in (78, 114, 132, 148):
        for n in range(8 * 1024, 64 * 1024 + 1, 1000):
            cfg = mma.pick_mma_config(8, n, 1024, sms)
            fills = [mma.wave_fill(math.ceil(n / c.rows_per_cta), per_sm * sms) for c, per_sm in mma.WIDE_SHAPES]
            chosen = fills[shapes.index(cfg)]
            assert chosen >= max(fills) - 0.05
            assert all(f < max(fills) - 0.05 for f in fills[:shapes.index(cfg)])  # nothing earlier qualified


def _cubin_registers(cubin: bytes) -> int:
    """Registers per thread of the one kernel in a cubin: the EIATTR_REGCOUNT (0x2f) record of the
    ELF's ``.nv.info`` section (records: format byte, attribute byte, u16 size, payload)."""
    import struct

    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    names_at = headers[names_index][4]
    for name_off, _, _, _, offset, size, *_ in headers:
        if cubin[names_at + name_off:].split(b"\0", 1)[0] != b".nv.info":
            continue
        p = offset
        while p < offset + size:
            fmt, attr = cubin[p], cubin[p + 1]
            if fmt != 4:  # fixed 4-byte records
                p += 4
                continue
            length = struct.unpack_from("<H", cubin, p + 2)[0]
            if attr == 0x2F:
                return struct.unpack_from("<II", cubin, p + 4)[1]
            p += 4 + length
    raise AssertionError("no register count in the cubin")


@pytest.mark.skipif(nvrtc_or_none() is None, reason="no libnvrtc here (CUDA builds of PyTorch ship it; or set QERL_NVRTC)")
def test_wide_shapes_run_at_the_ctas_per_sm_the_rule_assumes():
    """The wave arithmetic of the rule rests on each shape's residency: check it from the registers
    NVRTC allocates for sm_90 (65,536 per SM in 256-register warp granules), threads (2,048 per SM)
    and shared memory (228 KiB per SM, 1 KiB reserved per CTA)."""
    for cfg, per_sm in mma.WIDE_SHAPES:
        regs = _cubin_registers(mma.compile_cubin(mma.kernel_source(cfg, 1), mma.kernel_name(cfg, 1), "sm_90"))
        warps = cfg.warps_r * cfg.warps_k
        by_regs = 65536 // (math.ceil(regs * 32 / 256) * 256 * warps)
        by_smem = (228 * 1024) // (cfg.shared_bytes(1) + 1024)
        assert min(by_regs, 2048 // cfg.threads, by_smem, 32) == per_sm, (cfg, regs)


def test_small_m_backend_setting(monkeypatch):
    with pytest.raises(ValueError, match="small-M backend"):
        resolve_small_m_backend("cutlass")
    with pytest.raises(ValueError, match="small-M backend"):
        uses_mma(8, 4096, torch.device("cpu"), "cutlass")
    monkeypatch.delenv("QERL_FP4_SMALL_M", raising=False)
    assert resolve_small_m_backend() == "auto"
    monkeypatch.setenv("QERL_FP4_SMALL_M", "triton")
    assert resolve_small_m_backend() == "triton"  # read at each call
    assert resolve_small_m_backend("mma") == "mma"  # an explicit backend wins over the environment
    assert not uses_mma(8, 4096, torch.device("cpu"))  # CPU tensors take the reference path


def test_a_bad_environment_setting_is_named(monkeypatch):
    monkeypatch.setenv("QERL_FP4_SMALL_M", "cutlass")
    with pytest.raises(ValueError, match="QERL_FP4_SMALL_M"):
        uses_mma(8, 4096, torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_forcing_mma_without_a_gpu_names_the_fix(monkeypatch):
    assert not uses_mma(8, 4096, torch.device("cpu"), "mma")  # CPU still goes to the reference
    with pytest.raises(RuntimeError, match="small_m_backend='auto'"):
        uses_mma(8, 4096, torch.device("cuda"), "mma")
    monkeypatch.setenv("QERL_FP4_SMALL_M", "mma")
    with pytest.raises(RuntimeError, match="QERL_FP4_SMALL_M=auto"):
        uses_mma(8, 4096, torch.device("cuda"))


@pytest.mark.skipif(nvrtc_or_none() is None, reason="no libnvrtc here (CUDA builds of PyTorch ship it; or set QERL_NVRTC)")
@pytest.mark.parametrize("nb", [1, 2])
def test_source_compiles_for_hopper_in_every_shape_the_rule_picks(nb):
    shapes = [(4608, 3584), (37888, 3584), (3584, 18944), (55296, 5120), (5120, 27648), (22016, 2048)]  # 7B, 32B, 3B
    configs = {mma.pick_mma_config(8 * nb, n, k, 132) for n, k in shapes}
    assert len(configs) >= 4  # default, two wide shapes, and the deep shapes' K-slices
    for cfg in configs:
        cubin = mma.compile_cubin(mma.kernel_source(cfg, nb), mma.kernel_name(cfg, nb), "sm_90")
        assert cubin[:4] == b"\x7fELF" and mma.kernel_name(cfg, nb).encode() in cubin


# ============================================================================ GPU tests
_mma_skip = pytest.mark.skipif(not HAS_MMA, reason="needs a CUDA GPU with compute capability >= 9.0 and NVRTC")


def cuda_only(fn):
    return pytest.mark.cuda(_mma_skip(fn))


@cuda_only
@pytest.mark.parametrize("n,k", [(200, 256), (4608, 3584), (3584, 18944), (33000, 4096)])  # default, deep, wide
def test_kernel_matches_oracle_on_gpu(n, k):
    gen = torch.Generator(device="cuda").manual_seed(n)
    q = quantize((torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16))
    w = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    bias = (torch.randn(n, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    for m in (1, 3, 8, 9, 16):
        x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
        for b in (None, bias):
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            mma.mma_linear(x, w.words, w.scales, w.global_scale, b, out)
            ref = reference_matmul(x, q, b).float()
            # one bf16 rounding of either side, plus fp32 sums in another order: the term-size bound
            # K * 2^-24 * sum|w x| (the magnitudes' product, not the possibly cancelling sum)
            mags = x.float().abs() @ dequantize(q, torch.float32).abs().t()
            bound = 2 * torch.finfo(torch.bfloat16).eps * ref.abs() + k * 2.0 ** -24 * mags  # 2: bias rounds again
            assert not torch.isnan(out).any()
            assert bool(((out.float() - ref).abs() <= bound).all()), (n, k, m)
            again = torch.empty_like(out)
            mma.mma_linear(x, w.words, w.scales, w.global_scale, b, again)
            assert torch.equal(out.view(torch.int16), again.view(torch.int16)), "not deterministic"


@cuda_only
def test_fp4_linear_dispatches_small_m_to_mma_and_agrees_with_triton():
    n, k, m = 1024, 2048, 4
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)  # seeded: a failure reproduces
    q = quantize((torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16))
    w = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    calls = []
    real = mma.mma_linear
    mma.mma_linear = lambda *a, **kw: calls.append(1) or real(*a, **kw)  # noqa: E731 - a one-line spy
    try:
        via_mma = fp4_linear(x, w)
        via_triton = fp4_linear(x, w, small_m_backend="triton")
    finally:
        mma.mma_linear = real
    assert calls == [1]
    ref = reference_matmul(x, q).float()
    for out in (via_mma, via_triton):
        assert bool(((out.float() - ref).abs() <= 2 * torch.finfo(torch.bfloat16).eps * ref.abs() + 1e-5).all())


@cuda_only
def test_kernel_replays_in_a_cuda_graph_with_k_slices():
    n, k, m = 512, 4096, 8
    gen = torch.Generator(device="cuda").manual_seed(n + k + m)  # seeded: a failure reproduces
    q = quantize((torch.randn(n, k, device="cuda", generator=gen) * 0.02).to(torch.bfloat16))
    w = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    cfg = mma.MmaConfig(split_k=4)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    mma.mma_linear(x, w.words, w.scales, w.global_scale, None, out, cfg)
    eager = out.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mma.mma_linear(x, w.words, w.scales, w.global_scale, None, out, cfg)
    out.zero_()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)

"""The register-A NVFP4 GEMM's backward layout (``fp4_ra.grad_input``: ``dy @ W`` from the forward's bytes): the
producer's repack and scale pairing transcribed and checked against the wgmma fragment layout (CPU), what ptxas makes
of the launch shapes (CPU, with NVRTC), argument checks, and the outputs against ``nvfp4.reference_grad_input``
(CUDA)."""
import random

import pytest
import torch

from qerl_lib.kernels import fp4_ra
from qerl_lib.quant.nvfp4 import dequantize, reference_grad_input
from tests.conftest import assert_within_bf16_gemm_bound, bf16_gemm_bound, cuda_nvfp4_weights, nvrtc_or_none

SHAPES = [fp4_ra.RaConfig(256, 4, backward=True), fp4_ra.RaConfig(128, 6, backward=True),
          fp4_ra.RaConfig(64, 8, backward=True)]


def _prmt(a: int, b: int, sel: int) -> int:
    src = a.to_bytes(4, "little") + b.to_bytes(4, "little")
    return int.from_bytes(bytes(src[(sel >> (4 * i)) & 7] for i in range(4)), "little")


def _raw_offset(row: int, col: int) -> int:  # TMA's 64-byte swizzle of 64-byte rows
    return 64 * row + (col ^ (((row >> 1) & 3) << 4))


def _repack(raw: bytes) -> dict[int, list[int]]:
    """fp4_ra.cu's backward_producer, transcribed: consumer lane (0..255) -> its 8 words of halfword addresses."""
    def chunk(row: int, m: int) -> list[int]:
        off = _raw_offset(row, 16 * m)
        t = (row >> 1) & 3  # the kernel's base register and constant offsets give the same byte
        assert off == 128 * t + 16 * (m ^ t) + 1024 * (row >> 4) + 512 * ((row >> 3) & 1) + 64 * (row & 1)
        return [int.from_bytes(raw[off + 4 * i:off + 4 * i + 4], "little") for i in range(4)]

    stage = [None] * 2048  # the repacked half of a stage as words: [s // 2][slot][4]
    for p in range(128):
        t, gq, m, sh = p & 3, (p >> 2) & 3, (p >> 4) & 3, p >> 6
        sel, lane4 = gq | ((gq + 4) << 4), 0x10001 * (32 * gq + 4 * t)
        for ss in range(2):
            s = 2 * sh + (ss ^ (gq & 1))
            c = [[chunk(16 * s + 8 * h + 2 * t + r, m) for r in range(2)] for h in range(2)]
            for b in range(2):
                r0h0, r1h0, r0h1, r1h1 = (c[0][0][2 * b:], c[0][1][2 * b:], c[1][0][2 * b:], c[1][1][2 * b:])
                a = _prmt(_prmt(r0h0[0], r0h0[1], sel), _prmt(r0h1[0], r0h1[1], sel), 0x5410)
                bb = _prmt(_prmt(r1h0[0], r1h0[1], sel), _prmt(r1h1[0], r1h1[1], sel), 0x5410)
                e = (a & 0x0F0F0F0F) | ((bb << 4) & 0xF0F0F0F0)
                o = ((a >> 4) & 0x0F0F0F0F) | (bb & 0xF0F0F0F0)
                ct = 32 * (2 * m + b) + 8 * gq + t
                for lane_ct, v, l4 in ((ct, e, lane4), (ct + 4, o, lane4 + 0x100010)):
                    word = 1024 * (s >> 1) + 4 * _packed_slot(lane_ct) + 2 * (s & 1)
                    assert stage[word] is None and stage[word + 1] is None
                    stage[word] = (_prmt(v, 0, 0x4140) * 128 + l4) & 0xFFFFFFFF
                    stage[word + 1] = (_prmt(v, 0, 0x4342) * 128 + l4) & 0xFFFFFFFF
    # what consumer lane cb's two 16-byte loads read
    return {cb: [stage[1024 * half + 4 * _packed_slot(cb) + i] for half in range(2) for i in range(4)]
            for cb in range(256)}


def _packed_slot(ct: int) -> int:  # fp4_ra.cu's packed_slot
    return ct ^ (((ct >> 3) & 3) << 1)


def test_repacked_stores_and_loads_are_free_of_bank_conflicts():
    """Each producer half-warp's 8-byte stores (one instruction: t and gq vary) hit 16 distinct bank pairs, and each
    consumer quarter-warp's 16-byte loads 8 distinct 16-byte columns: shared memory serves both in one pass."""
    for warp in range(4):
        for half in range(2):
            for ss in range(2):
                for b in range(2):
                    for odd in range(2):
                        pairs = set()
                        for lane in range(16 * half, 16 * half + 16):
                            p = 32 * warp + lane
                            t, gq, m, sh = p & 3, (p >> 2) & 3, (p >> 4) & 3, p >> 6
                            s = 2 * sh + (ss ^ (gq & 1))
                            ct = 32 * (2 * m + b) + 8 * gq + t + 4 * odd
                            pairs.add((16 * _packed_slot(ct) + 8 * (s & 1)) // 8 % 16)
                        assert len(pairs) == 16
    for cb0 in range(0, 256, 8):
        assert len({_packed_slot(cb) % 8 for cb in range(cb0, cb0 + 8)}) == 8
    assert sorted(_packed_slot(ct) for ct in range(256)) == list(range(256))


def test_repack_gives_every_lane_its_fragment_codes_as_table_addresses():
    """For random raw tiles: consumer lane (warp wa, g, t) holds, in halfword h of word 2 s + h' (h' = 0, 1), the table
    address 128 * value + 4 * lane of the value whose low nibble is W[n, r] and high nibble W[n + 1, r], with k row
    r = 16 wa + g + 8 h and W row n = 16 s + 2 t + 8 h': wgmma's A fragment (rows g, g + 8; columns 2t, 2t + 8) of W^T."""
    rng = random.Random(5)
    for _ in range(3):
        logical = [[rng.randrange(256) for _ in range(64)] for _ in range(64)]  # 64 W rows x 64 bytes (128 k)
        raw = bytearray(4096)
        for row in range(64):
            for col in range(64):
                raw[_raw_offset(row, col)] = logical[row][col]
        packed = _repack(bytes(raw))
        assert all(None not in words for words in packed.values())

        def nib(n: int, k: int) -> int:
            return (logical[n][k // 2] >> (4 * (k % 2))) & 0xF

        for ct, words in packed.items():
            wa, lane = ct >> 5, ct & 31
            g, t = lane >> 2, lane & 3
            for s in range(4):
                for hn in range(2):
                    w = words[2 * s + hn]
                    for hk, addr in enumerate((w & 0xFFFF, w >> 16)):
                        r, n = 16 * wa + g + 8 * hk, 16 * s + 2 * t + 8 * hn
                        assert addr & 0x7F == 4 * lane
                        assert addr >> 7 == nib(n, r) | (nib(n + 1, r) << 4)


def test_scale_pairs_land_where_each_consumer_lane_reads_them():
    """The producer's scale words (thread p: W rows 2 (p / 4) and the next, blocks 2 (p % 4) and 2 (p % 4) + 1) fill
    each [block][lane column t][word 2 s + h] exactly once with (s[n, block], s[n + 1, block]), n = 16 s + 8 h + 2 t:
    the pair that multiplies fragment registers 2h, 2h + 1 of k16 step s of every lane (g, t) of warp `block`."""
    seen = {}
    for p in range(128):
        sn, sq = 2 * (p >> 2), p & 3
        sword = 8 * ((sn >> 1) & 3) + 2 * (sn >> 4) + ((sn >> 3) & 1)
        for q in range(2):
            kb = 2 * sq + q
            index = 32 * kb + sword  # fp4_ra.cu: byte 128 kb + 4 sword
            assert index not in seen
            seen[index] = (sn, kb)
    assert sorted(seen) == list(range(256))
    for kb in range(8):
        for t in range(4):
            for s in range(4):
                for h in range(2):
                    assert seen[kb * 32 + 8 * t + 2 * s + h] == (16 * s + 8 * h + 2 * t, kb)


def test_backward_configs_fit_and_are_named_apart():
    assert fp4_ra.RaConfig(256, 4, backward=True).shared_bytes <= fp4_ra.SHARED_MEMORY_LIMIT
    assert fp4_ra.RaConfig(256, 4, backward=True).name != fp4_ra.RaConfig(256, 4).name
    with pytest.raises(ValueError, match="shared memory"):
        fp4_ra.RaConfig(256, 5, backward=True)
    with pytest.raises(ValueError, match="backward must be a bool"):
        fp4_ra.RaConfig(backward=1)


@pytest.mark.skipif(nvrtc_or_none() is None, reason="no libnvrtc here (CUDA builds of PyTorch ship it; or set QERL_NVRTC)")
@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: c.name)
def test_backward_launch_shapes_compile_without_spills_or_serialized_wgmma(cfg):
    log: list[str] = []
    assert fp4_ra.compile_cubin(cfg, log=log)[:4] == b"\x7fELF"
    assert "C751" not in log[0], log[0]
    assert "0 bytes spill stores, 0 bytes spill loads" in log[0], log[0]


def test_grad_input_rejects_what_it_cannot_run():
    words = torch.zeros(128, 16, dtype=torch.int32)
    scales = torch.zeros(128, 8, dtype=torch.uint8)
    gs = torch.ones(1)
    dy = torch.zeros(4, 128, dtype=torch.bfloat16)
    out = torch.zeros(4, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="backward=True"):
        fp4_ra.grad_input(dy, words, scales, gs, out, fp4_ra.RaConfig())
    with pytest.raises(ValueError, match="backward=False"):
        fp4_ra.linear(dy, words, scales, gs, None, out, fp4_ra.RaConfig(backward=True))
    with pytest.raises(ValueError, match="N % 64 == 0"):
        fp4_ra.grad_input(dy[:, :96], words[:96], scales[:96], gs, out)
    with pytest.raises(ValueError, match="must be bf16"):
        fp4_ra.grad_input(dy.float(), words, scales, gs, out)
    with pytest.raises(ValueError, match=r"out must be \[4, 128\]"):
        fp4_ra.grad_input(dy, words, scales, gs, out[:, :64])
    with pytest.raises(ValueError, match="16-byte aligned scale rows"):
        fp4_ra.grad_input(dy, words, scales, gs, out)


CHECKS = [(128, 256, 1), (64, 768, 300), (192, 1280, 257), (512, 3584, 1024), (3584, 512, 777), (1024, 2048, 4096)]
LAUNCHES = SHAPES + [fp4_ra.RaConfig(128, 4, schedule="split", min_split_steps=1, backward=True),
                     fp4_ra.RaConfig(256, 4, schedule="persistent", backward=True),
                     fp4_ra.RaConfig(256, 4, schedule="one_tile", backward=True)]


@pytest.mark.cuda
@pytest.mark.skipif(not fp4_ra.available(), reason=f"fp4_ra cannot run here: {fp4_ra.unavailable_reason()}")
@pytest.mark.parametrize("cfg", LAUNCHES, ids=lambda c: f"{c.name}_{c.schedule}{c.min_split_steps}")
@pytest.mark.parametrize("n,k,m", CHECKS)
def test_grad_input_matches_the_oracle_and_writes_only_its_output(cfg, n, k, m):
    """Fresh random weights and dy: mean relative error <= 1e-3 against ``reference_grad_input`` and every element within
    the bf16 rounding of an fp32 sum (exact products summed in fp32 in another order; ``conftest.bf16_gemm_bound``), every output written, nothing around it touched, two launches bit-equal."""
    q, w, gen = cuda_nvfp4_weights(n, k, seed=n * 5 + k * 11 + m)
    dy = torch.randn(m, n, device="cuda", generator=gen).to(torch.bfloat16)
    ref = reference_grad_input(dy, q).double()
    buf = torch.full((m + 2, k + 8), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = buf[1:m + 1, :k]
    fp4_ra.grad_input(dy, w.words, w.scales, q.weight_global_scale, out, cfg)
    err = ((out.double() - ref).abs().mean() / ref.abs().mean()).item()
    assert out.isfinite().all() and err <= 1e-3, err
    # elementwise: bf16 output rounding of a float32-accumulated sum over N in another order (conftest.bf16_gemm_bound)
    bound = bf16_gemm_bound(ref.float(), dy, dequantize(q, torch.float32))
    assert_within_bf16_gemm_bound(out, ref.float(), bound, f"{cfg.name}_{cfg.schedule}{cfg.min_split_steps} n={n} k={k} "
                                                           f"m={m} (seed {n * 5 + k * 11 + m})")
    assert buf[0].isnan().all() and buf[-1].isnan().all() and buf[1:m + 1, k:].isnan().all()
    again = torch.empty_like(out)
    fp4_ra.grad_input(dy, w.words, w.scales, q.weight_global_scale, again, cfg)
    assert torch.equal(out, again)

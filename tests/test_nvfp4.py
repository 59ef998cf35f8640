"""NVFP4 format: bit-exact vs compressed-tensors 0.19, the test vectors of docs/nvfp4_format.md, codes, SQNR, errors, GEMM oracle.

Random inputs are fresh every run; the seed is printed in every failure message and can be
pinned with QERL_TEST_SEED=<int>.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from qerl_lib.quant import nvfp4
from qerl_lib.quant.nvfp4 import E2M1_VALUES, NVFP4Weight, dequantize, global_scale, quantize

SEED = int(os.environ.get("QERL_TEST_SEED", random.SystemRandom().randrange(2**31)))
BF16 = torch.bfloat16


def _bytes(t: torch.Tensor) -> bytes:
    if t.dtype != torch.uint8:
        t = t.contiguous().view(torch.uint8)
    return bytes(t.flatten().tolist())


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view, so -0.0 != +0.0 and NaN payloads count."""
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


# ----------------------------------------------------------------------------- CT reference
@pytest.fixture(scope="module")
def ct():
    """compressed-tensors wired exactly as llm-compressor 0.14 runs scheme NVFP4A16 (data-free)."""
    pytest.importorskip("compressed_tensors", reason="compressed-tensors 0.19 (the `quant` extra) not installed")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])

    def run(group: list[torch.Tensor]):
        # MemorylessMinMaxObserver: per-block min/max of the weight viewed as (1, N, K/16, 16).
        stats = [
            (torch.amin(obs, dim=(0, -1)), torch.amax(obs, dim=(0, -1)))
            for obs in (w.unflatten(-1, (-1, 16)).unsqueeze(0) for w in group)
        ]
        # Observer.get_global_scale: absmax over every fused observer, then generate_gparam.
        absmax = stats[0][1].max()
        for mins, maxs in stats:
            absmax = torch.max(absmax, -mins.min())
            absmax = torch.max(absmax, maxs.max())
        gs = generate_gparam(-absmax.reshape(1), absmax.reshape(1))
        results = []
        for w, (mins, maxs) in zip(group, stats):
            scale, _ = calculate_qparams(mins, maxs, scheme.weights, global_scale=gs)
            # update_qparams copies the scale into a parameter of the weight's dtype.
            state = {"weight": w, "weight_scale": scale.to(w.dtype), "weight_global_scale": gs}
            packed = NVFP4PackedCompressor.compress(state, scheme)
            dense = NVFP4PackedCompressor.decompress(dict(packed), scheme)["weight"]
            results.append((packed["weight_packed"], packed["weight_scale"], packed["weight_global_scale"], dense))
        return results

    return run


def _random_group(kind: str, gen: torch.Generator) -> list[torch.Tensor]:
    def randint(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    def gaussian(n, k, dtype=BF16):
        magnitude = 10 ** (torch.rand(1, generator=gen).item() * 4 - 3)  # 1e-3 .. 10
        return (torch.randn(n, k, generator=gen) * magnitude).to(dtype)

    n, k = randint(1, 12), 16 * randint(1, 12)
    if kind == "fused_qkv":  # q, k, v of different heights and magnitudes, one shared global scale
        return [gaussian(randint(1, 12), k) for _ in range(3)]
    if kind in ("fp16", "fp32"):
        return [gaussian(n, k, torch.float16 if kind == "fp16" else torch.float32)]
    w = torch.randn(n, k, generator=gen)
    pick = torch.rand(n, k, generator=gen)
    blocks = torch.rand(n, k // 16, 1, generator=gen).expand(-1, -1, 16).reshape(n, k)
    if kind == "outliers":
        w = torch.where(pick < 0.02, w * 300, w)
    elif kind == "zero_blocks":
        w = torch.where(blocks < 0.3, 0.0, w)
    elif kind == "signed_zeros":
        w = torch.where(pick < 0.15, -0.0, torch.where(pick < 0.25, 0.0, w))
        w = torch.where(blocks < 0.2, -0.0, w)
    elif kind == "tiny_negatives":  # negatives that round to zero -> code 8 (-0)
        tiny = -torch.rand(n, k, generator=gen) * 10 ** (-torch.rand(n, k, generator=gen) * 6)
        w = torch.where(pick < 0.3, tiny * 0.05, w)
    elif kind == "small_blocks":  # blocks 1e-1..1e-9 of the absmax: subnormal and underflowing scales
        factor = 10 ** (-1 - 8 * torch.rand(n, k // 16, 1, generator=gen)).expand(-1, -1, 16).reshape(n, k)
        w = torch.where(blocks < 0.6, w * factor, w)
    return [w.to(BF16)]


RANDOM_KINDS = ["gaussian", "outliers", "zero_blocks", "signed_zeros", "tiny_negatives", "small_blocks", "fp16", "fp32", "fused_qkv"]
TENSORS_PER_KIND = 12  # 8 kinds x 12 + 12 fused triples x 3 = 132 tensors per run


@pytest.mark.parametrize("kind", RANDOM_KINDS, ids=RANDOM_KINDS)
def test_bit_exact_vs_compressed_tensors(ct, kind):
    gen = torch.Generator().manual_seed(SEED + RANDOM_KINDS.index(kind))
    for case in range(TENSORS_PER_KIND):
        group = _random_group(kind, gen)
        shared_gs = global_scale(*group)
        for member, (w, (ct_packed, ct_scale, ct_gs, ct_dense)) in enumerate(zip(group, ct(group))):
            where = f"seed={SEED} kind={kind} case={case} member={member} shape={list(w.shape)} dtype={w.dtype}"
            q = quantize(w, global_scale=shared_gs if len(group) > 1 else None)
            assert torch.equal(_bits(q.weight_global_scale), _bits(ct_gs)), f"global scale differs: {where}"
            assert torch.equal(q.weight_scale.view(torch.uint8), ct_scale.view(torch.uint8)), f"scale bytes differ: {where}"
            assert torch.equal(q.weight_packed, ct_packed), f"packed bytes differ: {where}"
            assert torch.equal(_bits(dequantize(q)), _bits(ct_dense)), f"dequantized bf16 differs: {where}"


# ----------------------------------------------------------------- test vectors V1-V7 (docs/nvfp4_format.md)
def _row(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(BF16).reshape(1, -1)


V1 = [0, 0.10009765625, -0.2001953125, 0.30078125, -0.44921875, 0.6015625, 0.75, -0.8984375,
      1.046875, -1.203125, 1.5, 1.796875, -2.09375, 2.40625, -2.703125, 3.0]


def test_v1_single_block_amax_3():
    q = quantize(_row(V1))
    assert _bytes(q.weight_global_scale) == bytes.fromhex("00006044")  # 896.0
    assert _bytes(q.weight_scale) == bytes([0x7E])
    assert _bytes(q.weight_packed) == bytes.fromhex("00192AC3C4656E7F")
    expected = [0, 0, -0.25, 0.25, -0.5, 0.5, 0.75, -1, 1, -1, 1.5, 2, -2, 2, -3, 3]
    assert dequantize(q).float().flatten().tolist() == expected


def test_v1_fused_variant_shares_global_scale():
    q_proj, k_proj = _row(V1), _row([6.0] + [0.0] * 15)
    gs = global_scale(q_proj, k_proj)
    assert float(gs) == 448.0
    q = quantize(q_proj, global_scale=gs)
    assert _bytes(q.weight_scale) == bytes([0x76])  # 224
    assert _bytes(q.weight_packed) == bytes.fromhex("00192AC3C4656E7F")


def test_v2_ties_and_small_block():
    block0 = [6, -5, 4, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -0.25, 0.5, -1, 1.5, -2, 3, 0]
    block1 = [0.01, -0.02, 0.03, 0.04, -0.05, 0.06, 0.07, -0.08, 0.09, 0.10, 0.11, -0.12, 0.13, 0.14, 0.15, -0.16]
    q = quantize(_row(block0 + block1))
    assert float(q.weight_global_scale) == 448.0
    assert _bytes(q.weight_scale) == bytes([0x7E, 0x54])
    assert _bytes(q.weight_packed) == bytes.fromhex("E766442280A1C305" "91324CD565E676F7")
    dense = dequantize(q).float().flatten()
    assert abs(dense[16].item() - 0.013366699) < 1e-9 and abs(dense[17].item() + 0.013366699) < 1e-9


def test_v3_zero_block_next_to_ones():
    q = quantize(_row([0.0] * 16 + [1.0] * 16))
    assert float(q.weight_global_scale) == 2688.0
    assert _bytes(q.weight_scale) == bytes([0x20, 0x7E])
    assert _bytes(q.weight_packed) == bytes(8) + bytes([0x77] * 8)


def test_v4_subnormal_block_scale_kept():
    q = quantize(_row([448.0] * 16 + [0.01] * 16))
    assert float(q.weight_global_scale) == 6.0
    assert _bytes(q.weight_scale) == bytes([0x7E, 0x05])
    assert _bytes(q.weight_packed) == bytes([0x77] * 16)
    assert dequantize(q).float()[0, 16:].tolist() == [0.009765625] * 16  # Marlin would give 0 here


def test_v5_global_scale_double_rounding():
    w = _row([2.5, 1.25, -0.6, 0.3, 0.1, -0.05, 2.0, -2.4, 1.7, 0.9, -1.1, 0, 0.45, -0.2, 1.5, -2.5])
    q = quantize(w)
    assert _bytes(q.weight_global_scale) == bytes.fromhex("00008744")  # 1080, single rounding would be 1072
    assert _bytes(q.weight_scale) == bytes([0x7E])
    assert _bytes(q.weight_packed) == bytes.fromhex("571B80F6460D92F6")
    assert dequantize(q).float()[0, 0].item() == 2.484375


def test_v6_signed_zero_and_exact_ties():
    w = _row([-0.0, -0.0009995, 0.0009995, 0.0, 6, -6, 0.2598, -0.2598,
              0.7383, -0.7617, 5.0, -5.0, 2.5156, -2.4844, 1.7422, -1.7578])
    assert torch.signbit(w[0, 0])  # the -0.0 really is negative zero on input
    q = quantize(w)
    assert float(q.weight_global_scale) == 448.0 and _bytes(q.weight_scale) == bytes([0x7E])
    assert _bytes(q.weight_packed) == bytes.fromhex("8000F791A1E6C5C3")


def test_v7_all_zero_tensor():
    q = quantize(torch.zeros(1, 16, dtype=BF16))
    assert float(q.weight_global_scale) == 1.0
    assert _bytes(q.weight_scale) == bytes([0x20])
    assert _bytes(q.weight_packed) == bytes(8)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_v7_non_finite_rejected_naming_layer(bad):
    # CT would silently produce gs = 1 (NaN) or gs = 0 (Inf); we refuse, naming the layer.
    w = torch.randn(4, 32, dtype=BF16)
    w[2, 5] = bad
    with pytest.raises(ValueError, match=r"model\.layers\.3\.mlp\.up_proj.*NaN or Inf"):
        quantize(w, name="model.layers.3.mlp.up_proj")
    with pytest.raises(ValueError, match=r"q_proj.*NaN or Inf"):
        global_scale(torch.randn(4, 32, dtype=BF16), w, name="layers.0.self_attn.q_proj")


# ----------------------------------------------------------------------------- codes and packing
def _rne_e2m1_oracle(y: float) -> int:
    """Brute force: nearest E2M1 magnitude, ties to the even code (RNE), saturate at 6."""
    mag = min(abs(y), 6.0)
    best = min(range(8), key=lambda c: (abs(E2M1_VALUES[c] - mag), c % 2))
    return best | (8 if y < 0 else 0)


def test_encode_matches_rne_oracle_on_ties_and_random_values():
    gen = torch.Generator().manual_seed(SEED)
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    values = torch.tensor(ties + [-t for t in ties] + [0.0, -0.0, 6.0, -6.0, 7.5, -100.0, 1e-30, -1e-30])
    values = torch.cat([values, torch.randn(2000, generator=gen) * 3])
    codes = nvfp4.encode_e2m1(values)
    expected = torch.tensor([_rne_e2m1_oracle(v) for v in values.tolist()], dtype=torch.uint8)
    assert torch.equal(codes, expected), f"seed={SEED}"


def test_encode_decode_exact_on_representable_values():
    # Every block holds all 16 E2M1 values (permuted) times a power of two; the first block of
    # each row holds the row's absmax. gs = bf16(bf16(1/(6*2^k))*2688) = 448*2^-k exactly, so
    # every block scale 448*2^-j is exact in E4M3 (j <= 12 stays above its subnormal limit).
    gen = torch.Generator().manual_seed(SEED)
    values = torch.tensor(E2M1_VALUES)
    for k in (-8, 0, 6):
        rows = []
        for _ in range(4):
            blocks = [values[torch.randperm(16, generator=gen)] * 2.0 ** (k - j) for j in range(13)]
            rows.append(torch.cat(blocks))
        w = torch.stack(rows).to(BF16)
        q = quantize(w)
        assert torch.equal(dequantize(q), w), f"seed={SEED} k={k}"
        codes = nvfp4.unpack_fp4(q.weight_packed)
        # -0.0 input is stored as code 0 (CT: sign of an exact zero is +), the rest map back to themselves
        expected = torch.where(w == 0, 0, nvfp4.encode_e2m1(w.float() / 2.0 ** (k - torch.arange(13).repeat_interleave(16))))
        assert torch.equal(codes, expected.to(torch.uint8)), f"seed={SEED} k={k}"
    all_codes = torch.arange(16, dtype=torch.uint8)
    decoded = nvfp4.decode_e2m1(all_codes)
    assert decoded.tolist() == list(E2M1_VALUES) and torch.signbit(decoded[8])
    assert torch.equal(nvfp4.encode_e2m1(decoded), torch.where(all_codes == 8, 0, all_codes).to(torch.uint8))


def test_pack_unpack_identity_and_nibble_order():
    gen = torch.Generator().manual_seed(SEED)
    codes = torch.randint(0, 16, (7, 48), generator=gen, dtype=torch.uint8)
    assert torch.equal(nvfp4.unpack_fp4(nvfp4.pack_fp4(codes)), codes)
    packed = torch.randint(0, 256, (5, 24), generator=gen, dtype=torch.uint8)
    assert torch.equal(nvfp4.pack_fp4(nvfp4.unpack_fp4(packed)), packed)
    # element 2j -> low nibble of byte j
    assert nvfp4.pack_fp4(torch.tensor([[0x1, 0x2]], dtype=torch.uint8)).item() == 0x21


def test_row_chunking_does_not_change_results(monkeypatch):
    gen = torch.Generator().manual_seed(SEED)
    w = torch.randn(37, 80, generator=gen).to(BF16)
    whole = quantize(w)
    monkeypatch.setattr(nvfp4, "_CHUNK_ELEMENTS", 3 * 80)  # 3 rows per chunk, ragged last chunk
    chunked = quantize(w)
    assert torch.equal(chunked.weight_packed, whole.weight_packed)
    assert torch.equal(chunked.weight_scale.view(torch.uint8), whole.weight_scale.view(torch.uint8))
    assert torch.equal(dequantize(chunked), dequantize(whole))


# ----------------------------------------------------------------------------- quality and errors
def test_sqnr_of_gaussian_clears_floor():
    # Calibrated: 256x1024 bf16 randn gives 20.41-20.44 dB over seeds (NVFP4's ~4.5-bit noise);
    # floor 19.5 dB leaves margin for seed spread, the upper bound catches a no-op "quantizer".
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(SEED)).to(BF16)
    sqnr = nvfp4.sqnr_db(w, dequantize(quantize(w)))
    assert 19.5 < sqnr < 23.0, f"seed={SEED} sqnr={sqnr:.2f} dB"


def test_k_not_multiple_of_16_names_layer_and_rule():
    with pytest.raises(ValueError, match=r"layers\.0\.mlp\.down_proj.*K = 40 must be a multiple of 16"):
        quantize(torch.randn(4, 40, dtype=BF16), name="layers.0.mlp.down_proj")


def test_validate_names_the_bad_tensor():
    q = quantize(torch.randn(8, 64, dtype=BF16))
    assert q.shape == (8, 64) and q.nbytes == 8 * 32 + 8 * 4 + 4
    q.validate("ok")
    bad_scale = NVFP4Weight(q.weight_packed, q.weight_scale.float(), q.weight_global_scale)
    with pytest.raises(ValueError, match=r"^lin\.weight_scale: expected float8_e4m3fn \[N, K/16\]"):
        bad_scale.validate("lin")
    with pytest.raises(ValueError, match=r"lin\.weight_global_scale: expected float32 \[1\]"):
        NVFP4Weight(q.weight_packed, q.weight_scale, q.weight_global_scale.reshape(())).validate("lin")
    with pytest.raises(ValueError, match=r"lin\.weight_packed: expected uint8"):
        NVFP4Weight(q.weight_packed.to(torch.int8), q.weight_scale, q.weight_global_scale).validate("lin")


MATMUL_SHAPES = [((1,), 16, 16), ((3,), 48, 64), ((2, 5), 40, 256), ((17,), 96, 1024)]


@pytest.mark.parametrize("lead,n,k", MATMUL_SHAPES, ids=[f"x{'x'.join(map(str, s[0]))}-N{s[1]}-K{s[2]}" for s in MATMUL_SHAPES])
def test_reference_matmul_vs_float64(lead, n, k):
    gen = torch.Generator().manual_seed(SEED + n + k)
    q = quantize((torch.randn(n, k, generator=gen) * 0.05).to(BF16))
    x = torch.randn(*lead, k, generator=gen).to(BF16)
    bias = torch.randn(n, generator=gen).to(BF16)
    out = nvfp4.reference_matmul(x, q)
    assert out.shape == (*lead, n) and out.dtype == BF16
    # Like Marlin, the bias is added to the bf16 result (one more bf16 rounding).
    assert torch.equal(nvfp4.reference_matmul(x, q, bias=bias), out + bias)

    # Independent float64 computation of the same math (exact products, one 1/gs at the end).
    fp4 = torch.tensor(E2M1_VALUES, dtype=torch.float64)[nvfp4.unpack_fp4(q.weight_packed).long()]
    w64 = fp4 * q.weight_scale.double().repeat_interleave(16, dim=1)
    x64 = x.double().reshape(-1, k)
    exact = (x64 @ w64.T) / q.weight_global_scale.double()
    magnitude = (x64.abs() @ w64.abs().T) / q.weight_global_scale.double()
    # Tolerance: casting the fp32 result to bf16 costs <= 2^-8 relative (half an ulp; bf16 has
    # 8 significant bits); fp32 accumulation over K adds <= K * 2^-24 * sum |x*w| (worst case).
    tol = 2.0**-8 * exact.abs() + k * 2.0**-24 * magnitude + 1e-30
    err = (out.double().reshape(-1, n) - exact).abs()
    assert (err <= tol).all(), f"seed={SEED} max err {err.max():.3e}, worst ratio {(err / tol).max():.2f}"


@pytest.mark.cuda
def test_cuda_matches_cpu():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(SEED)).to(BF16)
    cpu, gpu = quantize(w), quantize(w.cuda())
    assert torch.equal(gpu.weight_packed.cpu(), cpu.weight_packed)
    assert torch.equal(gpu.weight_scale.cpu().view(torch.uint8), cpu.weight_scale.view(torch.uint8))
    assert torch.equal(dequantize(gpu).cpu(), dequantize(cpu))

"""Tests of the fused NVFP4 x BF16 GEMM (qerl_lib.kernels.fp4_gemm) against the plain-torch oracle.

* CPU, Triton interpreter: the real kernels on small awkward shapes (M in {1, 3, 17}, K a multiple
  of 16 but not of 64, N not a multiple of the 64/128-wide tile, split-K, tails, bias). The
  interpreter needs TRITON_INTERPRET=1 *before* triton is imported and another test module may
  import triton first, so these run in one subprocess that reports JSON per case.
* CPU: bad inputs raise ValueError naming the rule; the prepared weight is zero-copy; config choice.
* CUDA (skipped without a GPU): every projection shape of Qwen2.5-7B at rollout batch sizes,
  poisoned outputs, determinism, the dequantize + cuBLAS path.

Tolerances. The kernel forms every product ``x * fp4 * s`` exactly and sums in fp32, like the
oracle; only the summation order differs, which moves the fp32 sum by ~1e-7 relative and can flip
the final bf16 rounding by one unit in the last place (<= 2^-7 relative) for a tiny fraction of
elements. So elementwise ``rtol = 2^-7`` (one bf16 ulp), and the mean relative error
``mean|out - ref| / mean|ref|`` must be <= 1e-5 (observed: 0 in the interpreter, whose order
matches) -- far inside the issue's 1e-3, which is Marlin's bar. On GPU the mean bar is the issue's 1e-3,
and every element must also lie within the bf16 rounding of a float32-accumulated sum
(``conftest.bf16_gemm_bound``: one bf16 step of the value, two with a bias, plus K * 2^-24 * |x| @ |W|).
"""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from qerl_lib.quant import nvfp4
from qerl_lib.kernels.fp4_gemm import KernelConfig, PreparedFP4Weight, fp4_linear, fp4_matmul, pick_config, prepare_fp4_weights
from tests.conftest import assert_within_bf16_gemm_bound, bf16_gemm_bound, run_triton_interpreter

BF16_ULP_RTOL = 2.0**-7  # one bf16 unit in the last place, relative (worst case just above a power of two)
CPU_MEAN_REL_TOL = 1e-5

# (name, M, N, K, KernelConfig fields or None for the raw fp4_matmul path, bias).
# K in {48, 80, 208, 400}: multiples of 16, not of 64 (tails); N not a multiple of the 64/128 tile.
INTERP_CASES = [
    ("m1_n33_k48", 1, 33, 48, None, False),
    ("m3_n77_k80_bias", 3, 77, 80, None, True),
    ("m17_n33_k208", 17, 33, 208, None, False),
    ("m3_n130_k208_split3", 3, 130, 208, dict(block_m=16, block_n=64, block_k=32, split_k=3), True),
    ("m1_n77_k80_split2_generic", 1, 77, 80, dict(block_m=16, block_n=64, block_k=16, split_k=2), False),
    ("m17_n33_k80_bm32_generic", 17, 33, 80, dict(block_m=32, block_n=64, block_k=64), False),
    ("m17_n77_k208_not_swapped", 17, 77, 208, dict(block_m=32, block_n=64, block_k=32, swap_ab=False), True),
    ("m3_n65_k48_leading_dims", 3, 65, 48, None, True),          # x is [3, 1, K]
    ("m1_n77_k208_fragment", 1, 77, 208, dict(block_m=16, block_n=64, block_k=128, fragment=True), True),
    ("m17_n130_k256_fragment_split2", 17, 130, 256, dict(block_m=32, block_n=128, block_k=128, split_k=2, fragment=True), False),
    ("m3_n65_k400_fragment_split2", 3, 65, 400, dict(block_m=16, block_n=64, block_k=128, split_k=2, fragment=True), True),
    ("m64_n130_k208_fragment_bm64", 64, 130, 208, dict(block_m=64, block_n=128, block_k=128, fragment=True), True),
    ("m150_n77_k256_fragment_3_row_tiles", 150, 77, 256, dict(block_m=64, block_n=64, block_k=128, split_k=2,
                                                              fragment=True), True),  # the launch rule at 65 <= M < 193
    ("m5_n77_k80_dequant_cublas", 5, 77, 80, dict(block_m=128, block_n=128, block_k=64, cublas=True), True),
    ("m17_n77_k208_generic_large_tiles", 17, 77, 208, dict(block_m=32, block_n=64, block_k=32, swap_ab=False), True),
]

INTERP_SCRIPT = textwrap.dedent("""
    import json, os, sys, zlib
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from qerl_lib.quant import nvfp4
    from qerl_lib.kernels.fp4_gemm import KernelConfig, fp4_linear, fp4_matmul, prepare_fp4_weights, dequantize_exact
    cases = json.loads(sys.argv[1])
    results = {}
    for name, m, n, k, cfg, use_bias in cases:
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        w = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        q = nvfp4.quantize(w, name=name)
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        if "leading_dims" in name:
            x = x.reshape(m, 1, k)
        bias = torch.randn(n, generator=gen).to(torch.bfloat16) if use_bias else None
        ref = nvfp4.reference_matmul(x, q, bias)
        if cfg is None:
            out = fp4_matmul(x, q.weight_packed, q.weight_scale, q.weight_global_scale, bias, impl="triton")
        else:
            prep = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
            config = KernelConfig(**cfg) if cfg else None
            out = torch.full(ref.shape, float("nan"), dtype=torch.bfloat16)
            fp4_linear(x, prep, bias, impl="triton", out=out, config=config)
        d = (out.double() - ref.double()).abs()
        results[name] = {"shape": list(out.shape), "ref_shape": list(ref.shape), "nan": int(torch.isnan(out).sum()),
                         "mean_rel": float(d.mean() / ref.double().abs().mean()),
                         "max_ulp_rel": float((d / ref.double().abs().clamp_min(1e-30)).max()),
                         "out": out.float().flatten()[:8].tolist(), "ref": ref.float().flatten()[:8].tolist()}
    # the dequantize kernel (large-M path): bf16 fp4*s, exact, natural K order
    q = nvfp4.quantize(torch.randn(40, 80).to(torch.bfloat16))
    codes = nvfp4.decode_e2m1(nvfp4.unpack_fp4(q.weight_packed)).view(40, 5, 16)
    exact = (codes * q.weight_scale.float().view(40, 5, 1)).view(40, 80)
    prep = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    results["dequant"] = {"equal": bool(torch.equal(dequantize_exact(prep).float(), exact))}
    print("RESULTS " + json.dumps(results))
""")


@pytest.fixture(scope="module")
def interp_results():
    return run_triton_interpreter(INTERP_SCRIPT, INTERP_CASES, timeout=300)


@pytest.mark.parametrize("case", INTERP_CASES, ids=[c[0] for c in INTERP_CASES])
def test_triton_interpreter_matches_reference(interp_results, case):
    r = interp_results[case[0]]
    assert r["shape"] == r["ref_shape"]
    assert r["nan"] == 0, f"{case[0]}: {r['nan']} output elements never written (poisoned NaN survived)"
    assert r["max_ulp_rel"] <= BF16_ULP_RTOL, f"{case[0]}: max elementwise rel diff {r['max_ulp_rel']:.3g}; out {r['out']} ref {r['ref']}"
    assert r["mean_rel"] <= CPU_MEAN_REL_TOL, f"{case[0]}: mean rel err {r['mean_rel']:.3g}"


def test_dequantize_kernel_is_exact(interp_results):
    assert interp_results["dequant"]["equal"]


# ---------------------------------------------------------------------------------- CPU only
def _weights(n=64, k=96, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return nvfp4.quantize(torch.randn(n, k, generator=gen).to(torch.bfloat16))


def test_cpu_auto_dispatch_is_the_reference_with_leading_dims():
    q = _weights()
    x = torch.randn(2, 3, 96).to(torch.bfloat16)
    bias = torch.randn(64).to(torch.bfloat16)
    out = fp4_matmul(x, q.weight_packed, q.weight_scale, q.weight_global_scale, bias)
    assert out.shape == (2, 3, 64) and out.dtype == torch.bfloat16
    assert torch.equal(out, nvfp4.reference_matmul(x, q, bias))
    prep = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    assert torch.equal(fp4_linear(x, prep, bias), out)


def test_prepared_weight_is_zero_copy():
    q = _weights(n=32, k=208, seed=3)
    prep = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    assert prep.words.data_ptr() == q.weight_packed.data_ptr() and prep.shape == (32, 208)
    back = prep.to_compressed_tensors()
    assert torch.equal(back.weight_packed, q.weight_packed)
    assert torch.equal(back.weight_scale.view(torch.uint8), q.weight_scale.view(torch.uint8))
    assert prep.inv_global_scale == float(torch.reciprocal(q.weight_global_scale))


@pytest.mark.parametrize("m,n,k", [(1, 512, 3584), (16, 3584, 18944), (1, 37888, 3584), (64, 3584, 3584),
                                   (300, 4608, 3584), (4096, 27648, 5120)])
def test_pick_config_is_deterministic_and_has_no_empty_splits(m, n, k):
    cfg = pick_config(m, n, k, num_sms=132)
    assert cfg == pick_config(m, n, k, num_sms=132)
    if not cfg.cublas:
        assert cfg.block_m >= min(m, 16) and cfg.block_n >= 64
        iters = -(-k // cfg.block_k)
        per = -(-iters // cfg.split_k)
        assert (cfg.split_k - 1) * per < iters, "a K-slice would be empty"


def test_small_m_launch_rule_follows_the_h100_sweep():
    # the H100 sweep (dev/LOG.md): M = 1 keeps 64-wide tiles and ~4 programs per SM; 2 <= M <= 16
    # takes 128-wide tiles and ~2 per SM, except Qwen2.5-32B's fused gate_up (64 wide: one wave)
    one = pick_config(1, 37888, 3584, num_sms=132)
    eight = pick_config(8, 37888, 3584, num_sms=132)
    assert (one.block_n, one.split_k) == (64, 1) and (eight.block_n, eight.split_k) == (128, 1)
    down = pick_config(8, 3584, 18944, num_sms=132)
    assert (down.block_n, down.split_k) == (128, 10)  # 28 tiles x 10 K-slices ~ 2 x 132 programs
    assert pick_config(8, 55296, 5120, num_sms=132).block_n == 64
    assert pick_config(32, 3584, 3584, num_sms=132).block_n == 64


def test_mid_m_launch_rule_follows_the_h100_sweep():
    # H100 run 17 (dev/LOG.md): 65 <= M <= 192 runs the fragment path in 64-row tiles (as M = 1: 64 wide,
    # ~4 programs per SM), from M = 193 dequantize + cuBLAS; without cuBLAS large M takes 128 x 128 fused tiles
    for m in (65, 128, 192):
        cfg = pick_config(m, 37888, 3584, num_sms=132)
        assert (cfg.fragment, cfg.block_m, cfg.block_n, cfg.split_k, cfg.cublas) == (True, 64, 64, 1, False), m
    down = pick_config(128, 3584, 18944, num_sms=132)
    assert (down.block_m, down.split_k) == (64, 5)  # 56 x 2 tiles x 5 K-slices ~ 4 x 132 programs
    assert pick_config(193, 37888, 3584, num_sms=132).cublas
    assert not pick_config(300, 37888, 3584, num_sms=132, allow_cublas=False).fragment


BAD_INPUTS = {
    "x_float32": (lambda q: (torch.randn(2, 96), q.weight_packed, q.weight_scale, q.weight_global_scale), "bfloat16"),
    "x_wrong_k": (lambda q: (torch.randn(2, 80).bfloat16(), q.weight_packed, q.weight_scale, q.weight_global_scale), "last dim"),
    "packed_int8": (lambda q: (torch.randn(2, 96).bfloat16(), q.weight_packed.view(torch.int8), q.weight_scale, q.weight_global_scale), "uint8"),
    "packed_3d": (lambda q: (torch.randn(2, 96).bfloat16(), q.weight_packed[None], q.weight_scale, q.weight_global_scale), "uint8 [N, K/2]"),
    "k_not_multiple_of_16": (lambda q: (torch.randn(2, 88).bfloat16(), q.weight_packed[:, :44], q.weight_scale, q.weight_global_scale), "multiple of 16"),
    "packed_non_contiguous": (lambda q: (torch.randn(2, 96).bfloat16(), torch.cat([q.weight_packed, q.weight_packed], 1)[:, ::2],
                                         q.weight_scale, q.weight_global_scale), "contiguous"),
    "scale_uint8": (lambda q: (torch.randn(2, 96).bfloat16(), q.weight_packed, q.weight_scale.view(torch.uint8), q.weight_global_scale), "float8_e4m3fn"),
    "scale_wrong_shape": (lambda q: (torch.randn(2, 96).bfloat16(), q.weight_packed, q.weight_scale[:, :5], q.weight_global_scale), "[N, K/16]"),
    "scale_non_contiguous": (lambda q: (torch.randn(2, 96).bfloat16(), q.weight_packed,
                                        q.weight_scale.float().t().contiguous().t().to(torch.float8_e4m3fn), q.weight_global_scale), "contiguous"),
    "global_scale_bf16": (lambda q: (torch.randn(2, 96).bfloat16(), q.weight_packed, q.weight_scale, q.weight_global_scale.bfloat16()), "float32"),
    "global_scale_two_values": (lambda q: (torch.randn(2, 96).bfloat16(), q.weight_packed, q.weight_scale, q.weight_global_scale.repeat(2)), "one element"),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS), ids=list(BAD_INPUTS))
def test_bad_inputs_raise_with_the_rule(name):
    make, rule = BAD_INPUTS[name]
    args = make(_weights())
    with pytest.raises(ValueError, match=rule.replace("[", r"\[").replace("]", r"\]")):
        fp4_matmul(*args)


def test_bad_bias_impl_out_and_weight_type():
    q = _weights()
    x = torch.randn(2, 96).bfloat16()
    args = (x, q.weight_packed, q.weight_scale, q.weight_global_scale)
    with pytest.raises(ValueError, match="bias must be a bfloat16"):
        fp4_matmul(*args, torch.randn(64))
    with pytest.raises(ValueError, match="bias must be a bfloat16"):
        fp4_matmul(*args, torch.randn(63).bfloat16())
    with pytest.raises(ValueError, match="impl must be one of"):
        fp4_matmul(*args, impl="cuda")
    with pytest.raises(ValueError, match="out must be a contiguous bfloat16"):
        fp4_matmul(*args, out=torch.empty(2, 64))
    with pytest.raises(ValueError, match="PreparedFP4Weight"):
        fp4_linear(x, q)
    if os.environ.get("TRITON_INTERPRET") != "1":
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            fp4_matmul(*args, impl="triton")


def test_kernel_config_validation():
    with pytest.raises(ValueError, match="power of two"):
        KernelConfig(16, 96, 64)
    with pytest.raises(ValueError, match="block_n must be >= 64"):
        KernelConfig(16, 32, 64)


# ---------------------------------------------------------------------------------- CUDA
def _qwen7b_shapes():
    from qerl_lib.bench.gemm import projection_shapes
    return [(s.name, s.n, s.k) for s in projection_shapes("qwen2.5-7b")]


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 3, 16, 17, 64, 128, 150, 300], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("shape", _qwen7b_shapes(), ids=lambda s: f"{s[0]}_{s[1]}x{s[2]}")
def test_cuda_projection_shapes(shape, m, fp32_cublas_sums):
    from qerl_lib.bench.gemm import mean_relative_error
    _, n, k = shape
    seed = m * 7 + n
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = nvfp4.quantize((torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16())
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    bias = torch.randn(n, device="cuda", generator=gen).bfloat16()
    prep = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    fp4_linear(x, prep, bias, out=out)
    ref = nvfp4.reference_matmul(x, q, bias)
    assert not torch.isnan(out).any(), "poisoned output elements were never written"
    rel = mean_relative_error(out.float(), ref.float())
    assert rel <= 1e-3, f"mean rel err {rel:.3g}"
    # elementwise: bf16 output rounding of a float32-accumulated sum (another summation order, one rounding
    # before the bias and one after): see conftest.bf16_gemm_bound
    bound = bf16_gemm_bound(ref, x, nvfp4.dequantize(q, torch.float32).t(), nvfp4.reference_matmul(x, q))
    assert_within_bf16_gemm_bound(out, ref, bound, f"fp4_linear m={m} n={n} k={k} (seed {seed})")
    assert torch.equal(fp4_linear(x, prep, bias), out), "two identical calls differ (race or nondeterminism)"
    raw = fp4_matmul(x, q.weight_packed, q.weight_scale, q.weight_global_scale, bias)
    assert mean_relative_error(raw.float(), ref.float()) <= 1e-3
    assert_within_bf16_gemm_bound(raw, ref, bound, f"fp4_matmul m={m} n={n} k={k} (seed {seed})")


@pytest.mark.cuda
@pytest.mark.parametrize("cfg", [KernelConfig(128, 128, 64, cublas=True), KernelConfig(128, 128, 64, 1, 8, 3, swap_ab=False),
                                 KernelConfig(16, 64, 128, split_k=7), KernelConfig(64, 128, 128, split_k=3, fragment=True)],
                         ids=["cublas", "fused_large", "generic_split7", "fragment_bm64_split3"])
def test_cuda_forced_paths(cfg, fp32_cublas_sums):
    from qerl_lib.bench.gemm import mean_relative_error
    m, n, k = 257, 1000, 1040
    seed = 1040  # fixed: a failure reproduces
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = nvfp4.quantize(torch.randn(n, k, device="cuda", generator=gen).bfloat16())
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    prep = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    fp4_linear(x, prep, out=out, config=cfg)
    assert not torch.isnan(out).any()
    ref = nvfp4.reference_matmul(x, q)
    assert mean_relative_error(out.float(), ref.float()) <= 1e-3
    # elementwise: bf16 output rounding of a float32-accumulated sum in another order (conftest.bf16_gemm_bound);
    # the cuBLAS route runs with cuBLAS's bf16 split-K reductions off (fixture fp32_cublas_sums)
    bound = bf16_gemm_bound(ref, x, nvfp4.dequantize(q, torch.float32).t())
    assert_within_bf16_gemm_bound(out, ref, bound, f"{cfg} (seed {seed})")


@pytest.mark.cuda
def test_cuda_graph_capture():
    gen = torch.Generator(device="cuda").manual_seed(3584)  # seeded: a failure reproduces
    q = nvfp4.quantize(torch.randn(3584, 3584, device="cuda", generator=gen).bfloat16())
    prep = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    assert isinstance(prep, PreparedFP4Weight)
    x = torch.randn(4, 3584, device="cuda", generator=gen).bfloat16()
    eager = fp4_linear(x, prep)
    out = torch.empty_like(eager)
    fp4_linear(x, prep, out=out)  # warm-up (compile) outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp4_linear(x, prep, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)

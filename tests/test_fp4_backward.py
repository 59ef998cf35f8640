"""Tests of the backward-layout FP4 GEMM ``dx = dy @ W`` (the input gradient of a frozen NVFP4 layer):
the oracle ``nvfp4.reference_grad_input``, ``kernels.fp4_gemm.fp4_grad_input``, ``NVFP4Linear``'s
backward on the kernel path, and the ``bwd`` direction of ``qerl bench gemm``.

* CPU: the oracle against a float64 product computed independently from the format bytes, on fresh
  random inputs with leading dims and a row-chunked reduction; bad inputs raise naming the rule;
  the CPU dispatch; the layer's gradients; the benchmark's summary/report on synthetic rows
  (both directions, and legacy rows without a ``direction`` key).
* CPU, Triton interpreter (one subprocess, as tests/test_fp4_kernel.py): ``impl="triton"`` (the
  Triton dequantization + torch's ``addmm``; and the fp32 route taken without a host ``1/gs``).
* CUDA (skipped without a GPU): Qwen2.5-7B shapes at M in {1, 64, 1024, 3000}, the layer's
  kernel-path gradient against the reference path, and bench rows of the bwd direction.

Tolerances.
* Oracle vs float64: the oracle rounds once to bf16 (at most half a bf16 ulp, <= 2^-8 relative) after
  an fp32 sum of exact products and one multiply by ``fl32(1/gs)``; fp32 summation of N terms adds at
  most ``gamma_(N+2) = (N+2) 2^-24 / (1 - (N+2) 2^-24)`` times ``(|dy| @ |W|)`` (the standard dot
  product bound, the +2 covering ``fl32(1/gs)`` and the scaling). So elementwise
  ``|out - ref64| <= 2^-8 |ref64| + 1.01 * gamma_(N+2) * (|dy| @ |W|)``.
* Interpreter vs oracle: the same exact products in another fp32 summation order (torch's CPU bf16
  gemm blocks the sum its own way), which can flip the final bf16 rounding by one ulp (<= 2^-7
  relative) for a few elements; so elementwise ``rtol = 2^-7`` and mean relative error <= 1e-5,
  the bar of tests/test_fp4_kernel.py. (Observed bit-identical on this kit's CPU.)
* GPU vs oracle: the issue's bar, mean relative error <= 1e-3 (observed ~1e-6 in the forward), and every
  element within the bf16 rounding of a float32-accumulated sum (``conftest.bf16_gemm_bound``).
"""

from __future__ import annotations

import math
import textwrap

import pytest
import torch
from torch import nn

from qerl_lib.kernels.fp4_gemm import PreparedFP4Weight, fp4_grad_input, prepare_fp4_weights
from qerl_lib.quant import nvfp4
from tests.conftest import assert_within_bf16_gemm_bound, bf16_gemm_bound, run_triton_interpreter

BF16_HALF_ULP_RTOL = 2.0**-8  # round-to-nearest into bf16 (8 significant bits)
BF16_ULP_RTOL = 2.0**-7  # one bf16 unit in the last place, relative (worst case just above a power of two)
CPU_MEAN_REL_TOL = 1e-5
GPU_MEAN_REL_TOL = 1e-3


def _weights(n: int, k: int, gen: torch.Generator, scale: float = 1.0) -> nvfp4.NVFP4Weight:
    return nvfp4.quantize((torch.randn(n, k, generator=gen) * scale).to(torch.bfloat16))


def _float64_weight(q: nvfp4.NVFP4Weight) -> torch.Tensor:
    """W = e2m1(code) * s / gs in float64, straight from the bytes (low nibble = even element)."""
    table = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
    packed = q.weight_packed.long()
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)  # [N, K]
    values = table[codes & 0x7] * torch.where(codes >= 8, -1.0, 1.0).to(torch.float64)
    scales = q.weight_scale.to(torch.float64).repeat_interleave(nvfp4.GROUP_SIZE, dim=1)
    return values * scales / q.weight_global_scale.to(torch.float64)


def _mean_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    return float((out64 - ref64).abs().mean() / ref64.abs().mean())


# ---------------------------------------------------------------------------------- CPU: the oracle
ORACLE_CASES = [  # (leading dims of dy, N, K, rows of W per chunk or None for the default chunking)
    ((5,), 48, 32, None),
    ((2, 3), 77, 80, 10),      # 10-row chunks over N = 77: the last chunk has 7 rows
    ((4, 1, 2), 50, 208, 16),  # 16-row chunks over N = 50: the last chunk has 2 rows
    ((1,), 130, 48, 64),
    ((0,), 33, 16, None),      # no rows
]


@pytest.mark.parametrize("case", ORACLE_CASES, ids=lambda c: f"lead{'x'.join(map(str, c[0]))}_n{c[1]}_k{c[2]}_chunk{c[3]}")
def test_reference_grad_input_matches_float64(case, monkeypatch):
    lead, n, k, chunk_rows = case
    if chunk_rows is not None:  # make the oracle accumulate over several row chunks of W
        monkeypatch.setattr(nvfp4, "_CHUNK_ELEMENTS", chunk_rows * k)
    gen = torch.Generator().manual_seed(n * 1000 + k)
    q = _weights(n, k, gen, scale=0.05)
    dy = torch.randn(*lead, n, generator=gen).to(torch.bfloat16)
    out = nvfp4.reference_grad_input(dy, q)
    assert out.shape == (*lead, k) and out.dtype == torch.bfloat16
    w64 = _float64_weight(q)
    dy64 = dy.double().reshape(-1, n)
    ref64 = (dy64 @ w64).reshape(*lead, k)
    magnitude = (dy64.abs() @ w64.abs()).reshape(*lead, k)
    u = (n + 2) * 2.0**-24
    bound = BF16_HALF_ULP_RTOL * ref64.abs() + 1.01 * u / (1 - u) * magnitude
    excess = (out.double() - ref64).abs() - bound
    assert out.numel() == 0 or excess.max() <= 0, f"worst excess over the bound {excess.max():.3g}"
    if out.numel():
        assert _mean_rel(out, ref64) <= BF16_HALF_ULP_RTOL


def test_reference_grad_input_in_float32_has_only_the_fp32_sum_error():
    # an fp32 grad_out gets an fp32 result: no final rounding, so only the dot-product bound remains
    gen = torch.Generator().manual_seed(11)
    q = _weights(40, 64, gen)
    dy = torch.randn(3, 40, generator=gen)
    out = nvfp4.reference_grad_input(dy, q)
    assert out.dtype == torch.float32 and out.shape == (3, 64)
    w = _float64_weight(q)
    u = (40 + 2) * 2.0**-24
    assert ((out.double() - dy.double() @ w).abs() <= 1.01 * u / (1 - u) * (dy.double().abs() @ w.abs())).all()


def test_reference_grad_input_rejects_a_wrong_last_dim():
    q = _weights(40, 64, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=r"reference_grad_input: grad_out has last dim 64, the weight expects N = 40"):
        nvfp4.reference_grad_input(torch.randn(2, 64), q)


# ---------------------------------------------------------------------------------- CPU: fp4_grad_input
def _prepared(n=64, k=96, seed=0):
    q = _weights(n, k, torch.Generator().manual_seed(seed))
    return q, prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)


def test_cpu_auto_dispatch_is_the_oracle_with_leading_dims_and_out():
    q, prep = _prepared()
    dy = torch.randn(2, 3, 64).to(torch.bfloat16)
    ref = nvfp4.reference_grad_input(dy, q)
    assert torch.equal(fp4_grad_input(dy, prep), ref)
    out = torch.full((2, 3, 96), float("nan"), dtype=torch.bfloat16)
    assert fp4_grad_input(dy, prep, impl="reference", out=out) is out and torch.equal(out, ref)


BAD_GRAD_INPUTS = {
    "float32_grad": (lambda q, p: dict(grad_out=torch.randn(2, 64), weight=p), "grad_out must be a bfloat16 tensor"),
    "wrong_last_dim": (lambda q, p: dict(grad_out=torch.randn(2, 96).bfloat16(), weight=p),
                       r"grad_out has shape \[2, 96\]; its last dim must equal the weight.s N \(out_features\) = 64"),
    "raw_weight": (lambda q, p: dict(grad_out=torch.randn(2, 64).bfloat16(), weight=q), "PreparedFP4Weight"),
    "wrong_out_shape": (lambda q, p: dict(grad_out=torch.randn(2, 64).bfloat16(), weight=p, out=torch.empty(2, 64).bfloat16()),
                        r"out must be a contiguous bfloat16 tensor of shape \[2, 96\]"),
    "other_device": (lambda q, p: dict(grad_out=torch.empty(2, 64, dtype=torch.bfloat16, device="meta"), weight=p),
                     "grad_out is on meta but the weight is on cpu"),
    "bad_impl": (lambda q, p: dict(grad_out=torch.randn(2, 64).bfloat16(), weight=p, impl="cuda"), "impl must be one of"),
}


@pytest.mark.parametrize("name", list(BAD_GRAD_INPUTS), ids=list(BAD_GRAD_INPUTS))
def test_fp4_grad_input_bad_inputs_raise_with_the_rule(name):
    q, prep = _prepared()
    make, rule = BAD_GRAD_INPUTS[name]
    kwargs = make(q, prep)
    with pytest.raises(ValueError, match=rule):
        fp4_grad_input(kwargs.pop("grad_out"), kwargs.pop("weight"), **kwargs)


def test_fp4_grad_input_kernel_path_checks_dtype_before_running(monkeypatch):
    # impl="triton" on CPU needs the interpreter; the dtype rule holds on that path too
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    _, prep = _prepared()
    with pytest.raises(ValueError, match="grad_out must be a bfloat16 tensor, got torch.float16; convert with grad_out.to"):
        fp4_grad_input(torch.randn(2, 64).half(), prep, impl="triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        fp4_grad_input(torch.randn(2, 64).bfloat16(), prep, impl="triton")


# ---------------------------------------------------------------------------------- CPU: NVFP4Linear
def _layer(impl: str, n=48, k=64, seed=2):
    from qerl_lib.models.nvfp4_linear import NVFP4Linear

    torch.manual_seed(seed)
    return NVFP4Linear.from_linear(nn.Linear(k, n, bias=True).to(torch.bfloat16), impl=impl, name="probe")


def _input_grad(layer, x, grad):
    x = x.detach().clone().requires_grad_(True)
    layer(x).backward(grad)
    return x.grad


def test_layer_kernel_path_backward_is_fp4_grad_input_and_close_to_the_reference_path():
    kernel, reference = _layer("kernel"), _layer("reference")
    x = torch.randn(2, 5, 64).to(torch.bfloat16)
    grad = torch.randn(2, 5, 48).to(torch.bfloat16)
    gx = _input_grad(kernel, x, grad)
    # on CPU fp4_grad_input dispatches to the oracle: exact products, fp32 sum, 1/gs once, one rounding
    assert torch.equal(gx, nvfp4.reference_grad_input(grad, kernel.nvfp4_weight))
    # the reference path multiplies by the bf16-rounded weights (CT's dequantize), unchanged
    gx_ref = _input_grad(reference, x, grad)
    assert torch.equal(gx_ref, grad @ reference.dequantize())
    # the two differ by each weight's bf16 rounding (<= 2^-9 relative): ~1e-3 of the gradient on average
    assert _mean_rel(gx, gx_ref) <= 5e-3
    assert all(not b.requires_grad and b.grad is None for b in kernel.buffers())


# ---------------------------------------------------------------------------------- CPU: bench summary
def _row(direction, model="m7", m=16, speedup=1.0, ok=True, layout="hf", rel_err=1e-6):
    row = {"model": model, "proj": "q_proj", "layout": layout, "n": 64, "k": 32, "m": m, "speedup": speedup,
           "ok": ok, "rel_err": rel_err, "bf16_us": 1.0, "fp4_us": 1.0 / speedup, "byte_ceiling": 3.5,
           "fp4_gbps": 1.0, "fp4_pct_copy": 1.0, "bf16_pct_copy": 1.0, "path": "x"}
    if direction is not None:
        row["direction"] = direction
    return row


def _synthetic_rows():
    return [
        _row(None, m=4, speedup=2.0), _row(None, m=1024, speedup=0.8),             # legacy rows: forward
        _row("fwd", m=16, speedup=8.0, layout="fused"), _row("fwd", m=4096, speedup=0.9),
        _row("bwd", m=16, speedup=0.1), _row("bwd", m=1024, speedup=0.6), _row("bwd", m=4096, speedup=0.7),
        _row("fwd", model="m32", m=1024, speedup=1.1),                             # a model without bwd rows
    ]


def test_summarize_keeps_the_forward_meaning_and_adds_the_backward_minimum():
    from qerl_lib.bench.gemm import summarize

    s = summarize(_synthetic_rows())
    m7 = s["m7"]
    assert m7["geomean_speedup_m_le_16"] == pytest.approx(4.0)  # fwd M <= 16 only: sqrt(2 * 8), not the bwd 0.1
    assert m7["geomean_speedup_m_le_16_hf"] == pytest.approx(2.0)
    assert m7["geomean_speedup_m_le_16_fused"] == pytest.approx(8.0)
    assert m7["min_speedup_m_ge_1024"] == m7["min_speedup_m_ge_1024_fwd"] == pytest.approx(0.8)
    assert m7["min_speedup_m_ge_1024_bwd"] == pytest.approx(0.6)
    assert s["m32"]["min_speedup_m_ge_1024_bwd"] is None and s["m32"]["min_speedup_m_ge_1024"] == pytest.approx(1.1)
    assert m7["all_ok"]
    failing = _synthetic_rows()
    failing[5]["ok"], failing[5]["rel_err"] = False, 0.5
    s = summarize(failing)["m7"]
    assert not s["all_ok"] and s["max_rel_err"] == 0.5  # correctness covers the bwd rows too


@pytest.mark.parametrize("path, has_bwd", [("dev/runs/gemm_h100_v3.json", False), ("dev/runs/gemm_h100_v4.json", True),
                                           ("dev/runs/fp4_producer_h100_2026-11-27/gemm_bench_run5.json", True),
                                           ("dev/runs/fp4_producer_h100_2026-11-27/gemm_bench_run8.json", True),
                                           ("results/gemm_h100_v5.json", True)])
def test_summarize_of_the_committed_results_is_unchanged(path, has_bwd):
    """A forward-only record (rows without ``direction``) and one with both layouts re-summarize to
    what ``bench gemm`` stored when it ran."""
    import json

    from qerl_lib.bench.gemm import summarize
    from qerl_lib.paths import REPO_ROOT

    doc = json.loads((REPO_ROOT / path).read_text())
    assert any(r.get("direction") == "bwd" for r in doc["rows"]) == has_bwd
    s = summarize(doc["rows"])
    for model, stored in doc["summary"].items():
        for key, value in stored.items():
            assert s[model][key] == pytest.approx(value), (model, key)
        assert (s[model]["min_speedup_m_ge_1024_bwd"] is not None) == has_bwd
        if not has_bwd:
            assert s[model]["min_speedup_m_ge_1024_fwd"] == s[model]["min_speedup_m_ge_1024"]


def test_render_gemm_report_shows_the_direction_and_both_minima():
    from qerl_lib.bench.gemm import TABLE_COLUMNS, render_gemm_report, summarize

    rows = _synthetic_rows()
    doc = {"rows": rows, "summary": summarize(rows), "provenance": {"device": {"name": "probe-gpu"}},
           "device": {"copy_gbps": 1000.0}, "ceiling": 3.56}
    text = render_gemm_report(doc)
    lines = text.splitlines()
    assert lines[0].split()[2] == "dir" and [c[0] for c in TABLE_COLUMNS][2] == "dir"
    table = lines[2:2 + len(rows)]
    assert [ln.split()[2] for ln in table] == ["fwd", "fwd", "fwd", "fwd", "bwd", "bwd", "bwd", "fwd"]
    assert "m7: geomean speedup M<=16 4.00x" in text
    assert "min speedup M>=1024 fwd 0.80x, bwd 0.60x" in text
    assert "m32: " in text and "fwd 1.10x, bwd -;" in text


def test_gemm_headline_reads_forward_rows_and_reports_the_backward_minimum():
    from qerl_lib.studies.kernel import gemm_headline

    h = gemm_headline({"rows": _synthetic_rows()})["m7"]
    assert h["geomean_speedup_m_le_16"] == pytest.approx(4.0)
    assert h["min_speedup_m_ge_1024"] == pytest.approx(0.8) and h["min_speedup_m_ge_1024_at"] == "q_proj M=1024"
    assert h["min_speedup_m_ge_1024_bwd"] == pytest.approx(0.6) and h["min_speedup_m_ge_1024_bwd_at"] == "q_proj M=1024"


def test_cli_rejects_an_unknown_direction_before_touching_a_gpu(capsys):
    from qerl_lib.cli import main

    code = main(["bench", "gemm", "--directions", "fwd,sideways"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--directions accepts fwd and bwd" in err and "sideways" in err


# ---------------------------------------------------------------------------------- CPU: Triton interpreter
INTERP_CASES = [  # (name, leading dims of dy, N, K); K a multiple of 16 but not of the dequant kernel's 128-wide tile
    ("m1_n33_k48", [1], 33, 48),
    ("m3_n77_k80", [3], 77, 80),
    ("m17_n130_k208", [17], 130, 208),
    ("lead3x1_n65_k400", [3, 1], 65, 400),
    ("m64_n300_k256", [64], 300, 256),
]

INTERP_SCRIPT = textwrap.dedent("""
    import json, os, sys, zlib
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from qerl_lib.quant import nvfp4
    from qerl_lib.kernels.fp4_gemm import PreparedFP4Weight, fp4_grad_input, prepare_fp4_weights
    results = {}
    for name, lead, n, k in json.loads(sys.argv[1]):
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        q = nvfp4.quantize(torch.randn(n, k, generator=gen).to(torch.bfloat16), name=name)
        dy = torch.randn(*lead, n, generator=gen).to(torch.bfloat16)
        ref = nvfp4.reference_grad_input(dy, q)
        prep = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
        no_host_gs = PreparedFP4Weight(prep.words, prep.scales, prep.global_scale, float("nan"))
        for route, weight in (("addmm", prep), ("fp32", no_host_gs)):
            out = torch.full(ref.shape, float("nan"), dtype=torch.bfloat16)  # poison: unwritten stays NaN
            ret = fp4_grad_input(dy, weight, impl="triton", out=out)
            d = (out.double() - ref.double()).abs()
            results[name + "/" + route] = {
                "shape": list(out.shape), "ref_shape": list(ref.shape), "same_object": ret.data_ptr() == out.data_ptr() and ret.shape == out.shape,
                "nan": int(torch.isnan(out).sum()), "equal": bool(torch.equal(out, ref)),
                "mean_rel": float(d.mean() / ref.double().abs().mean()),
                "max_ulp_rel": float((d / ref.double().abs().clamp_min(1e-30)).max()),
                "fresh_equal": bool(torch.equal(fp4_grad_input(dy, weight, impl="triton"), out))}
    print("RESULTS " + json.dumps(results))
""")


@pytest.fixture(scope="module")
def interp_results():
    return run_triton_interpreter(INTERP_SCRIPT, INTERP_CASES, timeout=300)


@pytest.mark.parametrize("route", ["addmm", "fp32"])
@pytest.mark.parametrize("case", INTERP_CASES, ids=[c[0] for c in INTERP_CASES])
def test_triton_interpreter_matches_the_oracle(interp_results, case, route):
    r = interp_results[f"{case[0]}/{route}"]
    assert r["shape"] == r["ref_shape"] == [*case[1], case[3]]
    assert r["same_object"] and r["fresh_equal"]
    assert r["nan"] == 0, f"{r['nan']} output elements never written (poisoned NaN survived)"
    assert r["max_ulp_rel"] <= BF16_ULP_RTOL, f"max elementwise rel diff {r['max_ulp_rel']:.3g}"
    assert r["mean_rel"] <= CPU_MEAN_REL_TOL, f"mean rel err {r['mean_rel']:.3g}"


# ---------------------------------------------------------------------------------- CUDA
QWEN7B_SHAPES = [(3584, 3584), (18944, 3584), (3584, 18944)]  # (N, K): q/o_proj, gate/up_proj, down_proj


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 64, 1024, 3000], ids=lambda m: f"m{m}")
@pytest.mark.parametrize("shape", QWEN7B_SHAPES, ids=lambda s: f"n{s[0]}_k{s[1]}")
def test_cuda_grad_input_qwen7b_shapes(shape, m, fp32_cublas_sums):
    n, k = shape
    seed = m * 7 + n + 3 * k
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = nvfp4.quantize((torch.randn(n, k, device="cuda", generator=gen) * 0.02).bfloat16())
    prep = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    dy = torch.randn(m, n, device="cuda", generator=gen).bfloat16()
    out = torch.full((m, k), float("nan"), dtype=torch.bfloat16, device="cuda")
    fp4_grad_input(dy, prep, out=out)
    ref = nvfp4.reference_grad_input(dy, q)
    assert not torch.isnan(out).any(), "poisoned output elements were never written"
    rel = _mean_rel(out, ref)
    assert rel <= GPU_MEAN_REL_TOL, f"mean rel err {rel:.3g}"
    # elementwise: bf16 output rounding of a float32-accumulated sum over N in another order
    # (conftest.bf16_gemm_bound; cuBLAS's bf16 split-K reductions off, fixture fp32_cublas_sums)
    bound = bf16_gemm_bound(ref, dy, nvfp4.dequantize(q, torch.float32))
    assert_within_bf16_gemm_bound(out, ref, bound, f"fp4_grad_input m={m} n={n} k={k} (seed {seed})")
    assert torch.equal(fp4_grad_input(dy, prep), out), "two identical calls differ"
    no_host_gs = PreparedFP4Weight(prep.words, prep.scales, prep.global_scale, float("nan"))
    via_fp32 = fp4_grad_input(dy, no_host_gs)
    assert _mean_rel(via_fp32, ref) <= GPU_MEAN_REL_TOL
    assert_within_bf16_gemm_bound(via_fp32, ref, bound, f"fp4_grad_input without a host 1/gs, m={m} n={n} k={k} "
                                                        f"(seed {seed})")


@pytest.mark.cuda
def test_cuda_grad_input_leading_dims_and_empty(fp32_cublas_sums):
    gen = torch.Generator(device="cuda").manual_seed(512)  # seeded: a failure reproduces
    q = nvfp4.quantize(torch.randn(512, 256, device="cuda", generator=gen).bfloat16())
    prep = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    dy = torch.randn(2, 3, 512, device="cuda", generator=gen).bfloat16()
    out = fp4_grad_input(dy, prep)
    ref = nvfp4.reference_grad_input(dy, q)
    assert out.shape == (2, 3, 256) and _mean_rel(out, ref) <= GPU_MEAN_REL_TOL
    assert_within_bf16_gemm_bound(out, ref, bf16_gemm_bound(ref, dy, nvfp4.dequantize(q, torch.float32)),
                                  "fp4_grad_input [2, 3, 512] (seed 512)")
    assert fp4_grad_input(dy[:, :0], prep).shape == (2, 0, 256)


@pytest.mark.cuda
@pytest.mark.parametrize("shape", [(3584, 3584), (18944, 3584)], ids=lambda s: f"n{s[0]}_k{s[1]}")
def test_cuda_layer_kernel_path_grad_matches_the_reference_path(shape, fp32_cublas_sums):
    from qerl_lib.models.nvfp4_linear import NVFP4Linear

    n, k = shape
    torch.manual_seed(5)
    linear = nn.Linear(k, n, bias=False, device="cuda").to(torch.bfloat16)
    kernel = NVFP4Linear.from_linear(linear, impl="kernel", name="probe")
    reference = NVFP4Linear.from_linear(linear, impl="reference", name="probe")
    x = torch.randn(4, 256, k, device="cuda").bfloat16()
    grad = torch.randn(4, 256, n, device="cuda").bfloat16()
    gx = _input_grad(kernel, x, grad)
    gx_ref = _input_grad(reference, x, grad)
    # the kernel path is the Marlin-style oracle up to fp32 summation order (the 1e-3 bar), and elementwise
    # within the bf16 output rounding of a float32-accumulated sum over N (conftest.bf16_gemm_bound)
    oracle = nvfp4.reference_grad_input(grad, kernel.nvfp4_weight)
    assert _mean_rel(gx, oracle) <= GPU_MEAN_REL_TOL
    assert_within_bf16_gemm_bound(gx, oracle, bf16_gemm_bound(oracle, grad, nvfp4.dequantize(kernel.nvfp4_weight,
                                                                                             torch.float32)),
                                  f"NVFP4Linear kernel-path grad, n={n} k={k} (seed 5)")
    # the reference path rounds every weight to bf16 first (<= 2^-9 relative each): ~1.6e-3 of the
    # gradient on average for random data (measured on CPU); 5e-3 leaves room for the data's spread
    assert _mean_rel(gx, gx_ref) <= 5e-3
    assert not torch.isnan(gx).any()


@pytest.mark.cuda
def test_cuda_bench_rows_of_both_directions():
    from qerl_lib.bench.gemm import GemmShape, bench_gemm_shape, l2_cache_bytes, summarize

    shape = GemmShape("probe", "probe_proj", 512, 1024, "hf")
    rows = bench_gemm_shape(shape, [16, 1024], l2=l2_cache_bytes(), copy_gbps=1000.0, progress=None)
    assert [(r["m"], r["direction"]) for r in rows] == [(16, "fwd"), (16, "bwd"), (1024, "fwd"), (1024, "bwd")]
    for r in rows:
        assert r["ok"] and r["unwritten"] == 0 and r["rel_err"] <= GPU_MEAN_REL_TOL, r
        assert math.isfinite(r["speedup"]) and r["speedup"] > 0 and r["fp4_us"] > 0 and r["bf16_us"] > 0
    bwd = [r for r in rows if r["direction"] == "bwd"]
    assert all(r["path"] == "dequant+cublas" and r["config"] is None for r in bwd)
    s = summarize(rows)["probe"]
    assert s["min_speedup_m_ge_1024_bwd"] == bwd[1]["speedup"] and s["all_ok"]

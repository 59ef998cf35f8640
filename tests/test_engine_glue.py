"""The decode step's glue kernels (qerl_lib.engine.glue) against engine/forward.py's torch functions,
and programmatic dependent launch of the NVFP4 mma kernel after them.

* CPU, Triton interpreter (subprocess): float32 and float16 inputs, awkward widths (not a power of
  two, wider than one SiLU block), gate/up as strided views of one fused output. The RMSNorm sums
  in another order than torch, so results agree within one rounding step of the dtype (1e-6
  relative for float32; 2^-10 for float16, on <1% of elements); the residual sum is exact.
  The interpreter rounds bf16 conversions wrongly, so bf16 is a GPU test.
* CUDA: bf16 against torch within one bf16 rounding step; a CUDA graph of glue kernel -> mma
  matmul launched with PDL gives the same bits as the plain launch, over replays whose inputs change
  (the matmul must wait for the glue kernel's output).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.conftest import run_triton_interpreter

INTERP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from qerl_lib.engine import glue
    from qerl_lib.engine.forward import gated_act, residual_rms_norm, rms_norm
    out = {}
    for dtype_name, width in json.loads(sys.argv[1]):
        dt = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(width)
        x, d = (torch.randn(3, 1, width, generator=g).to(dt) for _ in range(2))
        w = (1 + 0.1 * torch.randn(width, generator=g)).to(dt)
        s, h = glue.residual_rms_norm(x, d, w, 1e-6)
        s0, h0 = residual_rms_norm(x, d, w, 1e-6)
        h1, h10 = glue.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5)
        fused = torch.randn(3, 1, 2 * width, generator=g).to(dt)
        gate, up = fused[..., :width], fused[..., width:]
        a, a0 = glue.silu_mul(torch.nn.SiLU(), gate, up), gated_act(torch.nn.SiLU(), gate, up)
        rel = lambda u, v: float(((u.double() - v.double()).abs() / v.double().abs().clamp_min(1e-3)).max())
        out[f"{dtype_name}-{width}"] = {
            "sum_equal": bool(torch.equal(s, s0)), "norm_rel": rel(h, h0), "plain_norm_rel": rel(h1, h10),
            "silu_rel": rel(a, a0), "shape": list(a.shape),
            "differ": max(float((h != h0).float().mean()), float((h1 != h10).float().mean()),
                          float((a != a0).float().mean()))}
    print("RESULTS " + json.dumps(out))
""")

CASES = [("float32", 3584), ("float32", 1000), ("float16", 3584), ("float16", 4500)]


@pytest.fixture(scope="module")
def interpreted():
    return run_triton_interpreter(INTERP_SCRIPT, CASES)


@pytest.mark.parametrize("dtype,width", CASES)
def test_glue_kernels_match_torch_in_the_interpreter(interpreted, dtype, width):
    r = interpreted[f"{dtype}-{width}"]
    assert r["sum_equal"]  # x + delta: one rounding, same value
    assert r["shape"] == [3, 1, width]
    # the variance is summed in another order: at most one rounding step apart, and rarely
    tol = 2.0**-10 if dtype == "float16" else 1e-6
    assert r["norm_rel"] <= tol and r["plain_norm_rel"] <= tol and r["silu_rel"] <= tol, r
    if dtype == "float16":  # (in float32 the last bit of exp differs often; the bound above is what counts)
        assert r["differ"] < 0.01, r


def test_silu_mul_refuses_mismatched_shapes():
    from qerl_lib.engine import glue as engine_glue

    if engine_glue.triton is None:
        pytest.skip("triton not installed")
    with pytest.raises(ValueError, match="silu_mul"):
        engine_glue.silu_mul(None, torch.zeros(2, 4), torch.zeros(2, 5))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
def test_cuda_bf16_glue_within_one_rounding():
    from qerl_lib.engine import glue
    from qerl_lib.engine.forward import gated_act, residual_rms_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    x, d = (torch.randn(8, 1, 3584, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    w = (1 + 0.1 * torch.randn(3584, generator=g, device="cuda")).to(torch.bfloat16)
    s, h = glue.residual_rms_norm(x, d, w, 1e-6)
    s0, h0 = residual_rms_norm(x, d, w, 1e-6)
    assert torch.equal(s, s0)
    torch.testing.assert_close(h.float(), h0.float(), rtol=2.0**-7, atol=0)  # at most one bf16 step apart
    assert (h != h0).float().mean() < 0.01
    fused = torch.randn(8, 1, 2 * 18944, generator=g, device="cuda").to(torch.bfloat16)
    gate, up = fused[..., :18944], fused[..., 18944:]
    a, a0 = glue.silu_mul(torch.nn.SiLU(), gate, up), gated_act(torch.nn.SiLU(), gate, up)
    torch.testing.assert_close(a.float(), a0.float(), rtol=2.0**-7, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU with compute capability >= 9.0 (PDL, mma kernel)")
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 18944)])
def test_cuda_pdl_matmul_after_glue_kernel_in_a_graph(n, k):
    from qerl_lib.engine import glue
    from qerl_lib.kernels import mma
    from qerl_lib.kernels.fp4_gemm import prepare_fp4_weights
    from qerl_lib.quant.nvfp4 import quantize

    if not mma.available():
        pytest.skip(f"mma kernel unavailable: {mma.unavailable_reason()}")
    g = torch.Generator(device="cuda").manual_seed(1)
    q = quantize((torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16))
    wt = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    w = torch.ones(k, dtype=torch.bfloat16, device="cuda")
    x, d = (torch.randn(8, 1, k, generator=g, device="cuda").to(torch.bfloat16) for _ in range(2))
    inputs = [torch.randn(8, 1, k, generator=g, device="cuda").to(torch.bfloat16) * (i + 1) for i in range(3)]
    outs = {}
    for pdl in (False, True):
        out = torch.empty(8, n, dtype=torch.bfloat16, device="cuda")

        def step():
            _, h = glue.residual_rms_norm(x, d, w, 1e-6)
            mma.mma_linear(h.view(8, k), wt.words, wt.scales, wt.global_scale, None, out, pdl=pdl)
            return out

        step()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        got = []
        for new_x in inputs:  # new inputs each replay: a matmul that read h too early would see stale values
            x.copy_(new_x)
            graph.replay()
            got.append(out.clone())
        outs[pdl] = got
    for plain, early in zip(outs[False], outs[True]):
        assert torch.equal(plain, early)

"""The decode step's glue kernels (qerl_lib.engine.glue) against engine/forward.py's torch functions,
and programmatic dependent launch of the NVFP4 mma kernel after them.

* CPU, Triton interpreter (subprocess): float32 and float16 inputs, awkward widths (not a power of
  two, wider than one SiLU block), gate/up as strided views of one fused output. The RMSNorm sums
  in another order than torch, so results agree within one rounding step of the dtype (1e-6
  relative for float32; 2^-10 for float16, on <1% of elements); the residual sum is exact.
  The interpreter rounds bf16 conversions wrongly, so bf16 is a GPU test.
* SiLU x up adding the gate/up group's LoRA expand (``lora=``): in the interpreter (float32) against the
  reference (``kernels/lora.reference_apply``, then SiLU x up) within 1e-5 of the output's scale, for
  both members adapted, one absent, ranks that pad, two row blocks, partials summed by either kernel;
  the group's output is left unwritten. On CUDA, bf16 on Qwen2.5-7B's gate/up shape against the
  two-kernel path (expand kernel, then SiLU x up): within one bf16 step, nearly always equal.
* CUDA: bf16 against torch within one bf16 rounding step; a CUDA graph of glue kernel -> mma
  matmul launched with PDL gives the same bits as the plain launch, over replays whose inputs change
  (the matmul must wait for the glue kernel's output).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.conftest import requires_triton, run_triton_interpreter

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
        if width % 128 == 0:  # the relabeled second outputs: permute_x of the first, bit for bit
            from qerl_lib.kernels.fp4_wgmma import permute_x
            flat = lambda t: t.reshape(-1, width)
            _, h_r, hr = glue.residual_rms_norm(x, d, w, 1e-6, relabeled=True)
            h1_r, h1r = glue.rms_norm(x, w, 1e-5, relabeled=True)
            a_r, ar = glue.silu_mul(torch.nn.SiLU(), gate, up, relabeled=True)
            out[f"relabeled-{dtype_name}-{width}"] = [bool(torch.equal(r, permute_x(flat(t))))
                                                      for r, t in ((hr, h_r), (h1r, h1_r), (ar, a_r))]
        else:
            try:
                glue.silu_mul(torch.nn.SiLU(), gate, up, relabeled=True)
                out[f"relabeled-{dtype_name}-{width}"] = "accepted"
            except ValueError as e:
                out[f"relabeled-{dtype_name}-{width}"] = str(e)
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


@pytest.mark.parametrize("dtype,width", CASES)
def test_glue_kernels_write_the_relabeled_copy_in_the_interpreter(interpreted, dtype, width):
    r = interpreted[f"relabeled-{dtype}-{width}"]
    if width % 128 == 0:  # norm after a residual add, plain norm, SiLU x up: each copy is permute_x(output)
        assert r == [True, True, True]
    else:
        assert "multiple of 128" in r


# (rows, K, [(width, rank or 0, scale)] for gate and up)
FOLD_CASES = [
    (8, 256, [(192, 16, 2.0), (192, 16, 2.0)]),
    (17, 2500, [(300, 8, 1.0), (300, 0, 1.0)]),      # up without an adapter; 5 K slices summed by the reader
    (70, 1100, [(130, 0, 0.0), (130, 33, 0.25)]),    # gate without one; rank 33 pads to 64; two row blocks
    (5, 1300, [(100, 40, 1.0), (100, 40, 0.5)]),     # rank 40 at M <= 8: the shrink sums the partials
    (20, 512, [(256, 16, 1.0), (256, 8, 0.5)]),      # widths of 128-column blocks: the relabeled copy too
]

FOLD_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from qerl_lib.engine import glue
    from qerl_lib.engine.forward import gated_act
    from qerl_lib.kernels import lora as lk
    from tests.test_lora_kernels import make_group
    out = {}
    for i, (m, k, members) in enumerate(json.loads(sys.argv[1])):
        plan, x, base = make_group(m, k, members, torch.float32, "cpu", seed=10 + i)
        width = members[0][0]
        kept = base.clone()
        got = glue.silu_mul(torch.nn.SiLU(), base[:, :width], base[:, width:], lora=lk.shrink_(x, plan))
        if width % 128 == 0:
            from qerl_lib.kernels.fp4_wgmma import permute_x
            got2, got_r = glue.silu_mul(torch.nn.SiLU(), base[:, :width], base[:, width:], lora=lk.shrink_(x, plan),
                                        relabeled=True)
            out[f"relabeled-{i}"] = bool(torch.equal(got2, got) and torch.equal(got_r, permute_x(got)))
        full = lk.reference_apply(base.clone(), x, plan)
        ref = gated_act(torch.nn.SiLU(), full[:, :width], full[:, width:])
        plain = gated_act(torch.nn.SiLU(), base[:, :width], base[:, width:])
        out[i] = {"err": float((got - ref).abs().max() / ref.abs().max()),
                  "effect": float((ref - plain).abs().max() / ref.abs().max()),
                  "output_untouched": bool(torch.equal(base, kept))}
    print("RESULTS " + json.dumps(out))
""")


SHRINK_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from qerl_lib.engine import glue
    from qerl_lib.engine.forward import residual_rms_norm, rms_norm
    out = {}
    for dtype_name, width, r in json.loads(sys.argv[1]):
        dt = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(width + r)
        x, d = (torch.randn(5, 1, width, generator=g).to(dt) for _ in range(2))
        w = (1 + 0.1 * torch.randn(width, generator=g)).to(dt)
        a_cat = (0.05 * torch.randn(r, width, generator=g)).to(dt)
        s, h, xa = glue.norm_shrink(x, d, w, 1e-6, a_cat)
        s0, h0 = residual_rms_norm(x, d, w, 1e-6)
        x1, h1, xa1 = glue.norm_shrink(x, None, w, 1e-5, a_cat)
        rel = lambda u, v: float(((u.double() - v.double()).abs() / v.double().abs().clamp_min(1e-3)).max())
        def shrink_ok(xa, h):  # one rounding to dt of the float64 dot, plus float32's summation error
            exact = h.reshape(-1, width).double() @ a_cat.double().t()
            sums = h.reshape(-1, width).double().abs() @ a_cat.double().abs().t()
            unit = 2.0 ** -10 if dt == torch.float16 else 2.0 ** -23
            return bool(((xa.double() - exact).abs() <= unit * exact.abs() + 1e-6 * sums + 1e-7).all())
        out[f"{dtype_name}-{width}-{r}"] = {
            "sum_equal": bool(torch.equal(s, s0)), "same_x": x1 is x, "norm_rel": rel(h, h0),
            "plain_norm_rel": rel(h1, rms_norm(x, w, 1e-5)), "xa_shape": list(xa.shape),
            "xa_ok": shrink_ok(xa, h), "plain_xa_ok": shrink_ok(xa1, h1),
            "xa_rounded": bool(torch.equal(xa, xa.to(dt).float())), "xa_dtype": str(xa.dtype)}
    print("RESULTS " + json.dumps(out))
""")

SHRINK_CASES = [("float32", 3584, 48), ("float32", 1000, 5), ("float16", 3584, 48), ("float16", 1000, 5)]


@pytest.fixture(scope="module")
def interpreted_shrink():
    return run_triton_interpreter(SHRINK_SCRIPT, SHRINK_CASES)


@pytest.mark.parametrize("dtype,width,rank", SHRINK_CASES)
def test_norm_shrink_matches_the_norm_and_x_at_a_in_the_interpreter(interpreted_shrink, dtype, width, rank):
    """``glue.norm_shrink``: the sum is the torch path's bit for bit, the norm within the plain kernel's bound (the
    variance is summed in another order), and ``xa`` one rounding of the float64 ``h @ A^T`` (float32 values); a
    rank count that is not a multiple of the programs' rank block (5) and a width that is not one of their step
    (1000) included."""
    r = interpreted_shrink[f"{dtype}-{width}-{rank}"]
    tol = 2.0**-10 if dtype == "float16" else 1e-6
    assert r["sum_equal"] and r["same_x"] and r["xa_shape"] == [5, rank] and r["xa_dtype"] == "torch.float32", r
    assert r["norm_rel"] <= tol and r["plain_norm_rel"] <= tol, r
    assert r["xa_ok"] and r["plain_xa_ok"] and r["xa_rounded"], r


def test_norm_shrink_refuses_an_a_of_another_width():
    from qerl_lib.engine import glue

    with pytest.raises(ValueError, match=r"A_cat must be \[R, 64\]"):
        glue.norm_shrink(torch.zeros(2, 64), None, torch.ones(64), 1e-6, torch.zeros(4, 32))


@pytest.fixture(scope="module")
def interpreted_fold():
    return run_triton_interpreter(FOLD_SCRIPT, FOLD_CASES, timeout=600)


@pytest.mark.parametrize("i", range(len(FOLD_CASES)))
def test_silu_mul_with_lora_matches_the_reference_in_the_interpreter(interpreted_fold, i):
    r = interpreted_fold[str(i)]
    assert r["effect"] > 0.05, "the adapters must change the activation for the test to mean anything"
    assert r["err"] <= 1e-5, r
    assert r["output_untouched"]
    if FOLD_CASES[i][2][0][0] % 128 == 0:
        assert interpreted_fold[f"relabeled-{i}"]  # same output, and its copy is permute_x of it


@requires_triton
def test_silu_mul_with_lora_refuses_a_split_it_does_not_cover():
    from qerl_lib.engine import glue as engine_glue
    from qerl_lib.kernels import lora as lk
    from tests.test_lora_kernels import make_group

    assert engine_glue.triton is not None, "triton is installed but qerl_lib.engine.glue did not import it"
    plan, _, base = make_group(2, 64, [(32, 4, 1.0), (32, 4, 1.0)], torch.float32, "cpu")
    shrunk = lk.Shrunk(torch.zeros(2, 8), 1, 2, plan, 16, "ieee", False)
    with pytest.raises(ValueError, match="silu_mul: with lora="):  # halves of another width than the plan's
        engine_glue.silu_mul(None, base[:, :16], base[:, 16:32], lora=shrunk)
    with pytest.raises(ValueError, match="silu_mul: with lora="):  # not adjacent halves of one output
        engine_glue.silu_mul(None, base[:, :32].clone(), base[:, 32:].clone(), lora=shrunk)


@requires_triton
def test_silu_mul_refuses_mismatched_shapes():
    from qerl_lib.engine import glue as engine_glue

    assert engine_glue.triton is not None, "triton is installed but qerl_lib.engine.glue did not import it"
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
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("rows", [1, 8, 32, 64, 200])
@pytest.mark.parametrize("pdl_on", [True, False], ids=["pdl", "plain"])
def test_cuda_silu_mul_with_lora_equals_the_expand_kernel_path(rank, rows, pdl_on):
    from qerl_lib.engine import glue
    from qerl_lib.kernels import lora as lk
    from tests.test_lora_kernels import make_group

    for members in ([(18944, rank, 2.0), (18944, rank, 2.0)], [(18944, 0, 0.0), (18944, rank, 2.0)]):
        plan, x, base = make_group(rows, 3584, members, torch.bfloat16, "cuda", seed=rank + rows)
        got = glue.silu_mul(torch.nn.SiLU(), base[:, :18944], base[:, 18944:], lora=lk.shrink_(x, plan, use_pdl=pdl_on))
        full = lk.apply_(base.clone(), x, plan, use_pdl=pdl_on)
        ref = glue.silu_mul(torch.nn.SiLU(), full[:, :18944], full[:, 18944:])
        plain = glue.silu_mul(torch.nn.SiLU(), base[:, :18944], base[:, 18944:])
        assert (ref.float() - plain.float()).abs().max() > 0.1, "the adapters must change the activation"
        torch.testing.assert_close(got.float(), ref.float(), rtol=2.0**-7, atol=1e-6)  # at most one bf16 step
        assert (got != ref).float().mean() < 0.01


def _mma_unavailable() -> str | None:
    """Why the NVFP4 mma.sync kernel cannot run here (no CUDA, capability < 9.0, no NVRTC or driver library), or None."""
    from qerl_lib.kernels import mma

    return mma.unavailable_reason()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="needs a CUDA GPU with compute capability >= 9.0 (PDL, mma kernel)")
@pytest.mark.skipif(_mma_unavailable() is not None, reason=f"mma kernel unavailable: {_mma_unavailable()}")
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 18944)])
def test_cuda_pdl_matmul_after_glue_kernel_in_a_graph(n, k):
    from qerl_lib.engine import glue
    from qerl_lib.kernels import mma
    from qerl_lib.kernels.fp4_gemm import prepare_fp4_weights
    from qerl_lib.quant.nvfp4 import quantize

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


def test_cpu_prefill_keeps_the_plain_ops(monkeypatch):
    """Off CUDA the prefill runs transformers' own arithmetic (the engine equals ``generate`` bit for bit there),
    whatever ``QERL_PREFILL_GLUE`` says."""
    from qerl_lib.engine.rollout import RolloutEngine
    from tests.test_engine import tiny_model

    monkeypatch.setenv("QERL_PREFILL_GLUE", "1")
    engine = RolloutEngine(tiny_model("qwen2"))
    engine.generate([[5, 6, 7]], 2, temperature=0.0, stop_token_ids=[])
    assert engine._forward.prefill_ops is engine._forward.eager_ops


def float32_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A float32 copy of ``model`` with the same weights: every ``NVFP4Linear`` becomes an ``nn.Linear`` holding its
    dequantized weight in float32 (``fp4 * s / gs``, the products the NVFP4 GEMMs form exactly). Its logits are the
    reference the bf16 paths' rounding error is measured against."""
    import copy

    from qerl_lib.models.nvfp4_linear import NVFP4Linear

    twin = copy.deepcopy(model)
    for name, module in list(twin.named_modules()):
        if isinstance(module, NVFP4Linear):
            dense = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                    device=module.weight_packed.device, dtype=torch.float32)
            with torch.no_grad():
                dense.weight.copy_(module.dequantize(torch.float32))
                if module.bias is not None:
                    dense.bias.copy_(module.bias.float())
            twin.set_submodule(name, dense)
    return twin.float().eval()


def twin_last_logits(twin: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """transformers' float32 logits of the last column for left-padded ``tokens`` (pad id 0; the prompts' ids are
    >= 3), with the prefill's RoPE ``positions``: on a CPU this equals the engine's float32 prefill exactly."""
    with torch.no_grad():
        out = twin(input_ids=tokens, attention_mask=(tokens != 0).long(), position_ids=positions)
    return out.logits[:, -1].float()


@pytest.mark.cuda
@pytest.mark.parametrize("weights", ["bf16", "nvfp4"])
def test_cuda_prefill_with_the_glue_kernels_matches_the_plain_ops(weights, monkeypatch):
    """The prefill's norms, RoPE and SiLU x up as the glue kernels (the CUDA default, dev/LOG.md 126, 128), 8
    left-padded prompts, NVFP4 and bf16 bases:

    * every glue call inside the prefill, against the plain op on the very inputs it got: residual sums and RoPE
      bit for bit, norms and SiLU x up within two bf16 steps (rtol 2^-6; the plain ops round twice, h to bf16 and
      then weight * h, or SiLU then * up, so a kernel that sums or rounds once in another order can land one step
      off at each), with at most 1% of the elements differing at all;
    * the logits within bf16 rounding: the glue path may not be further from the exact (float32) logits than twice
      the plain bf16 path is (``noise`` = max |plain - float32|, the bf16 rounding error of this model's
      arithmetic), and within ``rtol 2^-7 + 1.5 noise`` of the plain path. Why not a few logit ulps: this tiny model
      (initializer_range 0.3) amplifies rounding steps; on a CPU, nudging one bf16 step on 1% of the norm and
      SiLU x up outputs of the plain path moved the logits by up to 1.1 noise from the plain ones and 1.7 noise
      from float32 (0.1% of them: 0.83 and 1.25), noise being 0.25 there (logits' std 2.4), where a flat 2^-7
      would fail with a single flipped element;
    * the greedy first tokens agree."""
    from qerl_lib.engine import glue, reference_ops
    from qerl_lib.engine.continuous import left_padded
    from qerl_lib.engine.rollout import RolloutEngine
    from tests.test_engine import tiny_cuda_model

    model = tiny_cuda_model(weights)
    twin = float32_twin(model)  # before the engine sees the model
    engine = RolloutEngine(model)
    prompts = [[(7 * r + 3 * i) % 250 + 3 for i in range(5 + 3 * r)] for r in range(8)]
    engine.generate(prompts, 2, temperature=0.0, stop_token_ids=[])
    forward, cache = engine._forward, engine.cache
    ops = forward.prefill_glue_ops
    assert ops.norm is glue.rms_norm and ops.gated is glue.silu_mul and ops.rope is glue.rope_qk
    tokens, positions, _, mask = left_padded(prompts)
    args = (tokens.cuda(), positions.cuda(), mask.cuda(), cache)

    # spies on the glue functions (the module's own names: forward.py tells the glue path by identity with them)
    stats = {"norm": [0, 0], "silu_mul": [0, 0], "residual sum": [0, 0], "rope": [0, 0]}  # [differing, total]
    real = {name: getattr(glue, name) for name in ("rms_norm", "residual_rms_norm", "silu_mul", "rope_qk")}

    def check(what, got, want, rtol, atol=0.0):
        assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
        if rtol == 0:
            assert torch.equal(got, want), f"{what}: not bit-equal to the plain op on the same inputs"
        else:
            torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")
        stats[what][0] += int((got != want).sum())
        stats[what][1] += got.numel()

    def rms_norm(x, weight, eps, relabeled=False):
        want = reference_ops.rms_norm(x, weight, eps)
        res = real["rms_norm"](x, weight, eps, relabeled=relabeled)
        check("norm", res[0] if relabeled else res, want, rtol=2.0**-6)
        return res

    def residual_rms_norm(x, delta, weight, eps, relabeled=False):
        want_sum, want_h = reference_ops.residual_rms_norm(x, delta, weight, eps)
        res = real["residual_rms_norm"](x, delta, weight, eps, relabeled=relabeled)
        check("residual sum", res[0], want_sum, rtol=0)
        check("norm", res[1], want_h, rtol=2.0**-6)
        return res

    def silu_mul(act, gate, up, lora=None, relabeled=False):
        assert lora is None, "no adapters in this test"
        want = reference_ops.gated_act(act, gate, up)
        res = real["silu_mul"](act, gate, up, lora=lora, relabeled=relabeled)
        check("silu_mul", res[0] if relabeled else res, want, rtol=2.0**-6, atol=1e-6)
        return res

    def rope_qk(q, k, cos, sin):
        want = reference_ops.rope_qk(q, k, cos, sin)
        res = real["rope_qk"](q, k, cos, sin)
        for got, w in zip(res, want):
            check("rope", got, w, rtol=0)
        return res

    spies = dict(rms_norm=rms_norm, residual_rms_norm=residual_rms_norm, silu_mul=silu_mul, rope_qk=rope_qk)
    for name, spy in spies.items():
        monkeypatch.setattr(glue, name, spy)
    spied_ops = ops._replace(norm=glue.rms_norm, residual_norm=glue.residual_rms_norm, rope=glue.rope_qk,
                             gated=glue.silu_mul)
    with torch.no_grad():
        forward.prefill_ops = spied_ops
        fast = forward.prefill(*args)
        forward.prefill_ops = forward.eager_ops
        plain = forward.prefill(*args)
    for name in spies:
        monkeypatch.setattr(glue, name, real[name])
    for what, (differing, total) in stats.items():
        assert total > 0, f"the prefill never called the glue {what}: the test checked nothing of it"
        assert differing <= 0.01 * total, f"{what}: {differing} of {total} elements differ from the plain op"

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # the float32 reference must be float32
    exact = twin_last_logits(twin, args[0], args[1])
    assert exact.shape == plain.shape == fast.shape
    noise = float((plain - exact).abs().max())
    assert 0 < noise < 1.0, f"the plain bf16 path is {noise} from the float32 logits: the twin is not the same model"
    glue_error = float((fast - exact).abs().max())
    assert glue_error <= 2 * noise, f"glue path {glue_error:.4g} from the float32 logits, the plain path {noise:.4g}"
    torch.testing.assert_close(fast, plain, rtol=2.0**-7, atol=1.5 * noise)
    assert int((fast.argmax(-1) == plain.argmax(-1)).sum()) >= 7  # a near-tie may flip under one rounding


def test_rope_qk_off_cuda_is_the_reference():
    """``glue.rope_qk`` on CPU tensors (no kernel there) returns ``reference_ops.rope_qk``'s values."""
    from qerl_lib.engine import glue, reference_ops

    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 4, 6, 16, generator=g).bfloat16(), torch.randn(2, 2, 6, 16, generator=g).bfloat16()
    cos, sin = torch.randn(2, 6, 16, generator=g).bfloat16(), torch.randn(2, 6, 16, generator=g).bfloat16()
    for got, want in zip(glue.rope_qk(q, k, cos, sin), reference_ops.rope_qk(q, k, cos, sin)):
        assert torch.equal(got, want)


def _prefill_qk(g: torch.Generator, batch: int, length: int, heads: int = 28, kv: int = 4, d: int = 128):
    """The prefill's q and k (views ``[B, L, H, D] -> [B, H, L, D]`` of one q/k/v output) and per-row bf16 cos, sin
    ``[B, L, D]`` of random angles, on CUDA."""
    qkv = torch.randn(batch, length, (heads + 2 * kv) * d, device="cuda", generator=g).bfloat16()
    q = qkv[..., :heads * d].view(batch, length, heads, d).transpose(1, 2)
    k = qkv[..., heads * d:(heads + kv) * d].view(batch, length, kv, d).transpose(1, 2)
    angles = torch.rand(batch, length, d // 2, device="cuda", generator=g) * 50
    return q, k, torch.cat([angles.cos(), angles.cos()], -1).bfloat16(), \
        torch.cat([angles.sin(), angles.sin()], -1).bfloat16()


@pytest.mark.cuda
@pytest.mark.parametrize("seed", [0, 1])
def test_cuda_rope_qk_in_the_prefill_layout_bit_for_bit(seed):
    """The prefill's q and k (views ``[B, L, H, D] -> [B, H, L, D]`` of the q/k/v output) with per-row cos and sin
    ``[B, L, D]`` (left-padded positions): ``glue.rope_qk``'s kernels give ``reference_ops.rope_qk``'s bits."""
    from qerl_lib.engine import glue, reference_ops

    q, k, cos, sin = _prefill_qk(torch.Generator(device="cuda").manual_seed(seed), batch=3, length=37)
    assert glue.rotary_fits(q, k, cos, sin)
    for got, want in zip(glue.rope_qk(q, k, cos, sin), reference_ops.rope_qk(q, k, cos, sin)):
        assert torch.equal(got, want)


@requires_triton
def test_rotary_length_is_a_plain_argument():
    """The CPU half of the CUDA test below: the rotary kernel's position count is not specialized on."""
    from qerl_lib.engine import glue

    assert glue.triton is not None, "triton is installed but qerl_lib.engine.glue did not import it"
    kernel = glue._rotary_kernel
    assert [p.name for p in kernel.params if p.do_not_specialize] == ["positions"]
    assert not next(p for p in kernel.params if p.name == "positions").is_constexpr


@pytest.mark.cuda
def test_cuda_prefills_of_any_length_share_one_rotary_kernel():
    """Prefill lengths 250, 256, 1 and 37 (a refill's longest prompt changes from refill to refill): one compiled
    ``_rotary_kernel`` variant in all (Triton specializes integers on divisibility by 16 and on 1 unless told not
    to, dev/LOG.md 137), each length's bits equal to ``reference_ops.rope_qk``'s."""
    from qerl_lib.engine import glue, reference_ops

    g = torch.Generator(device="cuda").manual_seed(3)
    variants = []
    for length in (250, 256, 1, 37):
        q, k, cos, sin = _prefill_qk(g, batch=2, length=length)
        for got, want in zip(glue.rope_qk(q, k, cos, sin), reference_ops.rope_qk(q, k, cos, sin)):
            assert torch.equal(got, want), length
        torch.cuda.synchronize()
        variants.append(len(glue._rotary_kernel.device_caches[torch.cuda.current_device()][0]))
    assert variants[1:] == variants[:1] * 3, variants


@pytest.mark.cuda
def test_cuda_prefill_takes_the_glue_ops_unless_switched_off(monkeypatch):
    """On CUDA the prefill runs ``prefill_glue_ops`` by default and torch's eager ops with ``QERL_PREFILL_GLUE=0``."""
    from qerl_lib.engine.rollout import RolloutEngine
    from tests.test_engine import tiny_cuda_model

    def prefill_ops_of_a_fresh_engine():
        engine = RolloutEngine(model)
        engine.generate([[5, 6, 7]], 2, temperature=0.0, stop_token_ids=[])
        return engine._forward

    model = tiny_cuda_model("bf16")
    monkeypatch.delenv("QERL_PREFILL_GLUE", raising=False)
    forward = prefill_ops_of_a_fresh_engine()
    assert forward.prefill_ops is forward.prefill_glue_ops and forward.prefill_ops is not forward.eager_ops
    monkeypatch.setenv("QERL_PREFILL_GLUE", "0")
    forward = prefill_ops_of_a_fresh_engine()
    assert forward.prefill_ops is forward.eager_ops

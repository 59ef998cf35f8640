"""LoRA added by the NVFP4 decode GEMM itself (``kernels/mma.cu``, "LoRA"; ``mma_linear(lora=)``), or only its
``xa`` made in the GEMM's launch (``LoraEpilogue(expand=False)``, the expand left to ``kernels/lora.py``).

* CPU: the plan's epilogue tables, what the epilogue accepts, the errors of a call that cannot take it,
  and that the CUDA source compiles (NVRTC, sm_90) for the launch shapes the rule picks with stacked
  ranks 16-384 without costing the wide shapes their CTAs per SM (the launch rule's premise; registers and shared
  memory counted).
* CUDA (Hopper): for the Qwen2.5-7B groups (q/k/v with three members, o, gate/up, and down, which runs
  K-slices), ranks 8-128 and 1-8 rows, the fused launch against the base GEMM followed by the
  plain-torch adapters (``kernels.lora.reference_apply``), within one rounding of ``xa`` and one of the
  output, as the two-kernel path is held to; a member without adapter keeps the base output bit for bit;
  a second call gives the same bits (the kernel resets its counters). The engine end to end (a small
  NVFP4 model whose widths take the mma.sync path, CUDA graphs): programmatic dependent launch on and off
  give identical rollouts, and against the two-kernel path the logprobs agree within bf16 noise.
* The shrink-only launch: CPU, its workspace and the engine's choice (``engine/adapters.gemm_lora_epilogue``);
  CUDA, for the same groups, ranks and rows: the output is the plain GEMM's bit for bit, ``xa`` is within one
  bf16 rounding of float64 ``x @ A^T``, and ``given_xa`` + ``expand_`` match the plain-torch adapters as the
  two-kernel path does; the engine (``QERL_LORA_SHRINK_IN_GEMM=1``) as the fused launch above.
* The given-``xa`` epilogue (``epilogue(given=)``): CPU, what it accepts and that it compiles within the wide
  shapes' CTAs per SM; CUDA, bit-equal to the launch whose LoRA CTAs make the same ``xa``, and after
  ``glue.norm_shrink`` within the two-kernel path's tolerance of the reference adapters.
* The engine with ``QERL_LORA_SHRINK_IN_NORM=1``: CPU, which groups it takes (NVFP4 on the mma.sync kernel only)
  and that a group given ``xa`` adds the same adapters where its GEMM cannot take it; CUDA, the rollouts as the
  fused launch's above (PDL on and off identical, within bf16 noise of the two-kernel path), the norms having
  made q/k/v's and gate/up's ``xa`` in every captured step.
"""

from __future__ import annotations

import math

import pytest
import torch

from qerl_lib.kernels import lora as lk
from qerl_lib.kernels import mma
from tests.conftest import nvrtc_or_none
from tests.test_lora_kernels import assert_rollouts_agree, cuda_adapters, make_group

HAS_MMA = mma.available() if torch.cuda.is_available() else False
cuda_mma = pytest.mark.skipif(not HAS_MMA, reason="needs a CUDA GPU with compute capability >= 9.0 and NVRTC")

# group -> (K, member widths), Qwen2.5-7B
GROUPS_7B = {"qkv": (3584, [3584, 512, 512]), "o": (3584, [3584]), "gate_up": (3584, [18944, 18944]),
             "down": (18944, [3584])}


def _random_fp4(n, k, seed, device="cuda"):
    from qerl_lib.kernels.fp4_gemm import prepare_fp4_weights
    from qerl_lib.quant.nvfp4 import quantize

    g = torch.Generator().manual_seed(seed)
    q = quantize((torch.randn(n, k, generator=g) * 0.02).bfloat16().to(device))
    return prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)


def test_plan_epilogue_tables():
    plan, _, _ = make_group(4, 256, [(64, 5, 0.5), (32, 0, 1.0), (96, 16, 2.0)], torch.bfloat16, "cpu")
    epi = plan.epilogue()
    assert epi.bounds.tolist() == [[0, 64, 0, 5], [96, 192, 5, 16]]  # the absent member has no row
    assert epi.scale.tolist() == [0.5, 2.0] and epi.sync.tolist() == [0] * (4 + 2)  # 21 ranks: two blocks of 16
    assert epi.a_cat is plan.a_cat and epi.b_cat is plan.b_cat  # the engine's refreshed buffers, no copies
    assert epi.supported(8, 256) and not epi.supported(9, 256) and not epi.supported(8, 128)
    f32, _, _ = make_group(4, 256, [(64, 5, 0.5)], torch.float32, "cpu")
    assert not f32.epilogue().supported(8, 256)  # the kernel reads bf16


def test_shrink_only_epilogue_owns_a_workspace_and_reads_xa_from_it():
    plan, _, _ = make_group(4, 4096, [(64, 5, 0.5), (96, 16, 2.0)], torch.bfloat16, "cpu")
    shrink = plan.epilogue(expand=False)
    assert not shrink.expand and shrink.workspace is plan.xa_workspace
    assert plan.epilogue(expand=False).workspace is shrink.workspace  # allocated once, reused by every call
    assert shrink.workspace.numel() == (mma.LORA_SLICES + 1) * 8 * 21 and shrink.supported(8, 4096)
    slices, per_slice = mma.LoraEpilogue.slices(4096)
    assert (slices, per_slice) == (8, 512)
    # 7B's K: 512-column slices (two loads in flight per lane), longer ones where 16 would not cover K
    assert [mma.LoraEpilogue.slices(k) for k in (3584, 18944, 27648)] == [(7, 512), (13, 1536), (14, 2048)]
    shrink.workspace.copy_(torch.arange(shrink.workspace.numel(), dtype=torch.float32))
    xa = shrink.xa(3, 4096)  # after the slices' partials [8, 3, 21]: row-major [3, 21], unit column stride
    assert xa.shape == (3, 21) and xa.stride() == (21, 1) and xa[0, 0].item() == 8 * 3 * 21
    no_room = mma.LoraEpilogue(plan.a_cat, plan.b_cat, plan.bounds, plan.scale, plan.sync, expand=False,
                               workspace=torch.empty(10))
    assert not no_room.supported(8, 4096) and not mma.LoraEpilogue(
        plan.a_cat, plan.b_cat, plan.bounds, plan.scale, plan.sync, expand=False).supported(8, 4096)


def test_given_xa_epilogue_checks_its_xa():
    """``GroupPlan.epilogue(given=xa)``: the GEMM only adds ``xa @ B^T``; ``xa`` must be float32, contiguous, with
    the plan's stacked ranks as columns and at least the call's rows."""
    plan, _, _ = make_group(4, 256, [(64, 5, 0.5), (96, 16, 2.0)], torch.bfloat16, "cpu")
    xa = torch.zeros(8, 21, dtype=torch.float32)
    epi = plan.epilogue(given=xa)
    assert epi.expand and epi.given is xa and epi.supported(8, 256) and epi.supported(3, 256)
    assert not epi.supported(9, 256)
    for bad in (xa.bfloat16(), torch.zeros(8, 20), torch.zeros(21, 8).t(), torch.zeros(4, 21)):
        assert not plan.epilogue(given=bad).supported(8, 256)


def test_engine_picks_the_gemm_launch_only_where_the_mma_kernel_runs(monkeypatch):
    from types import SimpleNamespace

    from qerl_lib.engine.adapters import gemm_lora_epilogue
    from qerl_lib.kernels import fp4_gemm

    plan, x, _ = make_group(8, 256, [(64, 5, 0.5)], torch.bfloat16, "cpu")
    member = SimpleNamespace(small_m_backend=None)
    monkeypatch.setattr(fp4_gemm, "uses_mma", lambda m, k, device, backend: m <= 8)
    assert gemm_lora_epilogue(plan, x, True, False, True, member).expand
    assert not gemm_lora_epilogue(plan, x, False, True, True, member).expand
    assert gemm_lora_epilogue(plan, x, False, False, True, member) is None  # neither switch
    assert gemm_lora_epilogue(plan, x, False, True, False, member) is None  # not one fp4_linear call (bf16, unfused)
    assert gemm_lora_epilogue(None, x, False, True, True, member) is None  # no adapters on this group
    assert gemm_lora_epilogue(plan, torch.cat([x, x]), False, True, True, member) is None  # 16 rows: no mma.sync
    monkeypatch.setattr(fp4_gemm, "uses_mma", lambda m, k, device, backend: False)
    assert gemm_lora_epilogue(plan, x, False, True, True, member) is None


def _cpu_forward(monkeypatch, weights: str = "nvfp4", shrink_in_norm: str = "1", **kwargs):
    """A ForwardPass over a tiny bf16 or NVFP4 Qwen2 on the CPU with the LoRA kernels' plans built (``interpreting``
    patched), fused groups, rank-4 adapters on every projection, and the mma.sync path patched in at <= 8 rows."""
    from qerl_lib.engine.adapters import LoraAdapter
    from qerl_lib.engine.forward import ForwardPass, ModelView
    from qerl_lib.kernels import fp4_gemm
    from qerl_lib.models.loader import replace_linear_with_nvfp4
    from tests.test_engine import tiny_model

    model = tiny_model("qwen2", dtype=torch.bfloat16)
    if weights == "nvfp4":
        replace_linear_with_nvfp4(model, impl="kernel")  # the kernel path's layers (built, never called here)
    monkeypatch.setenv("QERL_LORA_SHRINK_IN_NORM", shrink_in_norm)
    monkeypatch.setattr(lk, "interpreting", lambda: True)
    monkeypatch.setattr(fp4_gemm, "uses_mma", lambda m, k, device, backend: m <= 8)
    fp = ForwardPass(ModelView(model), fuse_projections=True, lora_kernels=True, **kwargs)
    g = torch.Generator().manual_seed(5)
    adapters = {n: LoraAdapter((torch.randn(4, m.in_features, generator=g) * 0.3).bfloat16(),
                               (torch.randn(m.out_features, 4, generator=g) * 0.3).bfloat16(), 2.0)
                for n, m in model.named_modules() if n.endswith("_proj")}
    fp.load_lora(adapters)
    return fp


def test_engine_lets_the_norm_make_xa_only_for_nvfp4_groups_on_the_mma_kernel(monkeypatch):
    """``ForwardPass.norm_shrink_plan``: the group's plan with ``QERL_LORA_SHRINK_IN_NORM=1`` where an NVFP4 group runs
    on the mma.sync kernel (at most 8 rows), else None: more rows, the switch off, a bf16 base, or another fold of
    the shrink into the GEMM switched on."""
    fp = _cpu_forward(monkeypatch)
    assert fp.lora_kernels and fp.fused_groups() == 4
    for i in range(2):
        for group in ("qkv", "gate_up"):
            assert fp.norm_shrink_plan(i, group, 8) is fp.lora.plans[(i, group)] is not None
            assert fp.norm_shrink_plan(i, group, 1) is not None
            assert fp.norm_shrink_plan(i, group, 9) is None  # the mma.sync kernel takes at most 8 rows
    assert _cpu_forward(monkeypatch, shrink_in_norm="0").norm_shrink_plan(0, "qkv", 8) is None
    assert _cpu_forward(monkeypatch, weights="bf16").norm_shrink_plan(0, "qkv", 8) is None
    assert _cpu_forward(monkeypatch, lora_in_gemm=True).norm_shrink_plan(0, "qkv", 8) is None
    monkeypatch.setenv("QERL_LORA_SHRINK_IN_GEMM", "1")
    assert _cpu_forward(monkeypatch).norm_shrink_plan(0, "gate_up", 8) is None


def test_a_group_given_xa_without_the_gemm_epilogue_adds_the_same_adapters(monkeypatch):
    """Where the group's GEMM cannot take the given ``xa`` (here the CPU: no LoRA kernels run), ``_project_parts``
    adds the adapters from it: the same outputs as from its own ``x @ A_cat^T``, and different ones from a wrong
    ``xa`` (so the given one is what is read)."""
    fp = _cpu_forward(monkeypatch, weights="bf16", shrink_in_norm="0")
    fp.lora_kernels = False  # the plain-torch adapters of engine/adapters.add_lora_torch
    h = torch.randn(3, 1, 64, generator=torch.Generator().manual_seed(1)).bfloat16()
    for group in ("qkv", "gate_up"):
        a_cat = fp.lora.layout[(0, group)][0]
        xa = (h.reshape(-1, 64) @ a_cat.t()).float()  # bf16 values held in float32, as glue.norm_shrink writes
        own, _ = fp._project_parts(0, group, h)
        given, _ = fp._project_parts(0, group, h, given_xa=xa)
        wrong, _ = fp._project_parts(0, group, h, given_xa=xa * 2)
        assert all(torch.equal(a, b) for a, b in zip(own, given)), group
        assert not any(torch.equal(a, b) for a, b in zip(own, wrong)), group


def test_a_call_that_cannot_add_the_adapters_says_so():
    from qerl_lib.kernels.fp4_gemm import fp4_linear

    w = _random_fp4(192, 256, seed=0, device="cpu")
    plan, x, _ = make_group(4, 256, [(192, 8, 1.0)], torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="only on the mma.sync path"):
        fp4_linear(x, w, lora=plan.epilogue())
    assert fp4_linear(x, w).shape == (4, 192)


@pytest.mark.skipif(nvrtc_or_none() is None, reason="no libnvrtc here (CUDA builds of PyTorch ship it; or set QERL_NVRTC)")
def test_lora_source_compiles_and_keeps_the_wide_shapes_residency():
    from tests.test_fp4_kernel_mma import _cubin_registers

    shapes = [(4608, 3584), (37888, 3584), (3584, 18944), (3584, 3584), (55296, 5120), (5120, 27648)]
    for cfg in {mma.pick_mma_config(8, n, k, 132) for n, k in shapes}:
        for r in (16, 48, 384):
            cubin = mma.compile_cubin(mma.kernel_source(cfg, 1, r), mma.kernel_name(cfg, 1, r), "sm_90")
            assert mma.kernel_name(cfg, 1, r).encode() in cubin
            cfg.check_shared(1, r)
            name = mma.kernel_name(cfg, 1, r, lora_expand=False)
            assert name != mma.kernel_name(cfg, 1, r)
            assert name.encode() in mma.compile_cubin(mma.kernel_source(cfg, 1, r, lora_expand=False), name, "sm_90")
            assert cfg.shared_bytes(1, r, lora_expand=False) < cfg.shared_bytes(1, r)  # no xa rows staged
    for cfg, per_sm in mma.WIDE_SHAPES:  # the launch rule's premise: every LoRA build keeps the CTAs per SM
        warps = cfg.warps_r * cfg.warps_k
        for expand, given in ((True, False), (False, False), (True, True)):
            regs = _cubin_registers(mma.compile_cubin(mma.kernel_source(cfg, 1, 48, expand, given),
                                                      mma.kernel_name(cfg, 1, 48, expand, given), "sm_90"))
            by_regs = 65536 // (math.ceil(regs * 32 / 256) * 256 * warps)
            by_smem = (228 * 1024) // (cfg.shared_bytes(1, 48, expand) + 1024)
            assert min(by_regs, 2048 // cfg.threads, by_smem, 32) == per_sm, (cfg, expand, given, regs)


def _groups_7b(rank, rows):
    """Per Qwen2.5-7B group: ``(name, K, plan, x, FP4 weight, the plain GEMM's output)`` on CUDA (q/k/v's k_proj
    without an adapter)."""
    from qerl_lib.kernels.fp4_gemm import fp4_linear

    for name, (k, widths) in GROUPS_7B.items():
        members = [(w, rank if i != 1 else 0, 2.0) for i, w in enumerate(widths)] if name == "qkv" else \
            [(w, rank, 2.0) for w in widths]
        plan, x, _ = make_group(rows, k, members, torch.bfloat16, "cuda", seed=rank + rows)
        weight = _random_fp4(sum(widths), k, seed=rank)
        yield name, k, plan, x, weight, fp4_linear(x, weight, small_m_backend="mma")


@pytest.mark.cuda
@cuda_mma
@pytest.mark.parametrize("expand", [True, False], ids=["adapters-in-gemm", "shrink-only"])
@pytest.mark.parametrize("rank", [8, 16, 64, 128])
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_gemm_launch_with_adapters_matches_gemm_then_reference_adapters(rank, rows, expand):
    from qerl_lib.kernels.fp4_gemm import fp4_linear

    for name, k, plan, x, weight, base in _groups_7b(rank, rows):
        ref = lk.reference_apply(base.clone(), x, plan)
        epilogue = plan.epilogue(expand=expand)
        got = fp4_linear(x, weight, small_m_backend="mma", lora=epilogue)
        if not expand:
            assert torch.equal(got, base), name  # the GEMM's tiles are the plain kernel's
            xa = epilogue.xa(rows, k)
            exact = x.double() @ plan.a_cat.double().t()
            sums = x.double().abs() @ plan.a_cat.double().abs().t()  # fp32 summation error scales with these
            assert torch.equal(xa, xa.bfloat16().float()), name  # bf16 values, as the torch path's xa tensor
            # one bf16 rounding (half an ulp: 2^-8 relative) of an fp32 sum of <= ~100 sequential terms
            assert ((xa.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-5 * sums).all(), name
            xa = xa.clone()
            got = lk.expand_(got.clone(), lk.given_xa(xa, plan))  # kernels/lora.py's expand after the launch
        delta = (ref.float() - base.float()).abs().max()
        err = (got.float() - ref.float()).abs().max()
        assert delta > 1.0, name
        assert err <= 2 ** -7 * delta + 2 ** -7 * ref.float().abs().max(), (name, float(err), float(delta))
        if name == "qkv":  # k_proj has no adapter: its columns are the base GEMM's
            assert torch.equal(got[:, 3584:4096], base[:, 3584:4096])
        again = fp4_linear(x, weight, small_m_backend="mma", lora=epilogue)
        assert torch.equal(again, got if expand else base) and not plan.sync.any(), name
        if not expand:
            assert torch.equal(epilogue.xa(rows, k), xa), name


@pytest.mark.cuda
@cuda_mma
@pytest.mark.parametrize("rank", [8, 16, 64, 128])
@pytest.mark.parametrize("rows", [1, 5, 8])
def test_given_xa_launch_equals_the_launch_that_makes_its_own_xa(rank, rows):
    """The epilogue reading an ``xa`` made before the launch (``epilogue(given=)``, no LoRA CTAs) gives the bits of
    the launch whose LoRA CTAs make that same ``xa`` (here: a shrink-only launch's) and add it, on every 7B group
    (down's K-slices included); a second call gives the same bits and leaves the counters at zero."""
    from qerl_lib.kernels.fp4_gemm import fp4_linear

    for name, k, plan, x, weight, base in _groups_7b(rank, rows):
        shrink = plan.epilogue(expand=False)
        assert torch.equal(fp4_linear(x, weight, small_m_backend="mma", lora=shrink), base), name
        xa = shrink.xa(rows, k).clone()
        fused = fp4_linear(x, weight, small_m_backend="mma", lora=plan.epilogue())
        given = fp4_linear(x, weight, small_m_backend="mma", lora=plan.epilogue(given=xa))
        assert not torch.equal(given, base), name
        assert torch.equal(given, fused), (name, float((given.float() - fused.float()).abs().max()))
        assert torch.equal(fp4_linear(x, weight, small_m_backend="mma", lora=plan.epilogue(given=xa)), given)
        assert not plan.sync.any(), name


@pytest.mark.cuda
@cuda_mma
@pytest.mark.parametrize("rank", [16, 64])
@pytest.mark.parametrize("rows", [1, 8])
def test_shrink_in_the_norm_and_expand_in_the_gemm_match_the_reference(rank, rows):
    """The launch-free LoRA path of a group that follows a norm: ``glue.norm_shrink`` makes the normed rows and ``xa``
    (bf16: within one rounding of the glue norm and of float64 ``h @ A^T``), and the group's GEMM adds ``xa @ B^T`` in
    its epilogue (``epilogue(given=)``), within the two-kernel path's tolerance of the base GEMM + plain-torch
    adapters on those rows."""
    from qerl_lib.engine import glue
    from qerl_lib.kernels.fp4_gemm import fp4_linear

    for name in ("qkv", "gate_up"):
        k, widths = GROUPS_7B[name]
        plan, _, _ = make_group(rows, k, [(w, rank, 2.0) for w in widths], torch.bfloat16, "cuda", seed=rank + rows)
        g = torch.Generator().manual_seed(rows)
        x, d = (torch.randn(rows, k, generator=g).bfloat16().cuda() for _ in range(2))
        w = (1 + 0.1 * torch.randn(k, generator=g)).bfloat16().cuda()
        s, h, xa = glue.norm_shrink(x, d, w, 1e-6, plan.a_cat)
        s0, h0 = glue.residual_rms_norm(x, d, w, 1e-6)
        assert torch.equal(s, s0), name
        assert ((h.float() - h0.float()).abs() <= 2 ** -7 * h0.float().abs()).all(), name
        exact = h.double() @ plan.a_cat.double().t()
        sums = h.double().abs() @ plan.a_cat.double().abs().t()
        assert ((xa.double() - exact).abs() <= 2 ** -8 * exact.abs() + 1e-5 * sums).all(), name
        weight = _random_fp4(sum(widths), k, seed=rank)
        base = fp4_linear(h, weight, small_m_backend="mma")
        ref = lk.reference_apply(base.clone(), h, plan)
        got = fp4_linear(h, weight, small_m_backend="mma", lora=plan.epilogue(given=xa))
        delta = (ref.float() - base.float()).abs().max()
        err = (got.float() - ref.float()).abs().max()
        assert delta > 1.0, name
        assert err <= 2 ** -7 * delta + 2 ** -7 * ref.float().abs().max(), (name, float(err), float(delta))


def _small_nvfp4_model_with_adapters(rank=16):
    from transformers import AutoModelForCausalLM, Qwen2Config

    from qerl_lib.models.loader import replace_linear_with_nvfp4

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=2,
                      bos_token_id=1, pad_token_id=0, initializer_range=0.2, tie_word_embeddings=False)
    model = replace_linear_with_nvfp4(AutoModelForCausalLM.from_config(cfg).bfloat16().eval()).cuda()
    return model, cuda_adapters(model, rank)


@pytest.mark.cuda
@cuda_mma
def test_engine_rollouts_with_lora_in_the_gemm(monkeypatch):
    from qerl_lib.engine import glue
    from qerl_lib.engine.rollout import RolloutEngine
    from tests.test_engine import PROMPTS

    model, adapters = _small_nvfp4_model_with_adapters()
    made = []  # (rows, stacked ranks) of each glue.norm_shrink call (traced once per captured graph)
    real_norm_shrink = glue.norm_shrink
    monkeypatch.setattr(glue, "norm_shrink", lambda *a: made.append(tuple(a[-1].shape)) or real_norm_shrink(*a))
    runs = {}
    for name, in_gemm, shrink, in_norm, early in (
            ("gemm", True, "0", "0", "1"), ("gemm-plain", True, "0", "0", "0"), ("shrink", False, "1", "0", "1"),
            ("shrink-plain", False, "1", "0", "0"), ("norm", False, "0", "1", "1"), ("norm-plain", False, "0", "1", "0"),
            ("two-kernels", False, "0", "0", "1")):
        monkeypatch.setenv("QERL_PDL", early)
        monkeypatch.setenv("QERL_LORA_SHRINK_IN_GEMM", shrink)
        monkeypatch.setenv("QERL_LORA_SHRINK_IN_NORM", in_norm)
        made.clear()
        engine = RolloutEngine(model, lora_in_gemm=in_gemm)  # graphs+fused, LoRA kernels on CUDA
        runs[name] = engine.generate(PROMPTS, 24, temperature=0, stop_token_ids=[], lora=adapters)
        if shrink == "1":  # every group took the launch that makes xa (a workspace per plan)
            assert all(p is None or p.xa_workspace is not None for p in engine._forward.lora.plans.values()), name
        # with the switch, each layer's q/k/v (3 x 16 ranks) and gate/up (2 x 16) norms made xa; never otherwise
        assert (set(made) == {(48, 256), (32, 256)}) == (in_norm == "1"), (name, set(made))
    base = RolloutEngine(model).generate(PROMPTS, 24, temperature=0, stop_token_ids=[])
    assert [c.token_ids for c in runs["gemm"]] != [c.token_ids for c in base], "the adapters must matter"
    reference = engine  # the two-kernel engine (the loop's last), its switches still set: it re-runs the reference
    # from the fast path's tokens where a near tie broke the other way

    def rerun(prompts, n):
        return reference.generate(prompts, n, temperature=0, stop_token_ids=[], lora=adapters)

    assert_rollouts_agree(runs["gemm"], runs["gemm-plain"], runs["two-kernels"], 24, PROMPTS, rerun)
    assert_rollouts_agree(runs["shrink"], runs["shrink-plain"], runs["two-kernels"], 24, PROMPTS, rerun)
    assert_rollouts_agree(runs["norm"], runs["norm-plain"], runs["two-kernels"], 24, PROMPTS, rerun)

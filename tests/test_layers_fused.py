"""Fused projection groups (qerl_lib.models.fused): one matmul per q/k/v or gate/up group, no extra memory.

CPU, float32 tiny models: the fused call equals the members' own outputs (tolerance 1e-6 relative:
only the matmul's blocking may differ), the modules still compute exactly what they computed before,
Parameters keep their identity, storage is shared (not copied), a second fuse reuses it, replacing
a member's tensor is noticed, and the engine with fused groups matches the unfused engine. Extra rows
(``extra_rows``, where the engine puts a bf16 group's LoRA A): zero until written, their products come out
as the last columns, the members are unchanged, and the model still saves and loads.
NVFP4 groups need the FP4 kernel (CUDA); their CPU behaviour (left unfused) and their CUDA
equality with the member-by-member kernel calls are tested separately.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from qerl_lib.models.nvfp4_linear import NVFP4Linear
from qerl_lib.models.fused import fuse_group
from qerl_lib.quant.nvfp4 import global_scale
from tests.test_engine import PROMPTS, tiny_model

REL_TOL = 1e-6


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max()) if not a.requires_grad else _rel(a.detach(), b.detach())


def _group(sizes=(48, 16, 16), k=32, bias=True, seed=0):
    torch.manual_seed(seed)
    return [nn.Linear(k, n, bias=bias) for n in sizes]


def test_fused_linear_equals_members_and_shares_storage():
    members = _group()
    x = torch.randn(3, 5, 32)
    before = [m(x) for m in members]
    params = [m.weight for m in members]
    fused = fuse_group(members)
    assert fused is not None and fused.kind == "linear" and fused.splits == (48, 16, 16)
    outs = fused(x)
    for o, b in zip(outs, before):
        assert o.shape == b.shape and _rel(o, b) <= REL_TOL
    for m, b, p in zip(members, before, params):
        assert m.weight is p  # same Parameter object (optimizers, peft keep theirs)
        assert torch.equal(m(x), b)  # the module itself computes what it computed before
        assert m.weight.untyped_storage().data_ptr() == fused.tensors["weight"].untyped_storage().data_ptr()
        assert m.bias.untyped_storage().data_ptr() == fused.tensors["bias"].untyped_storage().data_ptr()
    assert fused.nbytes == sum(m.weight.numel() * 4 + m.bias.numel() * 4 for m in members)
    assert fused.is_current()


def test_second_fuse_reuses_the_buffer():
    members = _group(bias=False)
    first = fuse_group(members)
    second = fuse_group(members)
    assert second.tensors["weight"].data_ptr() == first.tensors["weight"].data_ptr()
    assert second.is_current() and first.is_current()


def test_replacing_a_member_tensor_is_noticed():
    members = _group()
    fused = fuse_group(members)
    members[1].weight = nn.Parameter(torch.randn(16, 32))
    assert not fused.is_current()
    fused = fuse_group(members)  # fusing again picks up the new weight
    x = torch.randn(2, 32)
    assert _rel(fused(x)[1], members[1](x)) <= REL_TOL


def test_in_place_writes_keep_the_group():
    members = _group()
    fused = fuse_group(members)
    with torch.no_grad():
        members[2].weight.copy_(torch.ones(16, 32))
    assert fused.is_current()
    assert torch.equal(fused.tensors["weight"][64:], torch.ones(16, 32))


@pytest.mark.parametrize("case", ["mixed_bias", "one_member", "mixed_in_features", "mixed_dtype", "subclass"])
def test_unfusable_groups_return_none(case):
    if case == "mixed_bias":
        members = [nn.Linear(32, 16, bias=True), nn.Linear(32, 16, bias=False)]
    elif case == "one_member":
        members = [nn.Linear(32, 16)]
    elif case == "mixed_in_features":
        members = [nn.Linear(32, 16), nn.Linear(48, 16)]
    elif case == "mixed_dtype":
        members = [nn.Linear(32, 16), nn.Linear(32, 16).double()]
    else:
        class MyLinear(nn.Linear):
            pass
        members = [MyLinear(32, 16), MyLinear(32, 16)]
    ptrs = [m.weight.data_ptr() for m in members]
    assert fuse_group(members) is None
    assert [m.weight.data_ptr() for m in members] == ptrs  # nothing was moved


@pytest.mark.parametrize("sizes", [(48, 16, 16), (40,)], ids=["three-members", "one-member"])
def test_extra_rows_compute_x_times_what_is_written_there(sizes):
    """``extra_rows``: the buffer gets zero rows after the members' (weight and bias); the members still
    compute what they did, ``outputs`` drops the extra columns, and rows written into ``extra_weight``
    come out as ``x @ E^T`` in the last columns of ``full`` (one member is enough for a group)."""
    members = _group(sizes)
    x = torch.randn(3, 5, 32)
    before = [m(x) for m in members]
    fused = fuse_group(members, extra_rows=6)
    assert fused is not None and fused.extra_rows == 6 and fused.width == sum(sizes)
    assert fused.tensors["weight"].shape == (sum(sizes) + 6, 32) and fused.tensors["bias"].shape == (sum(sizes) + 6,)
    assert torch.equal(fused.extra_weight(), torch.zeros(6, 32)) and torch.equal(fused.tensors["bias"][-6:], torch.zeros(6))
    extra = torch.randn(6, 32)
    fused.extra_weight().copy_(extra)
    full = fused.full(x)
    assert full.shape == (3, 5, sum(sizes) + 6)
    assert _rel(full[..., sum(sizes):], x @ extra.t()) <= REL_TOL
    for o, m, b in zip(fused(x), members, before):
        assert o.shape == b.shape and _rel(o, b) <= REL_TOL and torch.equal(m(x), b)
    assert fused.is_current()


def test_extra_rows_only_for_plain_linear_members():
    kernel_path = _nvfp4_group(shared=True, impl="kernel")  # fusable members (without extra rows) on any device
    assert fuse_group(kernel_path, extra_rows=4) is None  # an NVFP4 GEMM reads codes, not bf16 rows
    assert fuse_group(_group((16,))) is None  # one member and no extra rows: nothing to fuse


def _nvfp4_group(shared: bool, impl="auto"):
    torch.manual_seed(0)
    linears = [nn.Linear(64, n, bias=False).to(torch.bfloat16) for n in (64, 32)]
    with torch.no_grad():
        linears[1].weight.mul_(3.0)  # a different absmax, so that unshared global scales differ
    gs = global_scale(*[l.weight.detach() for l in linears]) if shared else None
    return [NVFP4Linear.from_linear(l, global_scale=gs, impl=impl, name=f"m{i}") for i, l in enumerate(linears)]


def test_nvfp4_groups_on_cpu_stay_unfused():
    # the reference path (CPU) gains nothing from fusing; the kernel path is CUDA-only
    members = _nvfp4_group(shared=True)
    assert torch.equal(members[0].weight_global_scale, members[1].weight_global_scale)
    assert fuse_group(members) is None


def test_projection_names_are_defined_once():
    from qerl_lib.models.fused import PARENT, PROJECTION_GROUPS, PROJECTIONS
    from qerl_lib.models.lora import DEFAULT_TARGETS
    from qerl_lib.quant.nvfp4 import FUSED_GROUPS

    assert tuple(p for group in PROJECTION_GROUPS.values() for p in group) == PROJECTIONS
    assert tuple(PARENT) == PROJECTIONS and DEFAULT_TARGETS == PROJECTIONS
    assert tuple(g for g in PROJECTION_GROUPS.values() if len(g) > 1) == FUSED_GROUPS  # one global scale each


def test_small_m_kernel_choice_is_per_layer():
    from qerl_lib.models.nvfp4_linear import set_small_m_kernel

    model = nn.Sequential(*_nvfp4_group(shared=True))
    assert all(m.small_m_backend is None and m.mma_rule is None for m in model)  # None: QERL_FP4_SMALL_M, the rule
    x = torch.randn(3, 64).to(torch.bfloat16)
    before = model(x)
    rule = lambda m, n, k: None  # noqa: E731 - never called on CPU
    assert set_small_m_kernel(model, "triton", rule) == 2
    assert all(m.small_m_backend == "triton" and m.mma_rule is rule for m in model)
    assert torch.equal(model(x), before)  # CPU runs the reference path whatever the choice
    with pytest.raises(ValueError, match="small-M backend"):
        set_small_m_kernel(model, "cutlass")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the NVFP4 fused group runs the FP4 kernel (CUDA)")
def test_nvfp4_fused_group_matches_members_on_cuda():
    members = [m.cuda() for m in _nvfp4_group(shared=True)]
    x = torch.randn(8, 64, device="cuda").to(torch.bfloat16)
    before = [m(x) for m in members]
    fused = fuse_group(members)
    assert fused is not None and fused.kind == "nvfp4"
    for o, b in zip(fused(x), before):
        # same exact products, fp32 sums possibly grouped differently: at most one bf16 ulp apart
        torch.testing.assert_close(o.float(), b.float(), rtol=2.0**-7, atol=1e-6)
    for m, b in zip(members, before):
        assert torch.equal(m(x), b)
    unshared = [m.cuda() for m in _nvfp4_group(shared=False)]
    assert not torch.equal(unshared[0].weight_global_scale, unshared[1].weight_global_scale)
    assert fuse_group(unshared) is None  # different global scales cannot share one kernel call


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_engine_with_fused_projections_matches_unfused(kind):
    from qerl_lib.engine.rollout import RolloutEngine

    model = tiny_model(kind)
    plain = RolloutEngine(model, fuse_projections=False).generate(PROMPTS, 8, temperature=0, stop_token_ids=[])
    engine = RolloutEngine(model, fuse_projections=True)
    fused = engine.generate(PROMPTS, 8, temperature=0, stop_token_ids=[])
    assert engine._forward.fused_groups() == 2 * model.config.num_hidden_layers
    assert [c.token_ids for c in fused] == [c.token_ids for c in plain]
    for a, b in zip(fused, plain):
        assert torch.allclose(torch.tensor(a.logprobs, dtype=torch.float64), torch.tensor(b.logprobs, dtype=torch.float64), atol=1e-5)
    # the model still runs through transformers, and saves/loads, with its views
    ids = torch.tensor([PROMPTS[0]])
    assert torch.isfinite(model(ids).logits).all()


def test_fused_model_saves_and_loads(tmp_path):
    from transformers import AutoModelForCausalLM

    from qerl_lib.engine.rollout import RolloutEngine

    model = tiny_model("qwen2")
    RolloutEngine(model, fuse_projections=True).generate(PROMPTS[:1], 2, temperature=0)
    model.save_pretrained(tmp_path, safe_serialization=True)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_model_with_extra_rows_saves_and_loads(tmp_path):
    """Groups with extra rows holding values of their own (as the engine's LoRA A): the model still saves to
    safetensors and loads back to the same logits; the extra rows are not part of any parameter."""
    from transformers import AutoModelForCausalLM

    model = tiny_model("qwen2")
    for layer in model.model.layers:
        attn = layer.self_attn
        fuse_group([attn.q_proj, attn.k_proj, attn.v_proj], extra_rows=5).extra_weight().normal_()
        fuse_group([layer.mlp.down_proj], extra_rows=3).extra_weight().normal_()
    model.save_pretrained(tmp_path, safe_serialization=True)
    again = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert again.model.layers[0].self_attn.q_proj.weight.shape == model.model.layers[0].self_attn.q_proj.weight.shape
    ids = torch.tensor([PROMPTS[2]])
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)


def test_engine_fused_projections_with_unmerged_lora():
    from qerl_lib.bench.rollout import random_lora
    from qerl_lib.engine.rollout import RolloutEngine

    model = tiny_model("qwen2")
    lora = random_lora(model, rank=4, seed=1)
    for adapter in lora.values():
        adapter.B.mul_(30.0)  # large enough to change greedy tokens, so the adapters visibly matter
    base = RolloutEngine(model, fuse_projections=False).generate(PROMPTS, 8, temperature=0, stop_token_ids=[])
    plain = RolloutEngine(model, fuse_projections=False).generate(PROMPTS, 8, temperature=0, stop_token_ids=[], lora=lora)
    fused = RolloutEngine(model, fuse_projections=True).generate(PROMPTS, 8, temperature=0, stop_token_ids=[], lora=lora)
    assert [c.token_ids for c in plain] != [c.token_ids for c in base]
    assert [c.token_ids for c in fused] == [c.token_ids for c in plain]
    for a, b in zip(fused, plain):
        assert torch.allclose(torch.tensor(a.logprobs, dtype=torch.float64), torch.tensor(b.logprobs, dtype=torch.float64),
                              atol=1e-5)

"""``RolloutEngine(lora_merge=True)``: a dense base's adapters merged into engine-owned weight copies
(``engine/merged.py``) against the float64 formula, the unmerged engine and a model merged by hand."""

from __future__ import annotations

import pytest
import torch

from qerl_lib.engine.merged import ROWS_PER_PASS, merge_into
from qerl_lib.engine.rollout import LoraAdapter, RolloutEngine
from tests.test_engine import NEW, PROMPTS, tiny_model

SEVEN = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapters_for(model, rank: int = 4, targets=SEVEN, seed: int = 3, dtype=None) -> dict:
    """Random rank-``rank`` adapters (A, B ~ N(0, 0.3^2), scale 2) on ``targets`` of every layer."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, mod in model.named_modules():
        if name.endswith(targets):
            dt = dtype or mod.weight.dtype
            out[name] = LoraAdapter((torch.randn(rank, mod.in_features, generator=g) * 0.3).to(dt),
                                    (torch.randn(mod.out_features, rank, generator=g) * 0.3).to(dt), 2.0)
    return out


def hand_merged(model, adapters):
    """A copy of ``model`` whose weights are W + scale * B @ A, in float64 then rounded (the formula)."""
    merged = tiny_model("qwen2", dtype=next(model.parameters()).dtype)
    merged.load_state_dict(model.state_dict())
    with torch.no_grad():
        for name, a in adapters.items():
            w = merged.get_submodule(name).weight
            w.copy_(w.double() + a.scale * a.B.double() @ a.A.double())
    return merged


def rollout(engine_or_model, lora=None, **kw):
    engine = engine_or_model if isinstance(engine_or_model, RolloutEngine) else RolloutEngine(engine_or_model, **kw)
    return engine.generate(PROMPTS, NEW, temperature=0, stop_token_ids=[], lora=lora)


def within_rounding(out, ref, adapter, mantissa: int) -> None:
    """``|out - ref|`` at most one unit in the last place of ``ref`` (the final rounding, and a tie broken the
    other way) plus float32's error in the rank-r delta, ``2^-20 * |s| |B| @ |A|`` (r products summed in float32,
    r <= 16: this is what remains where W and the delta nearly cancel and the unit in the last place is tiny)."""
    dtype = out.dtype
    ulp = torch.ldexp(torch.ones_like(ref), torch.frexp(ref).exponent - mantissa)
    ulp = ulp.clamp(min=torch.finfo(dtype).smallest_normal * 2.0 ** (1 - mantissa))  # subnormals' fixed spacing
    fp32 = 2.0 ** -20 * abs(adapter.scale) * adapter.B.double().abs() @ adapter.A.double().abs()
    assert ((out.double() - ref).abs() <= ulp + fp32).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_merge_into_is_the_float32_sum_rounded_once(dtype):
    """Fresh random W, A, B (more rows than one pass holds): every merged element is the float64 value of
    ``W + s B A`` rounded to ``dtype`` (``within_rounding``), and exactly it nearly everywhere; writing into W
    itself gives the same bits."""
    g = torch.Generator().manual_seed(11)
    rows = ROWS_PER_PASS + 37
    w = (torch.randn(rows, 96, generator=g) * 0.05).to(dtype)
    adapter = LoraAdapter(torch.randn(8, 96, generator=g).to(dtype), torch.randn(rows, 8, generator=g).to(dtype) * 0.01,
                          0.5)
    ref = w.double() + 0.5 * adapter.B.double() @ adapter.A.double()
    out = merge_into(torch.empty_like(w), w, adapter)
    exact = ref.to(dtype)
    mantissa = {torch.bfloat16: 8, torch.float16: 11}[dtype]
    within_rounding(out, ref, adapter, mantissa)
    assert (out != exact).double().mean() < 1e-3
    assert (out.double() - w.double()).abs().max() > 0.1 * w.double().abs().max(), "the adapter must move the weights"
    in_place = w.clone()
    merge_into(in_place, in_place, adapter)
    assert torch.equal(in_place, out)


INTERP_SCRIPT = """
import json, sys
import torch
from qerl_lib.engine.merged import merge_into, triton
from qerl_lib.engine.rollout import LoraAdapter
from tests.test_engine_merged import within_rounding

out = {"triton": triton is not None}
for i, (rows, cols, rank, dtype, adapter_dtype) in enumerate(json.loads(sys.argv[1])):
    dtype, adapter_dtype = getattr(torch, dtype), getattr(torch, adapter_dtype)
    g = torch.Generator().manual_seed(20 + i)
    w = (torch.randn(rows, cols, generator=g) * 0.05).to(dtype)
    ad = LoraAdapter(torch.randn(rank, cols, generator=g).to(adapter_dtype),
                     (torch.randn(rows, rank, generator=g) * 0.01).to(adapter_dtype), 0.75)
    ref = w.double() + 0.75 * ad.B.double() @ ad.A.double()
    got = merge_into(torch.empty_like(w), w, ad)
    try:
        within_rounding(got, ref, ad, {torch.bfloat16: 8, torch.float16: 11}[dtype])
        out[f"{i}_within"] = True
    except AssertionError:
        out[f"{i}_within"] = False
    out[f"{i}_inexact"] = float((got != ref.to(dtype)).double().mean())
    again = w.clone()
    out[f"{i}_in_place"] = bool(torch.equal(merge_into(again, again, ad), got))
print("RESULTS " + json.dumps(out))
"""
KERNEL_CASES = [(70, 300, 16, "bfloat16", "bfloat16"), (33, 129, 5, "float16", "float32"),
                (64, 256, 64, "bfloat16", "float32"), (40, 200, 21, "float16", "float16")]  # ragged tiles and ranks


@pytest.fixture(scope="module")
def interpreted():
    from tests.conftest import run_triton_interpreter

    return run_triton_interpreter(INTERP_SCRIPT, KERNEL_CASES)


@pytest.mark.parametrize("i", range(len(KERNEL_CASES)), ids=lambda i: "{}x{}_r{}_{}".format(*KERNEL_CASES[i][:4]))
def test_interpreted_merge_kernel_is_the_float32_sum_rounded_once(interpreted, i):
    """The CUDA merge kernel under Triton's interpreter, on tiles that do not divide the shapes: within rounding of
    the float64 formula everywhere and the same bits in place; float16 exactly the formula nearly everywhere. The
    interpreter truncates float32 -> bfloat16 casts (its ``cast_impl`` passes no rounding mode), so about half the
    bf16 outputs sit one unit below, and its 16-bit ``tl.dot`` is not emulated (the kernel takes its float32 path
    there); on the GPU the cast rounds to nearest even and bf16 adapters take the tensor cores: the CUDA test."""
    assert interpreted["triton"]
    assert interpreted[f"{i}_within"] and interpreted[f"{i}_in_place"]
    if KERNEL_CASES[i][3] == "float16":
        assert interpreted[f"{i}_inexact"] < 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("adapter_dtype", [torch.bfloat16, torch.float32], ids=["bf16-adapter", "fp32-adapter"])
def test_cuda_merge_into_is_the_float32_sum_rounded_once(adapter_dtype):
    """On the GPU (the Triton merge kernel), with bf16 and float32 adapters: within 1 unit in the last place of the
    float64 value (plus float32's error in the rank sum) everywhere, and exactly it nearly everywhere."""
    g = torch.Generator().manual_seed(13)
    w = (torch.randn(5000, 3584, generator=g) * 0.02).bfloat16().cuda()
    adapter = LoraAdapter((torch.randn(16, 3584, generator=g) * 0.02).to(adapter_dtype).cuda(),
                          (torch.randn(5000, 16, generator=g) * 0.02).to(adapter_dtype).cuda(), 2.0)
    ref = w.double() + 2.0 * adapter.B.double() @ adapter.A.double()
    out = merge_into(torch.empty_like(w), w, adapter)
    within_rounding(out, ref, adapter, 8)
    assert (out != ref.bfloat16()).double().mean() < 1e-3  # TF32 (10-bit products) would miss this by far
    in_place = w.clone()
    assert torch.equal(merge_into(in_place, in_place, adapter), out)


def test_merge_into_float32_is_the_formula_to_float32_accuracy():
    g = torch.Generator().manual_seed(12)
    w = torch.randn(300, 64, generator=g) * 0.05
    adapter = LoraAdapter(torch.randn(4, 64, generator=g), torch.randn(300, 4, generator=g) * 0.01, 2.0)
    ref = w.double() + 2.0 * adapter.B.double() @ adapter.A.double()
    torch.testing.assert_close(merge_into(torch.empty_like(w), w, adapter).double(), ref, rtol=1e-6, atol=1e-8)


def test_merged_engine_equals_the_unmerged_engine_and_a_hand_merged_model():
    """float32, adapters on all seven projections: the merged engine's greedy tokens are the unmerged engine's and
    the hand-merged model's, logprobs within 1e-4; every group of both layers is merged, none left unmerged, and
    the copies hold exactly the groups' weights and biases."""
    model = tiny_model("qwen2")
    ads = adapters_for(model)
    engine = RolloutEngine(model, lora_merge=True)
    merged = rollout(engine, ads)
    unmerged = rollout(model, ads)
    by_hand = rollout(hand_merged(model, ads))
    base = rollout(model)
    assert [c.token_ids for c in base] != [c.token_ids for c in merged], "the adapters must change the rollout"
    for m, u, h in zip(merged, unmerged, by_hand):
        assert m.token_ids == u.token_ids == h.token_ids
        assert m.logprobs == pytest.approx(u.logprobs, abs=1e-4)
        assert m.logprobs == pytest.approx(h.logprobs, abs=1e-4)
    fwd = engine._forward
    assert len(fwd.merged.layout) == 8 and fwd.lora is None and fwd.merged.targets == set(ads)
    params = sum(p.numel() for n, p in model.named_parameters() if n.rsplit(".", 2)[-2] in SEVEN)
    assert fwd.merged.nbytes == params * 4


def test_merged_copy_follows_in_place_updates_and_never_writes_the_base():
    model = tiny_model("llama")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ads = adapters_for(model, targets=("o_proj", "down_proj"))
    engine = RolloutEngine(model, lora_merge=True)
    first = rollout(engine, ads)
    for a in ads.values():
        a.B.zero_()  # the adapter updated in place: the next rollout samples from the base model
    assert [c.token_ids for c in rollout(engine, ads)] == [c.token_ids for c in rollout(model)]
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert [c.token_ids for c in first] != [c.token_ids for c in rollout(model)]


def test_partial_targets_merge_their_groups_only_and_keep_unadapted_members_exact():
    """Adapters on q_proj and down_proj: the q/k/v and down groups are merged (k and v rows are the base's own
    bits), o and gate/up run on the base; the rollout equals the unmerged engine's."""
    model = tiny_model("qwen2")
    ads = adapters_for(model, targets=("q_proj", "down_proj"))
    engine = RolloutEngine(model, lora_merge=True)
    merged = rollout(engine, ads)
    fwd = engine._forward
    assert sorted(fwd.merged.layout) == [(i, g) for i in range(2) for g in ("down", "qkv")]
    weight, bias, placed = fwd.merged.layout[(0, "qkv")]
    attn = model.model.layers[0].self_attn
    q_rows = attn.q_proj.out_features
    k_rows = attn.k_proj.out_features
    assert torch.equal(weight[q_rows:q_rows + k_rows], attn.k_proj.weight)
    assert torch.equal(weight[q_rows + k_rows:], attn.v_proj.weight)
    assert torch.equal(bias, torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
    for m, u in zip(merged, rollout(model, ads)):
        assert m.token_ids == u.token_ids and m.logprobs == pytest.approx(u.logprobs, abs=1e-4)


def test_nvfp4_bases_keep_their_adapters_unmerged():
    """An NVFP4 base cannot be merged (its codes are the frozen policy): with lora_merge on, nothing is merged
    and the rollout is bit for bit the unmerged one."""
    from qerl_lib.models.loader import replace_linear_with_nvfp4

    model = replace_linear_with_nvfp4(tiny_model("qwen2"))
    ads = adapters_for(model)
    engine = RolloutEngine(model, lora_merge=True)
    merged = rollout(engine, ads)
    assert not engine._forward.merged.layout and engine._forward.lora is not None
    unmerged = rollout(model, ads)
    assert [(c.token_ids, c.logprobs) for c in merged] == [(c.token_ids, c.logprobs) for c in unmerged]


def test_release_frees_the_copies_and_the_next_call_builds_them_again():
    model = tiny_model("qwen2")
    ads = adapters_for(model)
    engine = RolloutEngine(model, lora_merge=True)
    first = rollout(engine, ads)
    engine.release()
    assert engine._forward.merged is None
    again = rollout(engine, ads)
    assert engine._forward.merged is not None
    assert [(c.token_ids, c.logprobs) for c in first] == [(c.token_ids, c.logprobs) for c in again]
    engine.generate(PROMPTS, 2, lora=ads, timing=True)
    assert engine.last_timing.load_s > 0  # the copies' rewrite is timed with the call (bench rows count it)
    rollout(engine)  # no adapter: the copies go
    assert engine._forward.merged is None and engine._forward.lora is None


def _deviations(rollouts, reference) -> list[float]:
    """|logprob - reference logprob| along each row's prefix shared with the reference (greedy: bf16 rounding may
    break a near tie, after which the rows are different texts)."""
    out = []
    for c, e in zip(rollouts, reference):
        for a, b, ta, tb in zip(c.logprobs, e.logprobs, c.token_ids, e.token_ids):
            if ta != tb:
                break
            out.append(abs(a - b))
    return sorted(out)


def test_bf16_merged_rollouts_are_no_noisier_than_unmerged_ones():
    """bf16, rank 8, four adapter draws: against the same model and adapters in float32, the merged engine's greedy
    logprobs deviate no more than the unmerged engine's (both are bf16 roundings of one float32 function; pooled
    median within 1.5x, 90th percentile within 2x), and the shared prefixes are long. A wrong merge (scale, rows,
    transposition) deviates by whole nats, not by this tiny model's bf16 noise (median ~0.02 nats a token, a
    tail to ~0.5 that depends on the CPU's bf16 kernels, which is why no absolute maximum is asserted)."""
    import copy

    model = tiny_model("qwen2", dtype=torch.bfloat16)
    model32 = copy.deepcopy(model).float()
    merged_dev, plain_dev = [], []
    for seed in (3, 4, 5, 6):
        ads = adapters_for(model, rank=8, seed=seed)
        ads32 = {k: LoraAdapter(a.A.float(), a.B.float(), a.scale) for k, a in ads.items()}
        reference = rollout(model32, ads32)
        merged_dev += _deviations(rollout(model, ads, lora_merge=True), reference)
        plain_dev += _deviations(rollout(model, ads), reference)
    merged_dev.sort(), plain_dev.sort()
    assert len(merged_dev) >= 2 * NEW * len(PROMPTS) and len(plain_dev) >= 2 * NEW * len(PROMPTS)

    def quantile(values, q):
        return values[int(q * (len(values) - 1))]

    assert quantile(merged_dev, 0.5) <= 1.5 * quantile(plain_dev, 0.5) + 1e-3, (merged_dev, plain_dev)
    assert quantile(merged_dev, 0.9) <= 2.0 * quantile(plain_dev, 0.9) + 1e-3, (merged_dev, plain_dev)


@pytest.mark.cuda
@pytest.mark.parametrize("weights", ["bf16", "nvfp4"])
def test_cuda_merged_engine_agrees_with_the_unmerged_paths(weights, monkeypatch):
    """Greedy rollouts through CUDA graphs (graphs+fused): merged against the torch path within bf16 noise for a
    bf16 base (and a second merged engine with programmatic dependent launch off giving the same bits), and bit for
    bit the unmerged kernels' for NVFP4 (nothing merges); an in-place update of the adapters reaches the captured
    graphs (B zeroed: the base model's rollout)."""
    from tests.test_lora_kernels import _tiny_cuda_with_adapters, assert_rollouts_agree

    model, ads = _tiny_cuda_with_adapters(weights)
    engine = RolloutEngine(model, lora_merge=True)
    merged = engine.generate(PROMPTS, 24, temperature=0, stop_token_ids=[], lora=ads)
    if weights == "bf16":
        assert len(engine._forward.merged.layout) == 2 * 4
        with monkeypatch.context() as env:  # a second merged engine, its launches plain: the same bits
            env.setenv("QERL_PDL", "0")
            merged_plain = RolloutEngine(model, lora_merge=True).generate(PROMPTS, 24, temperature=0,
                                                                          stop_token_ids=[], lora=ads)
        torch_engine = RolloutEngine(model, lora_kernels=False)
        torch_path = torch_engine.generate(PROMPTS, 24, temperature=0, stop_token_ids=[], lora=ads)
        assert_rollouts_agree(merged, merged_plain, torch_path, 24, PROMPTS,
                              lambda prompts, n: torch_engine.generate(prompts, n, temperature=0, stop_token_ids=[],
                                                                       lora=ads))
    else:
        assert not engine._forward.merged.layout
        plain = RolloutEngine(model).generate(PROMPTS, 24, temperature=0, stop_token_ids=[], lora=ads)
        assert [(c.token_ids, c.logprobs) for c in merged] == [(c.token_ids, c.logprobs) for c in plain]
    for a in ads.values():
        a.B.zero_()
    zeroed = engine.generate(PROMPTS, 24, temperature=0, stop_token_ids=[], lora=ads)
    base = RolloutEngine(model).generate(PROMPTS, 24, temperature=0, stop_token_ids=[])
    assert [c.token_ids for c in zeroed] == [c.token_ids for c in base]

"""LoRA in the decode step (qerl_lib.kernels.lora) against its plain-torch reference.

* CPU, Triton interpreter (a subprocess: TRITON_INTERPRET=1 must be set before triton is imported),
  float32 (the interpreter mishandles bf16 dots): awkward groups -- ranks that are not powers of two,
  members of different ranks, an absent member, widths that are not multiples of the 128-column
  tile, K not a multiple of 128 and long enough for several K slices, 1 to 70 rows (two row
  blocks). Tolerance 1e-5 relative to the output's scale: only the summation order differs.
  Also the engine end to end (tiny Qwen2, every projection adapted, fused q/k/v and gate/up):
  the kernels against the torch path give the same greedy tokens, logprobs within 1e-4; the same with a bf16
  group's A as extra rows of its weight (``QERL_LORA_ROWS=1``: the expand reading the GEMM's strided xa
  columns, 1e-5 on the kernel cases; the engine, and a prefill longer than the kernels take).
* CPU: the plan's layout (B views share one zero-padded buffer, refresh reaches it), and its errors.
* CUDA: bf16 inputs of Qwen2.5-7B group shapes, ranks 8-128, 1-256 rows, with and without
  programmatic dependent launch, against the reference within bf16 rounding; prefill and decode-step
  logits with the kernels against the torch path (bf16 and NVFP4 bases), within 5% of the adapters'
  effect; greedy rollouts through CUDA graphs (the gate/up expand as its own kernel or folded into
  SiLU x up; bf16, NVFP4, and bf16 with A as weight rows): bit-identical with PDL on and off, and within
  bf16 noise of the torch path.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from qerl_lib.kernels import lora as lk
from tests.conftest import run_triton_interpreter

# (rows M, K, [(width N_j, rank r_j or 0 for no adapter, scale)])
CASES = [
    (8, 256, [(192, 16, 2.0), (64, 16, 2.0), (64, 16, 2.0)]),          # q/k/v-like, equal ranks
    (1, 200, [(130, 5, 0.5)]),                                          # one member, odd width, odd K, rank 5
    (17, 2500, [(300, 8, 1.0), (300, 0, 1.0)]),                        # 5 K slices; second member has no adapter
    (70, 1100, [(64, 3, 1.5), (32, 0, 0.0), (257, 33, 0.25)]),          # two row blocks; rank 33 pads to 64; the expand sums
    (5, 1300, [(100, 40, 1.0)]),                                        # rank 40 pads to 64 at M <= 8: the shrink sums
]

INTERP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from qerl_lib.kernels import lora as lk
    from tests.test_lora_kernels import make_group
    out = {}
    for i, (m, k, members) in enumerate(json.loads(sys.argv[1])):
        plan, x, base = make_group(m, k, members, torch.float32, "cpu", seed=i)
        assert lk.supported(base, x)
        got = lk.apply_(base.clone(), x, plan)
        ref = lk.reference_apply(base.clone(), x, plan)
        out[i] = float((got - ref).abs().max() / ref.abs().max())
        out[f"{i}_changed"] = float((ref - base).abs().max())
        out[f"{i}_counters_reset"] = bool((plan.counters == 0).all())
        again = lk.apply_(base.clone(), x, plan)  # a second call on the same counters: the same bits
        out[f"{i}_repeatable"] = bool(torch.equal(again, got))
        if plan.covers_all():  # the expand summing a K-split GEMM's partials = reduce_splits, then the expand
            from qerl_lib.kernels.fp4_gemm import reduce_splits
            g = torch.Generator().manual_seed(50 + i)
            ws = torch.randn(3 + i % 3, m, base.shape[1], generator=g) * 100.0
            gs, bias = torch.tensor([448.0 * 6.0 / 3.7]), torch.randn(base.shape[1], generator=g)
            eq = []
            for b in (None, bias):
                reduced = torch.full_like(base, float("nan"))
                reduce_splits(ws, gs, b, reduced)
                two = lk.apply_(reduced, x, plan)
                one = lk.apply_(torch.full_like(base, float("nan")), x, plan, base=lk.SplitBase(ws, gs, b))
                eq.append(bool(torch.equal(one, two)) and bool(torch.isfinite(one).all()))
            out[f"{i}_split_base_equal"] = eq
        # xa made elsewhere (a bf16 GEMM's extra columns, A as weight rows): a strided view beside the output
        wide = torch.cat([base, x @ plan.a_cat.t()], dim=1)
        n = base.shape[1]
        xa_before = wide[:, n:].clone()
        lk.expand_(wide[:, :n], lk.given_xa(wide[:, n:], plan))
        out[f"{i}_given_xa"] = float((wide[:, :n] - ref).abs().max() / ref.abs().max())
        out[f"{i}_given_xa_columns_kept"] = bool(torch.equal(wide[:, n:], xa_before))
    # the engine: kernels vs the torch path, every projection adapted, q/k/v and gate/up fused
    from qerl_lib.engine.rollout import LoraAdapter, RolloutEngine
    from tests.test_engine import PROMPTS, tiny_model
    model = tiny_model("qwen2")
    g = torch.Generator().manual_seed(5)
    adapters = {}
    for name, mod in model.named_modules():
        if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
            r = 4 if "mlp" in name else 6
            adapters[name] = LoraAdapter(torch.randn(r, mod.in_features, generator=g) * 0.2,
                                         torch.randn(mod.out_features, r, generator=g) * 0.2, 1.5)
    runs, used = {}, {}
    for use in (True, False, "rows"):
        os.environ["QERL_LORA_ROWS"] = "1" if use == "rows" else "0"
        engine = RolloutEngine(model, fuse_projections=True, lora_kernels=bool(use))
        runs[use] = engine.generate(PROMPTS, 6, temperature=0, stop_token_ids=[], lora=adapters)
        used[use] = engine._forward.lora_kernels and engine._forward.fused_groups() > 0
    fwd = engine._forward  # the "rows" engine: every group's A is the extra rows of its fused weight
    out["rows_groups"] = sum(f is not None and f.extra_rows > 0 for groups in fwd._fused for f in groups.values())
    out["rows_a_in_weight"] = all(fwd.lora.plans[key].a_cat.data_ptr() == fwd._fused[key[0]][key[1]].extra_weight().data_ptr()
                                  for key in fwd.lora.plans)
    out["rows_tokens_equal"] = [c.token_ids for c in runs["rows"]] == [c.token_ids for c in runs[False]]
    # above kernels/lora.MAX_M rows (long prefills) the torch path adds the adapters, taking xa from the GEMM
    x = torch.randn(1, lk.MAX_M + 44, model.config.hidden_size, generator=g)
    with torch.no_grad():
        got = torch.cat(fwd._project_parts(0, "qkv", x)[0], dim=-1)
        ref = torch.cat([m(x) + a.scale * (x @ a.A.t()) @ a.B.t() for m, a in
                         ((fwd._groups[0]["qkv"][j], adapters[f"model.layers.0.self_attn.{p}"])
                          for j, p in enumerate(("q_proj", "k_proj", "v_proj")))], dim=-1)
    out["rows_long_prefill"] = float((got - ref).abs().max() / ref.abs().max())
    out["rows_logprob_diff"] = max(abs(a - b) for c, e in zip(runs["rows"], runs[False])
                                   for a, b in zip(c.logprobs, e.logprobs))
    base = RolloutEngine(model, fuse_projections=True).generate(PROMPTS, 6, temperature=0, stop_token_ids=[])
    out["engine_used_kernels"] = used[True] and not used[False]
    out["engine_tokens_equal"] = [c.token_ids for c in runs[True]] == [c.token_ids for c in runs[False]]
    out["engine_adapter_matters"] = [c.token_ids for c in runs[True]] != [c.token_ids for c in base]
    out["engine_logprob_diff"] = max(abs(a - b) for c, e in zip(runs[True], runs[False])
                                     for a, b in zip(c.logprobs, e.logprobs))
    print("RESULTS " + json.dumps(out))
""")


def make_group(m, k, members, dtype, device, seed=0):
    """A random group: (plan with random A and B, x [m, k], base output [m, N]). ``members``:
    ``[(width, rank or 0, scale)]`` in column order."""
    g = torch.Generator().manual_seed(seed)
    spans, col, r0 = [], 0, 0
    for width, rank, scale in members:
        if rank:
            spans.append((col, col + width, r0, rank, scale))
            r0 += rank
        col += width
    a_cat = (torch.randn(r0, k, generator=g) / k ** 0.5).to(dtype).to(device)
    plan = lk.build_plan(a_cat, col, spans)
    for i in range(len(spans)):
        view = plan.b_view(i)
        view.copy_(torch.randn(tuple(view.shape), generator=g).to(dtype))
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    base = torch.randn(m, col, generator=g).to(dtype).to(device)
    return plan, x, base


@pytest.fixture(scope="module")
def interpreted():
    return run_triton_interpreter(INTERP_SCRIPT, CASES, timeout=600)


@pytest.mark.parametrize("i", range(len(CASES)), ids=lambda i: "M{}_K{}_members{}".format(CASES[i][0], CASES[i][1],
                                                                                          len(CASES[i][2])))
def test_interpreted_kernels_match_the_reference(interpreted, i):
    assert interpreted[f"{i}_changed"] > 0.1, "the adapter must change the output for the test to mean anything"
    assert interpreted[str(i)] <= 1e-5
    assert interpreted[f"{i}_counters_reset"] and interpreted[f"{i}_repeatable"]


@pytest.mark.parametrize("i", [i for i, c in enumerate(CASES) if all(r for _, r, _ in c[2])])
def test_interpreted_expand_sums_split_partials_as_the_reduction_does(interpreted, i):
    assert interpreted[f"{i}_split_base_equal"] == [True, True]  # without and with a bias


def test_split_base_needs_every_column_adapted_and_matching_partials():
    plan, x, base = make_group(4, 64, [(32, 4, 1.0), (32, 0, 1.0)], torch.float32, "cpu")
    assert not plan.covers_all()
    shrunk = lk.Shrunk(torch.zeros(4, 16), 1, 4, plan, 16, "ieee", False)
    with pytest.raises(ValueError, match="must cover every output column"):
        lk.expand_(base, shrunk, lk.SplitBase(torch.zeros(2, 4, 64), torch.ones(1), None))
    full, _, base = make_group(4, 64, [(32, 4, 1.0), (32, 4, 1.0)], torch.float32, "cpu")
    with pytest.raises(ValueError, match="must be contiguous"):
        lk.expand_(base, lk.Shrunk(torch.zeros(4, 16), 1, 4, full, 16, "ieee", False),
                   lk.SplitBase(torch.zeros(2, 4, 63), torch.ones(1), None))


def test_split_base_takes_one_reduction_over_all_of_out_and_runs_the_others():
    out = torch.zeros(4, 64)
    ws = torch.zeros(2, 4, 64)
    assert lk.split_base([], out) is None and lk.split_base(None, out) is None
    got = lk.split_base([(ws, torch.ones(1), None, out)], out)
    assert isinstance(got, lk.SplitBase) and got.ws is ws
    ran = []
    import qerl_lib.kernels.fp4_gemm as fg
    real = fg.reduce_splits
    try:
        fg.reduce_splits = lambda *job: ran.append(job)
        halves = [(ws[:, :, :32], torch.ones(1), None, out[:, :32]), (ws[:, :, 32:], torch.ones(1), None, out[:, 32:])]
        assert lk.split_base(halves, out) is None and len(ran) == 2  # two launches: reduced here
        assert lk.split_base([(ws, torch.ones(1), None, out)], None) is None and len(ran) == 3  # no expand to take it
        many = torch.zeros(lk.EXPAND_SUMS_SLICES_UP_TO + 1, 4, 64)
        assert lk.split_base([(many, torch.ones(1), None, out)], out) is None and len(ran) == 4  # too many slices
    finally:
        fg.reduce_splits = real


def test_interpreted_engine_with_kernels_equals_torch_path(interpreted):
    assert interpreted["engine_used_kernels"]
    assert interpreted["engine_adapter_matters"]
    assert interpreted["engine_tokens_equal"]
    assert interpreted["engine_logprob_diff"] <= 1e-4


@pytest.mark.parametrize("i", range(len(CASES)), ids=lambda i: f"case{i}")
def test_interpreted_expand_of_xa_made_elsewhere_matches_the_reference(interpreted, i):
    """``given_xa``: ``xa`` as a strided view of a wider GEMM output (A as extra weight rows); the expand
    reads it with that row stride, writes only the output's columns, and matches the reference."""
    assert interpreted[f"{i}_given_xa"] <= 1e-5
    assert interpreted[f"{i}_given_xa_columns_kept"]


def test_interpreted_engine_with_a_as_weight_rows_equals_torch_path(interpreted):
    """``QERL_LORA_ROWS=1``: all 4 groups of each of the tiny model's 2 layers carry A as weight rows, their
    plans' A buffers are those rows, and greedy rollouts match the torch path (logprobs within 1e-4)."""
    assert interpreted["rows_groups"] == 8 and interpreted["rows_a_in_weight"]
    assert interpreted["rows_tokens_equal"]
    assert interpreted["rows_logprob_diff"] <= 1e-4
    assert interpreted["rows_long_prefill"] <= 1e-5  # more rows than the kernels take: the torch path, same sums


def test_split_rule_by_rows_and_rank():
    # batch 8: ~256 columns per slice; the expand kernel sums up to padded rank 32, the shrink above
    assert lk.split_rule(8, 3584, 16) == (14, 256, False)
    assert lk.split_rule(8, 3584, 64) == (14, 256, True)
    # more rows: ~512 columns per slice, the expand kernel sums at every rank
    assert lk.split_rule(32, 3584, 64) == (7, 512, False)
    assert lk.split_rule(64, 18944, 16) == (30, 640, False)  # capped at MAX_SPLITS, rounded to BLOCK_K
    assert lk.split_rule(1, 200, 16) == (1, 256, False)
    for m in (1, 8, 9, 64, 256):
        for k in (128, 200, 2500, 3584, 18944, 27648):
            splits, k_per, _ = lk.split_rule(m, k, 16)
            assert k_per % lk.BLOCK_K == 0 and (splits - 1) * k_per < k <= splits * k_per and splits <= lk.MAX_SPLITS
    # the interpreter cases cover both ways of adding the slices' partials
    sliced = [lk.split_rule(m, k, make_group(m, k, members, torch.float32, "cpu")[0].padded_rank)
              for m, k, members in CASES]
    assert {shrink_sums for splits, _, shrink_sums in sliced if splits > 1} == {True, False}


def test_plan_layout_and_padding():
    plan, _, _ = make_group(2, 64, [(40, 5, 1.0), (24, 0, 1.0), (16, 3, 2.0)], torch.float32, "cpu")
    assert plan.padded_rank == lk.RANK_BLOCK and plan.n_total == 80
    assert plan.members == ((0, 40, 0, 5, 1.0), (64, 80, 5, 3, 2.0))
    assert plan.b_view(1).data_ptr() == plan.b_cat[64:, :3].data_ptr()
    assert plan.b_cat[:, 5:].abs().sum() == 0 and plan.b_cat[40:64].abs().sum() == 0  # padding and absent member
    assert plan.tiles.tolist() == [[0, 40, 0], [64, 80, 1]]
    wide = lk.build_plan(torch.zeros(40, 8), 300, [(0, 300, 0, 40, 1.0)], block_n=128)
    assert wide.padded_rank == 64 and wide.tiles.tolist() == [[0, 128, 0], [128, 256, 0], [256, 300, 0]]


def test_plan_errors_name_the_problem():
    with pytest.raises(ValueError, match="at least one member"):
        lk.build_plan(torch.zeros(4, 8), 10, [])
    with pytest.raises(ValueError, match="out of range"):
        lk.build_plan(torch.zeros(4, 8), 10, [(0, 12, 0, 4, 1.0)])
    with pytest.raises(ValueError, match="out of range"):
        lk.build_plan(torch.zeros(4, 8), 10, [(0, 10, 2, 4, 1.0)])
    plan = lk.build_plan(torch.zeros(4, 8), 10, [(0, 10, 0, 4, 1.0)])
    with pytest.raises(ValueError, match="do not match the plan"):  # checked before any launch
        lk.apply_(torch.zeros(2, 12), torch.zeros(2, 8), plan)
    with pytest.raises(ValueError, match="do not match the plan"):
        lk.apply_(torch.zeros(2, 10), torch.zeros(2, 9), plan)


def test_engine_buffers_refresh_reaches_the_plan():
    from qerl_lib.engine.adapters import LoraBuffers
    from qerl_lib.engine.forward import ModelView
    from qerl_lib.engine.rollout import LoraAdapter
    from tests.test_engine import tiny_model

    model = tiny_model("qwen2")
    q, v = model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.v_proj
    adapters = {"model.layers.0.self_attn.q_proj": LoraAdapter(torch.randn(4, q.in_features), torch.randn(q.out_features, 4)),
                "model.layers.0.self_attn.v_proj": LoraAdapter(torch.randn(2, v.in_features), torch.randn(v.out_features, 2), 3.0)}
    bufs = LoraBuffers(ModelView(model), adapters)
    plan = bufs.plans[(0, "qkv")]
    k_width = model.model.layers[0].self_attn.k_proj.out_features
    assert plan.members == ((0, q.out_features, 0, 4, 1.0),
                            (q.out_features + k_width, q.out_features + k_width + v.out_features, 4, 2, 3.0))
    bufs.refresh(adapters)
    torch.testing.assert_close(plan.b_view(1), adapters["model.layers.0.self_attn.v_proj"].B, rtol=0, atol=0)
    torch.testing.assert_close(plan.a_cat[4:6], adapters["model.layers.0.self_attn.v_proj"].A, rtol=0, atol=0)
    assert plan.b_cat[q.out_features:q.out_features + k_width].abs().sum() == 0  # k_proj has no adapter
    # torch path and plan agree on a random input
    x = torch.randn(3, q.in_features)
    base = torch.randn(3, plan.n_total)
    ref = lk.reference_apply(base.clone(), x, plan)
    a_cat, slots = bufs.layout[(0, "qkv")]
    xa = x @ a_cat.t()
    manual = base.clone()
    manual[:, :q.out_features] += xa[:, 0:4] @ adapters["model.layers.0.self_attn.q_proj"].B.t()
    manual[:, -v.out_features:] += 3.0 * xa[:, 4:6] @ adapters["model.layers.0.self_attn.v_proj"].B.t()
    torch.testing.assert_close(ref, manual, rtol=1e-5, atol=1e-5)
    assert slots[1] is None


def test_gate_up_fold_by_default_only_above_few_rows():
    from qerl_lib.engine.forward import ForwardPass, ModelView
    from tests.test_engine import tiny_model

    view = ModelView(tiny_model("qwen2"))
    auto = ForwardPass(view)
    assert not auto.folds_gate_up(lk.FEW_ROWS) and auto.folds_gate_up(lk.FEW_ROWS + 1)
    assert ForwardPass(view, lora_fold=True).folds_gate_up(1)
    assert not ForwardPass(view, lora_fold=False).folds_gate_up(256)


def test_unsupported_inputs_take_the_torch_path():
    x = torch.randn(4, 8)
    assert not lk.supported(torch.randn(4, 10), x)  # CPU without the interpreter (and float32)
    assert not lk.supported(torch.randn(lk.MAX_M + 1, 10), torch.randn(lk.MAX_M + 1, 8))


# ---- CUDA --------------------------------------------------------------------------------------
QWEN7B_GROUPS = {"qkv": (3584, [(3584, 1), (512, 1), (512, 1)]), "o": (3584, [(3584, 1)]),
                 "gate_up": (3584, [(18944, 1), (18944, 1)]), "down": (18944, [(3584, 1)])}


@pytest.mark.cuda
@pytest.mark.parametrize("rank", [8, 16, 64, 128])
@pytest.mark.parametrize("rows", [1, 8, 64, 256])
@pytest.mark.parametrize("pdl_on", [True, False], ids=["pdl", "plain"])
def test_cuda_kernels_match_the_reference_bf16(rank, rows, pdl_on):
    for group, (k, widths) in QWEN7B_GROUPS.items():
        members = [(w, rank, 2.0) for w, _ in widths]
        plan, x, base = make_group(rows, k, members, torch.bfloat16, "cuda", seed=rank + rows)
        assert lk.supported(base, x)
        got = lk.apply_(base.clone(), x, plan, use_pdl=pdl_on)
        ref = lk.reference_apply(base.clone(), x, plan)
        # one bf16 rounding of xa may differ (summation order), then one of the output: 2^-7 relative
        # of the adapter's contribution, plus one output ulp
        delta = (ref.float() - base.float()).abs().max()
        err = (got.float() - ref.float()).abs().max()
        assert delta > 1.0, group
        assert err <= 2 ** -7 * delta + 2 ** -7 * ref.float().abs().max(), (group, float(err), float(delta))


def cuda_adapters(model, rank: int) -> dict:
    """Rank-``rank`` bf16 adapters (A and B ~ N(0, 0.1^2), scale 2) on all seven projections of every layer,
    on the GPU, from a fixed seed."""
    from qerl_lib.engine.rollout import LoraAdapter

    g = torch.Generator().manual_seed(3)
    adapters = {}
    for name, mod in model.named_modules():
        if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")):
            adapters[name] = LoraAdapter((torch.randn(rank, mod.in_features, generator=g) * 0.1).bfloat16().cuda(),
                                         (torch.randn(mod.out_features, rank, generator=g) * 0.1).bfloat16().cuda(), 2.0)
    return adapters


def _tiny_cuda_with_adapters(weights: str, rank: int = 16):
    from tests.test_engine import tiny_model

    model = tiny_model("qwen2", dtype=torch.bfloat16)
    if weights == "nvfp4":
        from qerl_lib.models.loader import replace_linear_with_nvfp4

        replace_linear_with_nvfp4(model)
    model = model.cuda()
    return model, cuda_adapters(model, rank)


def _prefill_and_step(model, adapters, use_kernels: bool):
    """Float32 logits of a batch-8 prefill and of one decode step (eager, fused projections)."""
    from qerl_lib.engine.cache import KVCache
    from qerl_lib.engine.forward import ForwardPass, ModelView
    from tests.test_engine import PROMPTS

    view = ModelView(model)
    fwd = ForwardPass(view, decode_attention="kernel", fuse_projections=True, lora_kernels=use_kernels)
    assert fwd.lora_kernels is use_kernels
    fwd.load_lora(adapters)
    prompt = torch.tensor([PROMPTS[2]] * 8, device="cuda")
    plen = prompt.shape[1]
    cache = KVCache(view.n_layers, 8, view.n_kv_heads, plen + 4, view.head_dim, view.dtype, view.device)
    with torch.no_grad():
        first = fwd.prefill(prompt, torch.arange(plen, device="cuda")[None].expand(8, -1), None, cache)
        tokens = torch.arange(8, device="cuda") + 5
        step = fwd.decode_step(tokens, torch.tensor([plen], device="cuda"), torch.zeros(8, dtype=torch.long, device="cuda"),
                               plen + 1, cache)
    return first, step


@pytest.mark.cuda
@pytest.mark.parametrize("weights", ["bf16", "nvfp4"])
def test_cuda_prefill_and_decode_step_logits_with_kernels(weights):
    model, adapters = _tiny_cuda_with_adapters(weights)
    with_kernels = _prefill_and_step(model, adapters, True)
    torch_path = _prefill_and_step(model, adapters, False)
    no_adapter = _prefill_and_step(model, None, False)
    for got, ref, base in zip(with_kernels, torch_path, no_adapter):
        effect = (ref - base).abs().max()
        err = (got - ref).abs().max()
        assert effect > 0.5, "the adapters must move the logits for the test to mean anything"
        assert err <= 0.05 * effect, (float(err), float(effect))  # bf16 rounding differences only


@pytest.mark.cuda
@pytest.mark.parametrize("fold", [False, True], ids=["expand-kernel", "fold"])
@pytest.mark.parametrize("weights", ["bf16", "nvfp4", "bf16-rows"])
def test_cuda_engine_with_lora_kernels_equals_torch_path(weights, fold, monkeypatch):
    """Greedy rollouts through CUDA graphs, with the gate/up expand as its own kernel or folded into
    SiLU x up (``lora_fold``). With the kernels, programmatic dependent launch on and
    off give the same bits (the early start reads nothing too soon). Against the torch path: the
    same tokens until bf16 rounding breaks a near tie, and logprobs within bf16 noise at every position (after a
    near tie the torch path is re-run from the kernels' tokens: ``assert_rollouts_agree``).
    This tiny random model's adapters move the logits by ~1 (the decode-step test above asserts
    > 0.5), so one rounding of ``xa`` can move a logprob by a visible amount at some positions: the
    bound is on the median (0.05) and, loosely, on the largest difference (0.5)."""
    from qerl_lib.engine.rollout import RolloutEngine
    from tests.test_engine import PROMPTS

    model, adapters = _tiny_cuda_with_adapters(weights.removesuffix("-rows"))
    monkeypatch.setenv("QERL_LORA_ROWS", "1" if weights.endswith("-rows") else "0")  # A as bf16 weight rows
    runs = {}
    for name, use, early in (("kernels", True, "1"), ("kernels-plain", True, "0"), ("torch", False, "1")):
        monkeypatch.setenv("QERL_PDL", early)
        engine = RolloutEngine(model, lora_kernels=use, lora_fold=fold)  # graphs+fused on CUDA
        assert engine.lora_kernels is use
        runs[name] = engine.generate(PROMPTS, 24, temperature=0, stop_token_ids=[], lora=adapters)
        rows = sum(f is not None and f.extra_rows > 0 for groups in engine._forward._fused for f in groups.values())
        assert (rows > 0) == (use and weights.endswith("-rows")), rows
    # `engine` is the torch path's (the last one made): it re-runs the reference where a near tie broke differently
    assert_rollouts_agree(runs["kernels"], runs["kernels-plain"], runs["torch"], 24, PROMPTS,
                          lambda prompts, n: engine.generate(prompts, n, temperature=0, stop_token_ids=[], lora=adapters))


def assert_rollouts_agree(fast, fast_plain, reference, new_tokens: int, prompts, rerun_reference) -> None:
    """``fast`` equals ``fast_plain`` (a second run: the same kernels without programmatic dependent launch) bit for
    bit, and each of its rows has ``new_tokens`` tokens. Against the reference path at every one of those positions,
    in each row: greedy bf16 rounding may break a near tie the other way, so where the reference's row chose another
    token than ``fast``'s, the reference is run again (``rerun_reference(prompts, n)``: its greedy rollouts of ``n``
    tokens) from the prompt plus ``fast``'s tokens up to and including that one, and the comparison goes on in the
    same context. Over all ``rows x new_tokens`` positions the logprob differences have median < 0.05 and max < 0.5
    (at a position where the tokens differ, both logprobs are the top of a near tie: the same bound)."""
    assert len(fast) == len(fast_plain) == len(reference) == len(prompts), "one result per prompt"
    for c, e in zip(fast, fast_plain):
        assert c.token_ids == e.token_ids and c.logprobs == e.logprobs
    assert all(len(c.token_ids) == new_tokens for c in fast), [len(c.token_ids) for c in fast]
    diffs = [[] for _ in fast]
    segments = {r: (0, run) for r, run in enumerate(reference)}  # row -> (fast position the reference run starts at, run)
    while segments:
        resume = {}
        for r, (start, run) in segments.items():
            ids, logprobs = fast[r].token_ids, fast[r].logprobs
            for i, (token, logprob) in enumerate(zip(run.token_ids, run.logprobs), start):
                if i >= new_tokens:
                    break
                diffs[r].append(abs(logprobs[i] - logprob))
                if ids[i] != token:  # a near tie broken the other way: re-run from fast's context
                    if i + 1 < new_tokens:
                        resume[r] = i + 1
                    break
        rows = sorted(resume)
        if not rows:
            break
        contexts = [list(prompts[r]) + list(fast[r].token_ids[:resume[r]]) for r in rows]
        reruns = rerun_reference(contexts, max(new_tokens - resume[r] for r in rows))
        assert len(reruns) == len(rows)
        segments = {r: (resume[r], run) for r, run in zip(rows, reruns)}
    for r, d in enumerate(diffs):
        assert len(d) == new_tokens, f"row {r}: compared with the reference at {len(d)} of {new_tokens} positions"
    flat = sorted(x for d in diffs for x in d)
    median = flat[len(flat) // 2]
    assert median < 0.05 and flat[-1] < 0.5, (median, flat[-1], [max(d) for d in diffs])

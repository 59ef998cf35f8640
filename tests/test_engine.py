"""The rollout engine against transformers, against a teacher-forced forward, and against itself.

Models are tiny and random (2 layers, hidden 64, vocab 256), built in float32 unless a test
says otherwise, so equality with transformers is not blurred by bf16 rounding. Their weights
use init std 0.3 (not the usual 0.02) so that greedy decoding does not collapse into repeating
one token, which would make "same tokens" a weak check.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from qerl_lib.engine.rollout import Completion, LoraAdapter, RolloutEngine, generate, lora_from_peft, to_padded
from qerl_lib.engine.sampling import SamplingParams, process_logits, sample

PROMPTS = [[5, 7, 9, 11, 13], [3, 4], [100, 20, 30, 40, 50, 60, 70], [8]]
NEW = 12


def tiny_model(kind: str, dtype=torch.float32, seed: int = 0):
    """'llama': tied embeddings, no biases. 'qwen2': untied embeddings, random q/k/v biases."""
    torch.manual_seed(seed)
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=96, eos_token_id=2, bos_token_id=1,
                  pad_token_id=0, initializer_range=0.3)
    if kind == "llama":
        cfg = LlamaConfig(tie_word_embeddings=True, **common)
    else:
        cfg = Qwen2Config(tie_word_embeddings=False, **common)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)  # Qwen2 initialises its q/k/v biases to zero; make them matter
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.uniform_(0.5, 1.5)
    if kind == "llama":
        assert model.lm_head.weight is model.model.embed_tokens.weight
    else:
        assert model.lm_head.weight is not model.model.embed_tokens.weight
        assert model.model.layers[0].self_attn.k_proj.bias is not None
    return model


def tiny_cuda_model(weights: str):
    """``tiny_model("qwen2")`` in bf16 on the GPU, its Linears NVFP4 when ``weights`` is "nvfp4"."""
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    if weights == "nvfp4":
        from qerl_lib.models.loader import replace_linear_with_nvfp4

        replace_linear_with_nvfp4(model)
    return model.cuda()


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def naive_greedy(model, prompt, n, stop=()):
    """Full recompute every step: no cache at all."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt in stop:
                break
    return ids[len(prompt):]


def teacher_forced_logprobs(model, prompt, completion, params):
    """Logprobs of `completion` under `params`' processing of one full forward over prompt + completion."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    scores = torch.log_softmax(process_logits(logits, params), dim=-1)
    return scores.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


@pytest.fixture(scope="module", params=["llama", "qwen2"], ids=["llama-tied", "qwen2-bias-untied"])
def model(request):
    return tiny_model(request.param)


# ---- equality with transformers -----------------------------------------------------------------
def test_greedy_equals_hf_generate_per_prompt(model):
    # The batch mixes prompt lengths (left padding inside the engine); each row must equal an
    # unpadded single-prompt transformers generate, token for token.
    outs = generate(model, PROMPTS, NEW, temperature=0)
    for prompt, c in zip(PROMPTS, outs):
        ref = hf_greedy(model, prompt, NEW)
        assert c.token_ids == ref, f"prompt {prompt}"
        assert c.finish_reason == ("stop" if 2 in ref else "length")


def test_greedy_equals_naive_full_recompute(model):
    for prompt in PROMPTS[:2]:
        engine = generate(model, [prompt], NEW, temperature=0, stop_token_ids=[])[0].token_ids
        assert engine == naive_greedy(model, prompt, NEW)


def test_stop_token_ends_row_independently(model):
    free = generate(model, PROMPTS, NEW, temperature=0, stop_token_ids=[])
    stop = free[0].token_ids[3]  # a token row 0 emits at step 3
    outs = generate(model, PROMPTS, NEW, temperature=0, stop_token_ids=[stop])
    for f, c in zip(free, outs):
        if stop in f.token_ids:
            end = f.token_ids.index(stop) + 1
            assert c.token_ids == f.token_ids[:end] and c.finish_reason == "stop"
            assert c.logprobs == pytest.approx(f.logprobs[:end], abs=1e-6)
        else:
            assert c.token_ids == f.token_ids and c.finish_reason == "length"
    assert outs[0].finish_reason == "stop" and len(outs[0].token_ids) <= 4


def test_default_stop_tokens_come_from_generation_config(model):
    free = generate(model, PROMPTS, NEW, temperature=0, stop_token_ids=[])
    old = model.generation_config.eos_token_id
    stop = free[1].token_ids[2]
    try:
        model.generation_config.eos_token_id = [stop, 255]
        outs = RolloutEngine(model).generate(PROMPTS, NEW, temperature=0)
    finally:
        model.generation_config.eos_token_id = old
    assert outs[1].finish_reason == "stop" and outs[1].token_ids[-1] == stop


# ---- batching -----------------------------------------------------------------------------------
def test_batch_of_n_equals_n_single_runs(model):
    batch = generate(model, PROMPTS, NEW, temperature=0, stop_token_ids=[])
    for prompt, c in zip(PROMPTS, batch):
        single = generate(model, [prompt], NEW, temperature=0, stop_token_ids=[])[0]
        assert c.token_ids == single.token_ids
        # fp32: padding changes only the summation order inside attention (masked keys add exact zeros)
        assert c.logprobs == pytest.approx(single.logprobs, abs=1e-5)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_tensor_input_equals_ragged_lists(model, side):
    width = max(map(len, PROMPTS))
    ids = torch.zeros(len(PROMPTS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(PROMPTS):
        sl = slice(width - len(p), width) if side == "left" else slice(0, len(p))
        ids[r, sl], mask[r, sl] = torch.tensor(p), 1
    ragged = generate(model, PROMPTS, NEW, temperature=0, stop_token_ids=[])
    padded = generate(model, ids, NEW, temperature=0, stop_token_ids=[], prompt_mask=mask)
    assert [c.token_ids for c in padded] == [c.token_ids for c in ragged]


# ---- logprobs -----------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.7, top_k=20), SamplingParams(1.3, top_p=0.9),
                                    SamplingParams(0.0)], ids=["t1", "t0.7-k20", "t1.3-p0.9", "greedy"])
def test_logprobs_match_teacher_forced_forward_fp32(model, params):
    outs = generate(model, PROMPTS, NEW, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                    seed=3, stop_token_ids=[])
    for prompt, c in zip(PROMPTS, outs):
        ref = teacher_forced_logprobs(model, prompt, c.token_ids, params)
        # float32 end to end: cache vs full recompute differ only in summation order (~1e-6)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)


def test_logprobs_match_teacher_forced_forward_bf16():
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    params = SamplingParams(1.0)
    outs = generate(model, PROMPTS, NEW, seed=5, stop_token_ids=[])
    diffs = torch.cat([(torch.tensor(c.logprobs) - teacher_forced_logprobs(model, p, c.token_ids, params)).abs()
                       for p, c in zip(PROMPTS, outs)])
    # bf16 activations carry ~3 significant digits; K/V cached at one step vs recomputed in a
    # [B, T] block round differently, and logits of this model are O(10), so a logprob may move
    # by a few 1e-2. Calibrated: max observed ~0.06 over seeds; the bound leaves 2.5x headroom.
    assert diffs.max() < 0.15, f"max |dlogprob| {diffs.max():.4f}"
    assert diffs.mean() < 0.03, f"mean |dlogprob| {diffs.mean():.4f}"


# ---- sampling -----------------------------------------------------------------------------------
def test_same_seed_same_samples_different_seed_different(model):
    a = generate(model, PROMPTS, NEW, seed=11, stop_token_ids=[])
    b = generate(model, PROMPTS, NEW, seed=11, stop_token_ids=[])
    c = generate(model, PROMPTS, NEW, seed=12, stop_token_ids=[])
    assert [x.token_ids for x in a] == [x.token_ids for x in b]
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert [x.token_ids for x in a] != [x.token_ids for x in c]


def test_process_logits_matches_transformers_warpers():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(6, 300) * 3
    logits[0, :5] = logits[0, 5]  # ties around the k-th value
    for t, k, p in [(0.7, 0, 1.0), (1.0, 17, 1.0), (1.2, 0, 0.8), (0.5, 40, 0.6)]:
        ref = TemperatureLogitsWarper(t)(None, logits.clone())
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1:
            ref = TopPLogitsWarper(p)(None, ref)
        assert torch.equal(process_logits(logits, SamplingParams(t, p, k)), ref), (t, k, p)


def test_exponential_race_samples_the_distribution():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1, 0.0])
    logits = probs.clamp_min(1e-30).log().expand(20000, -1)
    tokens, logprobs = sample(logits, SamplingParams(1.0), torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=5).float() / 20000
    # std of a frequency is sqrt(p(1-p)/n) <= 0.0036 here; 0.015 is > 4 sigma
    assert (freq - probs).abs().max() < 0.015, freq
    assert freq[4] == 0  # a zero-probability token is never drawn
    torch.testing.assert_close(logprobs, probs.log()[tokens])


def test_sampling_params_validation():
    for bad in [dict(temperature=-1), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2), dict(top_k=1.5)]:
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# ---- LoRA and AQN hooks -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lora_pair():
    """(peft model with random non-zero B, merged copy) on the tiny Qwen2 model."""
    peft = pytest.importorskip("peft")
    base = tiny_model("qwen2")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"], lora_dropout=0.0)
    model = peft.get_peft_model(base, cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)  # peft starts B at zero (a no-op adapter); make it count
    return model, _merged_copy(model)


def _merged_copy(peft_model):
    """A plain model whose weights are W + scale * B @ A (built by hand: merge_and_unload would
    modify the peft model in place)."""
    merged = tiny_model("qwen2")
    with torch.no_grad():
        for name, module in peft_model.get_base_model().named_modules():
            if hasattr(module, "lora_A"):
                key = module.active_adapters[0]
                delta = module.lora_B[key].weight @ module.lora_A[key].weight * module.scaling[key]
                merged.get_submodule(name).weight.copy_(module.base_layer.weight + delta)
    return merged


def test_lora_unmerged_logits_equal_merged(lora_pair):
    from qerl_lib.engine.cache import KVCache
    from qerl_lib.engine.forward import ForwardPass, ModelView

    peft_model, merged = lora_pair
    prompt = torch.tensor([PROMPTS[2]])
    pos = torch.arange(prompt.shape[1])[None]
    logits = {}
    for name, m, lora, bypass in [("peft", peft_model, None, False), ("merged", merged, None, False),
                                  ("engine-lora", peft_model, lora_from_peft(peft_model), True)]:
        view = ModelView(m)
        fwd = ForwardPass(view, bypass_peft=bypass)
        fwd.load_lora(lora)
        cache = KVCache(view.n_layers, 1, view.n_kv_heads, prompt.shape[1], view.head_dim, view.dtype, view.device)
        with torch.no_grad():
            logits[name] = fwd.prefill(prompt, pos, None, cache)
    with torch.no_grad():
        ref = merged(prompt).logits[:, -1]
        base_only = peft_model.get_base_model()
        with peft_model.disable_adapter():
            no_lora = base_only(prompt).logits[:, -1]
    assert (ref - no_lora).abs().max() > 0.1, "the adapter must change the logits for this test to mean anything"
    # fp32: unmerged adds x@A^T@B^T*s to W x; merged computes (W + s B A) x -- equal up to rounding
    for name in ("peft", "engine-lora"):
        torch.testing.assert_close(logits[name], ref, atol=1e-4, rtol=1e-4, msg=name)
    torch.testing.assert_close(logits["merged"], ref, atol=1e-5, rtol=1e-5)


def test_lora_generate_paths_agree(lora_pair):
    peft_model, merged = lora_pair
    ref = generate(merged, PROMPTS, NEW, seed=4, stop_token_ids=[])
    via_peft = generate(peft_model, PROMPTS, NEW, seed=4, stop_token_ids=[])
    via_dict = generate(peft_model, PROMPTS, NEW, seed=4, stop_token_ids=[], lora=lora_from_peft(peft_model))
    for r, a, b in zip(ref, via_peft, via_dict):
        assert a.token_ids == r.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(r.logprobs, abs=1e-4)
        assert b.logprobs == pytest.approx(r.logprobs, abs=1e-4)


def test_lora_dict_on_plain_model_and_in_place_update():
    model = tiny_model("llama")
    torch.manual_seed(2)
    target = "model.layers.1.mlp.down_proj"
    adapter = LoraAdapter(torch.randn(3, 128) * 0.3, torch.randn(64, 3) * 0.3, 2.0)
    engine = RolloutEngine(model)
    base = engine.generate(PROMPTS, NEW, temperature=0, stop_token_ids=[])
    with_lora = engine.generate(PROMPTS, NEW, temperature=0, stop_token_ids=[], lora={target: adapter})
    assert [c.token_ids for c in base] != [c.token_ids for c in with_lora]
    adapter.B.zero_()  # updated in place: the engine must see the new values, giving the base model back
    zeroed = engine.generate(PROMPTS, NEW, temperature=0, stop_token_ids=[], lora={target: adapter})
    assert [c.token_ids for c in zeroed] == [c.token_ids for c in base]
    with pytest.raises(ValueError, match="not a projection"):
        engine.generate(PROMPTS, 2, lora={"model.layers.9.mlp.down_proj": adapter})


def test_norm_overrides_change_output_and_leave_parameters_untouched(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    base = generate(model, PROMPTS, NEW, temperature=0, stop_token_ids=[])
    torch.manual_seed(9)
    overrides = {f"model.layers.{i}.{n}": model.get_submodule(f"model.layers.{i}.{n}").weight + 0.5 * torch.randn(64)
                 for i in range(2) for n in ("input_layernorm", "post_attention_layernorm")}
    noisy = generate(model, PROMPTS, NEW, temperature=0, stop_token_ids=[], norm_overrides=overrides)
    again = generate(model, PROMPTS, NEW, temperature=0, stop_token_ids=[])
    assert [c.token_ids for c in noisy] != [c.token_ids for c in base]
    assert [c.token_ids for c in again] == [c.token_ids for c in base]  # an override lasts one call
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    # an override equal to the weight itself is a no-op
    same = {"model.norm": model.model.norm.weight.clone()}
    assert [c.token_ids for c in generate(model, PROMPTS, NEW, temperature=0, stop_token_ids=[],
                                          norm_overrides=same)] == [c.token_ids for c in base]
    with pytest.raises(ValueError, match="not RMSNorm modules"):
        generate(model, PROMPTS, 2, norm_overrides={"model.layers.0.mlp": torch.ones(64)})


# ---- alternative decode attention ---------------------------------------------------------------
def test_matmul_decode_attention_matches_sdpa(model):
    sdpa = RolloutEngine(model, decode_attention="sdpa").generate(PROMPTS, NEW, seed=1, stop_token_ids=[])
    mm = RolloutEngine(model, decode_attention="matmul").generate(PROMPTS, NEW, seed=1, stop_token_ids=[])
    for a, b in zip(sdpa, mm):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)  # fp32, different summation order


# ---- bad input ----------------------------------------------------------------------------------
def test_prompt_too_long_fails_before_any_work(model):
    engine = RolloutEngine(model, max_seq_len=32)
    with pytest.raises(ValueError, match="max_seq_len=32"):
        engine.generate([[5] * 30, [6]], 8)
    assert engine.cache is None  # nothing was allocated
    with pytest.raises(ValueError, match="exceeds the cache limit"):
        generate(model, [[5] * 90], 10)  # the model's max_position_embeddings is 96


def test_empty_and_malformed_prompts(model):
    assert generate(model, [], 5) == []
    assert generate(model, torch.zeros(0, 4, dtype=torch.long), 5) == []
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model, [[5], []], 5)
    with pytest.raises(ValueError, match="wrap a single prompt"):
        generate(model, [5, 6, 7], 5)
    with pytest.raises(ValueError, match="token ids must be in"):
        generate(model, [[5, 999]], 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [[5]], 0)


def test_unsupported_architecture_names_supported_ones():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="llama, qwen2"):
        generate(gpt2, [[1, 2]], 4)


def test_to_padded():
    ids, mask, lp = to_padded([Completion([4, 5, 2], [-0.1, -0.2, -0.3], "stop"), Completion([7], [-1.0], "length")],
                              pad_id=9)
    assert ids.tolist() == [[4, 5, 2], [7, 9, 9]] and mask.sum().item() == 4
    assert lp[1].tolist() == [-1.0, 0.0, 0.0]


# ---- the embedded model (real weights, bf16) ----------------------------------------------------
def test_embedded_model_greedy_equals_hf_generate(embedded_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_model_dir)
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir).eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"] for q in ("What is 2 + 3?",)]
    outs = generate(model, prompts, 16, temperature=0)
    for prompt, c in zip(prompts, outs):
        assert c.token_ids == hf_greedy(model, prompt, 16)


# ---- NVFP4 weights -------------------------------------------------------------------------------
def test_nvfp4_model_greedy_equals_naive_loop():
    from qerl_lib.models.loader import replace_linear_with_nvfp4

    model = tiny_model("qwen2", dtype=torch.bfloat16)
    replace_linear_with_nvfp4(model)
    assert any(type(m).__name__ == "NVFP4Linear" for m in model.modules())
    outs = generate(model, PROMPTS, NEW, temperature=0, stop_token_ids=[])
    for prompt, c in zip(PROMPTS[:2], outs):
        assert c.token_ids == naive_greedy(model, prompt, NEW)


# ---- CUDA: graphs against eager, bf16 and NVFP4 -----------------------------------------------------
def exact_twin(model):
    """A float32 copy of ``model`` (NVFP4 layers on the dequantize-then-matmul reference path): the
    same function evaluated without bf16 rounding, as the yardstick for "greedy"."""
    from qerl_lib.models.nvfp4_linear import set_impl

    twin = copy.deepcopy(model).float()
    set_impl(twin, "reference")
    return twin


def assert_near_greedy(model, twin, prompt, tokens, factor=2.0):
    """Every token must be the argmax of the exact (float32) teacher-forced logits over prompt + tokens,
    or within ``factor`` x the bf16 noise of it, where the noise is how far transformers' own bf16
    forward of the same ids lands from the exact logits (max over positions and vocabulary). bf16
    paths that round differently (the engine's fused glue, matmul attention, M-dependent GEMM tiles)
    may break a near tie either way; a real engine error (wrong position, cache, mask) is far larger."""
    ids = torch.tensor([list(prompt) + list(tokens)], device=model.device)
    with torch.no_grad():
        exact = twin(ids).logits[0, len(prompt) - 1:-1].double()
        rounded = model(ids).logits[0, len(prompt) - 1:-1].double()
    noise = (rounded - exact).abs().max().item()
    chosen = exact.gather(-1, torch.tensor(tokens, device=model.device)[:, None]).squeeze(-1)
    gaps = exact.max(-1).values - chosen
    at = int(gaps.argmax())
    assert gaps[at].item() <= factor * noise, (
        f"token {at} is {gaps[at].item():.4f} below the exact argmax logit; bf16 noise of this model is "
        f"{noise:.4f} (allowed {factor}x)")


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["graphs", "graphs+fused"])
def test_cuda_graph_decode_equals_eager(backend):
    model = tiny_model("qwen2").cuda()
    eager = RolloutEngine(model, decode_backend="eager").generate(PROMPTS, 40, temperature=0, stop_token_ids=[])
    graph_engine = RolloutEngine(model, decode_backend=backend, length_step=16)  # several length buckets
    graphs = graph_engine.generate(PROMPTS, 40, temperature=0, stop_token_ids=[])
    assert [c.token_ids for c in graphs] == [c.token_ids for c in eager]
    singles = [graph_engine.generate([p], 40, temperature=0, stop_token_ids=[])[0].token_ids for p in PROMPTS]
    assert singles == [c.token_ids for c in eager]


def test_graph_path_bookkeeping_on_cpu(model):
    # Off CUDA the "graphs" backend runs its static buffers, spare rows (3 prompts -> bucket of 4)
    # and length buckets (8 columns each: several per call) eagerly, so the CPU can check them.
    eager = RolloutEngine(model).generate(PROMPTS[:3], 20, temperature=0, stop_token_ids=[])
    bucketed = RolloutEngine(model, decode_backend="graphs", length_step=8)
    assert [c.token_ids for c in bucketed.generate(PROMPTS[:3], 20, temperature=0, stop_token_ids=[])] == \
        [c.token_ids for c in eager]
    assert bucketed.cache.batch == 4 and bucketed.cache.length % 8 == 0
    bucketed.warmup(3, 7, 20)  # captures nothing on CPU, but must leave the engine usable
    again = bucketed.generate(PROMPTS[:3], 20, temperature=0, stop_token_ids=[])
    assert [c.token_ids for c in again] == [c.token_ids for c in eager]


@pytest.mark.cuda
@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("weights", ["bf16", "nvfp4"])
def test_cuda_greedy_batch_and_singles_are_greedy(weights, fuse):
    model = tiny_cuda_model(weights)
    twin = exact_twin(model)
    engine = RolloutEngine(model, fuse_projections=fuse)  # graphs+fused on CUDA
    batch = engine.generate(PROMPTS, 24, temperature=0, stop_token_ids=[])
    singles = [engine.generate([p], 24, temperature=0, stop_token_ids=[])[0] for p in PROMPTS]
    for prompt, b, s in zip(PROMPTS, batch, singles):
        assert_near_greedy(model, twin, prompt, b.token_ids)
        assert_near_greedy(model, twin, prompt, s.token_ids)
    agree = sum(b.token_ids == s.token_ids for b, s in zip(batch, singles))
    assert agree >= len(PROMPTS) - 1, "batched and single greedy runs should agree except on a rare near tie"


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_rope_table_equals_the_rotary_module_at_every_position(kind):
    from qerl_lib.engine.forward import ForwardPass, ModelView

    model = tiny_model(kind, torch.bfloat16)
    view = ModelView(model)
    forward = ForwardPass(view)
    forward.reserve_columns(300)
    cos_t, sin_t = forward._rope_table
    positions = torch.tensor([[0, 1, 37, 255, 299]])
    probe = torch.zeros(1, 1, 1, dtype=torch.bfloat16)
    cos, sin = view.rotary(probe, positions)
    assert cos_t.shape[0] == 300
    assert torch.equal(cos_t[positions[0]], cos[0]) and torch.equal(sin_t[positions[0]], sin[0])

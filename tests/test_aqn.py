"""AQN: schedules, config validation, noise application without accumulation, exact restore, seeding,
and the norm-noise == multiplicative-projection-noise identity on real layers.

Random inputs are fresh every run; the seed is printed in failure messages and can be pinned
with QERL_TEST_SEED=<int>.
"""

from __future__ import annotations

import copy
import json
import math
import os
import random

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from qerl_lib.train import aqn
from qerl_lib.train.aqn import (DEFAULT_NORMS, SCHEDULES, AQNConfig, AQNController, AQNSchedule, apply_norm_overrides,
                          find_norms, merged_projection_weight, noise_to_overrides, realized_noise_stats,
                          sample_norm_noise, sample_norm_overrides, schedule_curves)

SEED = int(os.environ.get("QERL_TEST_SEED", random.SystemRandom().randrange(2**31)))
EPS32 = torch.finfo(torch.float32).eps
# projections that read each norm (nn.Linear [out, in]; their input columns get (1 + Z/w))
READERS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}


# ----------------------------------------------------------------------------- schedules
def _reference_sigmas(schedule, start, end, k_stages):
    """Independent closed forms (numpy) for stages 1..K-1, f = (k-1)/(K-2)."""
    f = np.arange(k_stages - 1) / (k_stages - 2)
    return {"exponential": start * (end / start) ** f,  # == the official code's sigma_trend
            "linear": start + (end - start) * f,
            "cosine": end + (start - end) * (1 + np.cos(np.pi * f)) / 2,
            "logarithmic": start + (end - start) * np.log10(1 + 9 * f)}[schedule]


@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s != "constant"])
@pytest.mark.parametrize("start,end,k", [(1e-2, 5e-4, 10), (5e-2, 5e-4, 10), (1e-2, 1e-4, 3), (1e-2, 1e-3, 17)],
                         ids=lambda v: str(v))
def test_schedule_endpoints_and_shape(schedule, start, end, k):
    table = AQNSchedule(AQNConfig(total_steps=1000, sigma_start=start, sigma_end=end, num_stages=k,
                                  schedule=schedule)).table()
    assert len(table) == k
    assert table[0] == 0.0, "stage 0 adds no noise (quantization noise only)"
    assert table[1] == start and table[-1] == end, f"endpoints must be exact: {table}"
    assert all(a >= b for a, b in zip(table[1:], table[2:])), f"σ must not increase: {table}"
    np.testing.assert_allclose(table[1:], _reference_sigmas(schedule, start, end, k), rtol=1e-12)


@pytest.mark.parametrize("k", [2, 3, 10])
def test_constant_schedule_holds_sigma_start_after_the_clean_stage(k):
    table = AQNSchedule(AQNConfig(total_steps=100, sigma_start=1e-2, sigma_end=5e-4, num_stages=k,
                                  schedule="constant")).table()
    assert table == [0.0] + [1e-2] * (k - 1)


def test_exponential_matches_the_official_trend_values():
    # the official code's sigma_trend with its scripts' 1e-2 -> 1e-4, K = 10 (3 significant digits)
    printed = [0, 1e-2, 5.62e-3, 3.16e-3, 1.78e-3, 1e-3, 5.62e-4, 3.16e-4, 1.78e-4, 1e-4]
    table = AQNSchedule(AQNConfig(total_steps=600, sigma_start=1e-2, sigma_end=1e-4)).table()
    np.testing.assert_allclose(table, printed, rtol=2e-3)
    # and it differs from the paper's Eq. 8 exponent (k-1)/(K-1), which stops short of σ_end
    assert 1e-2 * (1e-4 / 1e-2) ** (8 / 9) > 1.6e-4 > table[-1]


def test_stage_boundaries_1000_steps_10_stages():
    s = AQNSchedule(AQNConfig(total_steps=1000))
    assert [s.stage(t) for t in (0, 99, 100, 199, 899, 900, 999)] == [0, 0, 1, 1, 8, 9, 9]
    assert s.sigma(99) == 0.0 and s.sigma(100) == 1e-2 and s.sigma(999) == 5e-4
    assert s.stage(1000) == s.stage(10**9) == 9, "steps past total_steps stay in the last stage"
    assert [s.stage_first_step(k) for k in range(10)] == list(range(0, 1000, 100))
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="counted from 0"):
            s.stage(bad)


@pytest.mark.parametrize("m,k", [(1001, 7), (10, 10), (37, 3), (601, 10), (2, 2)], ids=lambda v: str(v))
def test_stages_are_equal_up_to_one_step(m, k):
    cfg = AQNConfig(total_steps=m, num_stages=k, sigma_end=1e-2 if k == 2 else 5e-4)
    s = AQNSchedule(cfg)
    stages = [s.stage(t) for t in range(m)]
    assert stages == sorted(stages) and set(stages) == set(range(k))
    lengths = np.bincount(stages)
    assert lengths.max() - lengths.min() <= 1, lengths
    for stage in range(1, k):
        first = s.stage_first_step(stage)
        assert stages[first] == stage and stages[first - 1] == stage - 1


def test_two_stages_and_disabled():
    assert AQNSchedule(AQNConfig(total_steps=10, num_stages=2, sigma_end=1e-2)).table() == [0.0, 1e-2]
    off = AQNConfig.off(total_steps=100)
    assert not off.enabled and AQNSchedule(off).table() == [0.0] * 10
    model = _tiny_model("llama")
    assert AQNController(off).overrides_for_step(model, 99) == {}


# ----------------------------------------------------------------------------- bad configs
@pytest.mark.parametrize("kwargs,rule", [
    (dict(sigma_start=1e-3, sigma_end=1e-2), "need sigma_end <= sigma_start"),
    (dict(num_stages=1), "need an integer >= 2"),
    (dict(num_stages=2), "num_stages=2 leaves one noisy stage"),
    (dict(sigma_start=-1e-2), "σ must be a finite number >= 0"),
    (dict(sigma_end=-1e-4), "σ must be a finite number >= 0"),
    (dict(sigma_start=float("nan")), "σ must be a finite number >= 0"),
    (dict(sigma_start=0.0, sigma_end=0.0), "need sigma_start > 0"),
    (dict(sigma_end=0.0), "geometric decay never reaches 0"),
    (dict(schedule="step"), "schedule must be one of"),
    (dict(norms=("input_layernorm", "o_proj_norm")), "norms must be among"),
    (dict(norms=()), "at least one"),
    (dict(target="trainer"), "target must be one of"),
    (dict(total_steps=5), "so that every stage has at least one step"),
    (dict(seed=-3), "non-negative integer"),
], ids=lambda v: v if isinstance(v, str) else ",".join(v))
def test_bad_config_raises_with_the_rule(kwargs, rule):
    with pytest.raises(ValueError, match=rule):
        AQNConfig(**{"total_steps": 1000, **kwargs})


def test_zero_sigma_end_is_fine_for_linear_decay():
    assert AQNSchedule(AQNConfig(total_steps=100, sigma_end=0.0, schedule="linear")).table()[-1] == 0.0


# ----------------------------------------------------------------------------- the training config's AQN settings
@pytest.mark.parametrize("mode", ["qerl", "nvfp4"])  # checked whether or not the run adds noise
@pytest.mark.parametrize("kwargs,rule", [
    (dict(sigma_start=1e-3, sigma_end=1e-2), "need sigma_end <= sigma_start"),
    (dict(aqn_stages=1), "aqn_stages=1: need an integer >= 2"),
    (dict(aqn_stages=0), "aqn_stages=0: need an integer >= 2"),
    (dict(aqn_stages=-4), "aqn_stages=-4: need an integer >= 2"),
    (dict(aqn_stages=2.5), "aqn_stages=2.5: need an integer >= 2"),
    (dict(aqn_stages=2), "aqn_stages=2 leaves one noisy stage"),
    (dict(sigma_start=-1e-2), "sigma_start=-0.01: σ must be a finite number >= 0"),
    (dict(sigma_end=-1e-4), "sigma_end=-0.0001: σ must be a finite number >= 0"),
    (dict(sigma_start=float("inf")), "σ must be a finite number >= 0"),
    (dict(sigma_start=0.0, sigma_end=0.0), r"need sigma_start > 0 \(use --aqn off"),
    (dict(sigma_end=0.0), "aqn_schedule='exponential': a geometric decay never reaches 0"),
    (dict(aqn_schedule="step"), "unknown aqn_schedule 'step': --schedule must be one of exponential"),
], ids=lambda v: v if isinstance(v, str) else ",".join(f"{k}={v}" for k, v in v.items()))
def test_bad_aqn_setting_fails_in_make_config_with_the_rule(kwargs, rule, mode):
    """Each AQNConfig rule fires when the training config is made (no model), as one line naming the setting."""
    from qerl_lib.errors import UserError
    from qerl_lib.train.presets import make_config

    with pytest.raises(UserError, match=rule) as err:
        make_config("smollm2-arith", mode=mode, steps=100, **kwargs)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("steps,stages,sigma_end", [(100, 10, 5e-4), (10, 10, 5e-4), (4, 4, 5e-4), (3, 3, 5e-4),
                                                     (2, 2, 1e-2), (1, 2, 1e-2)])
def test_a_run_shorter_than_aqn_stages_gets_one_stage_per_step(steps, stages, sigma_end):
    """The documented fit (TrainConfig.aqn_settings): K = min(aqn_stages, steps); a single noisy stage takes
    sigma_start; a 1-step run is stage 0 only. The fit is printed, and a valid AQNConfig comes out."""
    from qerl_lib.train.presets import describe, make_config

    config = make_config("smollm2-arith", mode="qerl", steps=steps)
    settings = config.aqn_settings()
    assert (settings["num_stages"], settings["sigma_end"]) == (stages, sigma_end)
    schedule = AQNSchedule(AQNConfig(**settings))
    assert schedule.sigma(0) == 0.0 and schedule.sigma(steps - 1) == (0.0 if steps == 1 else sigma_end)
    assert ("aqn_stages 10 fitted to" in describe(config)) == (stages != 10)


def test_aqn_stages_asked_for_are_kept():
    """Two stages asked for explicitly keep the given sigma_end (constant noise, or the constant schedule)."""
    from qerl_lib.train.presets import make_config

    same = make_config("smollm2-arith", mode="qerl", aqn_stages=2, sigma_end=1e-2).aqn_settings()
    constant = make_config("smollm2-arith", mode="qerl", aqn_stages=2, aqn_schedule="constant").aqn_settings()
    assert (same["num_stages"], same["sigma_end"]) == (2, 1e-2)
    assert (constant["num_stages"], constant["sigma_end"], constant["schedule"]) == (2, 5e-4, "constant")


@pytest.mark.parametrize("steps", [1, 2, 3, 7, 10, 60, 100])
@pytest.mark.parametrize("schedule", ["exponential", "linear", "constant"])
def test_config_settings_are_what_training_builds(steps, schedule):
    from qerl_lib.train.grpo import aqn_config
    from qerl_lib.train.presets import make_config

    config = make_config("smollm2-arith", mode="qerl", steps=steps, aqn_schedule=schedule, seed=3, aqn_target="both")
    assert aqn_config(config) == AQNConfig(**config.aqn_settings())


# ----------------------------------------------------------------------------- tiny models
def _tiny_model(arch: str, dtype=torch.float32, layers=2):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    cfg = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)  # Qwen2: q/k/v carry biases
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    with torch.no_grad():  # norms init to 1.0; give them trained-looking spread (and small entries)
        for name, module in model.named_modules():
            if name.endswith("norm"):
                module.weight.copy_(torch.empty_like(module.weight).uniform_(0.05, 1.5))
    return model


def _bits(model):
    return {k: v.detach().clone().view(torch.int16 if v.element_size() == 2 else torch.int32)
            for k, v in model.state_dict().items()}


def _assert_bit_identical(model, reference, what):
    now = _bits(model)
    changed = [k for k in reference if not torch.equal(now[k], reference[k])]
    assert not changed, f"{what}: changed {changed[:5]} (seed {SEED})"


@pytest.mark.parametrize("arch,dtype", [("llama", torch.bfloat16), ("qwen2", torch.float32)],
                         ids=["llama-bf16", "qwen2-fp32"])
def test_1000_rollouts_never_accumulate_and_final_norm_untouched(arch, dtype):
    model = _tiny_model(arch, dtype)
    start = _bits(model)
    base = {n: m.weight.detach().clone() for n, m in find_norms(model, DEFAULT_NORMS).items()}
    final_norm = model.model.norm.weight
    ctl = AQNController(AQNConfig(total_steps=1000, seed=SEED))
    for step in range(1000):
        overrides = ctl.overrides_for_step(model, step)
        assert (overrides == {}) == (step < 100), f"step {step}: stage 0 has no noise, later stages do"
        with apply_norm_overrides(model, overrides):
            assert torch.equal(final_norm.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               start["model.norm.weight"]), f"final norm moved at step {step}"
            if step % 97 == 0 or step == 999:  # compare with an independent recomputation
                for name, module in find_norms(model, DEFAULT_NORMS).items():
                    expected = (base[name].float() + ctl.last_noise[name]).to(dtype) if overrides else base[name]
                    assert torch.equal(module.weight, expected), f"{name} at step {step} != base + latest noise"
    assert set(ctl.last_noise) == set(base) and len(base) == 2 * model.config.num_hidden_layers
    _assert_bit_identical(model, start, "after 1000 applied rollouts")


def test_restore_is_exact_even_on_exception_and_guards_against_accumulation():
    model = _tiny_model("llama", torch.bfloat16)
    start = _bits(model)
    overrides = sample_norm_overrides(model, 1e-2, torch.Generator().manual_seed(SEED))
    assert overrides, "sample_norm_overrides returned no overrides: nothing would be tested"
    modules = dict(model.named_modules())

    def assert_overrides_in_effect(what):
        # every targeted norm holds exactly its override, and that differs from the saved original
        for name, value in overrides.items():
            weight = modules[name].weight
            assert torch.equal(weight, value.to(weight.dtype)), f"{what}: {name} does not hold its override"
            assert not torch.equal(weight.detach().view(torch.int16), start[f"{name}.weight"]), \
                f"{what}: {name} still holds its original bits, the override changed nothing (seed {SEED})"

    with pytest.raises(KeyError):
        with apply_norm_overrides(model, overrides):
            assert_overrides_in_effect("inside the block")
            raise KeyError("boom")
    _assert_bit_identical(model, start, "after an exception inside the block")
    with apply_norm_overrides(model, overrides):
        assert_overrides_in_effect("inside the guarded block")
        with pytest.raises(RuntimeError, match="outside `apply_norm_overrides`"):
            sample_norm_overrides(model, 1e-2, torch.Generator().manual_seed(0))
        with pytest.raises(RuntimeError, match="outside `apply_norm_overrides`"):
            with apply_norm_overrides(model, overrides):
                pass
    _assert_bit_identical(model, start, "after the guarded block")
    # bad override dicts are rejected before anything is touched
    with pytest.raises(ValueError, match="shape"):
        with apply_norm_overrides(model, {"model.layers.0.input_layernorm": torch.zeros(3)}):
            pass
    with pytest.raises(ValueError, match="matches 0 modules"):
        with apply_norm_overrides(model, {"model.layers.9.input_layernorm": torch.zeros(64)}):
            pass
    _assert_bit_identical(model, start, "after rejected overrides")


def test_same_seed_same_noise_fresh_per_rollout_and_resume():
    m1, m2 = _tiny_model("qwen2"), _tiny_model("qwen2")
    cfg = AQNConfig(total_steps=100, seed=SEED)
    a, b = AQNController(cfg), AQNController(cfg)
    first = a.overrides_for_step(m1, 50)
    assert all(torch.equal(first[k], v) for k, v in b.overrides_for_step(m2, 50).items()), "same seed, same noise"
    again = a.overrides_for_step(m1, 50)  # a second rollout in the same step draws afresh
    assert not any(torch.equal(first[k], again[k]) for k in first)
    other = AQNController(AQNConfig(total_steps=100, seed=SEED + 1)).overrides_for_step(m1, 50)
    assert not any(torch.equal(first[k], other[k]) for k in first)
    z = list(a.last_noise.values())
    assert not any(torch.equal(z[0], v) for v in z[1:]), "each norm gets its own vector"
    # resume: a fresh controller loaded from the checkpoint continues with the same draws
    state = json.loads(json.dumps(a.state_dict()))  # checkpoints may store it as JSON
    resumed = AQNController(cfg)
    resumed.load_state_dict(state)
    nxt_a, nxt_r = a.overrides_for_step(m1, 50), resumed.overrides_for_step(m1, 50)
    assert all(torch.equal(nxt_a[k], nxt_r[k]) for k in nxt_a)
    assert all(torch.equal(a.overrides_for_step(m1, 60)[k], resumed.overrides_for_step(m1, 60)[k]) for k in nxt_a)
    with pytest.raises(ValueError, match="different config"):
        AQNController(AQNConfig(total_steps=100, seed=SEED, sigma_end=1e-3)).load_state_dict(state)


def test_noise_is_gaussian_with_sigma():
    model = _tiny_model("llama", layers=4)
    g = torch.Generator().manual_seed(SEED)
    z = torch.cat([v for _ in range(40) for v in sample_norm_noise(model, 3e-3, g).values()]).double()
    n = z.numel()  # 40 draws x 8 norms x 64 channels
    # std of a sample std is σ/sqrt(2n) ≈ 0.9%; 5% is > 5 standard errors
    assert abs(z.std().item() / 3e-3 - 1) < 0.05, f"std {z.std().item():.3e} (seed {SEED})"
    assert abs(z.mean().item()) < 5 * 3e-3 / math.sqrt(n), f"mean {z.mean().item():.3e} (seed {SEED})"


def test_final_norm_only_when_listed_and_unknown_names():
    model = _tiny_model("llama")
    g = torch.Generator().manual_seed(SEED)
    assert list(sample_norm_overrides(model, 1e-2, g, norms=("norm",))) == ["model.norm"]
    assert "model.norm" not in sample_norm_overrides(model, 1e-2, g)
    with pytest.raises(ValueError, match=r"q_norm.*norm modules are named \['input_layernorm', 'norm', "
                                         r"'post_attention_layernorm'\]"):
        find_norms(model, ("q_norm",))


def test_target_both_reuses_the_rollout_noise_on_a_wrapped_trainer_model():
    model = _tiny_model("llama")
    trainer_model = nn.Module()
    trainer_model.base_model = model  # names gain a prefix, as under PEFT
    ctl = AQNController(AQNConfig(total_steps=100, seed=SEED, target="both"))
    with pytest.raises(RuntimeError, match="overrides_for_step"):
        ctl.trainer_overrides(trainer_model, 50)
    rollout = ctl.overrides_for_step(model, 50)
    trainer = ctl.trainer_overrides(trainer_model, 50)
    assert set(trainer) == {"base_model." + k for k in rollout}
    assert all(torch.equal(trainer["base_model." + k], v) for k, v in rollout.items())
    assert ctl.trainer_overrides(trainer_model, 5) == {}, "stage 0: no noise in the trainer either"
    only_rollout = AQNController(AQNConfig(total_steps=100, seed=SEED))
    only_rollout.overrides_for_step(model, 50)
    assert only_rollout.trainer_overrides(trainer_model, 50) == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_overrides_and_stats_equal_the_per_norm_formulas(dtype):
    # noise_to_overrides moves all of a device's noise in one copy and realized_noise_stats reads its sums back once:
    # the same values as the plain per-norm computation (bit for bit; the RMS's double sum in another order)
    model = _tiny_model("qwen2", dtype, layers=3)
    noise = sample_norm_noise(model, 0.01, torch.Generator().manual_seed(SEED))
    overrides = noise_to_overrides(model, noise)
    norms = find_norms(model, DEFAULT_NORMS)
    assert list(overrides) == list(norms)
    sq = changed = count = 0
    for name, module in norms.items():
        plain = (module.weight.detach().float() + noise[name].float()).to(dtype)
        assert overrides[name].dtype == dtype and torch.equal(overrides[name], plain), name
        delta = plain.float() - module.weight.detach().float()
        sq, changed, count = sq + float(delta.double().pow(2).sum()), changed + int((delta != 0).sum()), count + delta.numel()
    stats = realized_noise_stats(model, overrides)
    assert stats["fraction_changed"] == changed / count
    assert stats["realized_rms"] == pytest.approx(math.sqrt(sq / count), rel=1e-12)


def test_bf16_rounds_small_noise_away_and_float32_overrides_keep_it():
    model = _tiny_model("llama", torch.bfloat16)
    with torch.no_grad():
        for m in find_norms(model, DEFAULT_NORMS).values():
            m.weight.fill_(1.0)  # bf16 spacing is 2^-7 above 1.0 and 2^-8 below: |Z| < 2^-9 rounds back to 1.0
    # σ = 2e-4: |Z| > 2^-9 is a 9.8σ event (at 5e-4 it was 3.9σ: 1 in 40 draws of 256 kept one value, and
    # which draw a CPU makes depends on its randn code path and thread count)
    noise = sample_norm_noise(model, 2e-4, torch.Generator().manual_seed(SEED))
    bf16 = noise_to_overrides(model, noise)
    assert realized_noise_stats(model, bf16) == {"realized_rms": 0.0, "fraction_changed": 0.0}
    fp32 = noise_to_overrides(model, noise, dtype=torch.float32)
    stats = realized_noise_stats(model, fp32)
    # float32 keeps every draw except |Z| below half its spacing at 1.0 (2^-24, ~1e-4 σ): which ones
    # those are depends on the CPU's randn code path, so the expectation is computed from the draw.
    kept = sum(int(((1.0 + z) != 1.0).sum()) for z in noise.values()) / sum(z.numel() for z in noise.values())
    assert kept > 0.98 and stats["fraction_changed"] == kept, (stats, kept)
    assert abs(stats["realized_rms"] / 2e-4 - 1) < 0.25, stats


# ----------------------------------------------------------------------------- equivalence
def _capture_norm_inputs(model, ids):
    inputs, hooks = {}, []
    for name, module in find_norms(model, DEFAULT_NORMS).items():
        hooks.append(module.register_forward_pre_hook(
            lambda mod, args, name=name: inputs.__setitem__(name, args[0].detach().clone())))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return inputs


def _check_equivalence(model, layer_indices, sigmas, seed):
    """proj(RMSNorm_{w+Z}(x)) == linear(RMSNorm_w(x), W·diag(1 + Z/w)) on real activations x, float32.

    Tolerance: each output element is a dot product over terms x̂_i·(w_i + Z_i)·W_ji. The two sides
    round differently, and each side's error is at most a few ulps of the *sum of absolute
    terms*: the factor (1 + Z/w), its product with w, and the accumulation of the dot product.
    So we allow |a - b| <= 16·eps32·Σ_i |x̂_i|(|w_i| + |Z_i|)|W_ji|. On the embedded model the
    largest observed ratio was 1.6, so 16 leaves a 10x margin. The wrong merge (1 + Z), which
    forgets to divide by w, sits above 3.5e3 on the same scale, and the negative control below
    asserts that it fails.
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
    inputs = _capture_norm_inputs(model, ids)
    worst, checked = 0.0, 0
    for sigma in sigmas:
        noise = sample_norm_noise(model, sigma, g)
        overrides = noise_to_overrides(model, noise)
        for li in layer_indices:
            layer = model.model.layers[li]
            for norm_name, readers in READERS.items():
                key = f"model.layers.{li}.{norm_name}"
                norm, x, z = layer.get_submodule(norm_name), inputs[key], noise[key]
                with torch.no_grad():
                    clean = norm(x)
                    with apply_norm_overrides(model, {key: overrides[key]}):
                        noised = norm(x)  # the model's own module with w + Z
                    for reader in readers:
                        proj = layer.get_submodule(reader)
                        a = proj(noised)
                        b = F.linear(clean, merged_projection_weight(norm.weight, z, proj.weight), proj.bias)
                        scale = (clean / norm.weight).abs() * (norm.weight.abs() + z.abs())
                        bound = 16 * EPS32 * (scale @ proj.weight.abs().T)
                        ratio = ((a - b).abs() / bound).max().item()
                        assert ratio <= 1, (f"layer {li} {reader} σ={sigma}: |Δ| reaches {ratio:.2f}x the "
                                            f"tolerance, max |Δ|={(a - b).abs().max().item():.3e} (seed {seed})")
                        worst, checked = max(worst, ratio), checked + 1
                        # negative control: forgetting the 1/w (scaling by 1 + Z) must fail the same bound
                        wrong = F.linear(clean, proj.weight * (1 + z)[None, :], proj.bias)
                        assert ((a - wrong).abs() > bound).any(), "the check cannot tell (1+Z) from (1+Z/w)"
    return worst, checked


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_norm_noise_equals_multiplicative_projection_noise_random_models(arch):
    model = _tiny_model(arch, torch.float32, layers=3)
    _, checked = _check_equivalence(model, (0, 1, 2), (1e-3, 1e-2, 5e-2), SEED)
    assert checked == 3 * 3 * 5


@pytest.fixture(scope="module")
def embedded_fp32(embedded_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32).eval()


def test_norm_noise_equals_multiplicative_projection_noise_embedded(embedded_fp32):
    """The embedded SmolLM2 (30 layers): first, middle, last layer; q/k/v and gate/up; three σ."""
    _, checked = _check_equivalence(embedded_fp32, (0, 14, 29), (1e-3, 1e-2, 5e-2), SEED)
    assert checked == 3 * 3 * 5


def test_embedded_whole_model_noised_norms_equal_merged_projections(embedded_fp32):
    """Noise in every layer's two norms == every q/k/v/gate/up scaled per input column: same logits."""
    model = embedded_fp32
    g = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, model.config.vocab_size, (1, 16), generator=g)
    noise = sample_norm_noise(model, 1e-2, g)
    with torch.no_grad(), apply_norm_overrides(model, noise_to_overrides(model, noise)):
        noised = model(ids).logits
    originals = {}
    try:
        with torch.no_grad():
            for li, layer in enumerate(model.model.layers):
                for norm_name, readers in READERS.items():
                    z, w = noise[f"model.layers.{li}.{norm_name}"], layer.get_submodule(norm_name).weight
                    for reader in readers:
                        p = layer.get_submodule(reader).weight
                        originals[(li, reader)] = p.clone()
                        p.copy_(merged_projection_weight(w, z, p))
            merged = model(ids).logits
    finally:
        with torch.no_grad():
            for (li, reader), p in originals.items():
                model.model.layers[li].get_submodule(reader).weight.copy_(p)
    # The two fp32 forwards differ by rounding only, and 30 layers amplify it by however well conditioned this
    # input is: the gap was 1.4-2.5e-6 of the logits' scale for seeds 0-4 but 1.0e-4 for seed 723293862, whose
    # noised forward is itself 4.0e-5 of the scale away from the same forward in float64 (seeds 0-2: 2-3e-6).
    # So the gap is measured against that fp32 error on the same input (observed ratios 0.5-2.5; allowed 10).
    # A wrong merge moves the logits like the noise does (~0.1-0.7 of the scale), thousands of times more.
    model64 = copy.deepcopy(model).double()
    with torch.no_grad(), apply_norm_overrides(model64, noise_to_overrides(model64, noise)):
        noised64 = model64(ids).logits
    del model64
    scale = noised.abs().max().item()
    gap = (noised - merged).abs().max().item()
    fp32_error = (noised.double() - noised64).abs().max().item()
    assert gap <= 10 * fp32_error + 1e-7 * scale, (
        f"max |Δlogit| {gap:.3e} vs the fp32 forward's own error {fp32_error:.3e} (seed {SEED})")
    with torch.no_grad():
        clean = model(ids).logits
    assert (noised - clean).abs().max().item() > 100 * gap, "σ=1e-2 must visibly move the logits"


def test_embedded_bf16_rounding_matches_docstring(embedded_model_dir):
    """The numbers quoted in aqn.py's docstring: share of bf16 norm entries a draw actually changes."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(SEED)
    frac = {s: realized_noise_stats(model, sample_norm_overrides(model, s, g))["fraction_changed"]
            for s in (5e-4, 1e-2)}
    assert 0.10 < frac[5e-4] < 0.35 and frac[1e-2] > 0.85, frac  # docstring: ~16-24% and ~93%
    # final norm: only entries with |w| < 1 can move at σ = 5e-4 (|w| >= 1 would need |Z| > 2^-8, a 7.8σ event)
    w = model.model.norm.weight.float()
    assert int((w.abs() < 1).sum()) == 1, "docstring: 575 of 576 final-norm entries have |w| >= 1"
    final = sample_norm_overrides(model, 5e-4, g, norms=("norm",))
    assert realized_noise_stats(model, final)["fraction_changed"] <= 1 / w.numel()


# ----------------------------------------------------------------------------- figure
def test_schedule_curves_json_and_plot(tmp_path):
    from qerl_lib.io import write_json_atomic
    from qerl_lib.plots.aqn import plot_schedules

    data = schedule_curves(AQNConfig(total_steps=600, sigma_start=5e-2))
    assert [c["schedule"] for c in data["curves"]] == list(SCHEDULES)
    for c in data["curves"]:
        assert c["stage_sigmas"][1] == 5e-2
        assert c["stage_sigmas"][-1] == (5e-2 if c["schedule"] == "constant" else 5e-4)
        assert c["stage_first_steps"] == list(range(0, 600, 60))
    src = write_json_atomic(tmp_path / "aqn_schedules.json", data)
    out = plot_schedules(src, tmp_path / "fig" / "aqn_schedules.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert not list(out.parent.glob(".*")), "no temporary files left behind"
    write_json_atomic(tmp_path / "empty.json", {"curves": []})
    with pytest.raises(ValueError, match="schedule_curves"):
        plot_schedules(tmp_path / "empty.json", tmp_path / "x.png")


def test_merged_projection_weight_rejects_bad_input():
    with pytest.raises(ValueError, match="undefined"):
        merged_projection_weight(torch.tensor([1.0, 0.0]), torch.zeros(2), torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"projection \[out, in\]"):
        merged_projection_weight(torch.ones(2), torch.zeros(2), torch.ones(2, 3))
    assert aqn.KNOWN_NORM_NAMES.keys() >= set(DEFAULT_NORMS)

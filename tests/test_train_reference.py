"""Plain-torch references for the training objective's numbers, on fresh seeded random inputs.

* The kit's rollout/trainer mismatch metrics and truncated importance-sampling correction
  (``QeRLGRPOTrainer._generate_and_score_completions``, ``qerl_lib/train/trainer.py``), against the definitions
  of ``qerl_lib/train/grpo.py``'s docstring, computed here independently in float64 from the probabilities:
  with Δ = log π_old − log π_engine over the loss tokens, ``logprob_mismatch`` = mean |Δ|,
  ``logprob_mismatch_max`` = max |Δ|, ``mismatch_kl`` = mean(r − 1 − log r) with r = π_old / π_engine (the k3
  estimate of KL(engine ‖ trainer)), ``is_ratio_mean`` = mean min(r, C) (the weights applied), ``is_ratio_min`` /
  ``is_ratio_max`` = the range of r itself (the docstring's table shows ranges past C = 2), ``is_truncated_rate``
  = the share of tokens with r > C; with ``is_correction`` each token's advantage becomes A_i · min(r, C), and
  tokens outside the loss mask keep the weight 1. Ratios fall on both sides of C and on both sides of 1.
* TRL's clipped surrogate (``GRPOTrainer._compute_loss``) for the loss types the presets use ("grpo" for GSM8K,
  "dapo" otherwise), with the old log-probs moved so that the ratios ρ = π_θ / π_old fall below 1 − ε_low, inside
  the clip range, inside the DAPO clip-higher band (1 + ε_low, 1 + ε_high] and above 1 + ε_high, with advantages of
  both signs: the PPO/DAPO objective −min(ρ A, clip(ρ, 1 − ε_low, 1 + ε_high) A) per token, written here from the
  papers on the model's own forward (log-softmax of the logits / temperature), "grpo" averaged per sequence then
  over sequences, "dapo" summed over the tokens and divided by the batch's token count (TRL's documented
  normalizers, including its gradient-accumulation scaling). Loss and LoRA gradients must agree.

Tolerances: float32 arithmetic against float64 (metrics, rtol 1e-5; weights, rtol 1e-6), and for the loss the same
float32 forward summed in another order (rtol 1e-5 of the loss, and of the gradient's largest element).
"""

from __future__ import annotations

import collections
import math
import types

import pytest
import torch

trl = pytest.importorskip("trl")
from test_grpo import save_tiny_llama, tiny_config, toy_reward  # noqa: E402  (shared tiny-model helpers)

SEEDS = [0, 1, 2]


pytestmark = pytest.mark.usefixtures("single_torch_thread")  # tiny matrices (conftest.py)


# ============================================================ mismatch metrics and truncated IS
def _stub_trainer(is_correction: bool, is_cap: float, mismatch_forward: bool = True):
    """A ``QeRLGRPOTrainer`` without TRL's __init__: only what ``_generate_and_score_completions`` reads after
    TRL's own scoring (which the tests replace with a hand-made batch)."""
    from qerl_lib.train.trainer import trainer_class

    trainer = object.__new__(trainer_class())
    trainer.is_correction, trainer.is_cap = is_correction, is_cap
    trainer.qerl_rollout = types.SimpleNamespace(config=types.SimpleNamespace(mismatch_forward=mismatch_forward))
    trainer.model = types.SimpleNamespace(training=True, is_gradient_checkpointing=False)
    trainer.args = types.SimpleNamespace(gradient_checkpointing_kwargs=None, per_device_train_batch_size=4)
    trainer._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    return trainer


def _scored_batch(seed: int, batch: int = 6, length: int = 9):
    """TRL's scored batch with hand-set log-probs: a loss mask with padded tails (one row fully masked, one with a
    tool-masked token), engine log-probs in [-6, -0.05], trainer ("old") log-probs Δ ~ N(0, 0.9) away from them
    (ratios from ~e^-2.7 to ~e^2.7: both sides of 1 and of the cap 2), and garbage (NaN, -inf, +30) under the mask."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    lengths[0] = 0  # an all-masked row (e.g. a truncated completion)
    lengths[1] = length
    completion_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
    tool_mask = torch.ones_like(completion_mask)
    tool_mask[1, 2] = 0  # a tool-output token: not a loss token
    sampling = -(torch.rand(batch, length, generator=g) * 5.95 + 0.05)
    delta = torch.randn(batch, length, generator=g) * 0.9
    old = sampling + delta
    outside = (completion_mask * tool_mask) == 0
    sampling = torch.where(outside, torch.tensor(float("nan")), sampling)  # whatever the engine leaves there
    old = torch.where(outside, torch.where(torch.rand(batch, length, generator=g) < 0.5, float("-inf"), 30.0), old)
    out = {
        "prompt_ids": torch.randint(3, 100, (batch, 4), generator=g), "prompt_mask": torch.ones(batch, 4).long(),
        "completion_ids": torch.randint(3, 100, (batch, length), generator=g), "completion_mask": completion_mask,
        "tool_mask": tool_mask, "sampling_per_token_logps": sampling, "old_per_token_logps": old,
        "advantages": torch.randn(batch, generator=g),
    }
    return out


def _reference_is(out: dict, cap: float):
    """The definitions (module docstring), in float64 from the probabilities π = exp(log-prob)."""
    mask = (out["completion_mask"] * out["tool_mask"]).bool()
    p_old = torch.exp(out["old_per_token_logps"].double())
    p_engine = torch.exp(out["sampling_per_token_logps"].double())
    r_all = p_old / p_engine
    r = r_all[mask]
    delta = torch.log(r)  # = log π_old - log π_engine, from the ratio
    metrics = {
        "logprob_mismatch": delta.abs().mean().item(),
        "logprob_mismatch_max": delta.abs().max().item(),
        "mismatch_kl": (r - 1 - torch.log(r)).mean().item(),
        "is_ratio_mean": torch.minimum(r, torch.tensor(cap, dtype=torch.float64)).mean().item(),
        "is_ratio_min": r.min().item(),
        "is_ratio_max": r.max().item(),
        "is_truncated_rate": (r > cap).double().mean().item(),
    }
    weights = torch.where(mask, torch.minimum(torch.nan_to_num(r_all, nan=1.0), torch.tensor(cap, dtype=torch.float64)),
                          torch.ones_like(r_all))
    return metrics, out["advantages"].double()[:, None] * weights, r


def _run(trainer, out: dict, monkeypatch) -> dict:
    from trl import GRPOTrainer

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", lambda self, inputs: dict(out))
    return trainer._generate_and_score_completions({"prompt": ["unused"]})


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("is_correction", [True, False], ids=["is_correction", "measure_only"])
def test_mismatch_metrics_and_truncated_is_match_the_definitions(seed, is_correction, monkeypatch):
    cap = 2.0
    out = _scored_batch(seed)
    ref_metrics, ref_advantages, r = _reference_is(out, cap)
    assert bool((r > cap).any()) and bool(((r > 1) & (r <= cap)).any()) and bool((r < 1).any()), \
        f"seed {seed}: the ratios must fall on both sides of 1 and of the cap for the test to mean anything"
    trainer = _stub_trainer(is_correction, cap)
    got = _run(trainer, out, monkeypatch)
    logged = trainer._metrics["train"]
    for name, want in ref_metrics.items():
        assert len(logged[name]) == 1, f"{name} logged {len(logged[name])} times"
        assert math.isclose(logged[name][0], want, rel_tol=1e-5, abs_tol=1e-7), \
            f"seed {seed}: {name} = {logged[name][0]!r}, the definition gives {want!r}"
    if is_correction:
        assert got["advantages"].shape == out["completion_ids"].shape
        assert got["advantages"].dtype == out["advantages"].dtype
        torch.testing.assert_close(got["advantages"].double(), ref_advantages, rtol=1e-6, atol=1e-7,
                                   msg=lambda m: f"seed {seed}: truncated-IS advantages differ from A * min(r, C): {m}")
    else:
        assert torch.equal(got["advantages"], out["advantages"]), "without is_correction the advantages are untouched"


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
def test_mismatch_at_mu_1_scores_the_batch_once_with_the_trainer(seed, monkeypatch):
    """μ = 1 (no "old" log-probs from TRL) with ``mismatch_forward``: the kit scores prompt + completion once with
    the trainer's model, and the metrics and weights are those of that forward's log-probs."""
    cap = 1.5
    out = _scored_batch(seed)
    old = out.pop("old_per_token_logps")
    trainer = _stub_trainer(True, cap)
    calls = []

    def score(model, ids, attention, logits_to_keep, batch_size=None):
        calls.append((ids, attention, logits_to_keep))
        return old, None, None

    trainer._get_per_token_logps_and_entropies = score
    got = _run(trainer, out, monkeypatch)
    (ids, attention, keep), = calls
    assert torch.equal(ids, torch.cat([out["prompt_ids"], out["completion_ids"]], 1))
    assert torch.equal(attention, torch.cat([out["prompt_mask"], out["completion_mask"]], 1))
    assert keep == out["completion_ids"].size(1)
    ref_metrics, ref_advantages, _ = _reference_is(dict(out, old_per_token_logps=old), cap)
    for name, want in ref_metrics.items():
        assert math.isclose(trainer._metrics["train"][name][0], want, rel_tol=1e-5, abs_tol=1e-7), (seed, name)
    torch.testing.assert_close(got["advantages"].double(), ref_advantages, rtol=1e-6, atol=1e-7)


def test_extreme_mismatch_stays_finite_and_capped(monkeypatch):
    """A Δ far past exp's range (e.g. a token the engine gave ~e^-60): the weight is the cap, nothing overflows."""
    out = _scored_batch(0)
    mask = (out["completion_mask"] * out["tool_mask"]).bool()
    out["sampling_per_token_logps"] = torch.where(mask, torch.full_like(out["sampling_per_token_logps"], -60.0),
                                                  out["sampling_per_token_logps"])
    out["old_per_token_logps"] = torch.where(mask, torch.full_like(out["old_per_token_logps"], -0.5),
                                             out["old_per_token_logps"])
    trainer = _stub_trainer(True, 2.0)
    got = _run(trainer, out, monkeypatch)
    assert torch.isfinite(got["advantages"]).all()
    torch.testing.assert_close(got["advantages"][mask], (out["advantages"][:, None] * 2.0).expand_as(mask)[mask])
    logged = trainer._metrics["train"]
    assert logged["is_truncated_rate"] == [1.0] and logged["is_ratio_mean"] == [2.0]
    assert all(math.isfinite(v[0]) for v in logged.values())


# ============================================================ the clipped GRPO / DAPO surrogate
@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    from qerl_lib.train.grpo import build_trainer

    model_dir = save_tiny_llama(tmp_path_factory.mktemp("reference-llama"), hidden=32, layers=1, heads=2, kv_heads=1)
    return build_trainer(tiny_config(model_dir, "nvfp4", steps=1), tmp_path_factory.mktemp("reference-run"),
                         extra_rewards=[("toy", toy_reward, 1.0)], quiet=True)


@pytest.fixture(scope="module")
def scored(trainer):
    batch = next(iter(trainer.get_train_dataloader()))
    return trainer._generate_and_score_completions(batch)


def _own_logps(trainer, model, out):
    """log π_θ of the completion tokens from the model's forward: log-softmax of logits / temperature."""
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attention = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    t = out["completion_ids"].size(1)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, -t - 1:-1].float() / trainer.temperature
    return torch.log_softmax(logits, -1).gather(-1, out["completion_ids"][..., None]).squeeze(-1)


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_clipped_surrogate_matches_the_ppo_dapo_objective(trainer, scored, loss_type, seed, monkeypatch):
    model = trainer.model
    eps_low, eps_high = trainer.epsilon_low, trainer.epsilon_high
    assert eps_high > eps_low, "the presets use DAPO's clip-higher (epsilon_high > epsilon)"
    assert trainer.beta == 0.0 and trainer.top_entropy_quantile == 1.0 and trainer.args.delta is None
    monkeypatch.setattr(trainer, "loss_type", loss_type)
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by train()'s loop
    out = dict(scored)
    mask = out["completion_mask"].float()
    assert mask.sum() >= 4, "too few loss tokens"
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        logps = _own_logps(trainer, model, out)
    # ratios rho = exp(log pi - log pi_old) drawn per token across every region of the clip
    # (below 1 - eps_low, inside, in the clip-higher band (1 + eps_low, 1 + eps_high], above 1 + eps_high)
    bands = torch.tensor([0.55, 0.75, 0.95, 1.05, 1.15, 1.24, 1.45, 1.9])
    rho_target = bands[torch.randint(0, len(bands), logps.shape, generator=g)]
    rho_target = rho_target * (1 + 0.02 * torch.randn(logps.shape, generator=g))
    out["old_per_token_logps"] = (logps - torch.log(rho_target)).detach()
    advantages = torch.randn(out["completion_ids"].size(0), generator=g)
    advantages[0], advantages[-1] = abs(advantages[0]) + 0.1, -abs(advantages[-1]) - 0.1  # both signs
    out["advantages"] = advantages
    params = [p for n, p in model.named_parameters() if "lora_B" in n]  # A gets no gradient while B = 0

    loss = trainer._compute_loss(model, out)
    g_trl = torch.cat([x.flatten() for x in torch.autograd.grad(loss, params)])

    def reference(eps_hi):
        logp = _own_logps(trainer, model, out)
        rho = torch.exp(logp - out["old_per_token_logps"])
        a = advantages[:, None]
        per_token = -torch.minimum(rho * a, torch.clamp(rho, 1 - eps_low, 1 + eps_hi) * a)
        if loss_type == "grpo":  # per-sequence token mean, then the mean over sequences; per accumulation step
            value = ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
            value = value / trainer.current_gradient_accumulation_steps
        else:  # DAPO: token sum over the generation batch's token count, rescaled to one accumulation window
            tokens = out["num_items_in_batch"].float().clamp(min=1)
            value = (per_token * mask).sum() / (tokens * trainer.current_gradient_accumulation_steps
                                                / trainer.args.steps_per_generation)
        return value, torch.cat([x.flatten() for x in torch.autograd.grad(value, params)]), rho.detach()

    ref_loss, g_ref, rho = reference(eps_high)
    live = mask.bool()
    a = advantages[:, None].expand_as(rho)
    regions = {"clipped low (A<0, rho<1-eps)": (a < 0) & (rho < 1 - eps_low),
               "clipped high (A>0, rho>1+eps_high)": (a > 0) & (rho > 1 + eps_high),
               "clip-higher band, A>0": (a > 0) & (rho > 1 + eps_low) & (rho <= 1 + eps_high),
               "unclipped inside": (rho > 1 - eps_low) & (rho < 1 + eps_low)}
    for name, where in regions.items():
        assert bool((where & live).any()), f"seed {seed}: no loss token in region {name}: the test would not cover it"
    assert g_ref.abs().max() > 0, "no gradient reached the adapters: the comparison would be vacuous"
    assert math.isclose(loss.item(), ref_loss.item(), rel_tol=1e-5, abs_tol=1e-8), \
        f"{loss_type} seed {seed}: TRL loss {loss.item()!r}, the clipped surrogate {ref_loss.item()!r}"
    torch.testing.assert_close(g_trl, g_ref, rtol=1e-5, atol=1e-5 * g_ref.abs().max().item(),
                               msg=lambda m: f"{loss_type} seed {seed}: gradient differs from the clipped surrogate's: {m}")
    # the comparison can tell DAPO's clip-higher from a symmetric clip: with eps_high = eps_low it must differ
    _, g_sym, _ = reference(eps_low)
    assert not torch.allclose(g_sym, g_ref, rtol=1e-3, atol=1e-3 * g_ref.abs().max().item()), \
        f"seed {seed}: the clip-higher band made no difference to the gradient: the test cannot see epsilon_high"

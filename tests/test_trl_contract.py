"""Contract with TRL 1.16 (house rule P10): what qerl_lib.train.grpo passes to TRL, and the TRL internals it
relies on, still mean what the kit assumes.

TRL marks ``rollout_func`` experimental and the kit overrides two private methods, so drift must fail
loudly here rather than silently change training. A failure names the assumption that broke: fix
qerl_lib/train/grpo.py (or re-pin TRL); never skip these tests.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from qerl_lib.train.presets import make_config

trl = pytest.importorskip("trl")
from test_grpo import save_tiny_llama, tiny_config, toy_reward  # noqa: E402  (shared tiny-model helpers)

DRIFT = f"TRL DRIFT (installed trl {trl.__version__}, the kit is written against 1.16.0): "


pytestmark = pytest.mark.usefixtures("single_torch_thread")  # tiny matrices (conftest.py)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("contract-llama"), hidden=32, layers=1, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def trainer(tiny_dir, tmp_path_factory):
    from qerl_lib.train.grpo import build_trainer

    out = tmp_path_factory.mktemp("contract-run")
    return build_trainer(tiny_config(tiny_dir, "nvfp4", steps=1), out, extra_rewards=[("toy", toy_reward, 1.0)],
                         quiet=True)


def test_grpo_config_takes_every_field_the_kit_sets_and_keeps_its_meaning(tmp_path):
    from qerl_lib.train.trainer import grpo_args

    config = make_config("qwen2.5-7b-gsm8k", device="cpu", optim="adamw_torch")
    args = grpo_args(config, tmp_path, torch.device("cpu"), [1.0, 0.2])  # TypeError here = a field was removed
    expected = {
        "loss_type": "grpo", "beta": 0.0, "epsilon": 0.2, "epsilon_high": 0.28, "scale_rewards": "group",
        "num_generations": 8, "num_iterations": 4, "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 16, "steps_per_generation": 16, "generation_batch_size": 128,
        "max_completion_length": 4096, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
        "mask_truncated_completions": True, "importance_sampling_level": "token", "entropy_coef": 0.0,
        "top_entropy_quantile": 1.0, "use_vllm": False, "vllm_importance_sampling_correction": False,
        "reward_weights": [1.0, 0.2], "multi_objective_aggregation": "sum_then_normalize",
        "learning_rate": 1e-5, "lr_scheduler_type": "cosine", "warmup_steps": 0.1, "max_grad_norm": 0.2,
        "weight_decay": 0.1, "adam_beta2": 0.99, "disable_dropout": True, "logging_steps": 1,
    }
    got = {k: getattr(args, k, "<missing>") for k in expected}
    got["lr_scheduler_type"] = str(getattr(got["lr_scheduler_type"], "value", got["lr_scheduler_type"]))
    drift = {k: (expected[k], got[k]) for k in expected if got[k] != expected[k]}
    assert not drift, DRIFT + f"GRPOConfig changed these settings (expected, got): {drift}"


def test_trainer_takes_the_arguments_the_kit_passes():
    from trl import GRPOTrainer

    params = inspect.signature(GRPOTrainer.__init__).parameters
    missing = [p for p in ("model", "reward_funcs", "args", "train_dataset", "processing_class", "callbacks",
                           "rollout_func") if p not in params]
    assert not missing, DRIFT + f"GRPOTrainer.__init__ no longer takes {missing}"
    hooks = {"_generate_and_score_completions": ["inputs"], "training_step": ["model", "inputs", "num_items_in_batch"],
             "_get_per_token_logps_and_entropies": ["model", "input_ids", "attention_mask", "logits_to_keep",
                                                    "batch_size"]}
    for name, args in hooks.items():
        method = getattr(GRPOTrainer, name, None)
        assert method is not None, DRIFT + f"GRPOTrainer.{name} is gone (qerl_lib.train.grpo overrides or calls it)"
        have = list(inspect.signature(method).parameters)
        assert all(a in have for a in args), DRIFT + f"GRPOTrainer.{name}{tuple(have)} no longer takes {args}"


def test_rollout_output_is_accepted_and_a_missing_key_is_refused(trainer):
    prompts = [trainer.train_dataset[0]["prompt"]] * 2
    prompt_ids, completion_ids, _, completions, logprobs, extra, *_ = trainer._generate(prompts)
    assert len(prompt_ids) == len(completion_ids) == len(logprobs) == 2, DRIFT + "one completion per prompt entry"
    assert [len(c) for c in completion_ids] == [len(lp) for lp in logprobs]
    assert completions[0][0]["role"] == "assistant", DRIFT + "chat prompts no longer give message completions"
    assert extra == {}
    original = trainer.rollout_func
    try:
        trainer.rollout_func = lambda prompts, trainer: {"prompt_ids": [[1]], "completion_ids": [[2]]}
        with pytest.raises(ValueError, match="rollout_func must return keys"):
            trainer._generate(prompts)
    finally:
        trainer.rollout_func = original


def test_prompts_reach_the_rollout_repeated_per_generation(trainer):
    """TRL's sampler repeats each prompt num_generations times before the rollout sees it; the rollout
    samples one completion per entry. If TRL ever passes unique prompts, groups would be wrong."""
    seen = []
    original = trainer.rollout_func

    def spy(prompts, trainer_):
        seen.append(prompts)
        return original(prompts, trainer_)

    trainer.rollout_func = spy
    try:
        batch = next(iter(trainer.get_train_dataloader()))
        trainer._generate_and_score_completions(batch)
    finally:
        trainer.rollout_func = original
    (prompts,) = seen
    g = trainer.num_generations
    assert len(prompts) == trainer.args.generation_batch_size, DRIFT + "the rollout gets the whole generation batch"
    groups = [prompts[i:i + g] for i in range(0, len(prompts), g)]
    assert all(all(p == grp[0] for p in grp) for grp in groups), DRIFT + "prompts are no longer repeated G times"


def test_scored_batch_has_the_keys_the_kit_reads_and_2d_advantages_weight_the_loss(trainer):
    batch = next(iter(trainer.get_train_dataloader()))
    out = trainer._generate_and_score_completions(batch)
    needed = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages",
              "sampling_per_token_logps")
    missing = [k for k in needed if k not in out]
    assert not missing, DRIFT + f"the scored batch lacks {missing}"
    assert out["sampling_per_token_logps"].shape == out["completion_ids"].shape
    model = trainer.model
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps  # set by train()'s loop
    params = [p for n, p in model.named_parameters() if "lora_B" in n]  # A gets no gradient while B = 0
    advantages = out["advantages"].flatten()
    weights = torch.rand(out["completion_ids"].shape, generator=torch.Generator().manual_seed(0)) + 0.5

    def grads(adv):
        loss = trainer._compute_loss(model, dict(out, advantages=adv))
        return torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])

    g_flat = grads(advantages)
    g_2d = grads(advantages[:, None].expand(weights.shape).clone())
    g_weighted = grads(advantages[:, None] * weights)
    assert g_flat.abs().max() > 0, "no gradient reached the adapters: the comparisons below would be vacuous"
    # (B,) and (B,T) advantages must train identically; a per-token weight w must weight each token's
    # gradient (the kit's truncated IS weights enter this way). Reference: the same gradient from a
    # hand-written surrogate -mean_i(mean_t(w A_i log π)) (μ = 1: the ratio is 1, no clipping acts).
    assert torch.equal(g_flat, g_2d), DRIFT + "(B,T) advantages no longer train like (B,) advantages"
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attention = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, attention, out["completion_ids"].size(1))
    mask = out["completion_mask"].float()
    surrogate = -(((advantages[:, None] * weights * logps) * mask).sum(-1) / mask.sum(-1).clamp(min=1)).mean()
    surrogate = surrogate / trainer.current_gradient_accumulation_steps
    g_ref = torch.cat([g.flatten() for g in torch.autograd.grad(surrogate, params)])
    # observed bit-identical on CPU (same kernels); the tolerance only admits a TRL change in summation order
    assert torch.allclose(g_weighted, g_ref, rtol=1e-5, atol=1e-7 * g_ref.abs().max().item()), \
        DRIFT + f"per-token advantage weights no longer weight the gradient (max diff {(g_weighted - g_ref).abs().max()})"


def test_trl_only_applies_its_own_is_correction_with_vllm():
    """The kit does its truncated IS through advantages because TRL gates its own on `use_vllm`. If TRL
    starts applying `vllm_importance_sampling_correction` without vLLM, the two would stack: the kit sets
    it False explicitly, and this test notices if the gate moves."""
    from trl import GRPOTrainer

    source = inspect.getsource(GRPOTrainer._compute_loss)
    assert "self.use_vllm and self.vllm_importance_sampling_correction" in source, \
        DRIFT + "TRL's importance-sampling gate changed; re-check qerl_lib.train.grpo's is_correction path"

"""QeRL training on TRL (qerl_lib.train.grpo): two real steps per mode on a tiny random Llama, on CPU.

What must move and what must not (house rule P11): the frozen base (bf16 weights, NF4 codes and
absmax, NVFP4 packed codes and scales) is byte-identical after training, the LoRA adapters
changed, and every metrics line carries every key. Plus: σ follows the AQN schedule, a killed and
resumed run repeats the uninterrupted run's next step exactly, a raising reward scores 0 and is
counted, and bad input fails before any model loads.

The tiny model is a 2-layer, 64-wide random Llama with a byte-level tokenizer and a ChatML template,
so a step costs well under a second. Random weights never earn the accuracy or format reward,
so each run adds a deterministic toy reward with spread within groups; without it every
advantage is 0 and nothing would train.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qerl_lib.errors import UserError
from qerl_lib.train.metrics import METRIC_KEYS
from qerl_lib.train.presets import PRESETS, make_config

# keys that must hold a number on every line of every mode in these runs
NUMERIC_KEYS = ("step", "learning_rate", "loss", "grad_norm", "reward", "reward_std", "accuracy", "format_rate",
                "reward_errors", "entropy", "completion_length", "truncated_rate", "clip_ratio_low",
                "clip_ratio_high", "clip_ratio", "sigma", "noise_rms", "logprob_mismatch", "logprob_mismatch_max",
                "mismatch_kl", "is_ratio_mean", "is_ratio_min", "is_ratio_max", "rollout_tokens",
                "rollout_tokens_per_s", "rollout_seconds", "train_seconds", "step_seconds", "peak_memory_gb")


# --------------------------------------------------------------------------------------------- fixtures
pytestmark = pytest.mark.usefixtures("single_torch_thread")  # 64-wide matrices: one thread (conftest.py)


def byte_tokenizer():
    """A 258-token byte-level tokenizer with a ChatML template: a real chat template without a 49k vocabulary
    (the trainer's log-prob kernel tiles over the vocabulary, which would dominate these tests)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    backend = Tokenizer(models.BPE(vocab={table[b]: i for i, b in enumerate(sorted(table))}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                        pad_token="<|im_end|>")
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tokenizer


def save_tiny_llama(folder: Path, hidden: int, layers: int, heads: int, kv_heads: int) -> Path:
    """A random tiny Llama with the byte tokenizer, saved as a model folder (intermediate = 2 x hidden)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer = byte_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), hidden=64, layers=2, heads=4, kv_heads=2)


def tiny_config(model_dir, mode: str, steps: int = 2, **overrides):
    settings = dict(model=str(model_dir), n_train=8, max_prompt_tokens=1024, prompts_per_step=2, num_generations=2,
                    micro_batch=2,
                    max_completion_length=6, mask_truncated_completions=False, lr_quantized=1e-2, lr_bf16=1e-2,
                    save_steps=1, device="cpu", optim="adamw_torch")
    return make_config("smollm2-arith", mode=mode, steps=steps, seed=0, **{**settings, **overrides})


def toy_reward(prompts, completions, completion_ids, **kwargs):
    """Deterministic reward with spread inside a group (a function of the sampled ids)."""
    return [float(sum(ids) % 5) / 4.0 for ids in completion_ids]


class FlakyReward:
    """Raises on every second completion it scores, else returns 1.0 (SafeReward calls once per completion)."""

    __name__ = "flaky"

    def __init__(self):
        self.calls = 0

    def __call__(self, prompts, completions, **kwargs):
        self.calls += 1
        if self.calls % 2 == 0:
            raise RuntimeError("scoring blew up on this completion")
        return [1.0] * len(completions)


def frozen_base_state(model) -> dict[str, torch.Tensor]:
    """Every tensor of the model except the LoRA adapters: parameters, buffers, and bitsandbytes'
    quantization state (absmax lives outside the module tree)."""
    state = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if "lora_" not in name:
            state[name] = tensor.detach().clone()
    for name, module in model.named_modules():
        quant_state = getattr(getattr(module, "weight", None), "quant_state", None)
        if quant_state is not None:
            state[f"{name}.absmax"] = quant_state.absmax.detach().clone()
    return state


def adapters(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def base_layer_types(model) -> set[str]:
    return {type(m.base_layer).__name__ for m in model.modules() if hasattr(m, "base_layer") and hasattr(m, "lora_A")}


def snapshot_callback(store: dict):
    from transformers import TrainerCallback

    class Snapshot(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            store["base_before"], store["lora_before"] = frozen_base_state(model), adapters(model)
            store["layer_types"] = base_layer_types(model)

        def on_train_end(self, args, state, control, model=None, **kwargs):
            store["base_after"], store["lora_after"] = frozen_base_state(model), adapters(model)

    return Snapshot()


def read_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


# --------------------------------------------------------------------------------------------- 2 steps per mode
BASE_LAYER = {"lora": "Linear", "qlora": "Linear4bit", "nvfp4": "NVFP4Linear", "qerl": "NVFP4Linear"}


@pytest.mark.parametrize("mode", ["lora", "qlora", "nvfp4", "qerl"], ids=lambda m: f"mode={m}")
def test_two_steps_train_adapters_only_and_log_every_metric(mode, tiny_model_dir, tmp_path):
    from qerl_lib.train.aqn import AQNSchedule
    from qerl_lib.train.grpo import aqn_config, train

    config = tiny_config(tiny_model_dir, mode)
    store: dict = {}
    flaky = FlakyReward()
    summary = train(config, tmp_path, extra_rewards=[("toy", toy_reward, 1.0), ("flaky", flaky, 0.0)],
                    callbacks=[snapshot_callback(store)], quiet=True)

    assert store["layer_types"] == {BASE_LAYER[mode]}, f"{mode} must train on a {BASE_LAYER[mode]} base"
    before, after = store["base_before"], store["base_after"]
    assert before.keys() == after.keys() and len(before) > 0
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"frozen base tensors changed: {changed[:5]}"
    lora_moved = [k for k in store["lora_before"] if not torch.equal(store["lora_before"][k], store["lora_after"][k])]
    assert lora_moved, "no LoRA adapter changed in 2 steps"

    lines = read_lines(tmp_path)
    assert [r["step"] for r in lines] == [1, 2]
    for row in lines:
        missing = [k for k in METRIC_KEYS if k not in row]
        assert not missing, f"metrics line lacks {missing}"
        not_numbers = [k for k in NUMERIC_KEYS if not isinstance(row[k], (int, float))]
        assert not not_numbers, f"step {row['step']}: no number for {not_numbers}"
        # the flaky reward raised on 2 of the step's 4 completions: scored 0 each, counted, run continued
        assert row["reward_errors"] == 2 and row["rewards/flaky/mean"] == 0.5
        assert 0 < row["rollout_tokens"] <= config.completions_per_step * config.max_completion_length
    schedule = AQNSchedule(aqn_config(config)) if mode == "qerl" else None
    for row in lines:
        expected = schedule.sigma(row["step"] - 1) if schedule else 0.0
        assert row["sigma"] == expected, f"step {row['step']}: σ {row['sigma']} != schedule {expected}"
        assert (row["noise_rms"] > 0) == (expected > 0), "AQN noise must reach the rollout exactly when σ > 0"
    assert summary["steps"] == 2 and summary["reward_errors"] == 4
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "checkpoints" / "checkpoint-2" / "qerl_state.json").is_file()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
@pytest.mark.parametrize("mode", ["lora", "qerl"], ids=lambda m: f"mode={m}")
def test_two_steps_on_cuda_keep_the_base_frozen(mode, tiny_model_dir, tmp_path):
    # On CUDA the rollout engine captures graphs and fuses q/k/v and gate/up over shared storage
    # (layers_fused): the trainer must still train only the adapters on an untouched base.
    from qerl_lib.train.grpo import train

    config = tiny_config(tiny_model_dir, mode, device="cuda")
    store: dict = {}
    summary = train(config, tmp_path, extra_rewards=[("toy", toy_reward, 1.0)], callbacks=[snapshot_callback(store)],
                    quiet=True)
    before, after = store["base_before"], store["base_after"]
    assert before.keys() == after.keys() and len(before) > 0
    assert not [k for k in before if not torch.equal(before[k].cpu(), after[k].cpu())]
    assert [k for k in store["lora_before"] if not torch.equal(store["lora_before"][k], store["lora_after"][k])]
    assert summary["steps"] == 2 and [r["step"] for r in read_lines(tmp_path)] == [1, 2]


def test_sigma_schedule_of_a_full_run_is_the_aqn_schedule():
    """The run's AQN config is Table 4's (1e-2 -> 5e-4, 10 stages, stage 0 clean); short runs get fewer stages."""
    from qerl_lib.train.aqn import AQNSchedule
    from qerl_lib.train.grpo import aqn_config

    full = AQNSchedule(aqn_config(make_config("smollm2-arith", mode="qerl", steps=100)))
    assert [full.sigma(s) for s in (0, 9)] == [0.0, 0.0]
    assert full.sigma(10) == pytest.approx(1e-2, rel=1e-12) and full.sigma(99) == pytest.approx(5e-4, rel=1e-12)
    sigmas = [full.sigma(s) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(sigmas, sigmas[1:])), "σ must never increase"
    assert aqn_config(make_config("smollm2-arith", mode="nvfp4")) is None
    three = AQNSchedule(aqn_config(make_config("smollm2-arith", mode="qerl", steps=3)))
    assert [three.sigma(s) for s in range(3)] == [0.0, 1e-2, 5e-4]


def test_aqn_target_both_makes_the_trainer_score_the_noisy_policy(tiny_model_dir, tmp_path):
    """target "rollout" (paper): the trainer scores the clean policy, so at σ > 0 its log-probs differ from
    the engine's by the noise. target "both": the trainer's forward sees the same Z, so only numerics remain."""
    from qerl_lib.train.grpo import train

    mismatch = {}
    for target in ("rollout", "both"):
        out = tmp_path / target
        train(tiny_config(tiny_model_dir, "qerl", aqn_target=target), out, extra_rewards=[("toy", toy_reward, 1.0)],
              quiet=True)
        step2 = read_lines(out)[1]
        assert step2["sigma"] == 1e-2
        mismatch[target] = step2["logprob_mismatch"]
    # observed on this model: 6.7e-4 (rollout) vs 1.4e-7 (both, fp32 summation-order noise)
    assert mismatch["rollout"] > 1e-4 and mismatch["both"] < 1e-5, mismatch


# --------------------------------------------------------------------------------------------- resume
def test_killed_and_resumed_run_repeats_the_uninterrupted_step(tiny_model_dir, tmp_path):
    """3 steps straight vs 2 steps, stop, resume for step 3 (mode qerl: AQN, NVFP4, optimizer, scheduler,
    RNG and data order all restored). On CPU with fixed seeds step 3 is bit-identical, so we compare exactly
    (except wall-clock keys)."""
    from transformers import TrainerCallback

    from qerl_lib.train.grpo import train

    class StopAfter(TrainerCallback):
        def __init__(self, step):
            self.step = step

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= self.step:
                control.should_training_stop = True

    config = tiny_config(tiny_model_dir, "qerl", steps=3)
    rewards = [("toy", toy_reward, 1.0)]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    train(config, straight, extra_rewards=rewards, quiet=True)
    train(config, killed, extra_rewards=rewards, callbacks=[StopAfter(2)], quiet=True)
    assert [r["step"] for r in read_lines(killed)] == [1, 2]
    with open(killed / "metrics.jsonl", "a") as f:  # a line the dead run wrote after its last checkpoint
        f.write(json.dumps({"step": 3, "reward": -1.0}) + "\n")
    train(config, killed, resume=True, extra_rewards=rewards, quiet=True)

    a, b = read_lines(straight), read_lines(killed)
    assert [r["step"] for r in b] == [1, 2, 3], "resume must cut the log back to the checkpoint and append"
    timing = {"rollout_seconds", "rollout_tokens_per_s", "train_seconds", "step_seconds", "peak_memory_gb",
              "step_time", "memory_kind"}
    differ = {k: (a[2][k], b[2][k]) for k in a[2] if k not in timing and a[2][k] != b[2].get(k)}
    assert not differ, f"resumed step 3 differs from the uninterrupted run: {differ}"
    assert a[2]["sigma"] == 5e-4 and a[2]["grad_norm"] > 0
    from safetensors.torch import load_file

    final_a = load_file(straight / "adapter" / "adapter_model.safetensors")
    final_b = load_file(killed / "adapter" / "adapter_model.safetensors")
    assert all(torch.equal(final_a[k], final_b[k]) for k in final_a)


# --------------------------------------------------------------------------------------------- bad input
def test_unknown_preset_mode_or_setting_is_a_clear_error():
    with pytest.raises(UserError, match="unknown preset 'nope'.*smollm2-arith"):
        make_config("nope")
    with pytest.raises(UserError, match="--mode must be one of lora, qlora, nvfp4, qerl"):
        make_config("smollm2-arith", mode="int4")
    with pytest.raises(UserError, match="unknown training setting"):
        make_config("smollm2-arith", learning_rat=1e-3)


@pytest.mark.parametrize("prompts,generations,micro", [(3, 4, 5), (1, 1, 1)], ids=["12-not-multiple-of-5", "G=1"])
def test_impossible_batch_is_refused(prompts, generations, micro):
    with pytest.raises(UserError, match="impossible batch|at least 2 per prompt"):
        make_config("smollm2-arith", prompts_per_step=prompts, num_generations=generations, micro_batch=micro)


def test_every_preset_is_valid_and_mirrors_table_4():
    for name, preset in PRESETS.items():
        assert preset.preset == name
        assert (preset.beta, preset.epsilon, preset.epsilon_high) == (0.0, 0.2, 0.28)
        assert (preset.sigma_start, preset.sigma_end, preset.aqn_stages) == (1e-2, 5e-4, 10)
        assert preset.lora_rank == 32 and preset.temperature == 1.0
        if name.startswith("qwen"):
            assert (preset.lr_quantized, preset.lr_bf16) == (1e-5, 5e-6)
            assert preset.completions_per_step == 128 and preset.optim == "adamw_8bit"
    gsm8k = PRESETS["qwen2.5-7b-gsm8k"]
    assert (gsm8k.num_generations, gsm8k.num_iterations, gsm8k.loss_type) == (8, 4, "grpo")
    bigmath = PRESETS["qwen2.5-32b-bigmath"]
    assert (bigmath.num_generations, bigmath.num_iterations, bigmath.loss_type) == (16, 1, "dapo")


def _no_model_load(monkeypatch):
    import qerl_lib.train.grpo as grpo

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the input error was reported")

    monkeypatch.setattr(grpo, "load_policy", refuse)


def test_empty_dataset_fails_before_any_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    from qerl_lib.train.grpo import train

    _no_model_load(monkeypatch)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(UserError, match="empty"):
        train(tiny_config(tiny_model_dir, "lora", data="file", data_path=str(empty)), tmp_path / "run", quiet=True)
    with pytest.raises(UserError, match="--data-path"):
        train(tiny_config(tiny_model_dir, "lora", data="file"), tmp_path / "run2", quiet=True)


def test_output_folder_rules(tiny_model_dir, tmp_path, monkeypatch):
    from qerl_lib.train.grpo import train

    _no_model_load(monkeypatch)
    config = tiny_config(tiny_model_dir, "lora")
    with pytest.raises(UserError, match="nothing to resume"):
        train(config, tmp_path / "fresh", resume=True, quiet=True)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="already holds a run"):
        train(config, tmp_path / "used", quiet=True)


def test_a_run_whose_model_fails_to_load_leaves_its_out_reusable(tiny_model_dir, tmp_path, monkeypatch):
    """A fresh run that fails before training (here its model does not load) removes the run.json it wrote, so the
    retry may use the same --out; a folder holding only a run.json is refused with the ways out named."""
    import qerl_lib.train.grpo as grpo
    from qerl_lib.train.metrics import prepare_output

    def offline(*args, **kwargs):
        raise UserError("model 'org/x' is not cached and the Hugging Face Hub is unreachable")

    monkeypatch.setattr(grpo, "load_policy", offline)
    config = tiny_config(tiny_model_dir, "lora")
    out = tmp_path / "run"
    with pytest.raises(UserError, match="not cached"):
        grpo.train(config, out, quiet=True)
    assert out.is_dir() and not (out / "run.json").exists()
    with pytest.raises(UserError, match="not cached"):  # the retry gets as far as the model again
        grpo.train(config, out, quiet=True)
    prepare_output(out, config, resume=False)  # a run that stopped during its model load (killed: nothing removed)
    with pytest.raises(UserError, match=r"has not finished a step .* pass --resume .* delete .*run\.json"):
        prepare_output(out, config, resume=False)


def test_resume_names_the_padding_a_preset_run_was_saved_without(tmp_path):
    """A Qwen2.5 run saved before its preset padded to 64 (no pad_to_multiple_of in run.json) resumes only with the
    padding off, and the error says how; with it off, the settings match again."""
    from qerl_lib.train.metrics import prepare_output
    from qerl_lib.train.presets import make_config

    old = make_config("qwen2.5-3b-gsm8k", pad_to_multiple_of=0)
    prepare_output(tmp_path, old, resume=False, report=None)
    assert "pad_to_multiple_of" not in json.loads((tmp_path / "run.json").read_text())["config"]
    with pytest.raises(UserError, match=r"--pad-to-multiple-of 0\)$"):
        prepare_output(tmp_path, make_config("qwen2.5-3b-gsm8k"), resume=True, report=None)
    prepare_output(tmp_path, make_config("qwen2.5-3b-gsm8k", pad_to_multiple_of=0), resume=True, report=None)


def test_cli_reports_bad_input_in_one_line(capsys):
    from qerl_lib.cli import main

    assert main(["train", "--preset", "nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown preset 'nope'" in err


def test_plot_run_draws_the_curves(tmp_path):
    from qerl_lib.cli import main
    from qerl_lib.io import write_jsonl_atomic

    rows = [{"step": s, "reward": 0.1 * s, "accuracy": 0.05 * s, "entropy": 1.0 - 0.01 * s, "sigma": 0.0 if s < 3
             else 1e-2, "rollout_seconds": 1.0, "train_seconds": 0.5} for s in range(1, 6)]
    run = tmp_path / "run"
    write_jsonl_atomic(run / "metrics.jsonl", rows)
    assert main(["plot-run", str(run)]) == 0
    png = run / "training_curves.png"
    assert png.is_file() and png.read_bytes()[:4] == b"\x89PNG"


# --------------------------------------------------------------------------------------------- divergence
def test_a_run_whose_weights_turn_nan_stops_there_without_a_checkpoint(tiny_model_dir, tmp_path):
    """NaN gradients (as at too high a learning rate) make the weights NaN after the optimizer step:
    the run stops at that step with `TrainingDiverged`, saves no adapter or checkpoint of the broken
    weights, and records the step in summary.json."""
    from transformers import TrainerCallback

    from qerl_lib.errors import TrainingDiverged
    from qerl_lib.train.grpo import train

    class PoisonGradients(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            lora = next(p for n, p in model.named_parameters() if "lora_B" in n and p.requires_grad)
            lora.register_hook(lambda grad: grad * float("nan"))

    with pytest.raises(TrainingDiverged, match="diverged at step 1") as info:
        train(tiny_config(tiny_model_dir, "lora", steps=3), tmp_path, extra_rewards=[("toy", toy_reward, 1.0)],
              callbacks=[PoisonGradients()], quiet=True)
    assert info.value.step == 1
    assert not (tmp_path / "adapter").exists()
    assert not list((tmp_path / "checkpoints").glob("checkpoint-*")), "a checkpoint of NaN weights was written"
    assert json.loads((tmp_path / "summary.json").read_text())["diverged_at_step"] == 1


def test_engine_cache_is_released_before_the_backward_pass(tiny_model_dir, tmp_path):
    """With release_engine_cache (default) the KV cache's memory is gone when the loss's backward runs; with it
    off the cache stays allocated through the backward (what the flag exists to avoid)."""
    from transformers import TrainerCallback

    from qerl_lib.train.grpo import build_trainer

    for release in (True, False):
        seen: list = []
        config = tiny_config(tiny_model_dir, "lora", steps=1, release_engine_cache=release)
        trainer = build_trainer(config, tmp_path / str(release), extra_rewards=[("toy", toy_reward, 1.0)], quiet=True)
        rollout = trainer.qerl_rollout

        class WatchBackward(TrainerCallback):
            def on_train_begin(self, args, state, control, model=None, **kwargs):
                lora = next(p for n, p in model.named_parameters() if "lora_B" in n and p.requires_grad)
                lora.register_hook(lambda grad: seen.append(rollout.engine.resident_cache_bytes > 0) or grad)

        trainer.add_callback(WatchBackward())
        trainer.train()
        assert seen, "no backward pass ran"
        assert not any(seen) if release else all(seen), (release, seen)


def test_mismatch_forward_off_skips_the_extra_forward_at_mu_one(tiny_model_dir, tmp_path):
    """μ = 1: with mismatch_forward the step runs one more no-grad forward and logs the mismatch; off, it
    runs none and logs no mismatch (the rest of the step is unchanged)."""
    from qerl_lib.train.grpo import build_trainer

    counts, logged = {}, {}
    for flag in (True, False):
        trainer = build_trainer(tiny_config(tiny_model_dir, "lora", steps=1, mismatch_forward=flag),
                                tmp_path / str(flag), extra_rewards=[("toy", toy_reward, 1.0)], quiet=True)
        calls = []
        original = trainer._get_per_token_logps_and_entropies
        trainer._get_per_token_logps_and_entropies = lambda *a, **k: calls.append(torch.is_grad_enabled()) or \
            original(*a, **k)
        trainer.train()
        counts[flag] = calls.count(False)  # no-grad forwards
        logged[flag] = read_lines(tmp_path / str(flag))[0]["logprob_mismatch"]
    assert counts[True] == counts[False] + 1, counts
    assert logged[True] is not None and logged[False] is None, logged
    with pytest.raises(UserError, match="is_correction needs"):
        tiny_config(tiny_model_dir, "lora", is_correction=True, mismatch_forward=False)


def test_the_trainer_recomputes_only_the_first_layers_at_every_step(tiny_model_dir, tmp_path):
    """A real two-step run with the μ = 1 mismatch forward (TRL turns checkpointing off and on around it and
    around the rollout, inside each step's input preparation): with ``checkpoint_layers=1`` the first decoder
    layer runs as often as with every layer recomputing, and every other layer runs exactly once less per loss
    forward, at every micro-batch (not only those that reuse buffered completions)."""
    from qerl_lib.train.checkpointing import checkpointed_layers
    from qerl_lib.train.grpo import build_trainer
    from tests.test_checkpointing import count_forwards

    calls, losses = {}, {}
    for n in (None, 1):
        config = tiny_config(tiny_model_dir, "lora", steps=2, gradient_checkpointing=True, checkpoint_layers=n,
                             mismatch_forward=True)
        trainer = build_trainer(config, tmp_path / str(n), extra_rewards=[("toy", toy_reward, 1.0)], quiet=True)
        layers = checkpointed_layers(trainer.model)
        assert len(layers) >= 2
        calls[n] = count_forwards(layers)
        losses[n] = 0

        def counted_loss(*args, _loss=trainer.compute_loss, _n=n, **kwargs):
            losses[_n] += 1
            return _loss(*args, **kwargs)
        trainer.compute_loss = counted_loss
        trainer.train()
    assert losses[None] == losses[1] >= 4, losses  # two steps of two micro-batches
    assert calls[None][0] == calls[1][0], calls  # the first layer recomputes in both runs
    assert all(a - b == losses[1] for a, b in zip(calls[None][1:], calls[1][1:])), (calls, losses)


def test_memory_accounting_adds_up(tiny_model_dir, tmp_path):
    """Each step's row accounts for what the step holds: the frozen base, the LoRA parameters (r x (in + out)
    per targeted Linear, counted here from the model's shapes), their gradients, AdamW's two moments, and the
    rollout's KV cache; together they stay under the measured peak."""
    from peft.tuners.lora import LoraLayer

    from qerl_lib.train.grpo import build_trainer

    trainer = build_trainer(tiny_config(tiny_model_dir, "nvfp4", steps=1), tmp_path,
                            extra_rewards=[("toy", toy_reward, 1.0)], quiet=True)
    model = trainer.model
    trainer.train()
    (row,) = read_lines(tmp_path)
    lora_numel = 0
    for module in model.modules():
        if isinstance(module, LoraLayer):
            base = module.get_base_layer()
            lora_numel += module.r["default"] * (base.in_features + base.out_features)
    assert lora_numel > 0
    assert row["lora_gb"] == pytest.approx(lora_numel * 4 / 1e9) == row["grads_gb"]  # float32 adapters
    params = sum(1 for p in model.parameters() if p.requires_grad)
    assert 2 * row["lora_gb"] <= row["optimizer_gb"] <= 2 * row["lora_gb"] + params * 8 / 1e9  # moments (+ step)
    frozen = sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert row["base_weights_gb"] <= (frozen + buffers) / 1e9  # tied embeddings count once
    assert row["base_weights_gb"] > 0.5 * (frozen + buffers) / 1e9
    assert row["kv_cache_gb"] > 0
    held = sum(row[k] for k in ("base_weights_gb", "lora_gb", "grads_gb", "optimizer_gb"))
    assert held < row["peak_memory_gb"], row


def test_rollout_lora_merge_rolls_out_merged_and_frees_the_copies_before_the_backward(tiny_model_dir, tmp_path,
                                                                                       monkeypatch):
    """Mode lora with rollout_lora_merge: the engine is built with it, the step trains, and when the loss's backward
    runs the merged weight copies are gone with the KV cache. A quantized base refuses the flag in one line."""
    from transformers import TrainerCallback

    from qerl_lib.errors import UserError
    from qerl_lib.train.grpo import build_trainer
    from qerl_lib.train.metrics import prepare_output

    with pytest.raises(UserError, match="rollout_lora_merge needs a bf16 base"):
        tiny_config(tiny_model_dir, "qerl", steps=1, rollout_lora_merge=True)
    from qerl_lib.engine.merged import MergedAdapters

    real, refreshed = MergedAdapters.refresh, []
    monkeypatch.setattr(MergedAdapters, "refresh", lambda self, ads: refreshed.append(1) or real(self, ads))
    seen: list = []
    config = tiny_config(tiny_model_dir, "lora", steps=1, rollout_lora_merge=True)
    trainer = build_trainer(config, tmp_path, extra_rewards=[("toy", toy_reward, 1.0)], quiet=True)
    rollout = trainer.qerl_rollout

    class WatchBackward(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            lora = next(p for n, p in model.named_parameters() if "lora_B" in n and p.requires_grad)
            lora.register_hook(lambda grad: seen.append(rollout.engine._forward.merged) or grad)

    trainer.add_callback(WatchBackward())
    trainer.train()
    assert rollout.engine.lora_merge and seen and all(m is None for m in seen)
    assert refreshed, "the rollout never merged the adapters"
    assert trainer.state.log_history[0]["rollout_tokens"] > 0
    # recorded only when on: records from before the switch still match; resuming without it is refused
    assert config.to_dict()["rollout_lora_merge"] is True
    assert "rollout_lora_merge" not in tiny_config(tiny_model_dir, "lora", steps=1).to_dict()
    with pytest.raises(UserError, match="rollout_lora_merge"):
        prepare_output(tmp_path, tiny_config(tiny_model_dir, "lora", steps=1), resume=True, report=None)


def test_random_prompts_refuse_a_budget_smaller_than_the_chat_template(embedded_model_dir):
    """A prompt budget the template alone overflows is a clear error, not an endless shortening loop."""
    from transformers import AutoTokenizer

    from qerl_lib.train.grpo import random_prompts

    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    config = make_config("smollm2-arith-cpu", max_prompt_tokens=64, n_train=2)
    rows = random_prompts(config, tokenizer)
    assert len(rows) == 2 and all(r["prompt"][0]["content"] for r in rows)
    config = make_config("smollm2-arith-cpu", max_prompt_tokens=8, n_train=2)
    with pytest.raises(UserError, match="max_prompt_tokens=8 cannot hold"):
        random_prompts(config, tokenizer)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")])])
def test_trainable_weights_finite_finds_one_bad_value_anywhere(device):
    """The divergence check sees a single NaN or infinity in any trainable tensor (fp32 or bf16), ignores frozen
    ones, and passes large finite values."""
    from qerl_lib.train.metrics import trainable_weights_finite

    seed = int(torch.randint(0, 2**31, ()))
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(*(torch.nn.Linear(64, 48) for _ in range(6))).to(device)
    model[3].bfloat16()
    model[0].requires_grad_(False)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 1e4)
    assert trainable_weights_finite(model)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for layer in (1, 3, 5):
            weight = model[layer].weight
            i, j = (int(torch.randint(0, n, (), generator=g)) for n in weight.shape)
            keep = weight[i, j].item()
            with torch.no_grad():
                weight[i, j] = bad
            assert not trainable_weights_finite(model), (bad, layer, i, j, seed)
            with torch.no_grad():
                weight[i, j] = keep
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")  # frozen: not the trainer's business
    assert trainable_weights_finite(model)
    model.requires_grad_(False)
    assert trainable_weights_finite(model)


def test_run_summary_median_of_an_even_count_is_the_mean_of_the_middle_two():
    """``median_step_seconds`` of two steps is their mean (it was the larger of the two), odd counts the middle."""
    from qerl_lib.train.metrics import summarize

    rows = [{"step": 1, "step_seconds": 10.0, "rollout_seconds": 1.0, "train_seconds": 1.0},
            {"step": 2, "step_seconds": 14.0, "rollout_seconds": 1.0, "train_seconds": 1.0}]
    assert summarize(rows)["median_step_seconds"] == 12.0
    rows.append({"step": 3, "step_seconds": 30.0, "rollout_seconds": 1.0, "train_seconds": 1.0})
    assert summarize(rows)["median_step_seconds"] == 14.0

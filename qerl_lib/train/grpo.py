"""QeRL training: GRPO/DAPO on TRL's GRPOTrainer, rollouts from the kit's engine, LoRA on a frozen base.

What one optimizer step does
----------------------------
1. **Rollout** (`EngineRollout`, TRL's ``rollout_func`` hook). TRL hands over the step's prompts,
   each already repeated G times (its sampler groups them). We render each with the model's chat
   template, and the kit's engine samples one completion per entry from the policy as it is
   *now*: the frozen base (bf16, NF4 or NVFP4) with the LoRA adapters applied unmerged (no merged
   copy of the base exists) and, in mode ``qerl``, the RMSNorm weights replaced by
   ``w + N(0, σ²)`` with σ from the AQN schedule. The engine returns each token's log-probability
   under the distribution it was drawn from.
2. **Rewards** (TRL). accuracy (1.0 if the final answer equals the gold one) + 0.2 x format,
   each wrapped in `rewards.SafeReward`: a completion whose scoring raises gets 0 and is counted.
3. **Advantages** (TRL). A_i = (r_i - mean of the group) / (std of the group + 1e-4).
4. **Mismatch** (`train.trainer.QeRLGRPOTrainer`). The trainer recomputes the log-probs of the sampled tokens
   with the clean model (no AQN noise, its own matmul path) and we log how far they are from the
   engine's. With ``is_correction`` the advantages are weighted by a truncated importance ratio.
5. **Loss and update** (TRL). Clipped surrogate, AdamW, cosine schedule, checkpoints.

Every algorithmic choice, and where it comes from (QeRL §3-4, App. E; docs/paper_settings.md)
-------------------------------------------------------------------------
 1. Policy-gradient objective: PPO-style clipped surrogate min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A)
    with ε = 0.2 / 0.28 (Table 4; DAPO's clip-higher). TRL computes it.
 2. Loss normalisation: ``grpo`` (mean over each sequence's tokens, then over sequences) for the
    GSM8K presets, as the paper says GSM8K runs use GRPO; ``dapo`` (sum over all tokens of the
    accumulated batch / their count) for BigMath. The scripts use ``bnpo`` everywhere, equal to
    ``dapo`` on one GPU without accumulation.
 3. Advantages scaled by the group std (``scale_rewards="group"``), as in standard GRPO
    (DeepSeekMath). No Dr. GRPO un-scaling.
 4. No KL term (β = 0) and no entropy bonus, as Table 4 says ("without using entropy or KL losses").
    With β = 0 TRL loads no reference model.
 5. μ (policy updates per rollout): 4 on GSM8K, 1 on BigMath (Table 4, read as TRL's
    ``num_iterations``; see `train.presets`). With μ = 1 the ratio ρ is exactly 1 at the single update,
    so clipping never acts: the step is REINFORCE with a group baseline.
 6. Truncated completions (no end-of-turn token within the limit) are masked out of the loss
    (``mask_truncated_completions``, official scripts; DAPO's overlong filtering) in the Qwen
    presets; ``smollm2-arith`` keeps them (see `train.presets` for the measurement behind that).
 7. Rollouts at temperature 1.0, top-p 1.0, no top-k (Table 4, scripts). The engine's logprobs are
    of softmax(logits / T), the same distribution TRL scores; a top-p/top-k filter is refused.
 8. LoRA rank 32, alpha = rank, all seven projections, dropout 0, norms frozen (paper §4.1; the
    scripts' rank 16 and trainable norms are options).
 9. AdamW (8-bit on GPU, Table 4), betas (0.9, 0.99), weight decay 0.1, warm-up 10 %, cosine,
    grad-norm clip 0.2 (scripts). lr 1e-5 quantized / 5e-6 bf16 (Table 4).
10. AQN: σ_start 1e-2 → σ_end 5e-4 over 10 stages, exponential, stage 0 noise-free (Table 4,
    Eq. 8 with the official code's exponent, see `aqn`); one fresh draw per optimizer step that rolls out
    (`EngineRollout.noise_for`; TRL makes at most one rollout per step here), on the input
    and post-attention RMSNorms, *rollout only*, as the paper and code intend. The official code
    most likely never applied it (class check on transformers' RMSNorm inside vLLM); here it reaches
    the engine, and ``noise_rms`` in the metrics shows the realised perturbation.
11. Rewards: 1.0 / 0.0 accuracy + 0.2 x format (paper-era official code: gsm8k_score 1.0 +
    think_reward 0.2). HEAD gives 2.0 for a correct answer; the paper plots rewards on 0-1.
12. Rollout/trainer mismatch is measured every step; the truncated-IS correction is off by default
    (below).

Rollout/trainer mismatch: where the "old" log-probs come from
-------------------------------------------------------------
TRL computes the ratio ρ = π_θ / π_old with π_old = its own forward at rollout time when it has
to (μ > 1, or generation spanning several optimizer steps); otherwise (μ = 1) it uses
``π_θ.detach()``, so ρ = 1. Either way π_old is the *trainer's* clean model, not the engine
that sampled, exactly like the official code (docs/paper_settings.md). The behaviour policy differs from
π_old in two ways: the AQN noise (intended: it is the exploration) and numerics (FP4 kernel vs
the trainer's dequantised matmul, KV-cache decode vs one full forward, bf16 rounding). We
log per step, over the loss tokens, with Δ = log π_old − log π_engine:
``logprob_mismatch`` = mean |Δ|, ``logprob_mismatch_max``, ``mismatch_kl`` = mean(e^Δ − 1 − Δ)
(the k3 estimate of KL(engine ‖ trainer)), and the importance ratios e^Δ: ``is_ratio_mean`` = mean of
min(e^Δ, C), ``is_ratio_min`` / ``is_ratio_max`` = the extremes of e^Δ before the cap, ``is_truncated_rate``
= the share of tokens with e^Δ > C.

With ``is_correction=True`` each token's advantage is multiplied by min(e^Δ, C) (truncated
importance sampling, token level, C = ``is_cap`` = 2). Because that weight is detached and ≥ 0,
``-min(ρ·wA, clip(ρ)·wA) = w · -min(ρA, clip(ρ)A)``: it equals TRL's own vLLM-path correction
(``per_token_loss * importance_sampling_ratio``), which TRL only enables with ``use_vllm``. We pass
it through TRL's documented (B, T)-advantage path instead of flipping that switch.

Why the correction is off by default: it is not in the paper or the official code, and in mode
``qerl`` it would largely undo AQN. Weighting by π_clean/π_noisy re-targets the gradient to the
clean policy, removing the shift the noise introduces, and that shift is the exploration the method
wants. Measured on the embedded SmolLM2-135M, smollm2-arith (Δ in nats per token, over the loss tokens):

==================================  ===========  =========  ===========  ==============
run, step's noise                   mean abs Δ   max abs Δ  mismatch_kl  is ratio range
==================================  ===========  =========  ===========  ==============
CPU fp32, nvfp4 (σ = 0)             1.6e-5       4.1e-5     1.4e-9       [0.99996, 1.00001]
CPU fp32, qerl σ = 1e-2             0.28         1.56       0.074        [0.21, 3.27]
CPU fp32, qerl σ = 5e-4             0.015        0.078      2.2e-4       [0.93, 1.08]
H200 bf16, qerl σ = 0 (steps 1-10)  0.048        0.91       2.2e-3       [0.40, 2.32]
H200 bf16, qerl σ = 1e-2 (11-20)    0.29         6.8        0.082        [0.001, 19]
H200 bf16, qerl σ = 5e-4 (91-100)   0.050        0.74       2.5e-3       [0.58, 2.10]
==================================  ===========  =========  ===========  ==============

(CPU: 3-step runs of `train`, 8 completions x ≤ 32 tokens, seed 0. H200: the first 100-step GPU
run, 64 completions x ≤ 128 tokens per step, committed as ``results/train_smollm2_qerl_h200/``.)
Three readings. On a CPU the engine and the trainer run the same fp32 arithmetic, so the numerical
gap is negligible (1e-5). On a GPU in bf16 the two paths round differently and the gap without any noise is
already ~0.05 nats per token, as large as AQN's at σ_end = 5e-4, so the last stages' noise is
hidden in numerical noise there. At σ_start = 1e-2 the noise dominates (KL ~0.08 per token, several
nats per completion) and truncated IS would reweight the batch heavily. Turn the correction on to
study off-policy correction, or when engine and trainer numerics diverge further (another kernel).

Checkpoints and resume
----------------------
TRL/transformers save adapters, optimizer, scheduler, RNG and trainer state every ``save_steps``;
`train.metrics` then fsyncs the checkpoint and writes the AQN controller state, ``qerl_state.json``,
last: it is the completion marker, so a checkpoint cut short by a kill never counts, and ``--resume``
takes the newest complete one (`metrics.last_complete_checkpoint`; the kit, not transformers, deletes
old checkpoints, after the marker). Resuming truncates ``metrics.jsonl`` back to the checkpoint.
Rollout seeds (one per completion: seed, step, call, row of the global batch) and AQN draws (seed,
step, call) depend on no RNG state, so a resumed run samples exactly what the uninterrupted run would
have, and N processes sample what one process would. A step whose trainable weights turn non-finite ends the run
(`errors.TrainingDiverged`) without a checkpoint of them.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from qerl_lib.errors import TrainingDiverged, UserError
from qerl_lib.train.presets import TrainConfig, describe

__all__ = ["train", "build_trainer", "build_dataset", "load_policy", "load_base", "load_tokenizer", "EngineRollout", "reward_functions", "aqn_config",
           "resolve_device"]


# ----------------------------------------------------------------------------- devices, data, model
def resolve_device(config: TrainConfig) -> torch.device:
    if config.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was requested but CUDA is not available: use --device cpu (or auto)")
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device)
    if device.type == "cuda" and device.index is None and "LOCAL_RANK" in os.environ:
        # under `accelerate launch` each process takes its own GPU before anything is allocated: the model is
        # built (and the engine's kernels launch) on this device, not on GPU 0 with every other process
        local = int(os.environ["LOCAL_RANK"])
        if local >= torch.cuda.device_count():
            raise UserError(f"process {local} of a launch on a machine with {torch.cuda.device_count()} visible "
                            "GPU(s): pass --num-gpus at most the GPU count (or check CUDA_VISIBLE_DEVICES)")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if device.type == "cpu" and "8bit" in config.optim:
        raise UserError(f"optim={config.optim!r} (bitsandbytes 8-bit AdamW, the paper's) needs a GPU: on a CPU pass "
                        "optim='adamw_torch' (Python API) or use the smollm2-arith preset")
    needs_bnb = [what for what, used in (("mode qlora (NF4 base)", config.base == "nf4"),
                                         (f"optim={config.optim!r}", "8bit" in config.optim)) if used]
    if needs_bnb and importlib.util.find_spec("bitsandbytes") is None:
        raise UserError(f"{' and '.join(needs_bnb)} need{'s' if len(needs_bnb) == 1 else ''} bitsandbytes, which is "
                        "not installed: "
                        "pip install bitsandbytes (requirements.txt pins the tested version)")
    return device


def compute_dtype(device: torch.device) -> torch.dtype:
    # bf16 on GPUs (the paper's setting); fp32 on CPUs, which have no fast bf16 matmul here
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_tokenizer(config: TrainConfig):
    from transformers import AutoTokenizer

    from qerl_lib.models.embedded import resolve_model

    # a random-weight model has no tokenizer: the embedded model's (its ids fit every Qwen2.5 vocabulary)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model("smollm2" if _random_arch(config) else config.model))
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(f"{config.model}'s tokenizer has no chat template: use an instruct/chat model")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_dataset(config: TrainConfig, tokenizer):
    """The training problems as a TRL dataset: ``prompt`` (chat messages) and ``answer`` (gold text).

    Problems whose rendered prompt exceeds ``max_prompt_tokens`` are dropped (the scripts' limit).
    Raises `UserError` for an empty result, before any model is loaded.
    """
    from datasets import Dataset

    from qerl_lib.tasks.problems import load_problems, problem_messages, render_messages

    if config.data == "random":
        return Dataset.from_list(random_prompts(config, tokenizer))
    if config.data == "file" and not config.data_path:
        raise UserError(f"preset {config.preset!r} reads its problems from a file: pass --data-path FILE.jsonl "
                        "(GSM8K schema: 'question' and an 'answer' ending with '#### <answer>')")
    records = load_problems(config.data, "train", n=config.n_train if config.data in ("arith", "expr") else None,
                            seed=0, path=config.data_path, level=config.data_level)
    if config.n_train is not None:
        records = records[: config.n_train]
    rows = []
    for rec in records:
        messages = problem_messages(rec)
        text = render_messages(tokenizer, messages)
        if len(tokenizer(text, add_special_tokens=False)["input_ids"]) <= config.max_prompt_tokens:
            rows.append({"prompt": messages, "answer": rec["answer"]})
    if len(rows) < config.prompts_per_step:
        raise UserError(f"only {len(rows)} of {len(records)} problems fit max_prompt_tokens={config.max_prompt_tokens}, "
                        f"fewer than one step's {config.prompts_per_step} prompts: raise max_prompt_tokens or add data")
    return Dataset.from_list(rows)


def load_policy(config: TrainConfig, device: torch.device, dtype: torch.dtype):
    """The frozen base of ``config`` with fresh LoRA adapters (a peft ``PeftModel``); on a GPU its norms, SiLU
    MLPs and rotary embeddings run `train.fused_layers`' kernels in the trainer's forward and backward
    (``QERL_FUSED_LAYERS=0``: not)."""
    from qerl_lib.models.lora import attach_lora
    from qerl_lib.train.fused_layers import use_fused_layers

    base = load_base(config, device, dtype)
    if device.type == "cuda":
        use_fused_layers(base)
    return attach_lora(base, rank=config.lora_rank, alpha=config.lora_alpha, dropout=config.lora_dropout,
                       targets=config.lora_targets, train_norms=config.train_norms)


def _random_arch(config: TrainConfig) -> str | None:
    """NAME of a ``random:NAME`` model (random weights of a real architecture), else None."""
    from qerl_lib.train.presets import RANDOM_MODEL

    model = str(config.model)
    return model[len(RANDOM_MODEL):] if model.startswith(RANDOM_MODEL) else None


def random_prompts(config: TrainConfig, tokenizer) -> list[dict]:
    """``n_train`` prompts of random tokens, each rendered to at most ``max_prompt_tokens`` (speed benchmarks:
    the completions' rewards come from the caller's extra reward functions; the gold answer is a placeholder)."""
    from qerl_lib.tasks.problems import render_messages

    generator = np.random.default_rng(config.seed)
    rows, budget = [], config.max_prompt_tokens
    low, high = 1000, min(len(tokenizer), 40000)  # ordinary tokens of the embedded tokenizer's vocabulary
    for _ in range(config.n_train or 64):
        ids = generator.integers(low, high, size=budget).tolist()
        while True:
            messages = [{"role": "user", "content": tokenizer.decode(ids)}]
            length = len(tokenizer(render_messages(tokenizer, messages), add_special_tokens=False)["input_ids"])
            if length <= budget:
                break
            if not ids:
                raise UserError(f"max_prompt_tokens={budget} cannot hold the chat template's own {length} tokens: "
                                 f"raise it (the prompt length)")
            ids = ids[: max(0, len(ids) - (length - budget) - 1)]
        rows.append({"prompt": messages, "answer": "0"})
    return rows


def _random_base(name: str, base: str, device: torch.device, dtype: torch.dtype, seed: int):
    """Random weights of architecture ``name`` in the ``base`` format (NVFP4: random codes and block scales)."""
    from qerl_lib.models.loader import build_random_model

    if base in ("bf16", "mxfp4"):
        return build_random_model(name, dtype=dtype, device=device, seed=seed)
    if base == "nvfp4":
        return build_random_model(name, dtype=dtype, device=device, nvfp4=True, init="random_codes", seed=seed)
    # dense random weights where they will live, then each Linear becomes NF4 as it is (re)placed on `device`
    from qerl_lib.models.nf4 import to_nf4

    return to_nf4(build_random_model(name, dtype=dtype, device=device, seed=seed), device, dtype)


def load_base(config: TrainConfig, device: torch.device, dtype: torch.dtype):
    """The frozen base model in ``config.base`` format (bf16, NF4, NVFP4 or fake-quantized MXFP4), no adapters.
    ``random:NAME`` models get random weights of the architecture in that format (speed and memory only)."""
    from qerl_lib.models.embedded import resolve_model
    from qerl_lib.models.loader import is_nvfp4_checkpoint, load_model, replace_linear_with_nvfp4

    arch = _random_arch(config)
    if arch:
        model = _random_base(arch, config.base, device, dtype, config.seed)
        if config.base == "mxfp4":
            from qerl_lib.quant.formats import fake_quantize_

            fake_quantize_(model, "mxfp4")
        return model
    path = resolve_model(config.model)
    if config.base == "nf4":
        from qerl_lib.models.nf4 import load_nf4

        model = load_nf4(path, device, dtype)
    else:
        model = load_model(path, device=device, dtype=dtype)
        if config.base == "nvfp4" and not is_nvfp4_checkpoint(path):
            # a dense checkpoint: round-to-nearest NVFP4 in memory (the official quantize script's recipe)
            replace_linear_with_nvfp4(model)
        elif config.base in ("bf16", "mxfp4") and is_nvfp4_checkpoint(path):
            raise UserError(f"a {config.base} base needs a dense checkpoint, but {config.model} is NVFP4: "
                            "pass the bf16 model")
        elif config.base == "mxfp4":
            # dense layers holding MXFP4-representable values (the format's error, not its speed)
            from qerl_lib.quant.formats import fake_quantize_

            fake_quantize_(model, "mxfp4")
    return model


# ----------------------------------------------------------------------------- AQN and rewards
def aqn_config(config: TrainConfig):
    """The run's `AQNConfig` (None unless the run adds noise); `TrainConfig.aqn_settings` fits the stages."""
    if not config.aqn:
        return None
    from qerl_lib.train.aqn import AQNConfig

    return AQNConfig(**config.aqn_settings())


def reward_functions(config: TrainConfig, extra: list | None = None):
    """(reward functions, weights): accuracy and format, each wrapped in `SafeReward`, plus ``extra``
    ((name, function, weight) triples, also wrapped)."""
    from qerl_lib.tasks.rewards import SafeReward, accuracy_reward, format_reward_func

    accuracy = functools.partial(accuracy_reward, last_number_fallback=config.answer_fallback,
                                 first_number=config.answer_first_number)
    funcs = [SafeReward(accuracy, name="accuracy"), SafeReward(format_reward_func, name="format")]
    weights = [config.accuracy_weight, config.format_weight]
    for name, func, weight in extra or []:
        funcs.append(SafeReward(func, name=name))
        weights.append(float(weight))
    return funcs, weights


# ----------------------------------------------------------------------------- the rollout function
_ROLLOUT_STREAM = 0x5A3D  # keeps rollout seeds apart from AQN's, which hash (seed, step, call) too


def world() -> tuple[int, int]:
    """(this process's rank, number of processes) of an `accelerate launch` (0, 1 without one)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def accumulation_steps(config: TrainConfig) -> int:
    """Micro-batches per process and optimizer step, so that all processes together make one step of
    ``completions_per_step`` completions (the global batch does not change with the number of GPUs).
    Raises `UserError` (before any model loads) when the step cannot be split evenly."""
    _, size = world()
    if size > config.prompts_per_step:
        raise UserError(f"{size} processes but {config.prompts_per_step} prompt(s) per step: use at most "
                        f"{config.prompts_per_step} processes, or raise --prompts-per-step")
    if config.completions_per_step % (config.micro_batch * size):
        raise UserError(f"a step's {config.completions_per_step} completions do not split into micro-batches of "
                        f"{config.micro_batch} on {size} processes: make prompts_per_step x num_generations a "
                        f"multiple of micro_batch x {size}")
    return config.completions_per_step // (config.micro_batch * size)


def _seed(*words: int) -> int:
    state = np.random.SeedSequence([_ROLLOUT_STREAM, *(int(w) for w in words)]).generate_state(2, dtype=np.uint32)
    return int(state[0]) << 32 | int(state[1])


def row_seeds(run_seed: int, step: int, call: int, rows: int) -> list[int]:
    """Sampling seeds of this process's ``rows`` rows of rollout ``call`` of optimizer step ``step``.

    Row ``i`` of process ``rank`` is row ``rank * rows + i`` of the step's global batch (TRL hands each
    process a contiguous slice of it), and its seed is a function of (run seed, step, call, global
    row): one process and N processes, any ``rollout_batch`` (rows decoding at once), and a resumed run
    all sample the same completion for the same row.
    """
    rank, _ = world()
    return [_seed(run_seed, step, call, rank * rows + i) for i in range(rows)]


class EngineRollout:
    """TRL ``rollout_func``: chat-template the prompts, sample from the engine, return ids and logprobs.

    Every completion samples from its own stream, seeded by (run seed, optimizer step, rollout number,
    row of the global batch) (``row_seeds``): the samples depend on no global RNG state, on neither the
    rows decoding at once (``rollout_batch``: the engine's continuous batching) nor the number of
    processes, and a resumed run repeats them exactly.
    With ``config.release_engine_cache`` (the default) the engine's KV cache memory is given back after every
    rollout, before the loss forward and backward run (``RolloutEngine.release``).
    ``completion_budgets`` (benchmarks only): a function (rows, step, rollout number) -> one token budget per row,
    each in [1, max_completion_length], where a row stops as a stop token would stop it (random-weight models
    rarely sample one, so their completions would all run to the limit); None: one budget, the limit, for all.
    """

    def __init__(self, config: TrainConfig, tokenizer, aqn=None, completion_budgets=None):
        self.config, self.tokenizer, self.aqn = config, tokenizer, aqn
        self.completion_budgets = completion_budgets
        self.engine = None
        # this step's rollout-phase peak: PyTorch's allocated bytes + the engine's remappable memory (engine/remap.py),
        # which `metrics.RunMetrics` resets at each step's start and sets beside PyTorch's own step peak
        self.rollout_peak_bytes = 0
        self._calls_step, self._calls = None, 0  # rollouts within the current step (part of the seed)
        self._noise_step, self._noise = None, {}
        self._encoded: dict[str, list[int]] = {}

    def noise_for(self, model, step: int) -> dict:
        """This step's AQN norm overrides (drawn once per step, reused by every rollout of the step)."""
        if self.aqn is None:
            return {}
        if self._noise_step != step:
            self._noise = self.aqn.overrides_for_step(model, step)
            self._noise_step = step
        return self._noise

    def _encode(self, messages) -> list[int]:
        key = repr(messages)
        if key not in self._encoded:
            from qerl_lib.tasks.problems import render_messages

            text = render_messages(self.tokenizer, messages)
            self._encoded[key] = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return self._encoded[key]

    def __call__(self, prompts: list, trainer) -> dict:
        from qerl_lib.engine.rollout import RolloutEngine, lora_from_peft

        model = trainer.accelerator.unwrap_model(trainer.model)
        step = trainer.state.global_step
        if self.engine is None:
            self.engine = RolloutEngine(model, max_seq_len=self.config.max_prompt_tokens + trainer.max_completion_length,
                                        decode_backend=self.config.decode_backend, keep_alive=False,
                                        lora_merge=self.config.rollout_lora_merge)
        overrides = self.noise_for(model, step)
        adapters = lora_from_peft(model)  # views of the live LoRA tensors: unmerged, no copy of the base
        if self._calls_step != step:
            self._calls_step, self._calls = step, 0
        prompt_ids = [self._encode(p) for p in prompts]
        device = next(model.parameters()).device
        _sync(device)
        start = time.perf_counter()
        seeds = row_seeds(self.config.seed, step, self._calls, len(prompt_ids))
        budgets = trainer.max_completion_length
        if self.completion_budgets is not None:
            budgets = list(self.completion_budgets(len(prompt_ids), step, self._calls))
            if len(budgets) != len(prompt_ids) or not all(1 <= b <= trainer.max_completion_length for b in budgets):
                raise ValueError(f"completion_budgets gave {budgets[:8]}... for {len(prompt_ids)} rows: need one "
                                 f"budget per row, each in [1, {trainer.max_completion_length}]")
        # at most rollout_batch rows decode at once; further prompts take the rows of finished ones
        completions = self.engine.generate(
            prompt_ids, max_new_tokens=budgets, temperature=trainer.temperature,
            top_p=trainer.top_p, top_k=trainer.top_k or 0, row_seeds=seeds, stop_token_ids=trainer.eos_token_ids,
            lora=adapters, norm_overrides=overrides, max_batch=self.config.rollout_batch)
        _sync(device)
        seconds = time.perf_counter() - start
        cache_bytes = self.engine.cache.nbytes if self.engine.cache is not None else 0
        if device.type == "cuda":  # the rollout phase's peak, with the memory PyTorch's allocator does not see
            from qerl_lib.engine.remap import mapped_bytes

            self.rollout_peak_bytes = max(self.rollout_peak_bytes,
                                          torch.cuda.max_memory_allocated(device) + mapped_bytes())
        if self.config.release_engine_cache:
            # the KV cache would otherwise sit through the backward pass: ~32 GB at the 7B preset. Its memory
            # goes back (to the driver when the cache is remappable, engine/remap.py: the decode graphs stay and
            # the next rollout maps memory at the same addresses; else to torch's allocator, with the graphs)
            self.engine.release()
        self._calls += 1
        tokens = sum(len(c.token_ids) for c in completions)
        metrics = trainer._metrics["train" if model.training else "eval"]
        metrics["rollout_seconds"].append(slowest_process(seconds, trainer.accelerator))
        metrics["rollout_tokens"].append(float(tokens))
        metrics["rollout_tokens_per_s"].append(tokens / max(seconds, 1e-9))  # this process's engine
        metrics["kv_cache_gb"].append(cache_bytes / 1e9)  # the engine's KV cache during this rollout
        if self.aqn is not None:
            stats = self.aqn.last_stats
            metrics["sigma"].append(float(self.aqn.sigma(step)))
            metrics["aqn_stage"].append(float(self.aqn.stage(step)))
            metrics["noise_rms"].append(float(stats.get("realized_rms", 0.0)))
        else:
            metrics["sigma"].append(0.0)
            metrics["noise_rms"].append(0.0)
        return {"prompt_ids": prompt_ids, "completion_ids": [c.token_ids for c in completions],
                "logprobs": [c.logprobs for c in completions]}


def slowest_process(seconds: float, accelerator) -> float:
    """The longest of the processes' ``seconds`` (one process: its own). With several, a step's rollout phase ends
    with the slowest engine (the others wait for it when the rewards are gathered), so ``train_seconds``, the step
    less this, is the trainer phase, not the trainer phase plus that wait."""
    if accelerator.num_processes == 1:
        return seconds
    value = torch.tensor([float(seconds)], dtype=torch.float64, device=accelerator.device)
    return float(accelerator.gather(value).max())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- the entry point
def build_trainer(config: TrainConfig, out_dir: str | os.PathLike, extra_rewards: list | None = None,
                  callbacks: list | None = None, quiet: bool = False, completion_budgets=None):
    """The ready-to-train `QeRLGRPOTrainer` for ``config`` (metrics go to ``out_dir``). Data and rewards are
    prepared, and their errors raised, before the model loads. ``completion_budgets``: see `EngineRollout`."""
    from transformers import PrinterCallback, ProgressCallback

    from qerl_lib.train.aqn import AQNController
    from qerl_lib.train.metrics import RunMetrics
    from qerl_lib.train.trainer import grpo_args, trainer_class

    out = Path(out_dir)
    accumulation_steps(config)  # a step that does not split over the processes fails here, before loading
    device = resolve_device(config)
    tokenizer = load_tokenizer(config)
    dataset = build_dataset(config, tokenizer)
    funcs, weights = reward_functions(config, extra_rewards)
    if not quiet:
        print(describe(config))
        print(f"  device {device}, {len(dataset)} training problems, output {out}")
    torch.manual_seed(config.seed)  # LoRA's A init is drawn from the global RNG: fix it per run
    policy = load_policy(config, device, compute_dtype(device))
    aqn_cfg = aqn_config(config)
    rollout = EngineRollout(config, tokenizer, AQNController(aqn_cfg) if aqn_cfg is not None else None,
                            completion_budgets=completion_budgets)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*rollout_func.*experimental.*")
        trainer = trainer_class()(
            model=policy, reward_funcs=funcs, args=grpo_args(config, out / "checkpoints", device, weights),
            train_dataset=dataset, processing_class=tokenizer,
            callbacks=[RunMetrics(out, config, funcs, rollout, quiet=quiet), *(callbacks or [])],
            rollout=rollout, is_correction=config.is_correction, is_cap=config.is_cap,
            checkpoint_layers=config.checkpoint_layers)
    for cb in (PrinterCallback, ProgressCallback):  # our callback prints one line per step instead
        trainer.remove_callback(cb)
    return trainer


def train(config: TrainConfig, out_dir: str | os.PathLike, resume: bool = False, extra_rewards: list | None = None,
          callbacks: list | None = None, quiet: bool = False, completion_budgets=None) -> dict:
    """Run (or resume) one training run; return the summary dict (also written to OUT/summary.json).

    OUT holds ``run.json`` (config + provenance), ``metrics.jsonl`` (one line per step that rolled out: every μ-th),
    ``checkpoints/checkpoint-N`` (TRL), ``adapter/`` (final LoRA adapters) and ``summary.json``.
    Every input error (unknown preset or mode, impossible batch, empty dataset, a resume that does
    not match) raises `UserError` before any model is loaded. ``extra_rewards``: (name, function,
    weight) triples added to accuracy and format; ``callbacks``: more TRL callbacks; ``completion_budgets``
    (benchmarks): per-row token budgets of the rollouts (`EngineRollout`).
    """
    from qerl_lib.train import metrics as gm
    from qerl_lib.models.lora import save_adapters

    out = Path(out_dir)
    resolve_device(config)
    rank, _ = world()
    if rank == 0:
        checkpoint = gm.prepare_output(out, config, resume)  # validates a resume against run.json, before loading
    else:  # `accelerate launch`: the first process prepares OUT, the others only find the checkpoint to resume
        checkpoint = gm.last_complete_checkpoint(out / "checkpoints", None) if resume else None
    try:
        trainer = build_trainer(config, out, extra_rewards, callbacks, quiet, completion_budgets)
    except BaseException:
        if rank == 0 and not resume:  # e.g. a model that did not load: the retry may use the same OUT
            gm.discard_unstarted_run(out)
        raise
    if checkpoint is not None:
        gm.load_side_state(checkpoint, trainer.qerl_rollout)
    trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint is not None else None)
    run_metrics = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, gm.RunMetrics))
    if run_metrics.diverged_at is not None:
        gm.write_summary(out, config, diverged_at_step=run_metrics.diverged_at, steps_done=trainer.state.global_step)
        raise TrainingDiverged(f"training diverged at step {run_metrics.diverged_at}: the LoRA weights became "
                               f"non-finite (learning rate {config.learning_rate:g}); lower it with --lr",
                               step=run_metrics.diverged_at)
    if not trainer.accelerator.is_main_process:  # one process writes the adapter and the summary
        trainer.accelerator.wait_for_everyone()
        return {}
    save_adapters(trainer.accelerator.unwrap_model(trainer.model), out / "adapter")
    summary = gm.write_summary(out, config, steps_done=trainer.state.global_step)
    trainer.accelerator.wait_for_everyone()
    return summary

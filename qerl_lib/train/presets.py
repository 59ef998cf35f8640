"""Training presets: one dataclass holds every knob of a QeRL/GRPO run, validated before any model loads.

Modes (the base model the LoRA adapters ride on)
------------------------------------------------
=========  =======================================  ===================  =========================
mode       frozen base                              AQN                  learning rate (Table 4)
=========  =======================================  ===================  =========================
``lora``   bf16                                     off                  5e-6
``qlora``  NF4 (bitsandbytes, QLoRA defaults)       off                  1e-5
``nvfp4``  NVFP4 (``NVFP4Linear``, FP4 kernel)      off                  1e-5
``qerl``   NVFP4                                    on (σ 1e-2 → 5e-4)   1e-5
=========  =======================================  ===================  =========================

Where each preset value comes from (QeRL §4.1, App. E Tab. 4; docs/paper_settings.md)
---------------------------------------------------------------
The ``qwen2.5-*`` presets follow the paper's Table 4 where it states a value, and the official
scripts where the paper is silent:

* Table 4: AdamW-8bit, lr 1e-5 (NVFP4, NF4) / 5e-6 (bf16 LoRA), 8 generations (GSM8K) / 16
  (BigMath), max response 4096 / 8192, rollout temperature 1.0, ε 0.2 / 0.28, σ 1e-2 → 5e-4,
  no KL and no entropy loss (β = 0, entropy_coef = 0), training batch 128, 4 policy updates per
  rollout on GSM8K (we read this as TRL's μ = ``num_iterations`` = 4; UNCONFIRMED: it could also mean 4
  optimizer steps on quarters of one rollout batch) and 1 on BigMath. §4.1: LoRA rank 32.
* Official scripts (the paper does not say): Adam betas (0.9, 0.99), weight decay 0.1, warm-up
  ratio 0.1, cosine schedule, max grad norm 0.2, ``mask_truncated_completions=True``, top-p 1.0,
  LoRA on q/k/v/o/gate/up/down with alpha = rank (scale 1), prompt limits 256 (GSM8K) / 1024
  (BigMath) tokens.
* "Training batch size 128" is read as 128 *completions* per optimizer step (TRL's convention):
  16 prompts x 8 on GSM8K, 8 x 16 on BigMath. UNCONFIRMED (it could be 128 prompts).
* Loss: GRPO for GSM8K (paper §4.1); DAPO for BigMath. The scripts use TRL's ``bnpo`` everywhere
  ("bnpo equals to DAPO"); TRL's ``dapo`` normalises by the tokens of the whole accumulated
  batch, which is what DAPO means, and equals ``bnpo`` on one GPU without accumulation.
* Where the scripts and the paper differ (rank 16 vs 32, 2 vs 8 generations, completion 2048 vs
  4096, σ_end 1e-4 vs 5e-4, trainable layer norms), we take the paper. ``train_norms=True``
  reproduces the scripts' ``--ln True``.
* Where we deviate, for one 80 GB GPU: gradient checkpointing at every size (the paper: 14B and 32B
  only; without it a micro-batch of 8 x 4352 tokens would hold ~90-120 GB of activations at 3B-7B),
  and ``rollout_batch``, the rows the engine generates at once, sized by ``train.memory`` so that
  the rollout's weights and full-length KV cache fit (the paper's vLLM pages its cache instead); a
  step's further completions take the rows of finished ones (continuous batching).
* The kit's own, for speed: the trainer pads prompts and completions to multiples of 64 tokens
  (``pad_to_multiple_of``), so a run meets at most a few dozen padded lengths and cuDNN builds its
  attention plans for each once, instead of for nearly every step's new longest completion. Measured
  over 23-29 steps of uneven lengths (7B, H200): the trainer phase 18 % (qerl) and 20 % (lora) shorter
  on average; only rounding changes the scores (dev/LOG.md 89-90). At the presets' own lengths (128
  completions under 4096) a padded micro-batch was also 2 % faster than unpadded despite its extra
  tokens: cuDNN's attention runs its slower kernels at lengths that are not multiples of 64 (dev/LOG.md
  94, 97). ``pad_to_multiple_of=0`` pads to each batch's longest, as TRL does.

``smollm2-arith`` is the kit's own: the embedded SmolLM2-135M-Instruct on generated level-1
arithmetic problems (one operation), sized for a 100-step GPU run in minutes. ``smollm2-arith-cpu``
is the same run shrunk to what a 2-core CPU does in minutes (4 steps of 1 prompt x 4 completions of
≤ 16 tokens; on a CPU the NVFP4 layers dequantize every weight at every token, ~10x a dense
forward): it exercises every mechanism but is too small to learn. Both keep the GSM8K
presets' algorithm (GRPO loss, ε 0.2/0.28, β 0, group scaling, rank 32, AQN schedule, AdamW with
warm-up and cosine) and changes what a tiny model on a short run needs, each measured or argued:

* the accuracy reward also takes the last number of a completion without answer tags
  (``answer_fallback``): at step 0 the model writes the tags 0 % of the time (64 CPU samples), so
  without the fallback every reward is 0 and GRPO has no signal;
* big groups, 8 prompts x 16 completions per step: even with the fallback only 1.1 % of the
  completions are right (6400 completions of a first H200 run at 8 x 8, where 57 of 100 steps had
  no group with any reward spread, i.e. no gradient). With G = 16 a group holds at least one right
  answer about twice as often (1 - 0.989^16 = 16 % vs 8.5 %). 128 completions per step keep a
  100-step run at about 5 minutes on one H200 (the first run: 1.5 s per step at 64);
* truncated completions stay in the loss (``mask_truncated_completions=False``): about 60 % of its
  completions do not finish within 128 tokens; masking them would discard most of each batch,
  while keeping them lets rambling answers receive their (negative) advantage;
* learning rates 1e-4 (quantized) / 5e-5 (bf16): 10x Table 4, the same 2:1 ratio (100 steps, not 600);
* μ = 1, 128 completion tokens, micro-batches of 32, plain fp32 AdamW (``adamw_torch``).
"""

from __future__ import annotations

import importlib.util
import numbers
import re
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from qerl_lib.errors import UserError
from qerl_lib.train.aqn import SCHEDULES, AQNConfig
from qerl_lib.train.checkpointing import check_layer_count

MODES = ("lora", "qlora", "nvfp4", "qerl")
MODE_BASE = {"lora": "bf16", "qlora": "nf4", "nvfp4": "nvfp4", "qerl": "nvfp4"}
BASE_FORMATS = ("bf16", "nf4", "nvfp4", "mxfp4")  # mxfp4: dense weights fake-quantized to MXFP4 values
AQN_TARGETS = ("off", "rollout", "both")
LOSS_TYPES = ("grpo", "dapo", "bnpo", "dr_grpo")  # the clipped-surrogate losses; see grpo.py's docstring
SCALE_REWARDS = ("group", "batch", "none")
DATA_SOURCES = ("arith", "expr", "gsm8k", "file", "random")  # random: random-token prompts (benchmarks, no answers)
RANDOM_MODEL = "random:"  # model "random:NAME": random weights of data/configs/NAME.json (speed and memory only)
DEVICES = ("auto", "cpu", "cuda")
DECODE_BACKENDS = ("auto", "eager", "graphs", "graphs+fused")  # qerl_lib.engine.rollout's decode paths
REPORT_TO = ("none", "tensorboard", "trackio", "wandb")  # trackers TRL sends the step metrics to (trainer.py)
NOT_RECORDED = ("report_to", "release_engine_cache", "mismatch_forward")  # do not change the run: not in to_dict()
# recorded only when on (True), so that records written before these switches existed still match when they are off
RECORDED_WHEN_ON = ("rollout_lora_merge", "pad_to_multiple_of")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Every setting of one run. Build it with `make_config(preset, ...)`; fields are documented inline."""

    preset: str
    mode: str | None = "qerl"  # lora | qlora | nvfp4 | qerl (table above); None: set base_format (and aqn_target)
    base_format: str | None = None  # bf16 | nf4 | nvfp4 | mxfp4; None: the mode's (table above)
    model: str = "smollm2"  # local folder, hub id, or the embedded alias; an NVFP4 checkpoint is used as is
    # --- data
    data: str = "arith"  # arith | expr (generated) | gsm8k (hub or data_path) | file (data_path, GSM8K schema)
    data_path: str | None = None
    data_level: int | None = None  # arith: operations (None: mixed 1-4); expr: level 1-5 (tasks/expressions.py)
    n_train: int | None = None  # problems to train on (None: all / 2048 generated)
    max_prompt_tokens: int = 256  # rendered prompts longer than this are dropped (scripts: 256 / 1024)
    # --- batch shape: one optimizer step sees prompts_per_step x num_generations completions
    prompts_per_step: int = 16
    num_generations: int = 8  # G, completions per prompt (a GRPO group)
    micro_batch: int = 8  # completions per forward/backward; the rest is gradient accumulation
    num_iterations: int = 1  # μ: optimizer passes over each rollout batch (TRL num_iterations)
    max_completion_length: int = 4096
    rollout_batch: int = 256  # most sequences decoding at once (bounds the KV cache); more queue for their rows
    decode_backend: str = "auto"  # engine decode path: auto (graphs+fused on GPU, eager on CPU) | eager | graphs | graphs+fused
    # bf16 base only: each rollout runs the adapters merged into engine-owned weight copies (engine/merged.py): no
    # adapter launches, one more copy of the dense weights during the rollout (7B: +12.2 GiB; freed before the backward
    # with release_engine_cache); make_config re-sizes a Qwen preset's rollout_batch for it (train/memory.py)
    rollout_lora_merge: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # --- optimisation
    lr_quantized: float = 1e-5  # qlora / nvfp4 / qerl (Table 4)
    lr_bf16: float = 5e-6  # lora (Table 4: higher "will collapse in the late training stage")
    lr: float | None = None  # one learning rate for any base, overriding lr_quantized / lr_bf16
    optim: str = "adamw_8bit"  # Table 4; smollm2-arith uses adamw_torch (8-bit AdamW needs CUDA)
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    weight_decay: float = 0.1
    warmup_ratio: float = 0.1
    lr_scheduler_type: str = "cosine"
    max_grad_norm: float = 0.2
    # --- loss (TRL GRPOConfig fields of the same names)
    loss_type: str = "grpo"
    beta: float = 0.0  # KL coefficient: none in QeRL
    epsilon: float = 0.2  # ε_low
    epsilon_high: float = 0.28  # ε_high (DAPO clip-higher)
    scale_rewards: str = "group"  # divide advantages by the group's reward std (standard GRPO)
    mask_truncated_completions: bool = True
    # --- behaviour-policy mismatch: truncated importance sampling with the engine's logprobs
    is_correction: bool = False  # off by default: see grpo.py ("Rollout/trainer mismatch")
    is_cap: float = 2.0  # C in min(π_train / π_engine, C)
    # --- LoRA
    lora_rank: int = 32
    lora_alpha: float | None = None  # None -> alpha = rank (scale 1, as the scripts)
    lora_dropout: float = 0.0
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    train_norms: bool = False  # True = official scripts' --ln True
    # --- AQN (mode qerl, or aqn_target rollout/both); checked by AQNConfig's rules at construction
    sigma_start: float = 1e-2
    sigma_end: float = 5e-4
    aqn_stages: int = 10  # K >= 2, stage 0 noise-free; a run of fewer steps gets one stage per step (aqn_settings)
    aqn_schedule: str = "exponential"  # one of aqn.SCHEDULES
    aqn_target: str | None = None  # off | rollout (paper) | both (also the trainer's forward); None: the mode's
    # --- rewards: weighted sum (paper-era official code: 1.0 correct, 0.2 format)
    accuracy_weight: float = 1.0
    format_weight: float = 0.2
    answer_fallback: bool = False  # also accept the last number of an unmarked completion (small models)
    answer_first_number: bool = False  # the answer is the completion's first number (the expr task)
    # --- run
    steps: int = 100
    seed: int = 0
    device: str = "auto"
    gradient_checkpointing: bool = False  # paper: off for 3B/7B, on for 14B/32B; the kit's Qwen presets: on (_qwen)
    # with gradient_checkpointing: how many decoder layers recompute in the backward (the first ones); the others keep
    # their activations (no recompute, more memory; train/checkpointing.py). None: all of them
    checkpoint_layers: int | None = None
    # the trainer's batches: prompt and completion each padded to a multiple of this many tokens (TRL's
    # pad_to_multiple_of), so a run's padded lengths fall into few classes; 0: to the batch's longest (TRL's
    # default; the CPU presets'). Padding is masked and RoPE is relative, so only rounding changes; fewer distinct
    # lengths mean fewer per-shape set-ups (cuDNN attention plans, dev/LOG.md 82-89) at the price of the padded
    # tokens' compute. The Qwen2.5 presets: 64 (_qwen)
    pad_to_multiple_of: int = 0
    save_steps: int = 25
    save_total_limit: int = 2
    release_engine_cache: bool = True  # free the engine's KV cache after each rollout, before the backward (grpo.py)
    # μ = 1 only: one extra no-grad forward per step measures the rollout/trainer log-prob mismatch (trainer.py);
    # off: no mismatch metrics at μ = 1 (μ > 1 measures it from TRL's own "old" forward at no cost)
    mismatch_forward: bool = True
    report_to: str = "none"  # none | tensorboard | trackio | wandb: also send the step metrics there (offline, in OUT)

    def __post_init__(self):
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        if self.mode is None and self.base_format is None:
            raise UserError("no base: pass --mode (lora, qlora, nvfp4, qerl) or --base (bf16, nf4, nvfp4, mxfp4)")
        if self.mode is not None:
            _one_of("mode", self.mode, MODES, "--mode")
        if self.base_format is not None:
            _one_of("base_format", self.base_format, BASE_FORMATS, "--base")
            if self.mode is not None and MODE_BASE[self.mode] != self.base_format:
                raise UserError(f"mode {self.mode} trains on a {MODE_BASE[self.mode]} base, but base_format="
                                f"{self.base_format}: drop one of them (a mode is shorthand for a base and an AQN setting)")
        if self.aqn_target is not None:
            _one_of("aqn_target", self.aqn_target, AQN_TARGETS, "--aqn")
        if self.data_level is not None and self.data == "expr":
            from qerl_lib.tasks.expressions import EXPR_LEVELS

            _one_of("data_level", self.data_level, EXPR_LEVELS, "--level (expr)")
        _one_of("data", self.data, DATA_SOURCES, "--data")
        if str(self.model).startswith(RANDOM_MODEL):
            from qerl_lib.paths import CONFIGS_DIR

            name = str(self.model)[len(RANDOM_MODEL):]
            known = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))
            if name not in known and not Path(name).is_file():
                raise UserError(f"model {self.model!r}: random weights need an architecture, one of "
                                f"{[RANDOM_MODEL + k for k in known]} or random:PATH/config.json")
        _one_of("loss_type", self.loss_type, LOSS_TYPES, "loss_type")
        _one_of("scale_rewards", self.scale_rewards, SCALE_REWARDS, "scale_rewards")
        _one_of("device", self.device, DEVICES, "--device")
        _one_of("decode_backend", self.decode_backend, DECODE_BACKENDS, "--decode-backend")
        if self.rollout_lora_merge and self.base != "bf16":
            raise UserError(f"rollout_lora_merge needs a bf16 base (mode lora), not {self.base}: a quantized base's "
                            "adapters always run unmerged (merging would re-quantize the frozen policy); drop the flag")
        for name in ("prompts_per_step", "num_generations", "micro_batch", "num_iterations", "max_completion_length",
                     "rollout_batch", "steps", "lora_rank", "save_steps", "max_prompt_tokens", "save_total_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{name}={value!r}: must be a positive integer")
        if self.num_generations < 2:
            raise UserError(f"num_generations={self.num_generations}: GRPO compares completions within a group, "
                            "so it needs at least 2 per prompt")
        batch = self.prompts_per_step * self.num_generations
        if batch % self.micro_batch:
            raise UserError(f"impossible batch: prompts_per_step x num_generations = {self.prompts_per_step} x "
                            f"{self.num_generations} = {batch} completions per step is not a multiple of "
                            f"micro_batch={self.micro_batch}; pick a micro_batch that divides {batch}")
        if self.n_train is not None and self.n_train < self.prompts_per_step:
            raise UserError(f"n_train={self.n_train} is smaller than one step's prompts_per_step="
                            f"{self.prompts_per_step}: use more problems or fewer prompts per step")
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral) or self.seed < 0:
            raise UserError(f"seed={self.seed!r}: must be a non-negative integer (it seeds the LoRA init, data order, "
                            "rollouts and AQN noise)")
        for name in ("lr_quantized", "lr_bf16", "temperature", "top_p", "epsilon", "epsilon_high"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name}={getattr(self, name)!r}: must be > 0")
        if self.top_p != 1.0 or self.top_k != 0:
            # TRL scores tokens under softmax(logits / temperature) without top-p/top-k, so a filter
            # would make the engine's and the trainer's distributions differ by construction.
            raise UserError("top_p/top_k filter the rollout distribution but not the trainer's log-probs: "
                            "keep top_p=1.0 and top_k=0 (the paper's setting)")
        if self.beta < 0 or self.is_cap <= 1.0:
            raise UserError(f"beta={self.beta} must be >= 0 and is_cap={self.is_cap} > 1")
        if self.lr is not None and not self.lr > 0:
            raise UserError(f"lr={self.lr!r}: must be > 0")
        if self.is_correction and self.num_iterations == 1 and not self.mismatch_forward:
            raise UserError("is_correction needs the engine-vs-trainer log-probs: with num_iterations=1 keep "
                            "mismatch_forward on (or turn is_correction off)")
        check_layer_count(self.checkpoint_layers, self.gradient_checkpointing)
        if isinstance(self.pad_to_multiple_of, bool) or not isinstance(self.pad_to_multiple_of, numbers.Integral) \
                or self.pad_to_multiple_of < 0:
            raise UserError(f"pad_to_multiple_of={self.pad_to_multiple_of!r}: use a whole number of tokens >= 1 "
                            "(e.g. 64), or 0 to pad to each batch's longest")
        if self.noise_target == "both" and self.num_iterations != 1:
            raise UserError("aqn_target='both' needs one rollout per optimizer step (num_iterations=1), so the trainer "
                            "can score the exact noisy policy that sampled")
        self._check_aqn()
        _one_of("report_to", self.report_to, REPORT_TO, "--report-to")
        if self.report_to != "none" and importlib.util.find_spec(self.report_to) is None:
            raise UserError(f"report_to={self.report_to!r} needs the {self.report_to} package, which is not installed: "
                            f"pip install {self.report_to} (or --report-to none)")

    def _check_aqn(self) -> None:
        """The AQN settings as given, under AQNConfig's own rules, whether or not this run adds noise.

        aqn_stages < 2 has no meaning (stage 0 is noise-free, so K = 1 would never add noise) and is
        refused, as is aqn_stages = 2 with sigma_end != sigma_start unless the schedule is constant
        (one noisy stage cannot be both). The run itself may use fewer stages (`aqn_settings`).
        """
        _one_of("aqn_schedule", self.aqn_schedule, SCHEDULES, "--schedule")
        k = self.aqn_stages
        if isinstance(k, bool) or not isinstance(k, int) or k < 2:
            raise UserError(f"aqn_stages={k!r}: need an integer >= 2 (stage 0 is noise-free, stages 1..K-1 carry "
                            "noise); for no noise at all pass --aqn off")
        try:
            AQNConfig(total_steps=max(k, self.steps), sigma_start=self.sigma_start, sigma_end=self.sigma_end,
                      num_stages=k, schedule=self.aqn_schedule)
        except ValueError as err:  # AQNConfig names its own fields; name the TrainConfig's and the CLI's
            message = re.sub(r"\bnum_stages\b", "aqn_stages", str(err))
            message = re.sub(r"\bschedule=", "aqn_schedule=", message).replace("AQNConfig.off()", "--aqn off")
            raise UserError(f"AQN: {message}") from None

    # derived values ------------------------------------------------------------------------------
    @property
    def base(self) -> str:
        return self.base_format if self.base_format is not None else MODE_BASE[self.mode]

    @property
    def noise_target(self) -> str:
        """Where AQN acts: 'off', 'rollout' or 'both' (the explicit setting, else the mode's)."""
        if self.aqn_target is not None:
            return self.aqn_target
        return "rollout" if self.mode == "qerl" else "off"

    @property
    def aqn(self) -> bool:
        return self.noise_target != "off"

    @property
    def arm_label(self) -> str:
        """The mode when base and AQN match one (lora, qlora, nvfp4, qerl), else e.g. 'bf16+aqn', 'mxfp4'."""
        for mode, base in MODE_BASE.items():
            if base == self.base and (mode == "qerl") == (self.noise_target == "rollout") and self.noise_target != "both":
                return mode
        return self.base + ("" if not self.aqn else "+aqn" if self.noise_target == "rollout" else "+aqn-both")

    def aqn_settings(self) -> dict:
        """The `AQNConfig` keyword arguments of this run (``grpo.aqn_config`` builds it when AQN is on).

        Every stage needs a step, so a run shorter than aqn_stages gets one stage per step: K =
        min(aqn_stages, steps). A 2-step run then has one noisy stage, which takes sigma_start (it
        cannot be both ends); a 1-step run is stage 0 only, noise-free (2 stages over 2 steps, the
        smallest AQNConfig). `describe` prints the fitted stage count.
        """
        stages = max(2, min(self.aqn_stages, self.steps))
        fitted_to_one = stages == 2 and self.aqn_stages > 2
        return {"total_steps": max(self.steps, stages), "sigma_start": self.sigma_start,
                "sigma_end": self.sigma_start if fitted_to_one else self.sigma_end, "num_stages": stages,
                "schedule": self.aqn_schedule, "seed": self.seed,
                "target": self.noise_target if self.aqn else "rollout"}

    @property
    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return self.lr_bf16 if self.base == "bf16" else self.lr_quantized

    @property
    def completions_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.completions_per_step // self.micro_batch

    def to_dict(self) -> dict:
        """Every setting that shapes the run, plus derived values (run.json, resume and sweep checks).

        ``NOT_RECORDED`` is left out: where copies of the metrics go and when engine memory is freed do
        not change what the run computes, so a run may be resumed with other values, and records written
        before these fields existed still match. ``RECORDED_WHEN_ON`` switches appear only when on.
        """
        settings = {k: v for k, v in asdict(self).items()
                    if k not in NOT_RECORDED and (k not in RECORDED_WHEN_ON or v)}
        return {**settings, "learning_rate": self.learning_rate, "base": self.base, "aqn": self.noise_target,
                "arm_label": self.arm_label,
                "gradient_accumulation_steps": self.gradient_accumulation_steps}


def _one_of(name: str, value, allowed: tuple, flag: str) -> None:
    if value not in allowed:
        raise UserError(f"unknown {name} {value!r}: {flag} must be one of {', '.join(allowed)}")


def _rollout_rows(size: str, prompt_tokens: int, completion_tokens: int, lora_merge: bool = False) -> int:
    """Rows the engine runs at once so that the rollout phase (weights + KV cache for full-length
    completions) fits one 80 GB GPU (`train.memory`): with a bf16 base up to 14B, so that mode lora fits
    too, and with the NVFP4 base at 32B (whose bf16 weights alone take 62 GB). ``lora_merge``: a bf16 base
    with its merged copy beside it (0 where that does not fit at all)."""
    from qerl_lib.paths import load_model_config
    from qerl_lib.train.memory import rollout_rows_that_fit

    base = "nvfp4" if size == "32b" and not lora_merge else "bf16"
    return rollout_rows_that_fit(load_model_config(f"qwen2.5-{size}"), base, prompt_tokens, completion_tokens,
                                 continuous=True, lora_merge=lora_merge)


def _qwen(size: str, data: str, **kw) -> TrainConfig:
    # Gradient checkpointing at every size: a micro-batch of 8 sequences of 256 + 4096 tokens keeps ~34 x hidden
    # bytes of activations per token and layer without it, ~120 GB at 7B and ~90 GB at 3B; with it, one hidden
    # state per token and layer. Measured (results/train_step_h100.json, H100, random weights): the 7B gsm8k preset's
    # own step peaks at 45.4 (qerl), 54.2 (lora) and 44.0 GiB (qlora); its rollout's KV cache is 29.75 GiB.
    gsm8k = data == "gsm8k"
    prompt_tokens, completion_tokens = (256, 4096) if gsm8k else (1024, 8192)
    return TrainConfig(
        preset=f"qwen2.5-{size}-{data}", model=f"Qwen/Qwen2.5-{size.upper()}-Instruct",
        data="gsm8k" if gsm8k else "file", max_prompt_tokens=prompt_tokens,
        prompts_per_step=16 if gsm8k else 8, num_generations=8 if gsm8k else 16, micro_batch=8,
        num_iterations=4 if gsm8k else 1, max_completion_length=completion_tokens,
        rollout_batch=_rollout_rows(size, prompt_tokens, completion_tokens), loss_type="grpo" if gsm8k else "dapo",
        gradient_checkpointing=True, steps=600 if gsm8k else 500, save_steps=50, pad_to_multiple_of=64, **kw)


_SMOLLM2 = TrainConfig(
    preset="smollm2-arith", model="smollm2", data="arith", data_level=1, n_train=2048, max_prompt_tokens=256,
    prompts_per_step=8, num_generations=16, micro_batch=32, num_iterations=1, max_completion_length=128,
    rollout_batch=256, lr_quantized=1e-4, lr_bf16=5e-5, optim="adamw_torch", answer_fallback=True,
    mask_truncated_completions=False, steps=100, save_steps=25)

# The claim sweeps' task: bare expressions the embedded model gets right some of the time (see
# tasks/expressions.py and results/calibration.json for the level and temperature chosen), 16 prompts
# x 8 completions of <= 32 tokens, truncated completions masked, μ = 2 (the second pass over each
# rollout has ρ != 1, so the clip acts; the paper's μ = 4 would leave a short run a quarter as many
# rollouts), learning rates at the paper's 2:1 quantized:bf16 ratio.
_SMOLLM2_EXPR = TrainConfig(
    preset="smollm2-expr", model="smollm2", data="expr", data_level=3, n_train=2048, max_prompt_tokens=128,
    prompts_per_step=16, num_generations=8, micro_batch=64, num_iterations=2, max_completion_length=32,
    rollout_batch=256, temperature=1.0, lr_quantized=1e-4, lr_bf16=5e-5, optim="adamw_torch", accuracy_weight=1.0,
    format_weight=0.0, answer_first_number=True, mask_truncated_completions=True, steps=60, save_steps=20,
    save_total_limit=1)

PRESETS: dict[str, TrainConfig] = {
    "smollm2-arith": _SMOLLM2,
    "smollm2-expr": _SMOLLM2_EXPR,
    "smollm2-arith-cpu": replace(_SMOLLM2, preset="smollm2-arith-cpu", prompts_per_step=1, num_generations=4,
                                 micro_batch=4, max_completion_length=16, steps=4, save_steps=2),
    **{f"qwen2.5-{s}-gsm8k": _qwen(s, "gsm8k") for s in ("3b", "7b", "14b", "32b")},
    **{f"qwen2.5-{s}-bigmath": _qwen(s, "bigmath") for s in ("7b", "14b", "32b")},
}


def make_config(preset: str, mode: str | None = None, steps: int | None = None, seed: int | None = None,
                **overrides) -> TrainConfig:
    """The named preset with the given changes (None = keep the preset's value), validated.

    Raises `UserError` for an unknown preset or field, or any invalid combination, before
    anything is loaded.
    """
    if preset not in PRESETS:
        raise UserError(f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}")
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise UserError(f"unknown training setting(s) {unknown}: valid names are the fields of TrainConfig")
    changes = {k: v for k, v in dict(overrides, mode=mode, steps=steps, seed=seed).items() if v is not None}
    if overrides.get("base_format") is not None and mode is None:
        changes["mode"] = None  # an explicit base replaces the preset's mode; its AQN comes from aqn_target
    config = replace(PRESETS[preset], **changes)
    if config.rollout_lora_merge and preset.startswith("qwen2.5-") and "rollout_batch" not in changes:
        # the merged copy shares the rollout's memory with the KV cache: fewer rows where both do not fit
        size = preset.split("-")[1]
        rows = _rollout_rows(size, config.max_prompt_tokens, config.max_completion_length, lora_merge=True)
        if rows == 0:
            raise UserError(f"rollout_lora_merge: Qwen2.5-{size.upper()}'s bf16 weights and their merged copy leave "
                            "no room for a rollout on one 80 GB GPU: drop --rollout-lora-merge")
        config = replace(config, rollout_batch=min(rows, config.rollout_batch))
    return config


def describe(config: TrainConfig) -> str:
    """A few lines naming what the run will do (printed at start, shown in the notebook)."""
    c, a = config, config.aqn_settings()
    fitted = "" if a["num_stages"] == c.aqn_stages else f", aqn_stages {c.aqn_stages} fitted to {c.steps} steps"
    noisy = (f"σ {a['sigma_start']:g}" if a["num_stages"] == 2 else
             f"σ {a['sigma_start']:g} → {a['sigma_end']:g} over {a['num_stages'] - 1} stages")
    noise = (f"AQN: stage 0 without noise, then {noisy} ({c.aqn_schedule}, target {c.noise_target}{fitted})"
             if c.aqn else "no AQN")
    return (f"{c.preset} / {c.arm_label}: {c.base} base + LoRA r{c.lora_rank}, {noise}\n"
            f"  {c.steps} steps x {c.prompts_per_step} prompts x {c.num_generations} completions "
            f"(≤{c.max_completion_length} tokens), μ={c.num_iterations}, micro-batch {c.micro_batch} "
            f"(x{c.gradient_accumulation_steps} accumulation)"
            f"{f', lengths padded to multiples of {c.pad_to_multiple_of}' if c.pad_to_multiple_of else ''}\n"
            f"  loss {c.loss_type}, ε {c.epsilon}/{c.epsilon_high}, β {c.beta}, scale_rewards {c.scale_rewards}, "
            f"lr {c.learning_rate:g} ({c.lr_scheduler_type}, warm-up {c.warmup_ratio}), {c.optim}, "
            f"IS correction {'on (cap ' + format(c.is_cap, 'g') + ')' if c.is_correction else 'off'}")


CONFIG_FIELDS = tuple(f.name for f in fields(TrainConfig))
__all__ = ["TrainConfig", "PRESETS", "MODES", "REPORT_TO", "make_config", "describe", "CONFIG_FIELDS"]

"""The TRL side of QeRL training: `QeRLGRPOTrainer` (what the kit adds to TRL's GRPOTrainer) and
`grpo_args` (TRL's GRPOConfig with every semantics-bearing field set).

What the subclass adds, and why (the full reasoning is in ``qerl_lib/train/grpo.py``'s docstring):

* after TRL scores a batch, the trainer's log-probs of the sampled tokens are compared with the
  engine's and logged (``logprob_mismatch``, ``mismatch_kl``, ``is_ratio_*``); with μ = 1 TRL computes
  no "old" log-probs, so one no-grad forward is added for the measurement (``mismatch_forward``;
  off: no forward and no mismatch metrics at μ = 1);
* with ``is_correction`` each token's advantage is multiplied by min(π_trainer / π_engine, C), the
  truncated importance weight, through TRL's (B, T)-advantage path (TRL's own correction is only
  wired for vLLM);
* with ``checkpoint_layers`` (and gradient checkpointing on) only the first that many decoder layers
  recompute their forward in the backward pass; the others keep their activations
  (``train/checkpointing.py``);
* with AQN target "both" the trainer's forward and backward run with the rollout's noisy norm
  weights, so the trainer scores exactly the policy that sampled;
* before TRL averages a step's metrics and hands them to the callbacks, its key names are changed
  to the kit's (``metrics.RENAMES``: ``rewards/accuracy/mean`` -> ``accuracy``, ...), so every
  tracker shows the names of ``metrics.jsonl``.

Experiment tracking (``TrainConfig.report_to``)
-----------------------------------------------
TRL's own callbacks send the step metrics to TensorBoard, Trackio or Weights & Biases; the JSONL
written by ``metrics.RunMetrics`` stays the record. Everything stays local and under the run folder
(the parent of TRL's ``output_dir``, which ``grpo.build_trainer`` sets to ``RUN/checkpoints``):

* tensorboard: event files in ``RUN/tensorboard`` (unless ``TENSORBOARD_LOGGING_DIR`` is set);
* trackio: its SQLite store in ``RUN/trackio`` (``TRACKIO_DIR``, unless set; trackio reads it once,
  at its first import, so later runs of the same process write where the first did), no Space;
* wandb: ``WANDB_MODE=offline`` and ``WANDB_DIR=RUN`` unless set (``wandb sync RUN/wandb/...`` uploads).

Tags carry the tracker's ``train/`` prefix (``train/reward``, ``train/entropy``, ``train/sigma``).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

from qerl_lib.train.presets import TrainConfig

__all__ = ["trainer_class", "grpo_args", "QeRLGRPOTrainer", "run_folder", "tracker_environment"]


@functools.cache
def trainer_class():
    """The trainer class, built on first use so that importing this module does not import TRL."""
    from transformers.integrations import TensorBoardCallback
    from trl import GRPOTrainer
    from trl.models.utils import disable_gradient_checkpointing

    from qerl_lib.train.checkpointing import recompute_only
    from qerl_lib.train.metrics import RENAMES

    class QeRLGRPOTrainer(GRPOTrainer):
        """TRL's GRPOTrainer plus what QeRL adds: mismatch metrics, optional truncated IS, AQN in the trainer,
        the kit's metric names and trackers under the run folder."""

        def __init__(self, *args, rollout, is_correction: bool = False, is_cap: float = 2.0,
                     checkpoint_layers: int | None = None, **kwargs):
            self.qerl_rollout, self.is_correction, self.is_cap = rollout, is_correction, is_cap
            self.checkpoint_layers = checkpoint_layers
            if kwargs.get("args") is not None:  # before TRL builds (and imports) the trackers
                tracker_environment(kwargs["args"].report_to, run_folder(kwargs["args"].output_dir))
            super().__init__(*args, rollout_func=rollout, **kwargs)
            for callback in self.callback_handler.callbacks:  # transformers' default: output_dir/runs/DATE_HOST
                if isinstance(callback, TensorBoardCallback) and callback.logging_dir is None:
                    callback.logging_dir = str(run_folder(self.args.output_dir) / "tensorboard")

        def log(self, logs, start_time=None):
            # TRL's log averages self._metrics into `logs` and passes them to every callback: rename first
            metrics = self._metrics["train" if self.model.training else "eval"]
            items = list(metrics.items())
            metrics.clear()
            metrics.update((RENAMES.get(key, key), values) for key, values in items)
            super().log(logs, start_time)

        def _prepare_inputs(self, generation_batch):
            inputs = super()._prepare_inputs(generation_batch)  # may roll out and score, which re-enables every layer
            if self.checkpoint_layers is not None and self.model.training:  # so after it, before the loss forward
                recompute_only(self.accelerator.unwrap_model(self.model), self.checkpoint_layers)
            return inputs

        def training_step(self, model, inputs, num_items_in_batch):
            aqn = self.qerl_rollout.aqn
            if aqn is None or aqn.config.target != "both":
                return super().training_step(model, inputs, num_items_in_batch)
            # target "both": the trainer's forward/backward see the same noise Z as the rollout of this step.
            base = self.accelerator.unwrap_model(self.model)
            step = self.state.global_step
            self.qerl_rollout.noise_for(base, step)  # draw outside the override context
            from qerl_lib.train.aqn import apply_norm_overrides

            with apply_norm_overrides(base, aqn.trainer_overrides(base, step)):
                return super().training_step(model, inputs, num_items_in_batch)

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            if "sampling_per_token_logps" not in out:
                return out
            mask = out["completion_mask"] if "tool_mask" not in out else out["completion_mask"] * out["tool_mask"]
            old = out.get("old_per_token_logps")
            if old is None and not self.qerl_rollout.config.mismatch_forward:
                return out  # μ = 1 and the measurement is off: no extra forward, no mismatch metrics
            if old is None:  # μ = 1: TRL will use π_θ.detach(); score once here to measure the mismatch
                ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
                attention = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
                with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
                    old, _, _ = self._get_per_token_logps_and_entropies(
                        self.model, ids, attention, out["completion_ids"].size(1),
                        batch_size=self.args.per_device_train_batch_size)
            delta = (old - out["sampling_per_token_logps"]).float()
            delta = torch.where(mask.bool(), torch.nan_to_num(delta, nan=0.0), torch.zeros_like(delta))
            ratio = torch.exp(delta.clamp(max=20.0))
            weights = ratio.clamp(max=self.is_cap)
            self._log_mismatch(delta, ratio, mask.bool())
            if self.is_correction:
                out["advantages"] = out["advantages"].unsqueeze(1) * weights.to(out["advantages"].dtype)
            return out

        def _log_mismatch(self, delta, ratio, mask):
            metrics = self._metrics["train" if self.model.training else "eval"]
            n = int(mask.sum())
            if n == 0:  # every completion masked (e.g. all truncated): nothing to compare
                return
            d, r = delta[mask], ratio[mask]
            metrics["logprob_mismatch"].append(d.abs().mean().item())
            metrics["logprob_mismatch_max"].append(d.abs().max().item())
            metrics["mismatch_kl"].append((torch.exp(d.clamp(max=20.0)) - 1.0 - d).mean().item())
            metrics["is_ratio_mean"].append(r.clamp(max=self.is_cap).mean().item())
            metrics["is_ratio_min"].append(r.min().item())
            metrics["is_ratio_max"].append(r.max().item())
            metrics["is_truncated_rate"].append((r > self.is_cap).float().mean().item())

    return QeRLGRPOTrainer


def __getattr__(name):  # `from qerl_lib.train.trainer import QeRLGRPOTrainer` builds the class lazily
    if name == "QeRLGRPOTrainer":
        return trainer_class()
    raise AttributeError(f"module 'qerl_lib.train.trainer' has no attribute {name!r}")


_ENV_SET_HERE: dict[str, str] = {}  # tracker variables this module set, so a later run may set them again


def run_folder(output_dir: str | os.PathLike) -> Path:
    """The run folder of TRL's ``output_dir``: its parent when that is ``RUN/checkpoints``, else itself."""
    output_dir = Path(output_dir)
    return output_dir.parent if output_dir.name == "checkpoints" else output_dir


def tracker_environment(report_to, run: Path) -> None:
    """Set the variables that keep the chosen trackers offline and under `run`, unless the user set them."""
    report_to = [report_to] if isinstance(report_to, str) else list(report_to or ())
    wanted = {}
    if "wandb" in report_to:
        wanted |= {"WANDB_MODE": "offline", "WANDB_DIR": str(run)}
    if "trackio" in report_to:
        wanted["TRACKIO_DIR"] = str(run / "trackio")
    for name, value in wanted.items():
        if os.environ.get(name) in (None, _ENV_SET_HERE.get(name)):
            os.environ[name] = _ENV_SET_HERE[name] = value


def grpo_args(config: TrainConfig, output_dir: str | os.PathLike, device: torch.device, reward_weights: list[float]):
    """TRL's GRPOConfig with every semantics-bearing field set explicitly (TRL has changed defaults before,
    e.g. loss_type bnpo -> dapo, so nothing that changes the algorithm is left to a default).

    ``report_to`` is the config's (TRL's "none" turns every tracker off); the run is named after the
    run folder, and Trackio logs locally only (no Space, no sync on a hub push).
    """
    from trl import GRPOConfig

    from qerl_lib.train.grpo import accumulation_steps, world

    c = config
    accumulation = accumulation_steps(c)  # per process: the processes share one step's completions
    args = GRPOConfig(
        output_dir=str(output_dir),
        # batch shape: generation batch = one optimizer step's completions, over all processes
        per_device_train_batch_size=c.micro_batch, gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation, num_generations=c.num_generations,
        num_iterations=c.num_iterations, max_completion_length=c.max_completion_length, shuffle_dataset=True,
        # sampling (the engine reads these back from the trainer, so TRL's scoring matches)
        temperature=c.temperature, top_p=c.top_p, top_k=c.top_k, min_p=None, repetition_penalty=1.0,
        use_vllm=False, use_transformers_continuous_batching=False, vllm_importance_sampling_correction=False,
        # objective
        loss_type=c.loss_type, beta=c.beta, epsilon=c.epsilon, epsilon_high=c.epsilon_high, delta=None,
        scale_rewards=c.scale_rewards, importance_sampling_level="token", mask_truncated_completions=c.mask_truncated_completions,
        multi_objective_aggregation="sum_then_normalize", reward_weights=list(reward_weights),
        top_entropy_quantile=1.0, entropy_coef=0.0, use_adaptive_entropy=False, off_policy_mask_threshold=None,
        use_bias_correction_kl=True, sync_ref_model=False, disable_dropout=True, cast_lm_head_to_fp32=False,
        # optimisation
        learning_rate=c.learning_rate, lr_scheduler_type=c.lr_scheduler_type, warmup_steps=c.warmup_ratio,
        optim=c.optim, adam_beta1=c.adam_beta1, adam_beta2=c.adam_beta2, adam_epsilon=1e-8,
        weight_decay=c.weight_decay, max_grad_norm=c.max_grad_norm, max_steps=c.steps,
        bf16=device.type == "cuda", fp16=False, gradient_checkpointing=c.gradient_checkpointing,
        use_cpu=device.type == "cpu", seed=c.seed, data_seed=c.seed,
        # logging and checkpoints (the kit's callback writes metrics.jsonl and the progress bar)
        logging_strategy="steps", logging_steps=1, report_to=c.report_to, disable_tqdm=True, log_completions=False,
        run_name=run_folder(output_dir).name, project="qerl", trackio_space_id=None, trackio_static_space_id=False,
        save_strategy="steps", save_steps=c.save_steps, save_total_limit=c.save_total_limit, save_only_model=False,
        remove_unused_columns=False, dataloader_num_workers=0, pad_to_multiple_of=c.pad_to_multiple_of or None, trust_remote_code=False,
    )
    if device.type == "cuda" and world()[1] == 1 and torch.cuda.device_count() > 1:
        # one process on a machine with several visible GPUs trains on one of them: `Trainer` would count them all
        # and wrap the model in nn.DataParallel, which TRL refuses (data parallel is `--num-gpus N`, one process each)
        _ = args._setup_devices  # resolves the device (cuda:0) and counts the GPUs first; cached from here on
        args._n_gpu = 1
    return args

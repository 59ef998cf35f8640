"""Per-step metrics, progress line and checkpoint side state for QeRL training (TRL callback glue).

Every optimizer step TRL calls ``log`` with the averages of what it and the kit recorded during the
step; `RunMetrics.on_log` turns that into one JSON line in ``OUT/metrics.jsonl`` (rewritten
atomically, so a reader or a resumed run never sees a torn line) with plain key names, adds the
wall-clock split and peak memory, and prints one line under a tqdm bar.

Keys of a metrics line (``METRIC_KEYS``; TRL's own name in brackets where it differs)
------------------------------------------------------------------------------------
step, epoch, learning_rate, loss, grad_norm          optimizer state after the step
reward, reward_std                                   weighted reward sum, mean and std over the batch
accuracy [rewards/accuracy/mean]                     share of completions with the right answer
format_rate [rewards/format/mean]                    share with the <think>/<answer> format
reward_errors                                        completions whose scoring raised (scored 0)
zero_std_groups [frac_reward_zero_std]               groups whose rewards are all equal (no signal)
entropy                                              trainer's mean next-token entropy on the loss tokens
completion_length [completions/mean_length]          tokens per completion (mean)
truncated_rate [completions/clipped_ratio]           share that hit max_completion_length
clip_ratio_low / _high / clip_ratio [clip_ratio/*]   share of tokens where the PPO clip acts
sigma, aqn_stage, noise_rms                          AQN σ of the step, its stage, realised RMS noise
logprob_mismatch, logprob_mismatch_max, mismatch_kl  engine vs trainer log-probs (grpo.py)
is_ratio_mean, is_ratio_min, is_ratio_max, is_truncated_rate   the truncated-IS weights (logged even when off)
rollout_tokens, rollout_tokens_per_s                 completion tokens sampled and engine throughput
rollout_seconds, train_seconds, step_seconds         time split: engine / everything else / whole step
peak_memory_gb, memory_kind                          CUDA: peak allocated in the step; CPU: process peak RSS
"""

from __future__ import annotations

import json
import math
import resource
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from qerl_lib.errors import UserError
from qerl_lib.io import append_jsonl_atomic, read_jsonl, write_json_atomic, write_jsonl_atomic

RENAMES = {
    "rewards/accuracy/mean": "accuracy", "rewards/format/mean": "format_rate",
    "frac_reward_zero_std": "zero_std_groups", "completions/mean_length": "completion_length",
    "completions/clipped_ratio": "truncated_rate", "clip_ratio/low_mean": "clip_ratio_low",
    "clip_ratio/high_mean": "clip_ratio_high", "clip_ratio/region_mean": "clip_ratio",
}
KIT_KEYS = ("sigma", "aqn_stage", "noise_rms", "logprob_mismatch", "logprob_mismatch_max", "mismatch_kl",
            "is_ratio_mean", "is_ratio_min", "is_ratio_max", "is_truncated_rate", "rollout_tokens",
            "rollout_tokens_per_s", "rollout_seconds")
METRIC_KEYS = ("step", "epoch", "learning_rate", "loss", "grad_norm", "reward", "reward_std", "accuracy",
               "format_rate", "reward_errors", "zero_std_groups", "entropy", "completion_length", "truncated_rate",
               "clip_ratio_low", "clip_ratio_high", "clip_ratio", *KIT_KEYS, "train_seconds", "step_seconds",
               "peak_memory_gb", "memory_kind")
SIDE_STATE = "qerl_state.json"  # written into every checkpoint folder next to TRL's files


class RunMetrics(TrainerCallback):
    """Writes ``metrics.jsonl``, shows progress, and saves the AQN state into each checkpoint."""

    def __init__(self, out_dir: Path, config, reward_funcs: list, rollout, quiet: bool = False):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.config, self.reward_funcs, self.rollout, self.quiet = config, reward_funcs, rollout, quiet
        self.bar = None
        self._step_start = None
        self._step_seconds = float("nan")
        self.diverged_at: int | None = None  # the step after which a trainable weight was non-finite

    # ---- step timing -------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        if not self.quiet and state.is_world_process_zero:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=state.max_steps, initial=state.global_step, desc=f"{self.config.mode}", unit="step",
                            dynamic_ncols=True)

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._step_start = time.perf_counter()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._step_seconds = time.perf_counter() - self._step_start
        if model is not None and not trainable_weights_finite(model):
            # a NaN/inf update (too high a learning rate): stop here, and never checkpoint broken weights
            self.diverged_at = state.global_step
            control.should_training_stop = True
            control.should_save = False

    # ---- one line per step -------------------------------------------------------------------------
    def on_log(self, args, state, control, logs=None, **kwargs):
        if not logs or "reward" not in logs or not state.is_world_process_zero:
            return  # the end-of-training summary log has no step metrics; one process writes
        row = {key: None for key in METRIC_KEYS}
        for key, value in logs.items():
            row[RENAMES.get(key, key)] = value
        row["step"] = state.global_step
        row["reward_errors"] = sum(f.take_errors() for f in self.reward_funcs if hasattr(f, "take_errors"))
        # μ > 1 reuses one rollout for several steps: the steps without one spent 0 s in the engine
        row["rollout_seconds"] = rollout_s = row.get("rollout_seconds") or 0.0
        row["step_seconds"] = self._step_seconds
        row["train_seconds"] = self._step_seconds - rollout_s
        row["peak_memory_gb"], row["memory_kind"] = _peak_memory()
        row = {k: _plain(v) for k, v in row.items()}
        append_jsonl_atomic(self.path, row)
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)
            self.bar.write(progress_line(row, state.max_steps))
            if row["reward_errors"]:
                last = [f"{f.__name__}: {f.last_error}" for f in self.reward_funcs if getattr(f, "last_error", None)]
                self.bar.write(f"  {row['reward_errors']} completion(s) whose reward raised scored 0; last: {last[-1:]}")

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        aqn = self.rollout.aqn
        write_json_atomic(folder / SIDE_STATE, {"step": state.global_step,
                                                "aqn": aqn.state_dict() if aqn is not None else None})

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()


def trainable_weights_finite(model) -> bool:
    """True when every trainable parameter is finite (one device sync for all of them)."""
    flags = [torch.isfinite(p.detach()).all() for p in model.parameters() if p.requires_grad]
    return bool(torch.stack(flags).all()) if flags else True


def progress_line(row: dict, total: int) -> str:
    """``step 12/100 | reward 0.41±0.35 acc 0.38 fmt 0.12 | H 0.62 | σ 5.6e-03 Δlogp 0.031 | rollout 1.9s
    train 0.7s (73% rollout) | 2400 tok/s``"""
    def f(key, fmt):
        value = row.get(key)
        return format(value, fmt) if isinstance(value, (int, float)) and math.isfinite(value) else "-"

    rollout, train = row.get("rollout_seconds") or 0.0, row.get("train_seconds") or 0.0
    share = 100 * rollout / (rollout + train) if rollout + train > 0 else float("nan")
    return (f"step {row['step']}/{total} | reward {f('reward', '.3f')}±{f('reward_std', '.2f')} "
            f"acc {f('accuracy', '.2f')} fmt {f('format_rate', '.2f')} | H {f('entropy', '.3f')} | "
            f"σ {f('sigma', '.1e')} Δlogp {f('logprob_mismatch', '.2e')} | rollout {f('rollout_seconds', '.1f')}s "
            f"train {f('train_seconds', '.1f')}s ({share:.0f}% rollout) | {f('rollout_tokens_per_s', '.0f')} tok/s")


def _peak_memory() -> tuple[float, str]:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 1e9, "cuda_max_allocated_in_step"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, "cpu_peak_rss_of_process"  # Linux: KiB


def _plain(value):
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; None means "not measured this step"
    return value


# ----------------------------------------------------------------------------- output folder and resume
def prepare_output(out: Path, config, resume: bool):
    """Check OUT for a fresh run or a resume; return the checkpoint to resume from (or None).

    Fresh: OUT must not hold a run yet; ``run.json`` (config + provenance) is written. Resume: the
    saved config must equal this one, a checkpoint must exist, and ``metrics.jsonl`` is cut back
    to the checkpoint's step (lines written after it are re-done by the resumed run).
    """
    from transformers.trainer_utils import get_last_checkpoint

    from qerl_lib.io import provenance

    out = Path(out)
    run_json, metrics = out / "run.json", out / "metrics.jsonl"
    if not resume:
        if metrics.exists() or (out / "checkpoints").exists():
            raise UserError(f"{out} already holds a run: pass --resume to continue it, or choose another --out")
        write_json_atomic(run_json, {"config": config.to_dict(), "provenance": provenance()})
        return None
    if not run_json.exists():
        raise UserError(f"nothing to resume in {out} (no run.json): start the run without --resume")
    saved = json.loads(run_json.read_text())["config"]
    mine = json.loads(json.dumps(config.to_dict()))  # tuples -> lists, as saved
    diff = {k: (saved.get(k), v) for k, v in mine.items() if k != "device" and saved.get(k) != v}
    if diff:
        raise UserError(f"--resume with different settings than the saved run (setting: (saved, now)) {diff}: "
                        "resume with the same preset, mode, steps and seed")
    folder = out / "checkpoints"
    checkpoint = get_last_checkpoint(str(folder)) if folder.is_dir() else None
    if checkpoint is None:
        raise UserError(f"no checkpoint in {folder} yet (the run stopped before its first save, every "
                        f"{config.save_steps} steps): start again without --resume")
    checkpoint = Path(checkpoint)
    step = int(checkpoint.name.rsplit("-", 1)[1])
    if metrics.exists():
        write_jsonl_atomic(metrics, [r for r in read_jsonl(metrics) if r.get("step", 0) <= step])
    return checkpoint


def load_side_state(checkpoint: Path, rollout) -> None:
    """Restore the AQN controller from a checkpoint (TRL restores adapters, optimizer, scheduler, RNG)."""
    path = Path(checkpoint) / SIDE_STATE
    if rollout.aqn is None:
        return
    if not path.exists():
        raise UserError(f"{checkpoint} has no {SIDE_STATE} (written by the kit at every save): "
                        "it was not written by `qerl train`; start a new run")
    state = json.loads(path.read_text())
    rollout.aqn.load_state_dict(state["aqn"])


# ----------------------------------------------------------------------------- summary
def summarize(rows: list[dict], window: int = 10) -> dict:
    """First/last-window means of the learning metrics and the run's time split."""
    def mean(key, part):
        values = [r[key] for r in part if isinstance(r.get(key), (int, float))]
        return sum(values) / len(values) if values else None

    head, tail = rows[:window], rows[-window:]
    totals = {k: sum(r.get(k) or 0.0 for r in rows) for k in ("rollout_seconds", "train_seconds", "step_seconds")}
    learning = ("reward", "accuracy", "format_rate", "entropy", "completion_length", "logprob_mismatch", "sigma")
    return {
        "steps": len(rows),
        "first": {k: mean(k, head) for k in learning},
        "last": {k: mean(k, tail) for k in learning},
        "window": window,
        "reward_errors": sum(r.get("reward_errors") or 0 for r in rows),
        "seconds": totals,
        "rollout_share": totals["rollout_seconds"] / totals["step_seconds"] if totals["step_seconds"] else None,
        "median_step_seconds": _median([r.get("step_seconds") for r in rows]),
        "median_rollout_tokens_per_s": _median([r.get("rollout_tokens_per_s") for r in rows]),
        "peak_memory_gb": max((r.get("peak_memory_gb") or 0.0 for r in rows), default=None),
    }


def _median(values):
    values = sorted(v for v in values if isinstance(v, (int, float)))
    return values[len(values) // 2] if values else None


def write_summary(out: Path, config, diverged_at_step: int | None = None) -> dict:
    from qerl_lib.io import provenance

    rows = read_jsonl(Path(out) / "metrics.jsonl") if (Path(out) / "metrics.jsonl").exists() else []
    summary = {"preset": config.preset, "mode": config.mode, **summarize(rows), "diverged_at_step": diverged_at_step,
               "provenance": provenance()}
    write_json_atomic(Path(out) / "summary.json", summary)
    return summary

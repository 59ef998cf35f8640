"""Per-step metrics, progress line and checkpoints (side state, completion marker, resume) for QeRL training.

After every optimizer step TRL calls ``log`` with the averages of what it and the kit recorded during the
step. For each step that carried a rollout, `RunMetrics.on_log` turns that into one JSON line in
``OUT/metrics.jsonl`` (rewritten atomically, so a reader or a resumed run never sees a torn line) with plain
key names, adds the wall-clock split and peak memory, and prints one line under a tqdm bar. With μ > 1 a
rollout serves μ steps; the steps without one write no line (TRL logs no ``reward`` for them).

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
is_ratio_mean, is_ratio_min, is_ratio_max, is_truncated_rate   e^Δ: capped mean, uncapped min/max, share > cap
rollout_tokens, rollout_tokens_per_s                 completion tokens sampled and engine throughput
rollout_seconds, train_seconds, step_seconds         time split: engine (the slowest process's, when several) /
                                                     everything else / whole step
peak_memory_gb, memory_kind                          CUDA: peak allocated in the step (the engine's remappable KV
                                                     cache, outside PyTorch's allocator, counted during the rollout);
                                                     CPU: process peak RSS
kv_cache_gb                                          the engine's KV cache during the step's rollout
base_weights_gb, lora_gb, grads_gb, optimizer_gb     the step's fixed memory (`memory_accounting`)

Crash-proof checkpoints
-----------------------
transformers writes ``checkpoint-N`` file by file, and its ``get_last_checkpoint`` picks the highest N
even when the process died half-way through writing it. Here a checkpoint counts only once its
completion marker ``qerl_state.json`` exists: `RunMetrics.on_save` writes it last, after every file of
the folder (and the folder itself) has been fsynced, atomically (temp + rename), listing each file's size.
`last_complete_checkpoint` picks the newest checkpoint whose marker is present and whose files still
have the recorded sizes. transformers would delete older checkpoints (``save_total_limit``) *before* the
new one is marked, so `RunMetrics` takes that rotation over and deletes old checkpoints only after the
new one is complete. On ``--resume`` `prepare_output` continues from the newest complete checkpoint,
removes the incomplete ones after it, and starts the run over from step 0 when there is none.
"""

from __future__ import annotations

import json
import math
import re
import resource
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import TrainerCallback

from qerl_lib.errors import UserError
from qerl_lib.io import (append_jsonl_atomic, fsync_dir, fsync_tree, read_jsonl, refuse_overlap, write_json_atomic,
                         write_jsonl_atomic)

RENAMES = {
    "rewards/accuracy/mean": "accuracy", "rewards/format/mean": "format_rate",
    "frac_reward_zero_std": "zero_std_groups", "completions/mean_length": "completion_length",
    "completions/clipped_ratio": "truncated_rate", "clip_ratio/low_mean": "clip_ratio_low",
    "clip_ratio/high_mean": "clip_ratio_high", "clip_ratio/region_mean": "clip_ratio",
}
KIT_KEYS = ("sigma", "aqn_stage", "noise_rms", "logprob_mismatch", "logprob_mismatch_max", "mismatch_kl",
            "is_ratio_mean", "is_ratio_min", "is_ratio_max", "is_truncated_rate", "rollout_tokens",
            "rollout_tokens_per_s", "rollout_seconds", "kv_cache_gb")
MEMORY_KEYS = ("base_weights_gb", "lora_gb", "grads_gb", "optimizer_gb")  # memory_accounting()
METRIC_KEYS = ("step", "epoch", "learning_rate", "loss", "grad_norm", "reward", "reward_std", "accuracy",
               "format_rate", "reward_errors", "zero_std_groups", "entropy", "completion_length", "truncated_rate",
               "clip_ratio_low", "clip_ratio_high", "clip_ratio", *KIT_KEYS, "train_seconds", "step_seconds",
               "peak_memory_gb", "memory_kind", *MEMORY_KEYS)
SIDE_STATE = "qerl_state.json"  # written last into every checkpoint folder: AQN state + completion marker
PICKLED_ARGS = "training_args.bin"  # transformers' torch.save of its TrainingArguments, removed from checkpoints
RUN_FILES = ("run.json", "metrics.jsonl", "checkpoints", "adapter", "summary.json")  # what a run writes into OUT


class RunMetrics(TrainerCallback):
    """Writes ``metrics.jsonl``, shows progress, and marks each checkpoint complete (AQN state + file sizes,
    written last). It also applies ``save_total_limit`` itself: at train begin it takes the value over from
    the trainer's args (setting theirs to None), and deletes old checkpoints only after the new one is marked."""

    def __init__(self, out_dir: Path, config, reward_funcs: list, rollout, quiet: bool = False):
        self.path = Path(out_dir) / "metrics.jsonl"
        self.config, self.reward_funcs, self.rollout, self.quiet = config, reward_funcs, rollout, quiet
        self.bar = None
        self._step_start = None
        self._step_seconds = float("nan")
        self.diverged_at: int | None = None  # the step after which a trainable weight was non-finite
        self.keep_checkpoints: int | None = None  # save_total_limit, applied in on_save after the marker

    # ---- step timing -------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, **kwargs):
        # transformers rotates checkpoints before on_save marks the new one complete; rotate here instead
        self.keep_checkpoints, args.save_total_limit = args.save_total_limit, None
        if not self.quiet and state.is_world_process_zero:
            from qerl_lib.progress import progress_bar

            self.bar = progress_bar(total=state.max_steps, initial=state.global_step, desc=f"{self.config.arm_label}",
                                    unit="step", dynamic_ncols=True)

    def on_step_begin(self, args, state, control, **kwargs):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        if self.rollout is not None:
            self.rollout.rollout_peak_bytes = 0
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
        # a row without rollout_seconds (no engine in the loop) counts 0 s in it
        row["rollout_seconds"] = rollout_s = row.get("rollout_seconds") or 0.0
        row["step_seconds"] = self._step_seconds
        row["train_seconds"] = self._step_seconds - rollout_s
        row["peak_memory_gb"], row["memory_kind"] = _peak_memory(getattr(self.rollout, "rollout_peak_bytes", 0))
        if kwargs.get("model") is not None:
            row.update(memory_accounting(kwargs["model"], kwargs.get("optimizer")))
        row = {k: _plain(v) for k, v in row.items()}
        append_jsonl_atomic(self.path, row)
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)
            self.bar.write(progress_line(row, state.max_steps))
            if row["reward_errors"]:
                last = [f"{f.__name__}: {f.last_error}" for f in self.reward_funcs if getattr(f, "last_error", None)]
                self.bar.write(f"  {row['reward_errors']} completion(s) whose reward raised scored 0; last: {last[-1:]}")

    def on_save(self, args, state, control, **kwargs):
        # Every process writes its own files into the checkpoint (rng_state_K.pth) and then calls on_save;
        # the marker lists the files' sizes, so it waits until all of them are written.
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()
        if not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        # transformers pickles its TrainingArguments there; nothing reads it back (run.json keeps the config),
        # and the kit's checkpoints hold no pickle but the optimizer / scheduler / RNG state, loaded
        # weights_only
        (folder / PICKLED_ARGS).unlink(missing_ok=True)
        aqn = self.rollout.aqn
        mark_checkpoint_complete(folder, {"step": state.global_step,
                                          "aqn": aqn.state_dict() if aqn is not None else None})
        if self.keep_checkpoints:
            rotate_checkpoints(folder.parent, self.keep_checkpoints)

    def on_train_end(self, args, state, control, **kwargs):
        if self.bar is not None:
            self.bar.close()


def trainable_weights_finite(model) -> bool:
    """True when every trainable parameter is finite: their largest absolute value, taken by multi-tensor kernels
    (a NaN or an infinity anywhere makes it non-finite), and one device sync. A kernel pair per tensor instead
    cost ~40 ms of launches a step at 14B (dev/LOG.md 82)."""
    params = [p.detach() for p in model.parameters() if p.requires_grad]
    if not params:
        return True
    return bool(torch.isfinite(torch.nn.utils.get_total_norm(params, norm_type=float("inf"))))


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


def memory_accounting(model, optimizer=None) -> dict[str, float]:
    """What a training step holds from start to end, in GB (1e9 bytes, like ``peak_memory_gb``), counted
    from the tensors themselves (shared storages, e.g. tied embeddings, once):

    * ``base_weights_gb``: the frozen parameters and the buffers (NVFP4 codes and scales, or bf16 weights);
    * ``lora_gb``: the trainable parameters; ``grads_gb``: their gradients during the backward (one per
      trainable parameter, in its dtype: counted from the parameters, as they are freed between steps);
    * ``optimizer_gb``: the optimizer's state tensors (AdamW: two per trainable parameter).

    Beside them the step holds, for a while, the rollout's KV cache (``kv_cache_gb``, freed before the
    backward with ``release_engine_cache``) and the activations; ``peak_memory_gb`` is the measured
    maximum of all of it.
    """
    from qerl_lib.models.loader import storage_bytes

    frozen = [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
    trainable = [p for p in model.parameters() if p.requires_grad]
    state = [t for group in (optimizer.state.values() if optimizer is not None else ())
             for t in group.values() if isinstance(t, torch.Tensor)]
    return {"base_weights_gb": storage_bytes(frozen, set()) / 1e9,
            "lora_gb": storage_bytes(trainable, set()) / 1e9,
            "grads_gb": sum(p.numel() * p.element_size() for p in trainable) / 1e9,
            "optimizer_gb": storage_bytes(state, set()) / 1e9}


def _peak_memory(rollout_peak_bytes: int = 0) -> tuple[float, str]:
    """The step's peak: PyTorch's, or the rollout phase's with the engine's remappable memory, whichever is higher."""
    if torch.cuda.is_available():
        return max(torch.cuda.max_memory_allocated(), rollout_peak_bytes) / 1e9, "cuda_max_allocated_in_step"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, "cpu_peak_rss_of_process"  # Linux: KiB


def _plain(value):
    if isinstance(value, torch.Tensor):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN; None means "not measured this step"
    return value


# ----------------------------------------------------------------------------- checkpoints and resume
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


def mark_checkpoint_complete(folder: Path, side_state: dict) -> Path:
    """Make ``folder``'s files durable, then write its marker ``qerl_state.json`` (side state + each file's
    size) atomically, last. Until the marker is on disk the checkpoint does not count."""
    folder = Path(folder)
    files = {name: size for name, size in fsync_tree(folder).items() if name != SIDE_STATE}
    write_json_atomic(folder / SIDE_STATE, {**side_state, "files": files})
    fsync_dir(folder)
    return folder / SIDE_STATE


def checkpoint_problem(checkpoint: Path) -> str | None:
    """Why ``checkpoint`` is not a complete checkpoint (None when it is): no or unreadable marker, or a file
    the marker lists that is missing or has another size. Markers without a file list (written before the
    list existed) count as complete."""
    marker = Path(checkpoint) / SIDE_STATE
    if not marker.is_file():
        return f"no {SIDE_STATE} (the run stopped while writing it)"
    try:
        files = json.loads(marker.read_text()).get("files")
    except (ValueError, AttributeError):
        return f"unreadable {SIDE_STATE}"
    for name, size in (files or {}).items():
        path = Path(checkpoint) / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} when the checkpoint was written"
    return None


def checkpoints_by_step(folder: Path) -> list[tuple[int, Path]]:
    """``(N, folder/checkpoint-N)`` for every checkpoint folder, oldest first."""
    folder = Path(folder)
    found = [(int(m.group(1)), p) for p in folder.iterdir() if p.is_dir() and (m := _CHECKPOINT.match(p.name))] \
        if folder.is_dir() else []
    return sorted(found)


def last_complete_checkpoint(folder: Path, report: Callable[[str], None] | None = None) -> Path | None:
    """The newest complete ``checkpoint-N`` in ``folder`` (None when there is none). ``report`` receives one
    line per newer checkpoint skipped as incomplete, and one naming the checkpoint picked."""
    for _, checkpoint in reversed(checkpoints_by_step(folder)):
        problem = checkpoint_problem(checkpoint)
        if problem is None:
            if report is not None:
                report(f"resuming from {checkpoint.name}, the newest complete checkpoint")
            return checkpoint
        if report is not None:
            report(f"skipping {checkpoint.name}: incomplete ({problem})")
    return None


def rotate_checkpoints(folder: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints, and incomplete ones older than the newest
    complete one; return what was deleted. The newest complete checkpoint is never deleted."""
    complete, removed = [], []
    all_checkpoints = checkpoints_by_step(folder)
    for step, checkpoint in all_checkpoints:
        if checkpoint_problem(checkpoint) is None:
            complete.append((step, checkpoint))
    if not complete:
        return removed
    newest = complete[-1][0]
    kept = {c for _, c in complete[-max(keep, 1):]}
    for step, checkpoint in all_checkpoints:
        if checkpoint not in kept and step < newest:
            shutil.rmtree(checkpoint)
            removed.append(checkpoint)
    return removed


def _inputs(config) -> list:
    """The local paths a run reads (model folder, problems file), which OUT must stay clear of."""
    from qerl_lib.models.embedded import EMBEDDED_ALIASES, embedded_model_dir

    model = str(config.model)
    return [embedded_model_dir() if model.lower() in EMBEDDED_ALIASES else model, config.data_path]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


def prepare_output(out: Path, config, resume: bool, report: Callable[[str], None] | None = _stderr):
    """Check OUT for a fresh run or a resume; return the checkpoint to resume from (or None).

    OUT may not be, hold or lie inside the model folder or the problems file. Fresh: OUT must hold none
    of a run's files (``RUN_FILES``; other files are left alone); ``run.json`` (config + provenance) is
    written. Resume: the saved config must equal this one; the run continues from the newest complete
    checkpoint (`last_complete_checkpoint`; ``report`` is told which), incomplete checkpoints after it are
    removed, and ``metrics.jsonl`` is cut back to its step (lines written after it are re-done). With no
    complete checkpoint the run starts over from step 0 in the same folder.
    """
    from qerl_lib.io import provenance

    out = Path(out)
    refuse_overlap(out, _inputs(config))
    run_json, metrics = out / "run.json", out / "metrics.jsonl"
    if not resume:
        held = [name for name in RUN_FILES if (out / name).exists()]
        if held == ["run.json"]:
            raise UserError(f"{out} holds the run.json of a run that has not finished a step (it may be loading "
                            f"its model now): pass --resume to continue it, delete {run_json} if that run stopped, "
                            "or choose another --out")
        if held:
            raise UserError(f"{out} already holds a run ({', '.join(held)}): pass --resume to continue it, "
                            "or choose another --out")
        write_json_atomic(run_json, {"config": config.to_dict(), "provenance": provenance()})
        return None
    if not run_json.exists():
        raise UserError(f"nothing to resume in {out} (no run.json): start the run without --resume")
    from qerl_lib.train.presets import RECORDED_WHEN_ON

    saved = read_run_config(run_json, fix="choose another --out")
    mine = json.loads(json.dumps(config.to_dict()))  # tuples -> lists, as saved
    diff = {k: (saved.get(k), v) for k, v in mine.items() if k != "device" and saved.get(k) != v}
    diff.update({k: (saved.get(k, False), mine.get(k, False)) for k in RECORDED_WHEN_ON
                 if saved.get(k, False) != mine.get(k, False)})  # a switch recorded only when on
    if diff:
        saved_pad, pad = diff.get("pad_to_multiple_of", (None, None))
        hint = ""  # a run saved unpadded, e.g. before the Qwen2.5 presets padded to 64
        if saved_pad is False and pad:
            hint = f" (saved without padding, now {pad}: add --pad-to-multiple-of 0)"
        raise UserError(f"--resume with different settings than the saved run (setting: (saved, now)) {diff}: "
                        f"resume with the same preset, mode, steps and seed{hint}")
    folder = out / "checkpoints"
    checkpoint = last_complete_checkpoint(folder, report)
    step = int(checkpoint.name.rsplit("-", 1)[1]) if checkpoint is not None else 0
    for n, stale in checkpoints_by_step(folder):
        if n > step:  # incomplete (a complete one would have been picked): the resumed run writes it again
            shutil.rmtree(stale)
    if checkpoint is None and report is not None:
        report(f"no complete checkpoint in {folder}: starting the run over from step 0")
    if metrics.exists():
        write_jsonl_atomic(metrics, [r for r in read_jsonl(metrics) if r.get("step", 0) <= step])
    return checkpoint


def discard_unstarted_run(out: Path) -> None:
    """Remove the ``run.json`` that `prepare_output` wrote for a fresh run that failed before its trainer was
    built (nothing else of a run is in OUT then), so the same OUT can be used again."""
    out = Path(out)
    if not any((out / name).exists() for name in RUN_FILES if name != "run.json"):
        (out / "run.json").unlink(missing_ok=True)


def read_run_config(run_json: Path, fix: str) -> dict:
    """The saved config of a run's ``run.json`` (what ``prepare_output`` writes); a one-line `UserError` ending in
    ``fix`` for a file `qerl train` did not write."""
    try:
        saved = json.loads(Path(run_json).read_text())
    except (ValueError, UnicodeDecodeError):
        saved = None
    if not isinstance(saved, dict) or not isinstance(saved.get("config"), dict):
        raise UserError(f"{run_json} is not a run.json written by `qerl train`: {fix}")
    return saved["config"]


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
        "steps": len(rows),  # one metrics row per rollout; write_summary replaces it with optimizer steps
        "rollouts": len(rows),
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
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.median(values) if values else None


def write_summary(out: Path, config, diverged_at_step: int | None = None, steps_done: int | None = None) -> dict:
    """summary.json of a finished run. ``steps_done``: optimizer steps run (the trainer's global step); with
    μ > 1 a rollout serves μ steps, so the metrics have fewer rows than the run has steps."""
    from qerl_lib.io import provenance

    rows = read_jsonl(Path(out) / "metrics.jsonl") if (Path(out) / "metrics.jsonl").exists() else []
    summary = {"preset": config.preset, "mode": config.mode, **summarize(rows), "diverged_at_step": diverged_at_step,
               "provenance": provenance()}
    if steps_done is not None:
        summary["steps"] = int(steps_done)
    write_json_atomic(Path(out) / "summary.json", summary)
    return summary

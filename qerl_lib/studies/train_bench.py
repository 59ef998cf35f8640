"""`qerl bench train`: one GRPO step as RL runs it, measured through the real trainer.

Each case builds a `TrainConfig` from the Qwen2.5 preset of its size and runs `train.grpo.train`,
the code path of `qerl train`, for a few steps: a rollout with the kit's engine (LoRA on, AQN in
mode qerl), scoring, the loss forward and backward, and the optimizer step. Only the inputs are
synthetic: random weights of the real architecture (``model = "random:qwen2.5-7b"``; NVFP4 bases
get random codes and block scales, NF4 bases are quantized by bitsandbytes from random bf16), random
-token prompts (``data = "random"``) and a synthetic reward with spread inside each group. Random
weights rarely emit end-of-sequence, so every completion runs to ``gen_len``: the step is the
paper's setting at its maximum length. ``workload="gsm8k-like"`` (``--workload``) stops each row at its
own length instead, drawn afresh every step from GSM8K's solution lengths scaled to ``gen_len``
(`bench.workloads`): the uneven, step-to-step changing lengths an RL trainer sees, which a fixed-length
step hides (each new padded length costs the attention's per-shape set-up again).

Each case runs in its own process (a case that runs out of memory becomes a row with its ``error``,
and leaves nothing behind for the next), with PyTorch's allocator in ``expandable_segments`` mode unless
``PYTORCH_CUDA_ALLOC_CONF`` is already set (`qerl train` leaves the allocator as PyTorch sets it; what the mode
changes in a step is in dev/LOG.md section 118). The row reports the median over the steps after the first
(the first one captures graphs and warms the allocator) of the trainer's own per-step metrics
(``metrics.jsonl``): ``rollout_s`` (engine), ``train_s`` (everything else in the step), ``step_s``, what the
peak is made of (``base_weights_gib``, ``lora_gib``, ``grads_gib``, ``optimizer_gib``, ``kv_cache_gib``),
``completion_len``, and completion tokens per second of the whole step; ``peak_gib`` is the largest of those
steps' peak allocated GPU memory; ``rollout_s_steps`` and ``train_s_steps`` keep every measured step's value.

Mode lora can also run its rollouts with the adapters merged into a copy of the bf16 base (``rollout_lora_merge``,
``--rollout-lora-merge off,on``; table mode ``lora+m``), as TRL does before each weight sync to vLLM: such rows get
their own reference column, ``speedup_vs_lora_merged``, while ``speedup_vs_lora`` stays against the unmerged row.

Where this differs from the paper's Tables 3 and 5-8: the paper averages over the first 30 steps of
a real run (completions of varying length, vLLM for rollouts); here, with the default workload "fixed",
every step generates the full ``gen_len`` tokens, so a step here is at least as long as the paper's.
The paper's numbers are printed beside ours, labelled as the paper's (`PAPER`).

Resuming: a case can take up to half an hour, so ``--json`` is rewritten (atomically) after every case with the
record so far, and a rerun of the same command continues where the last one stopped. A case is known by the fields
that define what it runs (`CASE_FIELDS`: every `TrainCase` field, with the padding the trainer really used), which
each row records; `resume_rows` keeps the rows of an existing ``--json`` that ran without error, `run_bench` skips
their cases and runs the rest (a row with an error runs again). A file is resumed only if every one of its rows is
a case of this command: anything else (another command's rows, another settings' cases, not a bench-train file at
all) is refused rather than mixed in or silently replaced (``--force`` starts over).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from qerl_lib.bench.workloads import WORKLOADS, sample_lengths
from qerl_lib.errors import UserError
from qerl_lib.io import RESUME_FIX, resumable_record
from qerl_lib.train.checkpointing import check_layer_count

MODES = ("lora", "qlora", "nvfp4", "qerl")
# The paper's end-to-end numbers (QeRL Tab. 3: step-time speedup over 16-bit LoRA, 256 + 2048 tokens, first 30
# steps; Tab. 8: 32B QeRL seconds per step with gradient checkpointing). Keyed (model, mode, batch).
PAPER = {
    ("qwen2.5-7b", "qlora", 2): "x0.8 vs lora", ("qwen2.5-7b", "qlora", 4): "x0.8 vs lora",
    ("qwen2.5-7b", "qlora", 8): "x0.7 vs lora",
    ("qwen2.5-7b", "qerl", 2): "x1.5 vs lora", ("qwen2.5-7b", "qerl", 4): "x1.4 vs lora",
    ("qwen2.5-7b", "qerl", 8): "x1.2 vs lora",
    ("qwen2.5-14b", "qlora", 2): "x0.9 vs lora", ("qwen2.5-14b", "qlora", 4): "x0.7 vs lora",
    ("qwen2.5-14b", "qlora", 8): "x0.7 vs lora",
    ("qwen2.5-14b", "qerl", 2): "x1.4 vs lora", ("qwen2.5-14b", "qerl", 4): "x1.2 vs lora",
    ("qwen2.5-14b", "qerl", 8): "x1.2 vs lora",
    ("qwen2.5-32b", "qerl", 2): "10.6 s/step", ("qwen2.5-32b", "qerl", 8): "12.2 s/step",
}


@dataclass(frozen=True)
class TrainCase:
    model: str = "qwen2.5-7b"  # an architecture of data/configs/
    mode: str = "qerl"
    batch: int = 8  # completions per step (over all `groups`)
    prompt_len: int = 256
    gen_len: int = 2048
    steps: int = 3
    lora_rank: int = 32
    gradient_checkpointing: bool = True
    checkpoint_layers: int | None = None  # with checkpointing: decoder layers that recompute (None: all)
    mismatch_forward: bool = False
    micro_batch: int | None = None  # None: each process's share of the batch in one forward/backward
    groups: int = 1  # prompts per step (the batch is groups x completions per prompt)
    num_gpus: int = 1  # data-parallel processes (`accelerate launch`), at most `groups`
    device: str = "cuda"
    num_iterations: int = 1  # μ: policy updates per rollout (the bench's cases: 1; the GSM8K presets: 4)
    rollout_batch: int | None = None  # rows the engine generates at once (None: the whole batch)
    rollout_lora_merge: bool = False  # mode lora: rollouts with the adapters merged into a copy (engine/merged.py)
    # completion lengths: "fixed" (every row gen_len: random weights rarely sample a stop token) or "gsm8k-like"
    # (each row stops at its own drawn length, bench/workloads.py: the uneven, step-to-step varying lengths of RL)
    workload: str = "fixed"
    # the trainer's padded lengths in classes (TrainConfig.pad_to_multiple_of): None, the preset's (64); 0, the longest
    pad_to_multiple_of: int | None = None
    preset: str | None = None  # set by `from_preset`: the preset whose settings the case runs

    @classmethod
    def from_preset(cls, model: str, mode: str, steps: int = 3, num_iterations: int | None = None,
                    device: str = "cuda", rollout_lora_merge: bool = False) -> "TrainCase":
        """The case that runs the GSM8K preset of ``model``'s size as `qerl train` would (its prompts x
        completions per step, lengths, micro-batch, μ, LoRA rank and rollout rows); only the weights,
        prompts and reward are synthetic. ``num_iterations`` overrides the preset's μ (the peak memory
        does not depend on it, the step time grows with it). ``rollout_lora_merge``: mode lora with the merged
        rollout, at the rows the preset keeps beside the merged copy (`train.memory`)."""
        from qerl_lib.train.presets import make_config

        preset = _preset_name(model)
        p = make_config(preset, mode=mode, rollout_lora_merge=rollout_lora_merge or None)
        return cls(model=model, mode=mode, batch=p.completions_per_step, prompt_len=p.max_prompt_tokens,
                   gen_len=p.max_completion_length, steps=steps, lora_rank=p.lora_rank,
                   gradient_checkpointing=p.gradient_checkpointing, micro_batch=p.micro_batch,
                   groups=p.prompts_per_step, device=device, num_iterations=num_iterations or p.num_iterations,
                   rollout_batch=p.rollout_batch, preset=preset, rollout_lora_merge=rollout_lora_merge)

    def __post_init__(self):
        if self.mode not in MODES:
            raise UserError(f"mode {self.mode!r}: use one of {MODES}")
        if self.steps < 2:
            raise UserError(f"steps={self.steps}: the first step warms up, so at least 2 are needed")
        if min(self.batch, self.prompt_len, self.gen_len, self.lora_rank, self.groups, self.num_gpus,
               self.num_iterations, self.rollout_batch or 1) < 1:
            raise UserError("batch, prompt_len, gen_len, lora_rank, groups, num_gpus, num_iterations and "
                            "rollout_batch must be >= 1")
        check_layer_count(self.checkpoint_layers, self.gradient_checkpointing)
        if self.workload not in WORKLOADS:
            raise UserError(f"workload {self.workload!r}: use one of {', '.join(WORKLOADS)}")
        if self.rollout_lora_merge and self.mode != "lora":
            raise UserError(f"rollout_lora_merge with mode {self.mode}: only mode lora's bf16 base can merge its "
                            "adapters for the rollout")
        if self.batch % self.groups or self.num_gpus > self.groups or self.groups % self.num_gpus:
            raise UserError(f"batch {self.batch} over {self.groups} group(s) on {self.num_gpus} GPU(s): the groups "
                            "must divide the batch, and the GPUs the groups")


def synthetic_reward(prompts, completions, completion_ids, **kwargs) -> list[float]:
    """A reward with spread inside every group (a function of the sampled ids), so the loss has a gradient."""
    return [float(sum(ids) % 7) / 6.0 for ids in completion_ids]


def _preset_name(model: str) -> str:
    size = model.removeprefix("qwen2.5-") if model.startswith("qwen2.5-") else "7b"
    return f"qwen2.5-{size}-gsm8k"  # another architecture (a config path) takes the 7B preset's settings


def padding_of(case: TrainCase) -> int | None:
    """The multiple the case's trainer pads to (its own, else its preset's); None: to each batch's longest."""
    from qerl_lib.train.presets import PRESETS

    padding = case.pad_to_multiple_of
    return (PRESETS[_preset_name(case.model)].pad_to_multiple_of if padding is None else padding) or None


def case_config(case: TrainCase):
    """The `TrainConfig` of one case: the Qwen2.5 preset of its size with synthetic inputs."""
    from qerl_lib.train.presets import make_config

    preset = _preset_name(case.model)
    micro = case.micro_batch or case.batch // case.num_gpus
    cpu = {"optim": "adamw_torch"} if case.device == "cpu" else {}  # the presets' 8-bit AdamW needs a GPU
    return make_config(preset, mode=case.mode, steps=case.steps, seed=0, model=f"random:{case.model}", data="random",
                       n_train=case.steps * case.groups, prompts_per_step=case.groups,
                       num_generations=case.batch // case.groups, micro_batch=micro,
                       num_iterations=case.num_iterations, max_prompt_tokens=case.prompt_len, max_completion_length=case.gen_len,
                       lora_rank=case.lora_rank, lora_alpha=2 * case.lora_rank,
                       gradient_checkpointing=case.gradient_checkpointing, checkpoint_layers=case.checkpoint_layers,
                       mismatch_forward=case.mismatch_forward,
                       mask_truncated_completions=False, accuracy_weight=0.0, format_weight=0.0,
                       save_steps=10 * case.steps, device=case.device,
                       rollout_batch=case.rollout_batch or case.batch, rollout_lora_merge=case.rollout_lora_merge,
                       pad_to_multiple_of=case.pad_to_multiple_of,
                       **cpu)


def completion_budgets(case: TrainCase):
    """The rollouts' per-row token budgets of ``case`` (`grpo.EngineRollout`): None for "fixed", else a function
    drawing ``case.workload``'s lengths afresh for every rollout (seeded by step and rollout number)."""
    if case.workload == "fixed":
        return None

    def budgets(rows: int, step: int, call: int) -> list[int]:
        return sample_lengths(case.workload, rows, case.gen_len, seed=1000 * step + call)

    return budgets


def run_case_here(case: TrainCase, out_dir: str | Path) -> dict:
    """Run one case in this process and return its row (the trainer's metrics after the first step)."""
    from qerl_lib.io import read_jsonl
    from qerl_lib.train.grpo import train

    out_dir = Path(out_dir)
    if not train(case_config(case), out_dir, extra_rewards=[("synthetic", synthetic_reward, 1.0)], quiet=True,
                 completion_budgets=completion_budgets(case)):
        return {}  # not the first process of an `accelerate launch`: that one reports
    rows = [r for r in read_jsonl(out_dir / "metrics.jsonl") if r.get("step_seconds") is not None][1:]
    if not rows:
        raise RuntimeError("the trainer logged no step after the first")

    def median(key):
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return statistics.median(values) if values else None

    step_s = median("step_seconds")
    peak_gb = max((r["peak_memory_gb"] for r in rows if r.get("peak_memory_gb")), default=None)
    completion_len = median("completion_length")
    return {"rollout_s": median("rollout_seconds"), "train_s": median("train_seconds"), "step_s": step_s,
            # the trainer logs GB (1e9 bytes): the row keeps it and reports GiB (2^30), like the rollout bench
            "peak_gb": peak_gb, "peak_gib": peak_gb * 1e9 / 2**30 if peak_gb is not None else None,
            # what the peak is made of (train.metrics.memory_accounting and the rollout's KV cache), in GiB
            **{key.replace("_gb", "_gib"): (median(key) * 1e9 / 2**30 if median(key) is not None else None)
               for key in ("base_weights_gb", "lora_gb", "grads_gb", "optimizer_gb", "kv_cache_gb")},
            "completion_len": completion_len,
            "tokens_per_s": (completion_len * case.batch / step_s) if step_s and completion_len else None,
            "steps_measured": len(rows),
            # every measured step, so the spread behind each median is on record
            "rollout_s_steps": [r.get("rollout_seconds") for r in rows], "train_s_steps": [r.get("train_seconds") for r in rows]}


# The fields that say what a case runs: every TrainCase field. Each row starts with them (`case_fields`), so a row
# of an earlier `--json` can be matched to the case that made it (`resume_rows`).
CASE_FIELDS = tuple(f.name for f in fields(TrainCase))
_ABSENT = object()  # a field a row does not have (another command's row, or an older version's): matches no case


def case_fields(case: TrainCase) -> dict:
    """The case as its row records it: its fields, with the padding the trainer uses (`padding_of`) in place of
    None ("the preset's"), so a case that leaves the padding to the preset and one that names the same value are
    one case."""
    return {**asdict(case), "pad_to_multiple_of": padding_of(case)}


def case_key(case_or_row: TrainCase | dict) -> tuple:
    """What identifies a case: the values of `CASE_FIELDS`, taken from a case or from a row it wrote."""
    values = case_fields(case_or_row) if isinstance(case_or_row, TrainCase) else case_or_row
    return tuple(values.get(name, _ABSENT) for name in CASE_FIELDS)


def resume_rows(path: str | Path, cases: list[TrainCase]) -> tuple[list[dict], list[dict]]:
    """The rows of an existing ``--json`` that ``cases`` need not run again, and the provenance of the runs that
    measured them (empty when nothing is kept); ``([], [])`` when ``path`` does not exist.

    Kept: each case's first row without an error (a row with one is dropped, so its case runs again). Refused with
    a one-line `UserError` naming ``--force``: a file that is not a `qerl bench train` record, and one holding a row
    that is none of ``cases`` (written with other flags or by another command): resuming it would mix rows of two
    different benchmarks in one table, and replacing it would destroy rows the user may still want."""
    path = Path(path)
    if not path.exists():
        return [], []
    fix = RESUME_FIX
    doc, runs = resumable_record(path, "qerl bench train")
    wanted = {case_key(c): c for c in cases}
    foreign = [r for r in doc["rows"] if case_key(r) not in wanted]
    if foreign:
        raise UserError(f"--json {path} holds {len(foreign)} row(s) of cases this command does not run "
                        f"({_difference(foreign[0], cases)}): {fix}")
    kept: dict[tuple, dict] = {}
    for row in doc["rows"]:
        if "error" in row and row["error"] is None:
            kept.setdefault(case_key(row), row)
    return list(kept.values()), runs if kept else []


def _difference(row: dict, cases: list[TrainCase]) -> str:
    """How ``row`` differs from the nearest of ``cases``, e.g. "the first: steps 3 where this command runs 4"."""
    missing = [name for name in CASE_FIELDS if name not in row]
    if missing:
        return f"the first lacks {', '.join(missing[:3])}: another command's or an older version's row"
    if not cases:
        return "this command runs no case"
    key = case_key(row)
    nearest = min((case_key(c) for c in cases), key=lambda k: sum(a != b for a, b in zip(k, key)))
    diffs = [f"{name} {a!r} where this command runs {b!r}" for name, a, b in zip(CASE_FIELDS, key, nearest) if a != b]
    return "the first: " + ", ".join(diffs[:3])


def run_case(case: TrainCase, timeout_s: float = 1800) -> dict:
    """One case in a fresh process; an out-of-memory or any other failure becomes the row's ``error``."""
    row = {**case_fields(case), "paper": PAPER.get((case.model, case.mode, case.batch))}
    with tempfile.TemporaryDirectory(prefix="qerl-bench-train-") as tmp:
        spec, result = Path(tmp) / "case.json", Path(tmp) / "row.json"
        spec.write_text(json.dumps(asdict(case)))
        env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF",
                                                                       "expandable_segments:True")}
        command = [sys.executable, "-m", "qerl_lib.studies.train_bench", str(spec), str(result), str(Path(tmp) / "run")]
        if case.num_gpus > 1:
            from qerl_lib.paths import DATA_DIR

            command[1:3] = ["-m", "accelerate.commands.launch", "--config_file",
                            str(DATA_DIR / "accelerate" / "one_node.yaml"), "--num_processes", str(case.num_gpus),
                            *(["--cpu"] if case.device == "cpu" else []), "-m", "qerl_lib.studies.train_bench"]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired:
            return {**row, "error": f"timed out after {timeout_s:.0f} s"}
        if proc.returncode != 0 or not result.is_file():
            lines = [ln for ln in (proc.stderr or "").strip().splitlines() if ln.strip()]
            error = next((ln for ln in reversed(lines) if "OutOfMemoryError" in ln or "out of memory" in ln),
                         lines[-1] if lines else f"exit {proc.returncode}")
            return {**row, "error": error.strip()[:300]}
        return {**row, **json.loads(result.read_text()), "error": None}


def run_bench(cases: list[TrainCase], progress: bool = True, kept: list[dict] | None = None, checkpoint=None) -> dict:
    """Every case, one process each; the record `qerl bench train --json` writes (with provenance).

    ``kept``: rows of an earlier run (`resume_rows`); a case with a row there is not run again, its row takes the
    case's place. ``checkpoint(record)``, when given, is called after every case that ran with the record so far:
    the rows of every case done (kept or run), in the cases' order, with their speedups among themselves and this
    run's provenance, the same document as the final one; the CLI writes it to ``--json`` so a crash keeps every
    finished case. The rows come out in the cases' order whether or not some were kept, so a resumed run's record
    is the one an uninterrupted run gives."""
    from qerl_lib.io import provenance

    prov = provenance()  # at the start: a checkpoint needs it (it reads the GPU's properties, no CUDA context)
    earlier = {case_key(row): row for row in kept or ()}
    done = {i: earlier[case_key(case)] for i, case in enumerate(cases) if case_key(case) in earlier}
    todo = [i for i in range(len(cases)) if i not in done]

    def record() -> dict:
        rows = [done[i] for i in sorted(done)]
        add_speedups(rows)
        return {"rows": rows, "provenance": prov}

    for n, i in enumerate(todo):
        case = cases[i]
        if progress:
            recompute = "" if case.checkpoint_layers is None else f", {case.checkpoint_layers} layers recompute"
            print(f"[{n + 1}/{len(todo)}] {case.model} {case.mode} batch {case.batch}, {case.prompt_len} + "
                  f"{case.gen_len} tokens{recompute} ...", flush=True)
        done[i] = r = run_case(case)
        if progress:
            print("   " + (f"error: {r['error']}" if r["error"] else
                           f"step {r['step_s']:.2f} s (rollout {r['rollout_s']:.2f} s), peak {r['peak_gib']:.1f} GiB"),
                  flush=True)
        if checkpoint is not None:
            checkpoint(record())
    return record()


def add_speedups(rows: list[dict]) -> None:
    """Each row's step-time speedup over the lora row of the same model, batch, lengths, padding and GPUs (the paper's
    baseline: adapters unmerged), over the merged-rollout lora row (``speedup_vs_lora_merged``, where one ran),
    and over the one-GPU row of the same case (in place)."""
    def key(r, *extra):
        return (r["model"], r["batch"], r.get("groups", 1), r["prompt_len"], r["gen_len"], r["gradient_checkpointing"],
                r.get("checkpoint_layers"), r.get("workload", "fixed"), r.get("pad_to_multiple_of"), *extra)

    def lora_steps(merged: bool) -> dict:
        return {key(r, r.get("num_gpus", 1)): r["step_s"] for r in rows
                if r["mode"] == "lora" and bool(r.get("rollout_lora_merge")) == merged and not r.get("error")}

    lora, lora_merged = lora_steps(False), lora_steps(True)
    one = {key(r, r["mode"], bool(r.get("rollout_lora_merge"))): r["step_s"] for r in rows
           if r.get("num_gpus", 1) == 1 and not r.get("error")}
    for r in rows:
        ok = not r.get("error") and r.get("step_s")
        gpus = key(r, r.get("num_gpus", 1))
        ref, merged = lora.get(gpus), lora_merged.get(gpus)
        single = one.get(key(r, r["mode"], bool(r.get("rollout_lora_merge"))))
        r["speedup_vs_lora"] = ref / r["step_s"] if ref and ok else None
        r["speedup_vs_lora_merged"] = merged / r["step_s"] if merged and ok else None
        r["speedup_vs_1gpu"] = single / r["step_s"] if single and ok else None


COLUMNS = (("model", "", 12), ("mode", "", 8), ("batch", "d", 5), ("num_gpus", "d", 8), ("gen_len", "d", 7),
           ("checkpoint_layers", "d", 17),
           ("num_iterations", "d", 14), ("pad_to_multiple_of", "d", 18),
           ("completion_len", ".0f", 14),
           ("rollout_s", ".2f", 9), ("train_s", ".2f", 8), ("step_s", ".2f", 7), ("peak_gib", ".1f", 8),
           ("tokens_per_s", ".0f", 12), ("speedup_vs_lora", ".2f", 15), ("speedup_vs_lora_merged", ".2f", 22),
           ("speedup_vs_1gpu", ".2f", 15),
           ("paper", "", 13), ("error", "", 5))


def format_bench(record: dict) -> str:
    """Fixed-width table of the rows (the paper's column is the paper's number, see `PAPER`; mode ``lora+m``: the
    rollout ran with the adapters merged)."""
    from qerl_lib.bench.table import format_table

    rows = [{**r, "mode": r["mode"] + ("+m" if r.get("rollout_lora_merge") else ""),
             "error": (r.get("error") or "")[:60] or None} for r in record["rows"]]
    uneven = sorted({r.get("workload", "fixed") for r in record["rows"]} - {"fixed"})
    note = f"completion lengths: {', '.join(uneven)} (each row stops at a drawn length, new every step)\n"
    return (note if uneven else "") + format_table(rows, COLUMNS)


if __name__ == "__main__":  # one case: python -m qerl_lib.studies.train_bench CASE.json ROW.json RUN_DIR
    _row = run_case_here(TrainCase(**json.loads(Path(sys.argv[1]).read_text())), Path(sys.argv[3]))
    if _row:
        Path(sys.argv[2]).write_text(json.dumps(_row))

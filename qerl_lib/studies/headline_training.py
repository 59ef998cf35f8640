"""The training rows of the README's GPU table: the GRPO step per mode, with the merged 16-bit baseline, the 32B
step, data parallel on two GPUs, the 7B preset's step and rollout, and a short real run; each read from its results
file (`studies/result_reading`)."""

from __future__ import annotations

from qerl_lib.studies.result_reading import (ROLLOUT_KEYS, ResultsError, checked_rows, device_name, fastest, field,
                                             load_result, matching_row, model_size, provenances, times, tok_text)


def _training_row(results_dir) -> tuple:
    file = "train_smollm2_qerl_h200/summary.json"
    doc = load_result(results_dir, file)
    steps, window = field(doc, "steps", file=file), field(doc, "window", file=file)
    first, last = field(doc, "first", "reward", file=file), field(doc, "last", "reward", file=file)
    share = field(doc, "rollout_share", file=file)
    step_s = field(doc, "median_step_seconds", file=file)
    return (f"{steps}-step GRPO run, mode qerl, preset {field(doc, 'preset', file=file)}: mean reward of the "
            f"first / last {window} steps",
            f"{first:.3f} → {last:.3f}; {step_s:.2f} s per step (median), {share:.0%} of it rollout",
            device_name(doc, file), file)


TRAIN_STEP_KEYS = ("model", "mode", "batch", "gen_len", "completion_len", "rollout_s", "step_s", "peak_gib", "paper",
                   "error")
PRESET_STEP_KEYS = ("groups", "rollout_batch", "micro_batch", "num_iterations", "steps")  # rows of --preset-settings


def _train_step_rows(results_dir) -> list[tuple]:
    file = "train_step_h100.json"
    doc = load_result(results_dir, file)
    rows = checked_rows(doc, file, TRAIN_STEP_KEYS)

    def row(model, mode, batch):
        return matching_row(rows, file, model=model, mode=mode, batch=batch)

    dev = device_name(doc, file)
    lora, qerl, qlora = row("qwen2.5-7b", "lora", 8), row("qwen2.5-7b", "qerl", 8), row("qwen2.5-7b", "qlora", 8)
    lora14, qerl14, qlora14 = row("qwen2.5-14b", "lora", 8), row("qwen2.5-14b", "qerl", 8), row("qwen2.5-14b", "qlora", 8)
    big = row("qwen2.5-32b", "qerl", 2)
    pq, pl, pn = row("qwen2.5-7b", "qerl", 128), row("qwen2.5-7b", "lora", 128), row("qwen2.5-7b", "qlora", 128)
    missing = sorted({k for r in (pq, pl, pn) for k in PRESET_STEP_KEYS if k not in r})
    if missing:
        raise ResultsError(f"{file}: the qwen2.5-7b batch-128 (preset) rows miss {missing}")
    return [
        (f"GRPO step (rollout + scoring + forward/backward + AdamW), Qwen2.5-7B shapes, batch 8, 256 + "
         f"{qerl['gen_len']} tokens, LoRA r32: qerl / lora / qlora",
         f"{qerl['step_s']:.1f} / {lora['step_s']:.1f} / {qlora['step_s']:.1f} s: "
         f"{times(lora['step_s'] / qerl['step_s'])} over lora, {times(qlora['step_s'] / qerl['step_s'])} over qlora; peak "
         f"{qerl['peak_gib']:.1f} / {lora['peak_gib']:.1f} / {qlora['peak_gib']:.1f} GiB (paper, Tab. 3: qerl "
         f"{qerl['paper'].replace('x', '×', 1)}, qlora {qlora['paper'].replace('x', '×', 1)})", dev, file),
        ("the same step, Qwen2.5-14B shapes, batch 8: qerl / lora / qlora",
         f"{qerl14['step_s']:.1f} / {lora14['step_s']:.1f} / {qlora14['step_s']:.1f} s: "
         f"{times(lora14['step_s'] / qerl14['step_s'])} over lora, {times(qlora14['step_s'] / qerl14['step_s'])} over "
         f"qlora; peak {qerl14['peak_gib']:.1f} / {lora14['peak_gib']:.1f} / {qlora14['peak_gib']:.1f} GiB (paper, "
         f"Tab. 3: {qerl14['paper'].replace('x', '×', 1)})", dev, file),
        ("the same step for Qwen2.5-32B shapes, mode qerl, batch 2, on one GPU",
         f"{big['step_s']:.1f} s ({big['rollout_s']:.1f} s rollout of {big['completion_len']:.0f}-token completions), "
         f"peak {big['peak_gib']:.1f} GiB (paper, Tab. 8: {big['paper']}, shorter completions)", dev, file),
        (f"the qwen2.5-7b-gsm8k preset's own step ({pq['groups']} x {pq['batch'] // pq['groups']} completions of "
         f"<= {pq['gen_len']} tokens, {pq['rollout_batch']} rollout rows, micro-batch {pq['micro_batch']}, "
         f"μ = {pq['num_iterations']} of the preset's 4), {pq['steps']} steps each: qerl / lora / qlora",
         f"{pq['step_s']:.0f} / {pl['step_s']:.0f} / {pn['step_s']:.0f} s (rollout {pq['rollout_s']:.0f} / "
         f"{pl['rollout_s']:.0f} / {pn['rollout_s']:.0f} s: at {pq['rollout_batch']} rows the FP4 GEMM is below "
         f"bf16's); peak {pq['peak_gib']:.1f} / {pl['peak_gib']:.1f} / {pn['peak_gib']:.1f} GiB", dev, file),
    ]


def _train_merge_row(results_dir) -> tuple:
    """qerl's step against lora's with the rollout's adapters merged (TRL's way before a vLLM sync) and unmerged."""
    file = "train_step_merge_h200.json"
    doc = load_result(results_dir, file)
    rows = checked_rows(doc, file, TRAIN_STEP_KEYS + ("rollout_lora_merge", "lora_rank"))

    def row(model, mode, merged=False):
        return matching_row(rows, file, model=model, mode=mode, rollout_lora_merge=merged, batch=8)

    def part(m):
        cases = {"qerl": row(m, "qerl"), "lora merged": row(m, "lora", True), "lora": row(m, "lora")}
        q, merged, plain = (r["step_s"] for r in cases.values())
        paper = (cases["qerl"]["paper"] or "-").replace("x", "×", 1)
        # random weights can sample the end-of-text token: a rollout that stopped early did less work than asked
        short = [f"{name}'s completions averaged {r['completion_len']:.0f} tokens" for name, r in cases.items()
                 if r["completion_len"] < r["gen_len"]]
        return (f"{m.split('-')[1].upper()} {q:.1f} / {merged:.1f} / {plain:.1f} s ({times(merged / q)} / {times(plain / q)}; "
                f"{''.join(s + '; ' for s in short)}paper, Tab. 3: {paper})")

    r = row("qwen2.5-7b", "qerl")
    # 7B and the other sizes measured with the merged rollout at batch 8 (the 32B batch-8 pair has no merged row)
    models = sorted({"qwen2.5-7b"} | {r["model"] for r in rows if r["error"] is None and r["batch"] == 8
                                      and r["rollout_lora_merge"]}, key=model_size)
    return (f"the GRPO step in one run, batch {r['batch']}, 256 + {r['gen_len']} tokens, LoRA r{r['lora_rank']}: qerl / "
            f"lora with the rollout's adapters merged (`--rollout-lora-merge`) / lora unmerged (qerl's speedup over each)",
            "; ".join(part(m) for m in models), device_name(doc, file), file)


def _big_step_row(results_dir) -> tuple:
    """The 32B step at batch 2 with the current code, qerl against a 16-bit lora base, with both peaks (the paper
    reports 16-bit LoRA out of memory at this batch on its 80 GB GPU)."""
    file = "train_step_merge_h200.json"
    doc = load_result(results_dir, file)
    rows = checked_rows(doc, file, TRAIN_STEP_KEYS + ("lora_rank", "train_s"))
    q, lora = (matching_row(rows, file, model="qwen2.5-32b", mode=m, batch=2) for m in ("qerl", "lora"))
    return (f"the GRPO step for Qwen2.5-32B shapes on one GPU, batch {q['batch']}, 256 + {q['gen_len']} tokens, "
            f"LoRA r{q['lora_rank']}, gradient checkpointing, current code: qerl / lora (16-bit base)",
            f"{q['step_s']:.1f} / {lora['step_s']:.1f} s: {times(lora['step_s'] / q['step_s'])} over lora (rollout "
            f"{q['rollout_s']:.1f} / {lora['rollout_s']:.1f} s, trainer {q['train_s']:.1f} / {lora['train_s']:.1f} s); "
            f"peak {q['peak_gib']:.1f} / {lora['peak_gib']:.1f} GiB (paper, Tab. 8: qerl {q['paper'] or '-'}, "
            f"shorter completions)", device_name(doc, file), file)


def _data_parallel_row(results_dir) -> tuple:
    """The same global batch on one GPU and on two (`--num-gpus 2`: one process and one engine per GPU), mode qerl."""
    file = "train_step_merge_h200.json"
    doc = load_result(results_dir, file)
    rows = checked_rows(doc, file, TRAIN_STEP_KEYS + ("num_gpus", "groups", "micro_batch", "lora_rank"))
    batches = sorted({r["batch"] for r in rows if r["error"] is None and r["num_gpus"] == 2})
    if not batches:
        raise ResultsError(f"{file}: no measured two-GPU row")
    cases = [(matching_row(rows, file, model="qwen2.5-7b", mode="qerl", batch=b, num_gpus=1),
              matching_row(rows, file, model="qwen2.5-7b", mode="qerl", batch=b, num_gpus=2)) for b in batches]
    one = cases[0][0]
    gpus = max(int(p.get("device", {}).get("gpu_count", 1)) for p in provenances(doc, file))
    parts = [f"batch {a['batch']}: {a['step_s']:.1f} / {b['step_s']:.1f} s, {times(a['step_s'] / b['step_s'])} "
             f"(rollout {a['rollout_s']:.1f} / {b['rollout_s']:.1f} s)" for a, b in cases]
    return (f"data parallel, the same global batch on 1 / 2 GPUs (`--num-gpus`): GRPO step, Qwen2.5-7B shapes, mode "
            f"qerl, {one['groups']} groups, 256 + {one['gen_len']} tokens, LoRA r{one['lora_rank']}, micro-batch "
            f"{one['micro_batch']}", "; ".join(parts), f"{device_name(doc, file)} ({gpus}-GPU machine)", file)


def _preset_step_merged_row(results_dir) -> tuple:
    """The 7B GSM8K preset's whole step with the current kernels: qerl against lora with the rollout merged."""
    file = "train_step_merge_h200.json"
    doc = load_result(results_dir, file)
    rows = checked_rows(doc, file, TRAIN_STEP_KEYS + PRESET_STEP_KEYS + ("rollout_lora_merge", "train_s",
                                                                        "steps_measured"))
    q = matching_row(rows, file, model="qwen2.5-7b", mode="qerl", batch=128)
    m = matching_row(rows, file, model="qwen2.5-7b", mode="lora", batch=128, rollout_lora_merge=True)
    return (f"the same preset's step, current kernels ({q['rollout_batch']} rows, μ = {q['num_iterations']}, "
            f"{q['steps_measured']} measured step each): qerl / lora with the rollout's adapters merged",
            f"{q['step_s']:.0f} / {m['step_s']:.0f} s (rollout {q['rollout_s']:.0f} / {m['rollout_s']:.0f} s, trainer "
            f"{q['train_s']:.0f} / {m['train_s']:.0f} s): qerl at {times(m['step_s'] / q['step_s'])}; peak "
            f"{q['peak_gib']:.1f} / {m['peak_gib']:.1f} GiB", device_name(doc, file), file)


def _preset_rollout_row(results_dir) -> tuple:
    """The 7B GSM8K preset's rollout phase alone (its rows, lengths and rank), NVFP4 against bf16 merged and not,
    measured later than the preset's step above."""
    file = "rollout_h200.json"
    doc = load_result(results_dir, file)
    rows = checked_rows(doc, file, ROLLOUT_KEYS + ("lora_merged",))
    case = dict(model="qwen2.5-7b", batch=128, rank=32, prompt_len=256, gen_len=4096, engine="qerl")
    fp = fastest(rows, file, weights="nvfp4", lora_merged=False, **case)
    bf, merged = (fastest(rows, file, weights="bf16", lora_merged=m, **case) for m in (False, True))
    return (f"the qwen2.5-7b-gsm8k preset's rollout phase alone, current kernels: {case['batch']} rows, 256 + "
            f"{case['gen_len']} tokens, LoRA r{case['rank']}: NVFP4 / bf16 / bf16 merged (`lora_merge`)",
            f"{tok_text(fp['tok_s'])} / {tok_text(bf['tok_s'])} / {tok_text(merged['tok_s'])} tok/s: NVFP4 at "
            f"{times(fp['tok_s'] / bf['tok_s'])} / {times(fp['tok_s'] / merged['tok_s'])} of bf16's", device_name(doc, file),
            file)


def training_rows(results_dir) -> list[tuple]:
    """(quantity, value, device, file) of the README table's training topic, in its order."""
    return [*_train_step_rows(results_dir), _preset_rollout_row(results_dir), _preset_step_merged_row(results_dir),
            _train_merge_row(results_dir), _big_step_row(results_dir), _data_parallel_row(results_dir),
            _training_row(results_dir)]

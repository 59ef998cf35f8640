"""Where a GRPO step's time goes, per mode and model, from `qerl bench train --json`.

Each bar is one mode's step (median of the measured steps), stacked by phase: the rollout (``rollout_s``, the engine
sampling the completions), the trainer (``train_s``, everything else in the step: rewards, log-probs, forward,
backward, optimizer) and a grey remainder (``step_s`` less both; each of the three is a median of its own, so the
remainder is 0 or a sliver). QeRL's speedup over 16-bit LoRA is a rollout effect: the NVFP4 and bf16 bases' trainer
phases are about equal, so the bars differ mostly in their solid part. The label above a bar is the step time and, on
every bar but lora's unmerged one, the speedup over lora's unmerged step; the paper's figure for the case (its Tables
3 and 8) is printed under the case's name.
"""

from __future__ import annotations

from pathlib import Path

from qerl_lib.plots.style import COLORS, load_json, new_figure, save_figure

# (model, completions per step): the paper's Table 3 settings at 7B and 14B (batch 2, 4, 8), Table 8's at 32B (2, 8)
CASES = tuple((f"qwen2.5-{size}", batch) for size in ("7b", "14b") for batch in (2, 4, 8)) + \
    (("qwen2.5-32b", 2), ("qwen2.5-32b", 8))
# (mode, rollout adapters merged, label) in drawing order
BARS = (("qerl", False, "qerl"), ("nvfp4", False, "nvfp4 (no AQN)"), ("lora", True, "lora, merged rollout"),
        ("lora", False, "lora"), ("qlora", False, "qlora"))
MERGED_COLOR = "#64b5cd"


def _plain(row: dict) -> bool:
    """A row of the plain one-GPU setting: measured, not a preset's own step, fixed lengths."""
    return (row.get("error") is None and row.get("preset") is None and (row.get("num_gpus") or 1) == 1
            and row.get("workload") in (None, "fixed"))


def step_cases(rows: list[dict], source: str = "the rows") -> list[dict]:
    """The bars to draw: one entry per case of `CASES` with a measured row, each with its bars in `BARS` order.

    A bar holds ``rollout_s``, ``train_s``, ``other_s`` (the step less both), ``step_s``, ``speedup_vs_lora`` (lora's
    unmerged step over this one; None without that row) and the row's ``paper`` note. Two plain rows for one bar are
    ambiguous and raise ValueError naming ``source``.
    """
    cases = []
    for model, batch in CASES:
        bars = []
        for mode, merged, label in BARS:
            hits = [r for r in rows if _plain(r) and r.get("model") == model and r.get("batch") == batch
                    and r.get("mode") == mode and bool(r.get("rollout_lora_merge")) == merged]
            if len(hits) > 1:
                raise ValueError(f"{source}: {len(hits)} rows for {model} batch {batch} mode {label}: keep one")
            if hits:
                r = hits[0]
                bars.append({"label": label, "mode": mode, "merged": merged, "rollout_s": r["rollout_s"],
                             "train_s": r["train_s"], "other_s": max(0.0, r["step_s"] - r["rollout_s"] - r["train_s"]),
                             "step_s": r["step_s"], "paper": r.get("paper"),
                             "setting": (r.get("prompt_len"), r.get("gen_len"), r.get("lora_rank"))})
        if not bars:
            continue
        lora = next((b["step_s"] for b in bars if b["mode"] == "lora" and not b["merged"]), None)
        for b in bars:
            b["speedup_vs_lora"] = lora / b["step_s"] if lora and b["step_s"] else None
        cases.append({"model": model, "batch": batch, "bars": bars})
    return cases


def _device(doc: dict) -> str:
    runs = doc["provenance"] if isinstance(doc["provenance"], list) else [doc["provenance"]]
    names = sorted({p.get("device", {}).get("name", "?") for p in runs})
    return " / ".join(names)


def plot_train_steps(step_json: str | Path, out_png: str | Path) -> Path:
    """One panel of stacked bars (rollout, trainer, remainder) for every case and mode that `step_json` measured."""
    doc = load_json(step_json)
    cases = step_cases(doc["rows"], source=str(step_json))
    if not cases:
        raise ValueError(f"{step_json}: no measured one-GPU step row of the paper's Tables 3 and 8 settings (Qwen2.5-7B "
                         f"or 14B at batch 2, 4 or 8, 32B at batch 2 or 8) to draw (a row that failed carries its error)")
    fig, (ax,) = new_figure(width=max(6.0, 1.0 + 0.75 * sum(len(c["bars"]) + 1 for c in cases)), height=4.2)
    width, x, ticks, tick_labels, seen = 0.8, 0.0, [], [], set()
    for case in cases:
        start = x
        for b in case["bars"]:
            color = MERGED_COLOR if b["merged"] else COLORS[b["mode"]]
            show = b["label"] not in seen
            seen.add(b["label"])
            ax.bar(x, b["rollout_s"], width, color=color, label=b["label"] if show else None)
            ax.bar(x, b["train_s"], width, bottom=b["rollout_s"], color=color, alpha=0.45, hatch="//", edgecolor="white")
            ax.bar(x, b["other_s"], width, bottom=b["rollout_s"] + b["train_s"], color="0.75")
            text = f"{b['step_s']:.1f} s"
            if b["speedup_vs_lora"] and not (b["mode"] == "lora" and not b["merged"]):
                text += f"\n{b['speedup_vs_lora']:.2f}×"
            ax.annotate(text, (x, b["step_s"]), ha="center", va="bottom", fontsize=6)
            x += 1
        ticks.append((start + x - 1) / 2)
        paper = next((b["paper"] for b in case["bars"] if b["mode"] == "qerl" and b["paper"]), None)
        name = f"Qwen2.5-{case['model'].split('-')[1].upper()}, batch {case['batch']}"
        tick_labels.append(name + (f"\npaper: qerl {paper.replace('x', '×', 1)}" if paper else ""))
        x += 1
    ax.set_xticks(ticks, tick_labels, fontsize=7)
    ax.set_ylabel("seconds per GRPO step")
    ax.set_ylim(top=ax.get_ylim()[1] * 1.12)
    # phase key: proxy artists with no data
    ax.bar(0, 0, 0, color="0.4", label="rollout (solid)")
    ax.bar(0, 0, 0, color="0.4", alpha=0.45, hatch="//", edgecolor="white", label="trainer, rewards incl. (hatched)")
    ax.bar(0, 0, 0, color="0.75", label="step less both (medians' gap)")
    ax.legend(fontsize=6, ncol=2)
    settings = sorted({b["setting"] for c in cases for b in c["bars"]}, key=str)
    setting = "; ".join(f"{p} + {g} tokens, LoRA r{k}" for p, g, k in settings)
    ax.set_title(f"GRPO step by phase, {setting} ({_device(doc)}); ×: speedup over lora", fontsize=8)
    return save_figure(fig, out_png, source=step_json)

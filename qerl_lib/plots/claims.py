"""Figures of the claim sweeps (notebook 07), drawn from the block JSONs and the claims table.

* `plot_training_curves`: reward and entropy per step, one line per arm (mean over seeds) with a
  band from the lowest to the highest seed (paper Fig. 4 and 5 style);
* `plot_noise_ablations`: AQN on/off and the bf16 + AQN control (paper Fig. 8), the schedules'
  reward and their σ per step (paper Fig. 9 and 15);
* `plot_lr_ladder`: held-out pass@1 against the learning rate for LoRA and QeRL, every seed a
  dot, collapsed runs crossed (paper Fig. 16/17, App. I);
* `plot_base_formats`: untrained pass@1 per base format with 95% intervals (paper Tab. 1, base rows);
* `plot_claims`: every comparison behind each claim with its interval, coloured by verdict (supplementary
  comparisons grey and dashed).
"""

from __future__ import annotations

import math
from pathlib import Path

from qerl_lib.plots.style import COLORS, new_figure, save_figure

ARM_COLORS = {"lora": COLORS["lora"], "lora-at-qerl-lr": "#64b5cd", "qlora": COLORS["qlora"], "nvfp4": COLORS["nvfp4"],
              "qerl": COLORS["qerl"], "bf16-aqn": "#937860", "qerl-linear": "#8c8c8c", "qerl-cosine": "#da8bc3",
              "qerl-logarithmic": "#ccb974", "qerl-constant": "#4c4c4c"}
VERDICT_COLORS = {"holds": "#55a868", "does not hold": "#c44e52", "inconclusive": "#8c8c8c"}


def seed_band(curves: dict[str, dict], key: str) -> tuple[list, list, list, list]:
    """(steps, mean, low, high) of `key` over the seeds' curves, at the steps every seed logged."""
    series = [dict(zip(c["step"], c[key])) for c in curves.values()]
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    mean, low, high = [], [], []
    for step in steps:
        values = [s[step] for s in series if isinstance(s[step], (int, float)) and math.isfinite(s[step])]
        mean.append(sum(values) / len(values) if values else float("nan"))
        low.append(min(values, default=float("nan")))
        high.append(max(values, default=float("nan")))
    return steps, mean, low, high


def _draw_arms(ax, block: dict, arms: list[str], key: str, ylabel: str, title: str) -> None:
    for arm in arms:
        curves = block["curves"].get(arm) or {}
        if not curves:
            continue
        steps, mean, low, high = seed_band(curves, key)
        color = ARM_COLORS.get(arm)
        ax.plot(steps, mean, color=color, label=f"{arm} ({len(curves)} seeds)", lw=1.6)
        ax.fill_between(steps, low, high, color=color, alpha=0.15, lw=0)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)


def plot_training_curves(block_c: dict, out_png: str | Path, source: str | Path | None = None) -> Path:
    """Block (c): reward and entropy per step for qerl, lora, lora at qerl's lr, qlora and nvfp4."""
    arms = [a for a in ("qerl", "lora", "lora-at-qerl-lr", "qlora", "nvfp4") if a in block_c["curves"]]
    fig, (ax_r, ax_h) = new_figure(ncols=2, width=5.2, height=3.8)
    _draw_arms(ax_r, block_c, arms, "reward", "training reward (per rollout)", "(c) reward: QeRL vs LoRA vs QLoRA")
    _draw_arms(ax_h, block_c, arms, "entropy", "token entropy (trainer)", "(a) policy entropy")
    ax_r.legend(fontsize=7)
    return save_figure(fig, out_png, source)


def plot_noise_ablations(block_d: dict, block_e: dict, out_png: str | Path, source: str | Path | None = None) -> Path:
    """Blocks (d) and (e): AQN on/off and bf16 + AQN; the schedules' reward and σ."""
    fig, (ax_d, ax_e, ax_s) = new_figure(ncols=3, width=4.6, height=3.8)
    _draw_arms(ax_d, block_d, [a for a in ("nvfp4", "qerl", "lora", "bf16-aqn") if a in block_d["curves"]],
               "reward", "training reward (per rollout)", "(d) AQN on NVFP4, and on bf16")
    schedules = [a for a in block_e["curves"]]
    _draw_arms(ax_e, block_e, schedules, "reward", "training reward (per rollout)", "(e) σ schedules: reward")
    for arm in schedules:
        curves = block_e["curves"][arm]
        if curves:
            first = next(iter(curves.values()))
            ax_s.plot(first["step"], first["sigma"], color=ARM_COLORS.get(arm), label=arm.replace("qerl-", "") if
                      arm != "qerl" else "exponential", lw=1.4)
    ax_s.set_xlabel("optimizer step")
    ax_s.set_ylabel("AQN σ")
    ax_s.set_title("(e) σ per step", fontsize=10)
    ax_s.grid(alpha=0.3)
    for ax in (ax_d, ax_e, ax_s):
        ax.legend(fontsize=6)
    return save_figure(fig, out_png, source)


def plot_lr_ladder(block_lr: dict, out_png: str | Path, source: str | Path | None = None) -> Path:
    """Held-out pass@1 against the learning rate; every seed a dot, collapsed runs crossed."""
    fig, (ax,) = new_figure(ncols=1, width=5.6, height=3.8)
    for i, mode in enumerate(("lora", "qerl")):
        runs = [r for r in block_lr["runs"] if r["arm"].startswith(mode + "-")]
        rates = sorted({r["learning_rate"] for r in runs})
        shift = 1.06 if i else 1 / 1.06  # side by side on the log axis
        means = [sum(r["heldout_pass1"] for r in runs if r["learning_rate"] == lr) /
                 max(1, sum(r["learning_rate"] == lr for r in runs)) for lr in rates]
        ax.plot([lr * shift for lr in rates], means, color=COLORS[mode], lw=1.6, label=f"{mode} (mean)")
        for r in runs:
            collapsed = r.get("collapsed")
            ax.scatter(r["learning_rate"] * shift, r["heldout_pass1"], color=COLORS[mode], s=28 if collapsed else 14,
                       marker="x" if collapsed else "o", zorder=3)
    base = block_lr.get("base_pass1")
    if base is not None:
        ax.axhline(base, color="0.4", ls="--", lw=1, label="untrained bf16 base")
    ax.scatter([], [], color="0.3", marker="x", label="collapsed run")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("held-out pass@1 after training")
    ax.set_title("LR: stability of LoRA and QeRL", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, out_png, source)


def plot_base_formats(block_b: dict, out_png: str | Path, source: str | Path | None = None) -> Path:
    """Untrained pass@1 per base format (95% interval over held-out problems)."""
    fig, (ax,) = new_figure(ncols=1, width=4.4, height=3.6)
    arms = block_b["arms"]
    for i, arm in enumerate(arms):
        stats = block_b["per_arm"][arm]["heldout_pass1"]
        low, high = stats["ci"]
        ax.bar(i, stats["mean"], color=COLORS.get(arm, "0.5"), width=0.6)
        ax.errorbar(i, stats["mean"], yerr=[[stats["mean"] - low], [high - stats["mean"]]], color="k", capsize=4)
        ax.text(i, high + 0.005, f"{stats['mean']:.3f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(arms)), arms)
    ax.set_ylabel("untrained pass@1 (95% CI)")
    ax.set_title("(b) base accuracy by format", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    return save_figure(fig, out_png, source)


def plot_claims(table: dict, out_png: str | Path, source: str | Path | None = None) -> Path:
    """Each claim's comparisons: estimate and interval, in the paper's direction (right = as the paper says)."""
    rows = [(e, r) for e in table["claims"] for r in e["comparisons"]]
    fig, (ax,) = new_figure(ncols=1, width=7.5, height=0.32 * len(rows) + 1.2)
    for y, (entry, row) in enumerate(reversed(rows)):
        ci = row.get("ci90") or row["ci"]
        color = VERDICT_COLORS.get(row.get("verdict"), "0.5")
        if row["estimate"] is not None and None not in ci:
            if row["supplementary"]:  # not a test of the plan: thin, dashed, hollow
                ax.plot(ci, [y, y], color="0.55", lw=1, ls="--")
                ax.scatter(row["estimate"], y, facecolors="white", edgecolors="0.45", zorder=3, s=18)
            else:
                ax.plot(ci, [y, y], color=color, lw=2)
                ax.scatter(row["estimate"], y, color=color, zorder=3, s=18)
        tag = " (suppl.)" if row["supplementary"] else ""
        ax.text(-0.02, y, f"({entry['id']}) {row['comparison']}{tag}", transform=ax.get_yaxis_transform(),
                ha="right", va="center", fontsize=7)
    ax.axvline(0, color="k", lw=0.8)
    margin = table.get("margin")
    if margin:
        for x in (-margin, margin):
            ax.axvline(x, color="0.5", lw=0.6, ls=":")
    ax.set_yticks([])
    ax.set_xlabel("difference (pass@1; entropy for (a)); 95% CI, 90% for the schedules")
    for verdict, color in VERDICT_COLORS.items():
        ax.plot([], [], color=color, lw=2, label=verdict)
    ax.plot([], [], color="0.55", lw=1, ls="--", label="supplementary (no verdict)")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("The paper's claims at kit scale", fontsize=10)
    return save_figure(fig, out_png, source)

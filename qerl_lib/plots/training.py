"""Training curves of `qerl train` runs (paper Fig. 4, 5, 8 style), from the runs' metrics.jsonl files.

Five panels, one line per run (coloured by mode): reward (mean reward per step; thin raw line plus
a moving average, accuracy dashed), trainer entropy on the loss tokens, AQN σ, the engine-vs-trainer
log-prob mismatch (log scale), and the per-step time split (rollout solid, everything else dashed).
"""

from __future__ import annotations

from pathlib import Path

from qerl_lib.io import read_jsonl
from qerl_lib.plots.style import COLORS, new_figure, save_figure


def moving_average(values: list, window: int) -> list:
    """Trailing mean over the last `window` numbers, non-numbers (None) skipped; None where there are none yet."""
    out, kept = [], []
    for v in values:
        if isinstance(v, (int, float)):
            kept.append(v)
        recent = kept[-window:]
        out.append(sum(recent) / len(recent) if recent else None)
    return out


def _series(rows: list[dict], key: str) -> tuple[list, list]:
    pts = [(r["step"], r.get(key)) for r in rows if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_runs(runs: dict[str, str | Path] | list[str | Path], out_png: str | Path, window: int = 10) -> Path:
    """`runs`: {label: metrics.jsonl} (label = mode names get the mode colours) or a list of paths."""
    if not isinstance(runs, dict):
        runs = {Path(p).parent.name or str(p): p for p in runs}
    if not runs:
        raise ValueError("no runs to plot: pass at least one metrics.jsonl")
    fig, (ax_reward, ax_entropy, ax_sigma, ax_gap, ax_time) = new_figure(ncols=5, width=3.4, height=3.2)
    for i, (label, path) in enumerate(runs.items()):
        rows = read_jsonl(path)
        if not rows:
            raise ValueError(f"{path} has no metrics lines yet")
        color = COLORS.get(label, f"C{i}")
        steps, reward = _series(rows, "reward")
        ax_reward.plot(steps, reward, color=color, alpha=0.25, lw=0.8)
        ax_reward.plot(steps, moving_average(reward, window), color=color, lw=1.8, label=f"{label} reward")
        steps_acc, accuracy = _series(rows, "accuracy")
        ax_reward.plot(steps_acc, moving_average(accuracy, window), color=color, lw=1.2, ls="--",
                       label=f"{label} accuracy")
        steps, entropy = _series(rows, "entropy")
        ax_entropy.plot(steps, entropy, color=color, alpha=0.25, lw=0.8)
        ax_entropy.plot(steps, moving_average(entropy, window), color=color, lw=1.8, label=label)
        steps, sigma = _series(rows, "sigma")
        ax_sigma.plot(steps, sigma, color=color, marker=".", ms=3, lw=1.0, label=label)
        steps, gap = _series(rows, "logprob_mismatch")
        ax_gap.plot(steps, gap, color=color, marker=".", ms=3, lw=1.0, label=label)
        steps, rollout = _series(rows, "rollout_seconds")
        ax_time.plot(steps, rollout, color=color, lw=1.2, label=f"{label} rollout")
        steps, other = _series(rows, "train_seconds")
        ax_time.plot(steps, other, color=color, lw=1.2, ls="--", label=f"{label} training")
    ax_reward.set_title(f"reward (moving mean of {window})", fontsize=9)
    ax_entropy.set_title("entropy (nats/token)", fontsize=9)
    ax_sigma.set_title("AQN σ (0: no added noise)", fontsize=9)
    ax_gap.set_title("mean |Δ log-prob| engine vs trainer", fontsize=9)
    ax_gap.set_yscale("log")
    ax_time.set_title("seconds per step", fontsize=9)
    for ax in (ax_reward, ax_entropy, ax_sigma, ax_gap, ax_time):
        ax.set_xlabel("optimizer step")
        ax.legend(fontsize=6)
    return save_figure(fig, out_png, source=next(iter(runs.values())))

"""AQN noise schedules (paper Fig. 15 style): σ per stage for each decay shape, from a JSON the kit wrote.

The JSON is `qerl_lib.train.aqn.schedule_curves(...)` (plus the writer's provenance):
{"curves": [{"label", "schedule", "stage_sigmas", "stage_first_steps", "total_steps", ...}, ...]}.
"""

from __future__ import annotations

from pathlib import Path

from qerl_lib.plots.style import load_json, new_figure, save_figure

SCHEDULE_COLORS = {"exponential": "#dd8452", "linear": "#4c72b0", "cosine": "#55a868", "logarithmic": "#8172b2"}


def plot_schedules(json_path: str | Path, out_png: str | Path) -> Path:
    """Left: σ over training steps (a staircase, stage 0 = no added noise). Right: σ per noisy stage, log scale."""
    data = load_json(json_path)
    curves = data.get("curves")
    if not curves:
        raise ValueError(f"{json_path}: no 'curves' list; write it with qerl_lib.train.aqn.schedule_curves(...)")
    fig, (ax_steps, ax_log) = new_figure(ncols=2, width=4.8)
    for i, c in enumerate(curves):
        color = SCHEDULE_COLORS.get(c["schedule"], f"C{i}")
        sigmas, starts = c["stage_sigmas"], c["stage_first_steps"]
        # staircase: each stage's σ held from its first step to the next stage's first step
        ax_steps.step(starts + [c["total_steps"]], sigmas + [sigmas[-1]], where="post", color=color,
                      label=c["label"])
        # stage 0 has σ = 0, which a log axis cannot show; the left panel shows it
        stages = list(range(1, len(sigmas)))
        ax_log.plot(stages, sigmas[1:], marker="o", ms=3, color=color, label=c["label"])
    ax_steps.set_xlabel("training step")
    ax_steps.set_ylabel("σ of the added noise")
    ax_steps.set_title("σ over training (stage 0: quantization noise only)", fontsize=9)
    ax_steps.legend(fontsize=7)
    ax_log.set_yscale("log")
    ax_log.set_xlabel("stage")
    ax_log.set_ylabel("σ (log scale)")
    ax_log.set_title("noisy stages 1..K-1", fontsize=9)
    ax_log.set_xticks(range(1, max(len(c["stage_sigmas"]) for c in curves)))
    return save_figure(fig, out_png, source=json_path)

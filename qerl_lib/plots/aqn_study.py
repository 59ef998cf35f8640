"""Figure of `notebooks/04_adaptive_quantization_noise.ipynb`: next-token entropy vs AQN σ on NVFP4.

Drawn from the notebook's metrics JSON, whose "entropy" entry holds ``points`` (from
`qerl_lib.studies.aqn_noise.entropy_vs_sigma`) and optionally ``bf16`` (the unquantized model at σ = 0)
and ``nvfp4_minus_bf16`` (its paired bootstrap against NVFP4 at σ = 0).
Left: mean token entropy per σ, with BF16 as a dotted line. Right: the paired difference from
σ = 0 with its 95% bootstrap interval; a bar whose interval clears zero is a detected change.
σ sits on a categorical axis, because σ = 0 has no place on a log axis.
"""

from __future__ import annotations

from pathlib import Path

from qerl_lib.plots.style import COLORS, has_value, load_json, new_figure, save_figure


def plot_entropy_vs_sigma(metrics_json: str | Path, out_png: str | Path) -> Path:
    """Draw the two panels above from `metrics_json`; returns the PNG path."""
    m = load_json(metrics_json)
    points = (m.get("entropy") or {}).get("points")
    if not points:
        raise ValueError(f"{metrics_json}: no entropy.points; write them with qerl_lib.studies.aqn_noise.entropy_vs_sigma")
    labels = ["0" if p["sigma"] == 0 else f"{p['sigma']:g}" for p in points]
    xs = list(range(len(points)))
    fig, (ax_abs, ax_diff) = new_figure(ncols=2, width=4.6)

    entropies = [float("nan") if p["entropy"] is None else p["entropy"] for p in points]  # null: nothing scored
    ax_abs.plot(xs, entropies, marker="o", color=COLORS["nvfp4"], label="NVFP4 + AQN")
    bf16 = m["entropy"].get("bf16")
    values = [v for v in entropies if v == v] + ([bf16["entropy"]] if bf16 and bf16.get("entropy") is not None else [])
    if bf16 and bf16.get("entropy") is not None and values:
        ax_abs.axhline(bf16["entropy"], ls=":", color=COLORS["bf16"], label="BF16, σ = 0")
        pad = 0.08 * (max(values) - min(values)) or 0.01  # keep the BF16 line off the frame
        ax_abs.set_ylim(min(values) - pad, max(values) + pad)
    ax_abs.set_ylabel("mean token entropy (nats)")
    ax_abs.set_title("teacher-forced on the worked solutions", fontsize=9)
    ax_abs.legend(fontsize=7)

    diffs = [p["diff_vs_sigma0"] for p in points]
    shown = [(x, d) for x, d in zip(xs, diffs) if has_value(d)]  # null (with a note) when nothing was scored
    for x, d in zip(xs, diffs):
        if not has_value(d):
            ax_diff.text(x, 0, "n/a", ha="center", va="bottom", fontsize=7)
    if shown:
        ax_diff.bar([x for x, _ in shown], [d["mean_diff"] for _, d in shown],
                    yerr=[[d["mean_diff"] - d["low"] for _, d in shown], [d["high"] - d["mean_diff"] for _, d in shown]],
                    color=[COLORS["qerl"] if d["low"] > 0 or d["high"] < 0 else "0.6" for _, d in shown], capsize=3)
    quant = m["entropy"].get("nvfp4_minus_bf16")
    if has_value(quant):  # what the quantization itself adds, for scale
        ax_diff.axhline(quant["mean_diff"], ls=":", color=COLORS["bf16"],
                        label="NVFP4 − BF16 at σ = 0 (mean)")
        ax_diff.legend(fontsize=7)
    ax_diff.axhline(0, color="0.3", lw=0.8)
    n = diffs[0].get("n", 0)
    ax_diff.set_ylabel("entropy − entropy at σ = 0 (nats)")
    ax_diff.set_title(f"paired over {n} problems, 95% CI (coloured: excludes 0)", fontsize=9)
    for ax in (ax_abs, ax_diff):
        ax.set_xticks(xs)
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_xlabel("σ of the norm-weight noise")
    return save_figure(fig, out_png, source=metrics_json)

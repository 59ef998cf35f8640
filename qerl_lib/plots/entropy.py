"""Figure of `notebooks/06_entropy_study.ipynb`, drawn from the metrics JSON of
`qerl_lib.studies.entropy.run_entropy_study`.

Three panels (the third only when the JSON has an ``aqn`` entry):

1. entropy difference from BF16 (nats, format minus bf16, paired by problem) for each 4-bit
   format, one bar per reference (own samples, the worked solutions, BF16's samples), with the
   95% bootstrap interval. A bar whose interval clears the zero line is a detected difference;
2. accuracy (greedy pass@1 when measured, else sampled pass@1) per format with its interval;
3. entropy vs AQN σ on the perturbed format (difference from BF16, with intervals, on each fixed
   reference the ``aqn`` entry lists: the worked solutions and BF16's samples by default). The dotted
   horizontal lines mark where the other formats sit on the worked solutions, which shows whether
   noise moves entropy more than the choice of format does.
"""

from __future__ import annotations

from pathlib import Path

from qerl_lib.plots.style import COLORS, has_value, load_json, new_figure, save_figure

REFERENCE_STYLE = {  # reference -> (label, hatch, alpha)
    "own": ("own samples", "", 1.0),
    "gold": ("worked solutions", "//", 0.75),
    "bf16_samples": ("BF16's samples", "..", 0.5),
}


def _yerr(d: dict) -> list[list[float]]:
    return [[d["mean_diff"] - d["low"]], [d["high"] - d["mean_diff"]]]



def plot_entropy_study(metrics_json: str | Path, out_png: str | Path) -> Path:
    """Draw the panels above from `metrics_json`; returns the PNG path."""
    m = load_json(metrics_json)
    formats = m.get("formats")
    if not formats or "bf16" not in formats:
        raise ValueError(f"{metrics_json}: no 'formats' with a 'bf16' baseline; write it with run_entropy_study")
    quantized = [f for f in formats if f != "bf16"]
    aqn = m.get("aqn")
    fig, axes = new_figure(ncols=3 if aqn else 2, width=4.4)
    ax_diff, ax_acc = axes[0], axes[1]

    width = 0.8 / len(REFERENCE_STYLE)
    for x, fmt in enumerate(quantized):
        for j, (ref, (label, hatch, alpha)) in enumerate(REFERENCE_STYLE.items()):
            d = formats[fmt]["diff_vs_bf16"][f"entropy_{ref}"]
            pos = x + (j - (len(REFERENCE_STYLE) - 1) / 2) * width
            if not has_value(d):
                ax_diff.text(pos, 0, "n/a", ha="center", va="bottom", fontsize=6, rotation=90)
                continue
            ax_diff.bar(pos, d["mean_diff"], width=width, color=COLORS.get(fmt, "0.5"), alpha=alpha, hatch=hatch,
                        edgecolor="k", linewidth=0.4, label=label if x == 0 else None)
            ax_diff.errorbar(pos, d["mean_diff"], yerr=_yerr(d), color="k", capsize=3, lw=1)
    ax_diff.axhline(0, color="k", lw=0.8)
    ax_diff.set_xticks(range(len(quantized)), [f.upper() for f in quantized])
    ax_diff.set_ylabel("entropy − BF16 entropy (nats, paired)")
    ax_diff.set_title(f"entropy vs BF16, {m['n_problems']} problems, 95% CI", fontsize=9)
    ax_diff.legend(fontsize=7)

    kind = "greedy" if "greedy" in formats["bf16"] else "sampled"
    for x, fmt in enumerate(formats):
        acc = formats[fmt][kind]
        low, high = acc["pass@1_ci95"]
        ax_acc.bar(x, acc["pass@1"], color=COLORS.get(fmt, "0.5"))
        ax_acc.errorbar(x, acc["pass@1"], yerr=[[acc["pass@1"] - low], [high - acc["pass@1"]]], color="k", capsize=4)
    ax_acc.set_xticks(range(len(formats)), [f.upper() for f in formats])
    top = max(formats[f][kind]["pass@1_ci95"][1] for f in formats)
    ax_acc.set_ylim(0, max(0.1, 1.15 * top))  # a model that solves nothing still gets a readable axis
    ax_acc.set_ylabel(f"accuracy ({kind} pass@1)")
    ax_acc.set_title("accuracy with 95% CI", fontsize=9)

    if aqn:
        ax_s = axes[2]
        points = aqn["points"]
        sigmas = [p["sigma"] for p in points]
        for ref, marker in zip(aqn.get("references", ["gold"]), "os"):
            key = f"diff_vs_bf16_{ref}"
            drawn = [p for p in points if has_value(p.get(key))]
            if not drawn:
                continue
            ys = [p[key]["mean_diff"] for p in drawn]
            err = [[p[key]["mean_diff"] - p[key]["low"] for p in drawn], [p[key]["high"] - p[key]["mean_diff"] for p in drawn]]
            ax_s.errorbar([p["sigma"] for p in drawn], ys, yerr=err, marker=marker, ms=4, capsize=3, color=COLORS.get(aqn["format"], "C2"),
                          alpha=REFERENCE_STYLE[ref][2], label=f"{aqn['format'].upper()} + AQN, {REFERENCE_STYLE[ref][0]}")
        for fmt in quantized:
            if fmt != aqn["format"] and has_value(formats[fmt]["diff_vs_bf16"]["entropy_gold"]):
                level = formats[fmt]["diff_vs_bf16"]["entropy_gold"]["mean_diff"]
                ax_s.axhline(level, color=COLORS.get(fmt, "0.5"), ls=":", lw=1.2, label=f"{fmt.upper()} (no noise), solutions")
        ax_s.axhline(0, color=COLORS["bf16"], lw=0.8, label="BF16")
        positive = [s for s in sigmas if s > 0]
        if positive:  # symlog keeps σ = 0 on the axis next to the log-spaced σ values
            ax_s.set_xscale("symlog", linthresh=min(positive))
        ax_s.set_xlabel("AQN σ (noise on RMSNorm weights)")
        ax_s.set_ylabel("entropy − BF16 entropy (nats, paired)")
        ax_s.set_title(f"entropy vs σ (noise draws per σ > 0: {aqn['draws']})", fontsize=9)
        ax_s.legend(fontsize=6)
    return save_figure(fig, out_png, source=metrics_json)

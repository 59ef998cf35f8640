"""Figures of `notebooks/02_nvfp4_format.ipynb`, drawn from its metrics JSON (`02_nvfp4_format.metrics.json`).

The JSON holds `qerl_lib.studies.quant_formats` outputs under these keys:
`e2m1` (`e2m1_table()`), `block` (`explain_block(...)`), `sqnr` (`sqnr_scan(...)`, with
`gaussian_reference` added) and `layer` / `projection` naming the worked weight.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.ticker import MaxNLocator

from qerl_lib.plots.style import COLORS, load_json, new_figure, save_figure

THRESHOLDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # E2M1 rounding boundaries (ties to even)


def _require(m: dict, keys, path) -> None:
    missing = [k for k in keys if k not in m]
    if missing:
        raise ValueError(f"{path}: missing {missing}; write it with notebooks/02_nvfp4_format.ipynb")


def plot_e2m1_and_block(metrics_json: str | Path, out_png: str | Path) -> Path:
    """Left: the 16 E2M1 codes and their values. Middle: one real 16-weight block, original vs
    NVFP4, on the block's 15 levels. Right: the whole row divided by each block's effective
    scale (what E2M1 rounding sees), with the E2M1 values and rounding boundaries."""
    m = load_json(metrics_json)
    _require(m, ("e2m1", "block", "layer", "projection"), metrics_json)
    fig, (ax_grid, ax_block, ax_hist) = new_figure(ncols=3, width=4.6, height=3.9)

    table = m["e2m1"]
    codes = [r["code"] for r in table]
    values = [r["value"] for r in table]
    ax_grid.bar(codes, values, color=[COLORS["nvfp4"] if r["sign"] == 0 else "#a1c9a9" for r in table])
    for r in table:
        ax_grid.text(r["code"], r["value"] + (0.25 if r["sign"] == 0 else -0.25), f"{abs(r['value']):g}",
                     ha="center", va="bottom" if r["sign"] == 0 else "top", fontsize=6.5)
    ax_grid.set_xticks(codes, [r["bits"] for r in table], rotation=90, fontsize=6.5, family="monospace")
    ax_grid.axhline(0, color="0.3", lw=0.6)
    ax_grid.set_ylim(-7.6, 7.6)
    ax_grid.set_xlabel("code bits  sign | exponent | mantissa")
    ax_grid.set_ylabel("E2M1 value")
    ax_grid.set_title("E2M1: 16 codes, 15 values (0 twice)", fontsize=9)

    b = m["block"]
    idx = list(range(b["columns"][0], b["columns"][1]))
    for level in b["levels"]:
        ax_block.axhline(level, color="0.85", lw=0.7, zorder=0)
    ax_block.plot(idx, b["values"], "o", color=COLORS["bf16"], label="bf16 weight")
    ax_block.plot(idx, b["dequantized"], "x", color=COLORS["nvfp4"], ms=7, mew=1.8, label="NVFP4 (dequantized)")
    for x, v, d in zip(idx, b["values"], b["dequantized"]):
        ax_block.plot([x, x], [v, d], color="#c44e52", lw=0.9)
    ax_block.set_xlabel(f"column k (row {b['row']}, block {b['block']}); grey: the block's 15 levels")
    ax_block.set_ylabel("weight")
    ax_block.set_title(f"layer {m['layer']} {m['projection']}: scale byte 0x{b['scale_byte']:02X} = {b['scale']:g},\n"
                       f"gs = {b['global_scale']:g}, s/gs = {b['effective_scale']:.4g}, "
                       f"SQNR {b['block_sqnr_db']:.1f} dB", fontsize=8)
    ax_block.legend(fontsize=7, loc="lower right")

    ax_hist.hist(b["row_scaled"], bins=[i / 8 for i in range(-52, 53)], color=COLORS["bf16"], alpha=0.8)
    for v in sorted({abs(r["value"]) for r in table}):
        for s in ((1,) if v == 0 else (-1, 1)):
            ax_hist.axvline(s * v, color=COLORS["nvfp4"], lw=1.0)
    for t in THRESHOLDS:
        for s in (-1, 1):
            ax_hist.axvline(s * t, color="0.5", lw=0.6, ls=":")
    ax_hist.set_xlim(-6.6, 6.6)
    ax_hist.set_xticks([-6, -4, -3, -2, -1, 0, 1, 2, 3, 4, 6])
    ax_hist.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax_hist.set_xlabel("weight / (s / gs) of its block  (row, all blocks)")
    ax_hist.set_ylabel("count")
    ax_hist.set_title(f"row {b['row']}: {b['shape'][1]} weights on the E2M1 grid\n"
                      "(green: values, dotted: rounding boundaries)", fontsize=8)
    return save_figure(fig, out_png, source=metrics_json)


def plot_sqnr_by_layer(metrics_json: str | Path, out_png: str | Path) -> Path:
    """Left: mean SQNR of each decoder layer's linears per format. Right: mean per projection type,
    plus all linears and a Gaussian-weight control."""
    m = load_json(metrics_json)
    _require(m, ("sqnr",), metrics_json)
    scan = m["sqnr"]
    fmts, summary = scan["formats"], scan["summary"]
    fig, (ax_layers, ax_proj) = new_figure(ncols=2, width=5.4, height=3.8)
    for f in fmts:
        ax_layers.plot(summary["layers"], summary["by_layer"][f], marker="o", ms=3, color=COLORS.get(f),
                       label=f"{f.upper()} ({scan['bits_per_weight'][f]:g} bits/weight)")
    ax_layers.set_xlabel("decoder layer")
    ax_layers.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_layers.set_ylabel("SQNR vs bf16 weights (dB, higher is better)")
    ax_layers.set_title(f"mean over each layer's {len(summary['by_projection'])} linears "
                        f"({scan['layers_scanned']} of {scan['layers_total']} layers)", fontsize=9)
    ax_layers.legend(fontsize=7)

    groups = list(summary["by_projection"]) + ["all"]
    heights = {f: [summary["by_projection"][p][f] for p in groups[:-1]] + [summary["mean"][f]] for f in fmts}
    if "gaussian_reference" in scan:
        groups.append("Gaussian\ncontrol")
        for f in fmts:
            heights[f].append(scan["gaussian_reference"]["sqnr_db"][f])
    width = 0.8 / len(fmts)
    for i, f in enumerate(fmts):
        xs = [g + (i - (len(fmts) - 1) / 2) * width for g in range(len(groups))]
        ax_proj.bar(xs, heights[f], width=width, color=COLORS.get(f), label=f.upper())
    low = min(min(h) for h in heights.values())
    high = max(max(h) for h in heights.values())
    ax_proj.set_ylim(low - 1.0, high + 0.6)  # bars start near the data: differences are tenths of a dB
    ax_proj.set_xticks(range(len(groups)), [g.replace("_proj", "") for g in groups], fontsize=7)
    ax_proj.set_ylabel("mean SQNR (dB)")
    ax_proj.set_title("by projection type (y axis does not start at 0)", fontsize=9)
    ax_proj.legend(fontsize=7, ncol=len(fmts))
    return save_figure(fig, out_png, source=metrics_json)

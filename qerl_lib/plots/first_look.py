"""Figure of `notebooks/01_first_look.ipynb`: BF16 vs NVFP4 accuracy and entropy, from its metrics JSON."""

from __future__ import annotations

from pathlib import Path

from qerl_lib.plots.style import COLORS, load_json, new_figure, save_figure


def plot_format_comparison(metrics_json: str | Path, out_png: str | Path) -> Path:
    """Left: accuracy (pass@1) with its 95% interval, on the expression task where the metrics have it
    (``m["expressions"]``, notebook 01), else on the main problems. Right: mean next-token entropy on the main
    problems, on each model's own completions and on the reference model's completions (paired)."""
    m = load_json(metrics_json)
    names = list(m["formats"])
    accuracy = m.get("expressions", m)
    fig, (ax_acc, ax_ent) = new_figure(ncols=2, width=4.6)
    for x, name in enumerate(names):
        f, a = m["formats"][name], accuracy["formats"][name]
        low, high = a["pass@1_ci95"]
        ax_acc.bar(x, a["pass@1"], color=COLORS.get(name, "0.5"))
        ax_acc.errorbar(x, a["pass@1"], yerr=[[a["pass@1"] - low], [high - a["pass@1"]]], color="k", capsize=4)
        if f.get("entropy") is not None:
            ax_ent.bar(x - 0.18, f["entropy"], width=0.36, color=COLORS.get(name, "0.5"),
                       label="own completions" if x == 0 else None)
        ax_ent.bar(x + 0.18, f["entropy_on_reference"], width=0.36, color=COLORS.get(name, "0.5"), alpha=0.5,
                   hatch="//", label=f"{m['reference']} completions" if x == 0 else None)
    for ax in (ax_acc, ax_ent):
        ax.set_xticks(range(len(names)), [n.upper() for n in names])
    ax_acc.set_ylabel("accuracy (pass@1)")
    acc_task = accuracy.get("task", m.get("task", "problems"))
    ax_acc.set_title(f"{acc_task}, {accuracy['n_problems']} problems", fontsize=9)
    ax_ent.set_title(f"{m.get('task', 'problems')}, {m['n_problems']} problems", fontsize=9)
    ax_ent.set_ylabel("mean next-token entropy (nats)")
    ax_ent.legend(fontsize=7)
    return save_figure(fig, out_png, source=metrics_json)

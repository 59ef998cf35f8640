"""Static against continuous batching as row timelines, from a JSON the kit wrote.

The JSON is ``qerl_lib.studies.scheduling.scheduling_study(...)`` (plus the writer's provenance): ``config.slots``,
and for "static" and "continuous" a ``timeline`` of ``[sequence, row, first decode step, end decode step]`` with the
schedule's ``decode_steps``, ``slot_utilization``, ``tok_s`` and ``seconds``. Each sequence is one bar on the row that
held it, coloured by its index (the same colour in both panels; tab20, or turbo beyond 20 sequences); white is an
idle slot.
"""

from __future__ import annotations

from pathlib import Path

from qerl_lib.plots.style import load_json, save_figure

SCHEDULES = ("static", "continuous")


def plot_schedule(json_path: str | Path, out_png: str | Path) -> Path:
    """Two panels on one axis of decode steps: the static schedule above, continuous batching below."""
    import matplotlib.pyplot as plt

    data = load_json(json_path)
    missing = [s for s in SCHEDULES if not (data.get(s) or {}).get("timeline")]
    if missing or "config" not in data:
        raise ValueError(f"{json_path}: no {' / '.join(missing) or 'config'} timeline; write it with "
                         "qerl_lib.studies.scheduling.scheduling_study(...)")
    slots = data["config"]["slots"]
    count = max(seq for schedule in SCHEDULES for seq, *_ in data[schedule]["timeline"]) + 1
    palette = plt.get_cmap("tab20") if count <= 20 else plt.get_cmap("turbo").resampled(count)
    fig, axes = plt.subplots(2, 1, figsize=(9.0, 2.2 + 0.55 * slots), sharex=True)
    longest = max(max(data[s]["decode_steps"] for s in SCHEDULES), 1)
    for k, schedule in enumerate(SCHEDULES):
        part = data[schedule]
        ax = axes[k]
        for seq, row, first, end in part["timeline"]:
            ax.barh(row, end - first, left=first, height=0.8, color=palette(seq), edgecolor="white", linewidth=0.6)
            ax.plot([first, first], [row - 0.4, row + 0.4], color="black", linewidth=0.8)  # the prefill (token 0)
        busy = part["slot_utilization"]
        title = f"{schedule}: {part['decode_steps']} decode steps, " + \
            (f"{100 * busy:.0f}% of slots busy, " if busy is not None else "") + f"{part['tok_s']:.0f} tok/s"
        if schedule == "continuous" and part.get("refill_prefills"):
            title += f", {part['refills']} refills in {part['refill_prefills']} prefills"
        ax.set_title(title, fontsize=9)
        ax.set_xlim(0, longest)
        ax.set_ylim(slots - 0.5, -0.5)
        ax.set_yticks(range(slots))
        ax.set_ylabel("row")
    ax.set_xlabel("decode step (black tick: a sequence's prefill, which samples its first token)")
    return save_figure(fig, out_png, source=json_path)

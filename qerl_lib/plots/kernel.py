"""Figures of the GPU benchmarks, each drawn from its JSON only: the FP4 x BF16 GEMM (``qerl bench gemm --json``)
and rollout throughput (``qerl bench rollout --json``)."""

from __future__ import annotations

from pathlib import Path

from qerl_lib.plots.style import COLORS, load_json, new_figure, save_figure


def plot_gemm_speedup(gemm_json: str | Path, out_png: str | Path, target: float | None = None,
                      target_large_m: float | None = None) -> Path:
    """One panel per model: speedup of the fused NVFP4 kernel over torch BF16 vs batch size M,
    one line per projection shape, with the 16/4.5 = 3.56x byte ceiling, the 1x line and, if given,
    the target speedups for M <= 16 and M >= 1024 (each drawn over its range of M only). Forward
    layout only: rows with ``direction`` "bwd" are left out (rows without the key are forward)."""
    doc = load_json(gemm_json)
    rows = [r for r in doc["rows"] if r.get("direction", "fwd") == "fwd"]
    models = sorted({r["model"] for r in rows})
    fig, axes = new_figure(ncols=len(models), width=5.2, height=3.8)
    for ax, model in zip(axes, models):
        mine = [r for r in rows if r["model"] == model]
        for layout, proj, n, k in shape_order(mine):
            pts = sorted((r["m"], r["speedup"]) for r in mine if (r["layout"], r["proj"]) == (layout, proj))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                    linestyle="-" if layout == "hf" else "--", label=f"{proj} {n}x{k}")
        ax.axhline(doc["ceiling"], color=COLORS["nvfp4"], linestyle=":", label=f"byte ceiling {doc['ceiling']:.2f}x")
        ax.axhline(1.0, color=COLORS["bf16"], linestyle=":", label="bf16 (1x)")
        if target is not None:
            ax.plot([1, 16], [target, target], color=COLORS["qerl"], linewidth=2, label=f"target {target:.1f}x (M <= 16)")
        if target_large_m is not None:
            ax.plot([1024, 4096], [target_large_m] * 2, color=COLORS["qerl"], linewidth=2, linestyle="--",
                    label=f"target {target_large_m:.2f}x (M >= 1024)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per GEMM (M)")
        ax.set_ylabel("speedup over torch bf16")
        ax.set_title(model)
        ax.legend(fontsize=6)
    fig.suptitle(f"NVFP4 x BF16 GEMM on {doc['provenance']['device'].get('name')}", fontsize=9)
    return save_figure(fig, out_png, source=gemm_json)


def shape_order(rows: list[dict]) -> list[tuple[str, str, int, int]]:
    """The (layout, proj, n, k) of ``rows`` in drawing order: by layout, the largest weight first, then by name, so
    that shapes of equal size (7B's down and gate/up: 3584 x 18944 and 18944 x 3584) keep their colours run to run."""
    return sorted({(r["layout"], r["proj"], r["n"], r["k"]) for r in rows}, key=lambda s: (s[0], -s[2] * s[3], s[1]))


def plot_gemm_bandwidth(gemm_json: str | Path, out_png: str | Path, max_m: int = 16) -> Path:
    """Achieved bandwidth as % of the measured device copy bandwidth, BF16 vs FP4, for M <= max_m
    (the memory-bound regime), one bar pair per (model, projection) at the largest such M; forward
    layout only, as ``plot_gemm_speedup``."""
    doc = load_json(gemm_json)
    rows = [r for r in doc["rows"] if r["m"] <= max_m and r.get("direction", "fwd") == "fwd"]
    top_m = max((r["m"] for r in rows), default=None)
    rows = [r for r in rows if r["m"] == top_m]
    fig, (ax,) = new_figure(ncols=1, width=max(5.0, 0.5 * len(rows) + 2), height=3.8)
    labels = [f"{r['model'].replace('qwen2.5-', '')} {r['proj'].split(',')[0]}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["bf16_pct_copy"] for r in rows], width=0.4, color=COLORS["bf16"], label="bf16 (cuBLAS)")
    ax.bar([x + 0.2 for x in xs], [r["fp4_pct_copy"] for r in rows], width=0.4, color=COLORS["nvfp4"], label="nvfp4 (fused)")
    ax.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(f"% of copy bandwidth ({doc['device']['copy_gbps']:.0f} GB/s)")
    ax.set_title(f"memory-bound regime, M = {top_m}")
    ax.legend(fontsize=7)
    return save_figure(fig, out_png, source=gemm_json)


def _best(rows: list[dict], **match) -> dict | None:
    """The fastest row matching ``match`` (several backends/runs per configuration: the fastest
    counts, as `qerl_lib.bench.rollout_report.summarize` does)."""
    hits = [r for r in rows if r.get("error") is None and r.get("tok_s") and all(r.get(k) == v for k, v in match.items())]
    return max(hits, key=lambda r: r["tok_s"]) if hits else None


def _bar_labels(ax, bars, fmt="{:.0f}") -> None:
    for bar in bars:
        ax.annotate(fmt.format(bar.get_height()), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=6)


def plot_rollout(rollout_json: str | Path, out_png: str | Path) -> Path:
    """Three panels from ``qerl bench rollout --json``: (1) the kit's engine vs ``transformers.generate``
    on SmolLM2 bf16 at the baseline's lengths; (2) bf16 vs NVFP4 tokens/s for the Qwen2.5 shapes at
    batch 8, 256 + 2048 tokens, next to the paper's vLLM numbers (H100); (3) tokens/s vs LoRA rank
    (Qwen2.5-7B, batch 8, 256 + 512 or 2048 tokens, whichever has more ranks)."""
    doc = load_json(rollout_json)
    rows = doc["rows"]
    fig, (ax_hf, ax_fmt, ax_lora) = new_figure(ncols=3, width=4.2, height=3.8)

    hf_rows = sorted((r for r in rows if r["engine"] == "hf-generate" and r["model"] == "smollm2"), key=lambda r: r["batch"])
    xs = range(len(hf_rows))
    eng = [_best(rows, model="smollm2", weights="bf16", engine="qerl", rank=0, batch=r["batch"],
                 gen_len=r["gen_len"], prompt_len=r["prompt_len"]) for r in hf_rows]
    _bar_labels(ax_hf, ax_hf.bar([x - 0.2 for x in xs], [r["tok_s"] for r in hf_rows], width=0.4, color="0.6",
                                 label="transformers.generate"))
    _bar_labels(ax_hf, ax_hf.bar([x + 0.2 for x in xs], [e["tok_s"] if e else 0 for e in eng], width=0.4,
                                 color=COLORS["qerl"], label="qerl engine"))
    ax_hf.set_xticks(list(xs), [f"batch {r['batch']}\n{r['prompt_len']}+{r['gen_len']} tok" for r in hf_rows], fontsize=7)
    ax_hf.set_yscale("log")
    lows = [r["tok_s"] for r in hf_rows] + [e["tok_s"] for e in eng if e]
    if lows:  # start the log axis well below the shortest bar, so it reads as a bar
        ax_hf.set_ylim(bottom=min(lows) / 10)
    ax_hf.set_ylabel("tokens/s")
    ax_hf.set_title("SmolLM2-135M bf16: engine vs HF generate", fontsize=8)
    ax_hf.legend(fontsize=6)

    paper = doc["summary"].get("paper_vllm_h100", {})
    sizes = [s for s in ("3b", "7b", "14b", "32b") if _best(rows, model=f"qwen2.5-{s}", batch=8, rank=0, gen_len=2048)]
    xs = range(len(sizes))
    for offset, weights in ((-0.3, "bf16"), (-0.1, "nvfp4")):
        vals = [(_best(rows, model=f"qwen2.5-{s}", weights=weights, batch=8, rank=0, gen_len=2048, engine="qerl")
                 or {}).get("tok_s", 0) for s in sizes]
        _bar_labels(ax_fmt, ax_fmt.bar([x + offset for x in xs], vals, width=0.2, color=COLORS[weights], label=f"{weights} (kit)"))
    for offset, weights in ((0.1, "bf16"), (0.3, "nvfp4")):
        vals = [paper.get(f"{s}_{weights}_b8", 0) for s in sizes]
        _bar_labels(ax_fmt, ax_fmt.bar([x + offset for x in xs], vals, width=0.2, color=COLORS[weights], alpha=0.35,
                                       hatch="//", label=f"{weights} (paper, vLLM H100)"))
    ax_fmt.set_xticks(list(xs), [f"Qwen2.5-{s.upper()}" for s in sizes], fontsize=7)
    ax_fmt.set_ylabel("tokens/s (batch 8, 256+2048 tok)")
    ax_fmt.set_title("bf16 vs NVFP4 weights", fontsize=8)
    ax_fmt.legend(fontsize=6)

    # the generation length with the most LoRA ranks measured for 7B at batch 8 (512 or 2048 in the committed runs)
    lora_rows = [r for r in rows if r["model"] == "qwen2.5-7b" and r["batch"] == 8 and r.get("tok_s")]
    ranks_at = {g: {r["rank"] for r in lora_rows if r["gen_len"] == g} for g in {r["gen_len"] for r in lora_rows}}
    lora_gen = max(ranks_at, key=lambda g: (len(ranks_at[g]), -g), default=512)
    ranks = sorted(ranks_at.get(lora_gen, ()))
    for weights in ("bf16", "nvfp4"):
        pts = [(k, _best(rows, model="qwen2.5-7b", weights=weights, batch=8, rank=k, gen_len=lora_gen, engine="qerl"))
               for k in ranks]
        pts = [(k, r["tok_s"]) for k, r in pts if r]
        ax_lora.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=COLORS[weights], label=weights)
    ax_lora.set_xticks(ranks)
    ax_lora.set_ylim(bottom=0)
    ax_lora.set_xlabel("LoRA rank (all 7 projections, unmerged)")
    ax_lora.set_ylabel(f"tokens/s (batch 8, 256+{lora_gen} tok)")
    ax_lora.set_title("Qwen2.5-7B: cost of the adapter", fontsize=8)
    ax_lora.legend(fontsize=6)

    runs = doc["provenance"] if isinstance(doc["provenance"], list) else [doc["provenance"]]
    fig.suptitle(f"rollout throughput on {runs[0]['device'].get('name')} (kit engine; Qwen weights random, real shapes)", fontsize=9)
    return save_figure(fig, out_png, source=rollout_json)

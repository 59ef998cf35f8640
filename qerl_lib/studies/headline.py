"""The README's "Results on GPU" table and results/README.md's file index, read from the results files.

Every number the README shows about a GPU comes from here, so it is typed nowhere. `headline_rows`
reads the JSONs in ``results/``; each row names a quantity, its value, the GPU from the file's own
provenance block, and the file. `render_headline` writes the rows as a markdown table;
`update_block` puts a rendered table between a pair of markers in a markdown file
(``<!-- headline:start -->`` / ``<!-- headline:end -->`` in README.md,
``<!-- index:start -->`` / ``<!-- index:end -->`` in results/README.md). ``qerl results --readme
README.md --index results/README.md`` does both; ``tests/test_headline.py`` re-renders them and
compares, so the README cannot drift from the files.

A field a row needs and the file lacks raises `ResultsError` naming the file and the field, rather
than a KeyError three frames down: a results file rewritten by a newer benchmark should fail loudly.

`results_index` renders the table of results/README.md: one line per entry of ``results/`` with what
it holds (`studies/result_files.RESULT_FILES`, the one place those descriptions live), the device and
the command from its provenance block (a merged file's ``merged_by`` command where it has one). Commands
are shown with the kit's current names: ``qerl`` for ``python -m qerl_lib``, current module paths,
output files without the measuring machine's folder, and inputs that have since moved to ``dev/runs/``
under their new path. The JSONs keep the command exactly as it ran.
"""

from __future__ import annotations

import re
from pathlib import Path

from qerl_lib.paths import REPO_ROOT, RESULTS_DIR
from qerl_lib.studies.headline_training import training_rows
from qerl_lib.studies.kernel import gemm_headline
from qerl_lib.studies.result_files import RESULT_FILES  # also read as headline.RESULT_FILES by tests/test_headline.py
from qerl_lib.studies.result_reading import (BATCH8, ROLLOUT_KEYS, ResultsError, checked_rows, ci_text, device_name,
                                             fastest, field, ktok_text, load_result, markdown_table, model_size,
                                             provenances, times, tok_text)

MARKERS = {"headline": ("<!-- headline:start -->", "<!-- headline:end -->"),
           "index": ("<!-- index:start -->", "<!-- index:end -->"),
           "claims": ("<!-- claims:start -->", "<!-- claims:end -->"),
           "speed_claims": ("<!-- speed_claims:start -->", "<!-- speed_claims:end -->")}


# ---- the rows -----------------------------------------------------------------------------------

def _gemm_rows(results_dir) -> list[tuple]:
    file = "gemm_h100_v5.json"
    doc = load_result(results_dir, file)
    checked_rows(doc, file, ("model", "proj", "m", "speedup", "fp4_pct_copy", "bf16_pct_copy", "rel_err", "ok"))
    ceiling = field(doc, "ceiling", file=file)
    per = dict(sorted(gemm_headline(doc).items(), key=lambda kv: model_size(kv[0])))
    short = {m: m.replace("qwen2.5-", "").upper() for m in per}
    dev = device_name(doc, file)
    geo = ", ".join(f"{times(h['geomean_speedup_m_le_16'])} ({short[m]})" for m, h in per.items())
    best_model = max(per, key=lambda m: per[m]["best_m_le_16"]["speedup"])
    best = per[best_model]["best_m_le_16"]
    worst = ", ".join(f"{times(h['min_speedup_m_ge_1024'])} / "
                      f"{times(h['min_speedup_m_ge_1024_bwd']) if h['min_speedup_m_ge_1024_bwd'] is not None else '-'} ({short[m]})"
                      for m, h in per.items())
    return [
        ("FP4 GEMM vs cuBLAS bf16, decode sizes (M ≤ 16), geometric mean over the Qwen2.5 projection shapes",
         geo, dev, file),
        (f"FP4 GEMM, best single shape at M ≤ 16 (byte ceiling {ceiling:.2f}×)",
         f"{times(best['speedup'])} ({short[best_model]} {best['proj']}, M = {best['m']})", dev, file),
        ("FP4 GEMM, training sizes (M ≥ 1024), worst shape, forward / backward: dequantize + cuBLAS", worst, dev, file),
        _gemm_peer_row(results_dir),
    ]


def _gemm_peer_row(results_dir) -> tuple:
    """The forward FP4 GEMM at training sizes beside vLLM's Marlin FP4, as ranges over the shapes per M."""
    file = "gemm_marlin_peer_h200.json"
    doc = load_result(results_dir, file)
    rows = [r for r in checked_rows(doc, file, ("m", "kit_over_bf16", "marlin_over_bf16", "ok", "marlin_ok"))
            if r["ok"] and r["marlin_ok"]]
    if not (ms := sorted({r["m"] for r in rows})):
        raise ResultsError(f"{file}: no row with both outputs checked")
    ranges = {key: " / ".join(f"{times(min(v))}-{times(max(v))}" for v in ([r[key] for r in rows if r["m"] == m] for m in ms))
              for key in ("kit_over_bf16", "marlin_over_bf16")}
    return (f"FP4 GEMM forward vs cuBLAS bf16, Qwen2.5-7B shapes at M = {' / '.join(map(str, ms))}, beside vLLM "
            f"{field(doc, 'vllm', file=file)}'s Marlin FP4 in the same process (range over shapes)",
            f"kit {ranges['kit_over_bf16']}; Marlin {ranges['marlin_over_bf16']}", device_name(doc, file), file)


def _rollout_ratio_rows(results_dir, file: str, paper: bool) -> list[tuple]:
    doc = load_result(results_dir, file)
    rows = checked_rows(doc, file, ROLLOUT_KEYS)
    dev = device_name(doc, file)
    out = []
    for size in ("7b", "32b"):
        fp = fastest(rows, file, model=f"qwen2.5-{size}", weights="nvfp4", rank=0, **BATCH8)
        bf = fastest(rows, file, model=f"qwen2.5-{size}", weights="bf16", rank=0, **BATCH8)
        value = f"{tok_text(fp['tok_s'])} / {tok_text(bf['tok_s'])} tok/s = {times(fp['tok_s'] / bf['tok_s'])}"
        if paper:
            ref = field(doc, "summary", "paper_vllm_h100", file=file)
            p_fp, p_bf = field(ref, f"{size}_nvfp4_b8", file=file), field(ref, f"{size}_bf16_b8", file=file)
            value += f" (paper, vLLM on H100: {tok_text(p_fp)} / {tok_text(p_bf)} = {times(p_fp / p_bf)})"
        out.append((f"rollout, Qwen2.5-{size.upper()} shapes, batch 8, 256 + 2048 tokens: NVFP4 / bf16",
                    value, dev, file))
    return out


def _rollout_extra_rows(results_dir) -> list[tuple]:
    file = "rollout_h100.json"
    doc = load_result(results_dir, file)
    rows = checked_rows(doc, file, ROLLOUT_KEYS)
    dev = device_name(doc, file)
    fp = fastest(rows, file, model="qwen2.5-32b", weights="nvfp4", rank=0, **BATCH8)
    bf = fastest(rows, file, model="qwen2.5-32b", weights="bf16", rank=0, **BATCH8)
    fp_lora = fastest(rows, file, model="qwen2.5-7b", weights="nvfp4", rank=16, **BATCH8)
    bf_lora = fastest(rows, file, model="qwen2.5-7b", weights="bf16", rank=16, **BATCH8)
    return [
        ("peak GPU memory of that 32B rollout: NVFP4 vs bf16",
         f"{field(fp, 'peak_gib', file=file):.1f} vs {field(bf, 'peak_gib', file=file):.1f} GiB", dev, file),
        ("7B rollout with a rank-16 LoRA on all seven projections (unmerged): NVFP4 / bf16",
         f"{tok_text(fp_lora['tok_s'])} / {tok_text(bf_lora['tok_s'])} tok/s = {times(fp_lora['tok_s'] / bf_lora['tok_s'])}",
         dev, file),
    ]


def _rollout_14b_row(results_dir) -> tuple:
    file = "rollout_14b_h100.json"
    doc = load_result(results_dir, file)
    rows = checked_rows(doc, file, ROLLOUT_KEYS)
    ranks = sorted({r["rank"] for r in rows if r["error"] is None})
    tok = {(w, k): fastest(rows, file, model="qwen2.5-14b", weights=w, rank=k, **BATCH8)["tok_s"]
           for w in ("nvfp4", "bf16") for k in ranks}
    ref = field(doc, "summary", "paper_vllm_h100", file=file)
    p_fp, p_bf = field(ref, "14b_nvfp4_b8", file=file), field(ref, "14b_bf16_b8", file=file)
    parts = [f"r{k}: {tok_text(tok['nvfp4', k])} / {tok_text(tok['bf16', k])} tok/s = {times(tok['nvfp4', k] / tok['bf16', k])}"
             for k in ranks]
    return (f"rollout, Qwen2.5-14B shapes, batch 8, 256 + 2048 tokens, LoRA rank {' and '.join(map(str, ranks))}: "
            f"NVFP4 / bf16", "; ".join(parts) + f" (paper, vLLM on H100: {tok_text(p_fp)} / {tok_text(p_bf)} = "
            f"{times(p_fp / p_bf)})", device_name(doc, file), file)


def _rollout_nf4_rows(results_dir) -> list[tuple]:
    """NVFP4 / NF4 within the kit's engine; where the file has vLLM's rows too, NVFP4 / NF4 with both served by vLLM
    and the kit's NVFP4 against vLLM's NF4 (the paper's Fig. 1 QLoRA rollout ran in vLLM)."""
    file = "rollout_nf4_h200.json"
    doc = load_result(results_dir, file)
    rows = [r for r in checked_rows(doc, file, ROLLOUT_KEYS) if r["error"] is None and r["model"] == "qwen2.5-7b"]
    ref = field(doc, "summary", "paper_vllm_h100", file=file)
    p_fp, p_nf = field(ref, "7b_nvfp4_b8", file=file), field(ref, "7b_nf4_b8", file=file)
    paper = f"(paper, vLLM on H100, Fig. 1: {tok_text(p_fp)} / {tok_text(p_nf)} = {times(p_fp / p_nf)})"

    def cases(engine):
        return sorted({(r["batch"], r["rank"], r["gen_len"]) for r in rows
                       if r["weights"] == "nf4" and r["engine"] == engine})

    def tok(engine, weights, batch, rank, gen):
        return fastest(rows, file, engine=engine, weights=weights, batch=batch, rank=rank, gen_len=gen)["tok_s"]

    kit = cases("qerl")
    if not kit:
        raise ResultsError(f"{file}: no NF4 row measured")
    ratios = [times(tok("qerl", "nvfp4", *c) / tok("qerl", "nf4", *c)) for c in kit]
    nf4 = [tok_text(tok("qerl", "nf4", *c)) for c in kit]
    where = " / ".join(f"batch {b} r{k} 256 + {g}" for b, k, g in kit)
    out = [(f"rollout, Qwen2.5-7B shapes, same run: NVFP4 / NF4 (QLoRA's base, bitsandbytes) in the kit's engine, "
            f"{where}", f"{' / '.join(ratios)} (NF4 {' / '.join(nf4)} tok/s) {paper}", device_name(doc, file), file)]
    served = cases("vllm")
    if served:
        both = [times(tok("vllm", "nvfp4", *c) / tok("vllm", "nf4", *c)) for c in served]
        kit_fp = [times(tok("qerl", "nvfp4", *c) / tok("vllm", "nf4", *c)) for c in served]
        nf4 = [tok_text(tok("vllm", "nf4", *c)) for c in served]
        where = " / ".join(f"batch {b} r{k} 256 + {g}" for b, k, g in served)
        out.append((f"rollout, Qwen2.5-7B shapes, same run: NVFP4 / NF4 both served by vLLM 0.24 (bitsandbytes for "
                    f"NF4), and the kit's NVFP4 / vLLM's NF4, {where}",
                    f"vLLM {' / '.join(both)}; kit {' / '.join(kit_fp)} (vLLM NF4 {' / '.join(nf4)} tok/s) {paper}",
                    device_name(doc, file), file))
    return out


def _rollout_merge_row(results_dir) -> tuple:
    """What a bf16 base's adapter costs the rollout against the same run's rank-0 row: merged into engine-owned weight
    copies (``RolloutEngine(lora_merge=True)``) and through the unmerged kernels; and the copies' peak memory."""
    file = "rollout_lora_merge_h200.json"
    doc = load_result(results_dir, file)
    rows = [r for r in checked_rows(doc, file, ROLLOUT_KEYS + ("lora_merged",)) if r["error"] is None and r["weights"] == "bf16"]
    cases = sorted({(r["batch"], r["rank"], r["gen_len"]) for r in rows if r["lora_merged"]})
    if not cases:
        raise ResultsError(f"{file}: no row with lora_merged true")

    def row(batch, rank, gen, merged):
        return fastest(rows, file, batch=batch, rank=rank, gen_len=gen, lora_merged=merged)

    def cost(case, merged):
        return f"{100 * (1 - row(*case, merged)['tok_s'] / row(case[0], 0, case[2], False)['tok_s']):.1f}%"

    more = max(row(*c, True)["peak_gib"] - row(*c, False)["peak_gib"] for c in cases)
    where = " / ".join(f"batch {b} r{k} 256 + {g}" for b, k, g in cases)
    return (f"bf16 + LoRA rollout, Qwen2.5-7B shapes, same run: tokens/s lost to the adapter against no adapter, "
            f"merged into engine-owned weight copies (`lora_merge`) / unmerged kernels, {where}",
            f"merged {' / '.join(cost(c, True) for c in cases)}; unmerged {' / '.join(cost(c, False) for c in cases)} "
            f"(the copies: +{more:.1f} GiB peak)", device_name(doc, file), file)


def _fixed_rows(results_dir, file: str):
    """(every row, the fixed-length rows, device, tok/s lookup, gen_len) of one engine-vs-vLLM results file."""
    doc = load_result(results_dir, file)
    every = checked_rows(doc, file, ROLLOUT_KEYS + ("workload", "prompts", "scheduling"))
    rows = [r for r in every if r["workload"] == "fixed" and r["prompts"] is None]
    gen = fastest(rows, file, engine="qerl", model="qwen2.5-7b", rank=16)["gen_len"]
    common = dict(model="qwen2.5-7b", rank=16, prompt_len=256, gen_len=gen)

    def tok(engine, weights, batch):
        return fastest(rows, file, engine=engine, weights=weights, batch=batch, **common)["tok_s"]
    return every, rows, device_name(doc, file), tok, gen


def _batches(rows: list[dict], engine: str, weights: str) -> list[int]:
    return sorted({r["batch"] for r in rows if r["engine"] == engine and r["weights"] == weights and r["rank"] == 16
                   and r["model"] == "qwen2.5-7b"})


LEAD = "kit engine / vLLM 0.24, same run, same Qwen2.5-7B-shaped checkpoint, prompts and adapters"


def _where(batches, gen) -> str:
    return f"batch {' / '.join(map(str, batches))}, 256 + {gen} tokens"


def _ratios(pairs) -> str:
    return " / ".join(times(a / b) for a, b in pairs)


def _peer_nvfp4_row(results_dir, file: str) -> tuple:
    """The kit's engine over vLLM, NVFP4 + r16 at every batch of one same-run file, with the kit's tokens/s."""
    _, rows, dev, tok, gen = _fixed_rows(results_dir, file)
    batches = _batches(rows, "vllm", "nvfp4")
    return (f"{LEAD}, NVFP4 + LoRA r16, {_where(batches, gen)}",
            _ratios((tok("qerl", "nvfp4", b), tok("vllm", "nvfp4", b)) for b in batches)
            + f" (kit {' / '.join(tok_text(tok('qerl', 'nvfp4', b)) for b in batches)} tok/s)", dev, file)


def _uneven_row(every: list[dict], dev: str, file: str) -> tuple:
    """Continuous batching against the static batch and vLLM on one file's uneven workload."""
    label = {"nvfp4": "NVFP4", "bf16": "bf16"}
    uneven = [r for r in every if r["workload"] != "fixed"]
    cont = fastest(uneven, file, engine="qerl", scheduling="continuous")
    static = fastest(uneven, file, engine="qerl", scheduling="static", batch=cont["batch"], rank=cont["rank"])
    peer = fastest(uneven, file, engine="vllm", batch=cont["batch"], rank=cont["rank"])
    return (f"uneven rollout, {cont['prompts']} {cont['workload']} completions of <= {cont['gen_len']} tokens on "
            f"{cont['batch']} rows, {label[cont['weights']]} + LoRA r{cont['rank']}: kit continuous / kit static / vLLM",
            f"{tok_text(cont['tok_s'])} / {tok_text(static['tok_s'])} / {tok_text(peer['tok_s'])} tok/s: "
            f"{times(cont['tok_s'] / static['tok_s'])} over static, {times(cont['tok_s'] / peer['tok_s'])} over vLLM",
            dev, file)


def _vllm_rows(results_dir) -> list[tuple]:
    """The kit's engine against vLLM in the same run: fixed lengths per batch, NVFP4/bf16 in each, uneven rollout.
    NVFP4 + r16 comes from the newer run (``rollout_vllm_r16_h100.json``), the kit's NVFP4 / bf16 from the newest
    kit-only run (``rollout_r16_h100.json``); bf16 + r16, vLLM's NVFP4 / bf16 and the uneven rollout from the earlier
    full set (``rollout_vllm_h100.json``)."""
    kit_file = "rollout_r16_h100.json"
    _, rows_kit, dev_kit, tok_kit, gen_kit = _fixed_rows(results_dir, kit_file)
    b_ratio = sorted(set(_batches(rows_kit, "qerl", "nvfp4")) & set(_batches(rows_kit, "qerl", "bf16")))
    file = "rollout_vllm_h100.json"
    every, rows, dev, tok, gen = _fixed_rows(results_dir, file)
    batches = _batches(rows, "vllm", "bf16")
    return [_peer_nvfp4_row(results_dir, "rollout_vllm_r16_h100.json"),
            (f"{LEAD}, bf16 + LoRA r16, {_where(batches, gen)}",
             _ratios((tok("qerl", "bf16", b), tok("vllm", "bf16", b)) for b in batches)
             + f" (kit {' / '.join(tok_text(tok('qerl', 'bf16', b)) for b in batches)} tok/s)", dev, file),
            (f"NVFP4 / bf16 with LoRA r16, kit engine, same run, {_where(b_ratio, gen_kit)}",
             " / ".join(times(tok_kit("qerl", "nvfp4", b) / tok_kit("qerl", "bf16", b), 3) for b in b_ratio)
             + f" (NVFP4 {' / '.join(tok_text(tok_kit('qerl', 'nvfp4', b)) for b in b_ratio)}, bf16 "
             + f"{' / '.join(tok_text(tok_kit('qerl', 'bf16', b)) for b in b_ratio)} tok/s)", dev_kit, kit_file),
            (f"NVFP4 / bf16 with LoRA r16, vLLM 0.24 (Marlin FP4), same run, {_where(batches, gen)}",
             _ratios((tok("vllm", "nvfp4", b), tok("vllm", "bf16", b)) for b in batches), dev, file),
            _uneven_row(every, dev, file)]


def _vllm_h200_rows(results_dir) -> list[tuple]:
    """The same-run comparison on the H200 (``rollout_vllm_h200.json``): the 7B NVFP4 + r16 batches, the uneven
    workload, and the larger models' batch-8 rows beside the paper's vLLM figures for them."""
    file = "rollout_vllm_h200.json"
    every, _, dev, _, _ = _fixed_rows(results_dir, file)
    out = [_peer_nvfp4_row(results_dir, file), _uneven_row(every, dev, file)]
    large = sorted({r["model"] for r in every if r["model"] != "qwen2.5-7b" and r["engine"] == "vllm"
                    and r["workload"] == "fixed" and r["error"] is None}, key=model_size)
    if large:
        ref = field(load_result(results_dir, file), "summary", "paper_vllm_h100", file=file)

        def tok(model, engine):
            return fastest(every, file, model=model, engine=engine, weights="nvfp4", batch=8, prompt_len=256,
                           gen_len=2048, workload="fixed")

        kit, peer = {m: tok(m, "qerl") for m in large}, {m: tok(m, "vllm") for m in large}
        ranks = sorted({kit[m]["rank"] for m in large} | {peer[m]["rank"] for m in large})
        sizes = [m.replace("qwen2.5-", "") for m in large]
        paper = " / ".join(tok_text(field(ref, f"{s}_nvfp4_b8", file=file)) for s in sizes)
        out.append((f"kit engine / vLLM 0.24, same run, Qwen2.5-{' / '.join(s.upper() for s in sizes)} shapes, "
                    f"NVFP4 + LoRA r{' / r'.join(map(str, ranks))}, batch 8, 256 + 2048 tokens",
                    _ratios((kit[m]["tok_s"], peer[m]["tok_s"]) for m in large)
                    + f" (kit {' / '.join(tok_text(kit[m]['tok_s']) for m in large)}, vLLM "
                    + f"{' / '.join(tok_text(peer[m]['tok_s']) for m in large)} tok/s) "
                    + f"(paper, vLLM on H100, Tab. 7-8, rank not stated: {paper} tok/s)", dev, file))
    return out


def _engine_vs_generate(results_dir, file: str) -> tuple:
    doc = load_result(results_dir, file)
    rows = checked_rows(doc, file, ROLLOUT_KEYS)
    hf = fastest(rows, file, model="smollm2", weights="bf16", batch=64, engine="hf-generate")
    eng = fastest(rows, file, model="smollm2", weights="bf16", batch=64, engine="qerl", rank=0,
                  prompt_len=hf["prompt_len"], gen_len=hf["gen_len"])
    return (f"kit engine vs `transformers.generate`, SmolLM2-135M bf16, batch 64, "
            f"{hf['prompt_len']} + {hf['gen_len']} tokens",
            f"{ktok_text(eng['tok_s'])} / {ktok_text(hf['tok_s'])} tok/s = {eng['tok_s'] / hf['tok_s']:.1f}×",
            device_name(doc, file), file)


def _entropy_rows(results_dir) -> list[tuple]:
    file = "entropy_study_cuda.json"
    doc = load_result(results_dir, file)
    dev = device_name(doc, file)
    n = field(doc, "n_problems", file=file)
    source = field(doc, "data", "source", file=file)
    diff = field(doc, "formats", "nvfp4", "diff_vs_bf16", file=file)
    points = field(doc, "aqn", "points", file=file)
    top = max(points, key=lambda p: field(p, "sigma", file=file))
    where = f"SmolLM2-135M, {n} {source.upper()} test problems"
    return [
        (f"next-token entropy, NVFP4 − BF16, on fixed reference solutions ({where})",
         ci_text(field(diff, "entropy_gold", file=file), file), dev, file),
        ("the same on each model's own samples (temperature 1)",
         ci_text(field(diff, "entropy_own", file=file), file), dev, file),
        (f"AQN noise σ = {top['sigma']:g} on top of NVFP4, same reference solutions",
         ci_text(field(top, "diff_vs_sigma0_gold", file=file), file), dev, file),
    ]


TOPICS = ("gemm", "rollout", "entropy", "training")


def headline_rows(results_dir: str | Path = RESULTS_DIR,
                  topics: tuple[str, ...] = TOPICS) -> list[tuple[str, str, str, str]]:
    """(quantity, value, device, file) for every row of the README's results table, by topic
    (``gemm``, ``rollout``, ``entropy``, ``training``; a notebook shows its own topic)."""
    unknown = set(topics) - set(TOPICS)
    if unknown:
        raise ValueError(f"unknown topics {sorted(unknown)}: choose from {TOPICS}")
    rows: list[tuple] = []
    if "gemm" in topics:
        rows += _gemm_rows(results_dir)
    if "rollout" in topics:
        rows += [*_rollout_ratio_rows(results_dir, "rollout_h100.json", paper=True),
                 *_rollout_ratio_rows(results_dir, "rollout_h200.json", paper=False),
                 *_rollout_extra_rows(results_dir),
                 _rollout_14b_row(results_dir),
                 *_rollout_nf4_rows(results_dir),
                 _rollout_merge_row(results_dir),
                 *_vllm_rows(results_dir),
                 *_vllm_h200_rows(results_dir),
                 _engine_vs_generate(results_dir, "rollout_h100.json"),
                 _engine_vs_generate(results_dir, "rollout_h200.json")]
    if "entropy" in topics:
        rows += _entropy_rows(results_dir)
    if "training" in topics:
        rows += training_rows(results_dir)
    return rows


def render_headline(results_dir: str | Path = RESULTS_DIR, topics: tuple[str, ...] = TOPICS) -> str:
    """The README's results table (markdown), every cell computed from the files in `results_dir`."""
    return markdown_table(("quantity", "value", "device", "file"),
                  [(q, v, d, f"`results/{f}`") for q, v, d, f in headline_rows(results_dir, topics)])


# ---- results/README.md's index ------------------------------------------------------------------

def display_command(command: str, repo_root: str | Path = REPO_ROOT) -> str:
    """A recorded command with the kit's current names (see the module docstring); the JSON keeps the original."""
    cmd = re.sub(r"^(\S*/)?__main__\.py\b", "qerl", command.strip())
    cmd = re.sub(r"^python3? -m qerl_lib\b", "qerl", cmd)
    cmd = cmd.replace("qerl_lib.entropy_study.", "qerl_lib.studies.entropy.")
    cmd = re.sub(r"^(\w+\.py)\b", r"python dev/sweeps/\1", cmd)
    cmd = re.sub(r"(?<=\s)/\S+/([^/\s]+)", r"\1", cmd)  # the measuring machine's output folder

    def moved(m: re.Match) -> str:
        name = m.group(1)
        gone = not (Path(repo_root) / "results" / name).exists() and (Path(repo_root) / "dev" / "runs" / name).exists()
        return f"dev/runs/{name}" if gone else m.group(0)
    return re.sub(r"\bresults/([\w.-]+)", moved, cmd)


def _file_provenance(results_dir: Path, name: str) -> tuple[dict, str]:
    """(document holding the provenance, its file label) for a results entry (a folder: its run.json, or
    else its first JSON file)."""
    label = name
    if name.endswith("/"):
        folder = results_dir / name
        first = next(iter(sorted(folder.glob("*.json"))), None) if folder.is_dir() else None
        label = f"{name}run.json" if (folder / "run.json").is_file() or first is None else f"{name}{first.name}"
    return load_result(results_dir, label), label


def results_index(results_dir: str | Path = RESULTS_DIR, repo_root: str | Path = REPO_ROOT) -> str:
    """results/README.md's table: file | what | device | command, one row per `RESULT_FILES` entry."""
    results_dir = Path(results_dir)
    rows = []
    for name, what in RESULT_FILES.items():
        doc, label = _file_provenance(results_dir, name)
        if "merged_by" in doc:
            command = display_command(field(doc, "merged_by", "command", file=label), repo_root)
        else:
            command = display_command(field(provenances(doc, label)[0], "command", file=label), repo_root)
        rows.append((f"`{name}`", what, device_name(doc, label), f"`{command}`"))
    return markdown_table(("file", "what", "device", "command"), rows)


def unlisted_entries(results_dir: str | Path = RESULTS_DIR) -> tuple[list[str], list[str]]:
    """(entries of `results_dir` that `RESULT_FILES` does not describe, described entries that are missing)."""
    results_dir = Path(results_dir)
    present = {p.name + ("/" if p.is_dir() else "") for p in results_dir.iterdir() if p.name != "README.md"}
    return sorted(present - set(RESULT_FILES)), sorted(set(RESULT_FILES) - present)


# ---- writing into markdown ----------------------------------------------------------------------

def update_block(text: str, block: str, body: str) -> str:
    """`text` with the lines between `block`'s two markers replaced by `body`."""
    start, end = MARKERS[block]
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise ResultsError(f"expected one {start} line followed by one {end} line")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{start}\n{body}\n{end}{tail}"


def read_block(text: str, block: str) -> str:
    """What stands between `block`'s markers in `text` (without the surrounding newlines)."""
    start, end = MARKERS[block]
    if start not in text or end not in text:
        raise ResultsError(f"no {start} ... {end} block")
    return text.split(start, 1)[1].split(end, 1)[0].strip("\n")

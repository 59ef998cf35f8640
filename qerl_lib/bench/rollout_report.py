"""`qerl bench rollout`'s report: the acceptance summary, merging runs, and the fixed-width table.

``summarize`` turns measured rows into ratios (NVFP4 over bf16 per configuration; continuous over
static batching on the same rollout) and the acceptance targets, each with its value and whether it
was met; ``merge_results`` joins several runs' documents (one GPU call per model size, say) and
recomputes the summary; ``render_rollout_report`` prints the table. Rows are ``bench.rollout.Row``.
"""

from __future__ import annotations

from dataclasses import asdict

from qerl_lib.bench.table import format_table, table_row

# Acceptance targets of the rollout engine (the paper's vLLM numbers in parentheses).
TARGETS = {
    "engine_vs_hf_smollm2_b64": 10.0,  # engine tok/s / transformers.generate tok/s at batch 64
    "nvfp4_over_bf16_7b_b8": 1.6,  # (paper: 1.27x)
    "nvfp4_over_bf16_32b_b8": 2.2,  # (paper: 2.0x)
    "nvfp4_tok_s_7b_b8": 3000.0,  # (paper: 2092 with vLLM + Marlin)
    "nvfp4_peak_gib_32b_b8": 80.0 * 1e9 / 2**30,  # must fit an 80 GB GPU
    "continuous_over_static_7b": 1.5,  # uneven lengths: continuous batching tok/s / static batches' (same outputs)
    "nvfp4_over_nf4_7b_b8_r16": 1.5,  # the paper's "vs QLoRA", measured: NVFP4 / bitsandbytes NF4, LoRA r16
    "kit_over_vllm_7b_nvfp4_r16": 1.25,  # the kit's engine / vLLM, same checkpoint and run; worst batch of 8-128
    "nvfp4_tok_s_7b_b8_r16": 2600.0,  # with a rank-16 adapter (vLLM 0.24 on the same H100: 1486 at 256 + 2048)
    "nvfp4_tok_s_14b_b8_r32": 1350.0,  # (paper: 1091, rank not stated)
    "lora_overhead_7b_b8_r16": 0.05,  # at most: 1 - tok/s with the adapter / without, worse of NVFP4 and bf16
    "lora_overhead_7b_b8_r64": 0.10,  # at most
    "nvfp4_over_bf16_7b_b32_r16": 1.6,  # with LoRA r16, worst generation length measured
    "nvfp4_over_bf16_7b_b64_r16": 1.4,
}
AT_MOST = ("nvfp4_peak_gib_32b_b8", "lora_overhead_7b_b8_r16", "lora_overhead_7b_b8_r64")  # the rest: at least


# The paper's rollout throughput (tokens/s, vLLM on one H100, 256 prompt / up to 2048 generated,
# Tables 5-8; QLoRA's NF4 at 7B from Fig. 1), for context in the JSON; not comparable one to one (see
# bench/rollout.py's docstring).
PAPER_TOK_S = {"7b_bf16_b8": 1641.1, "7b_nvfp4_b8": 2091.8, "14b_bf16_b8": 737.2, "14b_nvfp4_b8": 1091.1,
               "32b_bf16_b8": 344.3, "32b_nvfp4_b8": 688.2, "7b_bf16_b2": 115.4, "7b_nvfp4_b2": 151.6,
               "14b_bf16_b2": 65.4, "14b_nvfp4_b2": 95.3, "32b_bf16_b2": 34.0, "32b_nvfp4_b2": 60.0,
               "7b_nf4_b8": 1362.0}


def summarize(rows: list) -> dict:
    """NVFP4/bf16 and NVFP4/NF4 ratios for every (size, batch, rank, lengths) measured both ways, and the acceptance
    criteria, each with its target and whether it was met. Where several backends were measured for
    one configuration, the fastest counts (the engine uses whichever measures faster). The checks read the
    default engine's rows: merged-adapter rows (``lora_merged``, an option with a memory cost) are summarized beside
    them, never in their place."""
    def find(**kw):
        kw.setdefault("lora_merged", False)
        hits = [r for r in rows if r.error is None and r.tok_s and all(getattr(r, k) == v for k, v in kw.items())]
        return max(hits, key=lambda r: r.tok_s) if hits else None

    out: dict = {}
    checks = []
    hf = find(model="smollm2", weights="bf16", batch=64, engine="hf-generate")
    if hf is not None:  # like for like: the engine at the baseline's prompt and generation lengths
        eng = find(model="smollm2", weights="bf16", batch=64, engine="qerl", rank=0, gen_len=hf.gen_len,
                   prompt_len=hf.prompt_len)
        if eng is not None:
            checks.append(("engine_vs_hf_smollm2_b64", eng.tok_s / hf.tok_s))
    for size in ("3b", "7b", "14b", "32b"):
        for key in sorted({(r.batch, r.rank, r.prompt_len, r.gen_len) for r in rows}):
            batch, rank, plen, glen = key
            common = dict(model=f"qwen2.5-{size}", batch=batch, rank=rank, prompt_len=plen, gen_len=glen, engine="qerl",
                          scheduling="static", prompts=None)
            fp = find(weights="nvfp4", **common)
            for base in ("bf16", "nf4"):
                other = find(weights=base, **common)
                if other is not None and fp is not None:
                    out[f"nvfp4_over_{base}_{size}_b{batch}_r{rank}_p{plen}_g{glen}"] = fp.tok_s / other.tok_s
    if "nvfp4_over_nf4_7b_b8_r16_p256_g2048" in out:
        checks.append(("nvfp4_over_nf4_7b_b8_r16", out["nvfp4_over_nf4_7b_b8_r16_p256_g2048"]))
    # the criteria's setting: batch 8, 256-token prompts, 2048 generated tokens, no adapter
    setting = "b8_r0_p256_g2048"
    for size in ("7b", "32b"):
        if f"nvfp4_over_bf16_{size}_{setting}" in out:
            checks.append((f"nvfp4_over_bf16_{size}_b8", out[f"nvfp4_over_bf16_{size}_{setting}"]))
    headline = dict(weights="nvfp4", batch=8, rank=0, prompt_len=256, gen_len=2048, engine="qerl", scheduling="static",
                    prompts=None)
    fp7 = find(model="qwen2.5-7b", **headline)
    if fp7 is not None:
        checks.append(("nvfp4_tok_s_7b_b8", fp7.tok_s))
    for size, rank in (("7b", 16), ("14b", 32)):
        hit = find(model=f"qwen2.5-{size}", **{**headline, "rank": rank})
        if hit is not None:
            checks.append((f"nvfp4_tok_s_{size}_b8_r{rank}", hit.tok_s))
    for rank in (16, 64):  # what an adapter costs the engine, NVFP4 and bf16 alike
        costs = []
        for weights in ("nvfp4", "bf16"):
            base, lora = (find(model="qwen2.5-7b", **{**headline, "weights": weights, "rank": r}) for r in (0, rank))
            if base is not None and lora is not None:
                costs.append(1.0 - lora.tok_s / base.tok_s)
                out[f"lora_overhead_7b_{weights}_b8_r{rank}"] = costs[-1]
        if costs:
            checks.append((f"lora_overhead_7b_b8_r{rank}", max(costs)))
    for r in rows:  # what a merged bf16 adapter costs, against the same setting without an adapter
        same = {k: getattr(r, k) for k in CONFIGURATION if k not in ("rank", "lora_merged")}
        base = find(**same, rank=0) if r.lora_merged else None
        if base is not None and r.error is None and r.tok_s:
            size = r.model.removeprefix("qwen2.5-")
            out[f"lora_overhead_merged_{size}_{r.weights}_b{r.batch}_r{r.rank}_p{r.prompt_len}_g{r.gen_len}"] = \
                1.0 - r.tok_s / base.tok_s
    for batch in (32, 64):
        found = [v for k, v in out.items() if k.startswith(f"nvfp4_over_bf16_7b_b{batch}_r16_p256_")]
        if found:
            checks.append((f"nvfp4_over_bf16_7b_b{batch}_r16", min(found)))
    fp32 = find(model="qwen2.5-32b", **headline)
    if fp32 is not None and fp32.peak_gib is not None:
        checks.append(("nvfp4_peak_gib_32b_b8", fp32.peak_gib))
    # continuous batching against static batches on the same rollout (workload, prompts, lengths, rank)
    ratios_7b = []
    for r in rows:
        if r.scheduling != "continuous" or r.error is not None or not r.tok_s:
            continue
        static = find(model=r.model, weights=r.weights, batch=r.batch, rank=r.rank, prompt_len=r.prompt_len,
                      gen_len=r.gen_len, workload=r.workload, prompts=r.prompts, engine=r.engine, scheduling="static")
        if static is not None:
            ratio = r.tok_s / static.tok_s
            out[f"continuous_over_static_{r.model}_{r.weights}_b{r.batch}_r{r.rank}_n{r.prompts}_{r.workload}"] = ratio
            if r.model == "qwen2.5-7b":
                ratios_7b.append(ratio)
    if ratios_7b:
        checks.append(("continuous_over_static_7b", min(ratios_7b)))
    # the kit's engine against vLLM on the same checkpoint, prompts and lengths (bench/vllm_peer.py)
    peer_7b = []
    for r in rows:
        if r.engine != "vllm" or r.error is not None or not r.tok_s:
            continue
        # the same rollout (workload, prompts); the kit's faster scheduling counts, as vLLM runs its own best
        kit = find(model=r.model, weights=r.weights, batch=r.batch, rank=r.rank, prompt_len=r.prompt_len,
                   gen_len=r.gen_len, engine="qerl", prompts=r.prompts, workload=r.workload)
        if kit is not None:
            size = r.model.removeprefix("qwen2.5-")
            fixed = r.workload == "fixed" and r.prompts is None
            rollout = "" if fixed else f"_n{r.prompts or r.batch}_{r.workload}"
            out[f"kit_over_vllm_{size}_{r.weights}_b{r.batch}_r{r.rank}_p{r.prompt_len}_g{r.gen_len}{rollout}"] = \
                kit.tok_s / r.tok_s
            if fixed and (r.model, r.weights, r.rank) == ("qwen2.5-7b", "nvfp4", 16) and r.batch in (8, 32, 64, 128):
                peer_7b.append(kit.tok_s / r.tok_s)
    if peer_7b:
        checks.append(("kit_over_vllm_7b_nvfp4_r16", min(peer_7b)))
    # the paper's "vs QLoRA" as it measured it: QLoRA's NF4 base served by vLLM, against NVFP4 in each engine
    for r in rows:
        if r.engine != "vllm" or r.weights != "nf4" or r.error is not None or not r.tok_s:
            continue
        same = dict(model=r.model, batch=r.batch, rank=r.rank, prompt_len=r.prompt_len, gen_len=r.gen_len,
                    prompts=r.prompts, workload=r.workload)
        size = r.model.removeprefix("qwen2.5-")
        for engine, label in (("qerl", "kit"), ("vllm", "vllm")):
            fp = find(weights="nvfp4", engine=engine, **same)
            if fp is not None:
                out[f"{label}_nvfp4_over_vllm_nf4_{size}_b{r.batch}_r{r.rank}_p{r.prompt_len}_g{r.gen_len}"] = \
                    fp.tok_s / r.tok_s
    out["paper_vllm_h100"] = PAPER_TOK_S
    out["targets"] = {k: {"value": round(v, 3), "target": round(TARGETS[k], 3),
                          "met": v <= TARGETS[k] if k in AT_MOST else v >= TARGETS[k]}
                      for k, v in checks}
    return out


# what makes two rows the same measurement, for `merge_results`
CONFIGURATION = ("model", "weights", "batch", "rank", "backend", "engine", "prompt_len", "gen_len", "workload",
                 "scheduling", "prompts", "lora_merged")


def merge_results(docs: list[dict]) -> dict:
    """One results document from several runs (e.g. one GPU call per model size): rows concatenated in
    the order given, except that a configuration measured again in a later document replaces that
    configuration's rows of the earlier ones (a re-measurement after a code change supersedes the old
    rows instead of sitting beside them, where the summary's "fastest counts" would pick between
    them); every run's provenance and config kept, the summary recomputed over the rows kept."""
    from qerl_lib.bench.rollout import Row
    from qerl_lib.io import provenance

    def configuration(row) -> tuple:
        return tuple(getattr(row, k) for k in CONFIGURATION)

    rows: list = []
    for d in docs:
        batch = [Row(**r) for r in d["rows"]]
        again = {configuration(r) for r in batch}
        rows = [r for r in rows if configuration(r) not in again] + batch
    return {"merged_by": provenance(), "provenance": [d["provenance"] for d in docs],
            "code": [d.get("code") for d in docs],
            "config": [d["config"] for d in docs],
            "rows": [asdict(r) for r in rows], "summary": summarize(rows)}


# ---- output -------------------------------------------------------------------------------------
TABLE_COLUMNS = (("model", "", 13), ("weights", "", 7), ("batch", "", 5), ("rank", "", 4), ("engine", "", 11),
                 ("backend", "", 12), ("gen_len", "", 7), ("tok_s", ".0f", 9), ("decode_tok_s", ".0f", 12),
                 ("ms_per_step", ".2f", 11), ("ttft_ms", ".0f", 8), ("peak_gib", ".2f", 8),
                 ("weights_gib", ".2f", 11), ("slot_utilization", ".2f", 16), ("scheduling", "", 10),
                 ("prompts", "", 7), ("lora_merged", "", 11))


def format_row(row) -> str:
    """One row of the table (``TABLE_COLUMNS``), with its error appended if it failed."""
    line = table_row(asdict(row), TABLE_COLUMNS)
    return f"{line}  ERROR {row.error}" if row.error else line


def render_rollout_report(result: dict) -> str:
    """The fixed-width table of every row, the rows that failed with their errors, then each
    acceptance target and whether it was met."""
    rows = result["rows"]
    lines = [format_table(rows, TABLE_COLUMNS)]
    lines += [f"ERROR {r.get('model')} {r.get('weights')} batch {r.get('batch')} rank {r.get('rank')}: {r['error']}"
              for r in rows if r.get("error")]
    for key, t in result["summary"].get("targets", {}).items():
        lines.append(f"{key:<28} {t['value']:>10} target {t['target']:>8}  {'met' if t['met'] else 'MISSED'}")
    return "\n".join(lines)

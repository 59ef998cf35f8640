"""The paper's speed and memory claims, each beside the kit's measurement and a verdict, read from results/.

The training claims have their own table (`studies/claims_table.py`: seeds, intervals, a pre-registered plan). These
are the paper's claims about time and memory (§4.2-4.3, Tables 3 and 5-8, Fig. 1). Each is a ratio or a size, and
here each is measured on random-weight Qwen2.5 shapes with the kit's engine and trainer; speed and memory do not
depend on the weights' values. Which baseline each of the paper's speedups is against is settled in
docs/paper_settings.md ("Which speedup is which"). Each claim below is one rule on the committed JSONs:

* a speedup holds when every measured ratio is at least the paper's; a larger ratio means the claim is met, not that
  the paper's number is reproduced, because the kit runs its own stack (the paper ran vLLM and TRL);
* a memory share holds where the kit's share is at most the paper's bound; the verdict names the models where it does;
* a claim no committed file measures is listed as "not measured", so the table shows what is missing;
* "fits one 80 GB GPU" holds when the step's peak is below the capacity of the H100 the kit measured on (from that
  run's provenance). The paper's statement that 16-bit LoRA does not fit is tested the same way, so it does not hold
  when the kit's 16-bit step fits; a 16-bit 32B step run on an H100 decides it directly (out of memory: it holds).

Where this deviates from the paper: a step speedup here is the ratio of medians over a few steps of one run, while the
paper averages its first 30 steps. The completions are full length (2048 tokens: random weights rarely stop), which
gives the rollout the largest share of the step it can have. Tables 6-8's batch-2 rollout ratios are read from the
rollout phase of the kit's batch-2 GRPO steps, at LoRA r32 where those tables use r16. The ratios carry no interval:
each row is one run's measurement, and `results/` keeps the repeats.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from qerl_lib.bench.rollout_report import PAPER_TOK_S
from qerl_lib.studies.result_reading import (BATCH8, ROLLOUT_KEYS, ResultsError, checked_rows, device_name, fastest,
                                             field, load_result, markdown_table, matching_row, provenances, times,
                                             tok_text)
from qerl_lib.studies.train_bench import PAPER as PAPER_STEP

# §4.2: "the model size falls to 25%-30% of 16-bit"; the model sizes of Tables 3 and 5-8 (bf16 GB, NVFP4 GB)
PAPER_WEIGHT_SHARE = 0.30
PAPER_WEIGHT_GB = {"qwen2.5-7b": (15.2, 5.9), "qwen2.5-14b": (29.6, 10.6), "qwen2.5-32b": (62.3, 20.7)}
# §4.3: QeRL uses "40%-50% of the GPU memory of vanilla LoRA"
PAPER_MEMORY_SHARE = 0.50
STEP_H100, STEP_H200 = "train_step_h100.json", "train_step_merge_h200.json"
PAPER_LORA_32B = "Tab. 8: out of memory, with and without gradient checkpointing"
HEADER = ("claim", "paper", "kit", "device", "verdict")


def _paper_factor(model: str, mode: str, batch: int) -> float:
    """Tab. 3's step-time factor over 16-bit LoRA ("x1.2 vs lora" -> 1.2)."""
    return float(re.match(r"x([0-9.]+) vs lora", PAPER_STEP[model, mode, batch]).group(1))


def _verdict(holds: bool) -> str:
    return "**holds**" if holds else "**does not hold**"


def _size(model: str) -> str:
    return model.split("-")[1].upper()


def _rollout_rows(results_dir) -> list[tuple]:
    file = "rollout_h100.json"
    doc = load_result(results_dir, file)
    rows, dev = checked_rows(doc, file, ROLLOUT_KEYS), device_name(doc, file)
    ref = field(doc, "summary", "paper_vllm_h100", file=file)
    paper = {k: field(ref, k, file=file) for k in ("7b_nvfp4_b8", "7b_bf16_b8", "32b_nvfp4_b8", "32b_bf16_b8")}

    def tok(size, weights, rank):
        return fastest(rows, file, model=f"qwen2.5-{size}", weights=weights, rank=rank, **BATCH8)["tok_s"]

    p7 = paper["7b_nvfp4_b8"] / paper["7b_bf16_b8"]
    k7 = tok("7b", "nvfp4", 16) / tok("7b", "bf16", 16)
    vfile = "rollout_vllm_h100.json"
    vdoc = load_result(results_dir, vfile)
    vrows = [r for r in checked_rows(vdoc, vfile, ROLLOUT_KEYS + ("workload",)) if r["workload"] == "fixed"]
    vllm = {w: fastest(vrows, vfile, model="qwen2.5-7b", weights=w, rank=16, batch=8, engine="vllm")
            for w in ("nvfp4", "bf16")}
    v7 = vllm["nvfp4"]["tok_s"] / vllm["bf16"]["tok_s"]
    p32 = paper["32b_nvfp4_b8"] / paper["32b_bf16_b8"]
    k32 = tok("32b", "nvfp4", 0) / tok("32b", "bf16", 0)

    nf_file = "rollout_nf4_h200.json"
    nf_doc = load_result(results_dir, nf_file)
    nf_rows = checked_rows(nf_doc, nf_file, ROLLOUT_KEYS)
    nf_ref = field(nf_doc, "summary", "paper_vllm_h100", file=nf_file)
    nf_paper = {k: field(nf_ref, k, file=nf_file) for k in ("7b_nvfp4_b8", "7b_nf4_b8")}
    pq = nf_paper["7b_nvfp4_b8"] / nf_paper["7b_nf4_b8"]

    def nf(engine, weights):
        return fastest(nf_rows, nf_file, model="qwen2.5-7b", weights=weights, rank=16, batch=8, gen_len=2048,
                       engine=engine)["tok_s"]

    kq, vq = nf("qerl", "nvfp4") / nf("qerl", "nf4"), nf("vllm", "nvfp4") / nf("vllm", "nf4")
    return [
        ("rollout ~1.3× faster than 16-bit LoRA's (7B, batch 8)",
         f"Tab. 6: {tok_text(paper['7b_nvfp4_b8'])} / {tok_text(paper['7b_bf16_b8'])} tok/s = {times(p7)} (vLLM)",
         f"{times(k7)}, LoRA r16, 256 + 2048; vLLM 0.24 in one run: {times(v7)} (r16, 256 + "
         f"{vllm['nvfp4']['gen_len']})", f"{dev}", _verdict(k7 >= p7 and v7 >= p7)),
        ("rollout > 1.5× faster than QLoRA's (7B, batch 8)",
         f"Fig. 1: {tok_text(nf_paper['7b_nvfp4_b8'])} / {tok_text(nf_paper['7b_nf4_b8'])} tok/s = {times(pq)} (vLLM)",
         f"{times(kq)}, LoRA r16, 256 + 2048; both served by vLLM 0.24: {times(vq)}", device_name(nf_doc, nf_file),
         _verdict(kq >= pq and vq >= pq)),
        ("rollout 2× faster than 16-bit at 32B (batch 8)",
         f"Tab. 8: {tok_text(paper['32b_nvfp4_b8'])} / {tok_text(paper['32b_bf16_b8'])} tok/s = {times(p32)} (vLLM)",
         f"{times(k32)}, no adapter, 256 + 2048", dev, _verdict(k32 >= p32)),
    ]


@dataclass(frozen=True)
class _StepFiles:
    """The H100 and H200 step files, read once for every step row: documents, rows (their common fields checked),
    device names, and the H100's memory in GiB (the "one 80 GB GPU" of the paper's claims)."""
    docs: dict
    rows: dict
    devs: dict
    capacity_gib: float


def _step_files(results_dir) -> _StepFiles:
    docs = {f: load_result(results_dir, f) for f in (STEP_H100, STEP_H200)}
    keys = ("model", "mode", "batch", "step_s", "peak_gib", "error")
    return _StepFiles(docs, {f: checked_rows(d, f, keys) for f, d in docs.items()},
                      {f: device_name(d, f) for f, d in docs.items()},
                      field(provenances(docs[STEP_H100], STEP_H100)[0], "device", "memory_gib", file=STEP_H100))


def _step(rows, file, model, mode, batch=8) -> dict:
    return matching_row(rows, file, model=model, mode=mode, batch=batch, **(
        {"rollout_lora_merge": False, "num_gpus": 1} if file == STEP_H200 else {}))


def _small_batch_rollout_row(steps: _StepFiles) -> tuple:
    """Tables 6-8's rollout at batch 2 (r16; 7B 1.31x, 14B 1.46x, 32B 1.76x over 16-bit LoRA, computed from their
    tokens/s), against the rollout phase of the kit's batch-2 GRPO steps (r32), tokens/s from each row's completion
    length; "not measured" until the H200 step file has both modes at every size."""
    sizes = ("7b", "14b", "32b")
    paper = [PAPER_TOK_S[f"{s}_nvfp4_b2"] / PAPER_TOK_S[f"{s}_bf16_b2"] for s in sizes]
    claim = "rollout faster than 16-bit LoRA's at batch 2 (7B / 14B / 32B)"
    tok_s = ", ".join(f"{tok_text(PAPER_TOK_S[f'{s}_nvfp4_b2'])} / {tok_text(PAPER_TOK_S[f'{s}_bf16_b2'])}"
                      for s in sizes)
    cited = (f"Tab. 6-8: {' / '.join(times(p) for p in paper)} ({tok_s} tok/s, vLLM, r16; Tab. 7 prints ×1.3, "
             "Tab. 8 ×1.8)")
    rows = checked_rows(steps.docs[STEP_H200], STEP_H200, ("rollout_s", "completion_len"))
    try:
        pairs = [[_step(rows, STEP_H200, f"qwen2.5-{s}", mode, 2) for mode in ("qerl", "lora")] for s in sizes]
    except ResultsError:
        return (claim, cited, "no batch-2 step of qerl and lora at 7B, 14B and 32B in results/ yet", "-",
                "**not measured**")
    kit = [(q["completion_len"] / q["rollout_s"]) / (lo["completion_len"] / lo["rollout_s"]) for q, lo in pairs]
    return (claim, cited, f"{' / '.join(times(k) for k in kit)}, LoRA r32, 256 + 2048, the GRPO step's rollout phase",
            steps.devs[STEP_H200], _verdict(all(k >= p for k, p in zip(kit, paper))))


def _step_rows(steps: _StepFiles) -> list[tuple]:
    docs, rows, devs, capacity_gib = steps.docs, steps.rows, steps.devs, steps.capacity_gib
    models = ("qwen2.5-7b", "qwen2.5-14b")

    lora = {(f, m): _step(rows[f], f, m, "lora")["step_s"] / _step(rows[f], f, m, "qerl")["step_s"]
            for f in docs for m in models}
    p_lora = [_paper_factor(m, "qerl", 8) for m in models]
    qlora = {m: _step(rows[STEP_H100], STEP_H100, m, "qlora")["step_s"]
             / _step(rows[STEP_H100], STEP_H100, m, "qerl")["step_s"] for m in models}
    p_qlora = [_paper_factor(m, "qerl", 8) / _paper_factor(m, "qlora", 8) for m in models]

    def per_file(values):
        return "; ".join(f"{devs[f]} " + " / ".join(times(values[f, m]) for m in models) for f in docs)

    big_q = _step(rows[STEP_H100], STEP_H100, "qwen2.5-32b", "qerl", batch=2)
    big_q200 = _step(rows[STEP_H200], STEP_H200, "qwen2.5-32b", "qerl", batch=2)
    big_lora = _lora_32b_fit(rows[STEP_H100], rows[STEP_H200], 2, capacity_gib, devs)
    return [
        ("GRPO step faster than 16-bit LoRA's (7B / 14B, batch 8)",
         f"Tab. 3: ×{' / ×'.join(f'{p:g}' for p in p_lora)}",
         f"{per_file(lora)}, LoRA r32, 256 + 2048", " / ".join(devs.values()),
         _verdict(all(v >= _paper_factor(m, "qerl", 8) for (_, m), v in lora.items()))),
        ("GRPO step ~1.7× faster than QLoRA's (7B / 14B, batch 8)",
         f"Fig. 1, Tab. 3: {' / '.join(times(p) for p in p_qlora)} (×1.2 over ×0.7 of LoRA's)",
         " / ".join(times(qlora[m]) for m in models) + ", LoRA r32, 256 + 2048", devs[STEP_H100],
         _verdict(all(qlora[m] >= p for m, p in zip(models, p_qlora)))),
        ("a 32B model trains on one 80 GB GPU (batch 2, gradient checkpointing)",
         f"Tab. 8: {PAPER_STEP['qwen2.5-32b', 'qerl', 2]}",
         f"peak {big_q['peak_gib']:.1f} GiB of the H100's {capacity_gib:.1f} ({big_q['step_s']:.1f} s a step with "
         f"2048-token completions; {big_q200['peak_gib']:.1f} GiB, {big_q200['step_s']:.1f} s on the H200)",
         " / ".join(devs.values()), _verdict(big_q["peak_gib"] < capacity_gib)),
        ("16-bit LoRA at 32B does not fit one 80 GB GPU (batch 2)", PAPER_LORA_32B, *big_lora),
    ]


def _lora_32b_fit(h100_rows, h200_rows, batch: int, capacity_gib: float, devices: dict) -> tuple:
    """(kit, device, verdict) for "16-bit LoRA at 32B does not fit one 80 GB GPU" at ``batch``. A 32B lora step on
    the H100 decides it (out of memory: holds; a measured step: does not); else the H200's peak against the H100's
    capacity; else "not measured"."""
    tried = [r for r in h100_rows if (r["model"], r["mode"], r["batch"]) == ("qwen2.5-32b", "lora", batch)]
    if any(r["error"] is None for r in tried):
        ran = next(r for r in tried if r["error"] is None)
        return (f"ran on the H100: peak {ran['peak_gib']:.1f} GiB of its {capacity_gib:.1f}", devices[STEP_H100],
                _verdict(False))
    if any("out of memory" in r["error"].lower() or "outofmemoryerror" in r["error"].lower() for r in tried):
        return (f"out of memory on the H100 ({capacity_gib:.1f} GiB)", devices[STEP_H100], _verdict(True))
    try:
        lora = _step(h200_rows, STEP_H200, "qwen2.5-32b", "lora", batch)
    except ResultsError:
        return (f"no 32B lora step at batch {batch} in results/ yet (`qerl bench train --models qwen2.5-32b "
                f"--modes lora --batches {batch}`)", "-", "**not measured**")
    side = "under" if lora["peak_gib"] < capacity_gib else "over"
    return (f"peak {lora['peak_gib']:.1f} GiB with checkpointing, {side} the H100's {capacity_gib:.1f}; measured on "
            "an H200, not run on an 80 GB GPU (the kit's engine samples from the trainer's weights: one copy)",
            devices[STEP_H200], _verdict(lora["peak_gib"] >= capacity_gib))


def _small_batch_row(steps: _StepFiles, batch: int) -> tuple:
    """Tab. 3's step speedups at ``batch`` 2 or 4 (x1.5 / x1.4 at 7B, x1.4 / x1.2 at 14B), from whichever step file
    measured both modes there; "not measured" until one does."""
    models = ("qwen2.5-7b", "qwen2.5-14b")
    paper = " / ".join(f"×{_paper_factor(m, 'qerl', batch):g}" for m in models)
    claim = f"GRPO step faster than 16-bit LoRA's at batch {batch} (7B / 14B)"
    for file in (STEP_H200, STEP_H100):
        rows = steps.rows[file]
        try:
            ratios = [_step(rows, file, m, "lora", batch)["step_s"] / _step(rows, file, m, "qerl", batch)["step_s"]
                      for m in models]
        except ResultsError:
            continue
        return (claim, f"Tab. 3: {paper}", " / ".join(times(r) for r in ratios) + ", LoRA r32, 256 + 2048",
                steps.devs[file],
                _verdict(all(r >= _paper_factor(m, "qerl", batch) for r, m in zip(ratios, models))))
    return (claim, f"Tab. 3: {paper}", f"no batch-{batch} step of both modes in results/ yet "
            f"(`qerl bench train --batches {batch}`)", "-", "**not measured**")


def _big_batch_eight_rows(steps: _StepFiles) -> list[tuple]:
    """Tab. 8 at batch 8: QeRL's 32B step fits one 80 GB GPU (12.2 s a step), judged by the H200's peak against the
    H100's capacity as at batch 2, and 16-bit LoRA's does not (`_lora_32b_fit`); "not measured" without rows."""
    rows, devs, capacity_gib = steps.rows, steps.devs, steps.capacity_gib
    claim = "a 32B model trains on one 80 GB GPU (batch 8, gradient checkpointing)"
    paper = f"Tab. 8: {PAPER_STEP['qwen2.5-32b', 'qerl', 8]}"
    try:
        qerl = _step(rows[STEP_H200], STEP_H200, "qwen2.5-32b", "qerl", batch=8)
        side = "under" if qerl["peak_gib"] < capacity_gib else "over"
        fits = (claim, paper, f"peak {qerl['peak_gib']:.1f} GiB, {side} the H100's {capacity_gib:.1f} "
                f"({qerl['step_s']:.1f} s a step with 2048-token completions); measured on an H200", devs[STEP_H200],
                _verdict(qerl["peak_gib"] < capacity_gib))
    except ResultsError:
        fits = (claim, paper, "no 32B qerl step at batch 8 in results/ yet (`qerl bench train --models qwen2.5-32b "
                "--batches 8`)", "-", "**not measured**")
    return [fits, ("16-bit LoRA at 32B does not fit one 80 GB GPU (batch 8)", PAPER_LORA_32B,
                   *_lora_32b_fit(rows[STEP_H100], rows[STEP_H200], 8, capacity_gib, devs))]


def _memory_rows(steps: _StepFiles) -> list[tuple]:
    file = STEP_H200
    rows, dev = checked_rows(steps.docs[file], file, ("base_weights_gib",)), steps.devs[file]
    cases = (("qwen2.5-7b", 8), ("qwen2.5-14b", 8), ("qwen2.5-32b", 2))
    pairs = {m: (_step(rows, file, m, "qerl", b), _step(rows, file, m, "lora", b)) for m, b in cases}
    weights = {m: q["base_weights_gib"] / lo["base_weights_gib"] for m, (q, lo) in pairs.items()}
    peaks = {m: q["peak_gib"] / lo["peak_gib"] for m, (q, lo) in pairs.items()}
    paper_w = " / ".join(f"{n / b:.0%}" for b, n in PAPER_WEIGHT_GB.values())
    sizes = " / ".join(_size(m) for m in pairs)

    def where(shares, bound):
        met = [_size(m) for m, s in shares.items() if s <= bound]
        if len(met) == len(shares):
            return "**holds**"
        return f"**holds at {', '.join(met)} only**" if met else "**does not hold**"

    return [
        ("4-bit weights take 25-30% of the 16-bit model's memory", f"§4.2 (its own model sizes: {paper_w} at "
         f"{' / '.join(_size(m) for m in PAPER_WEIGHT_GB)})",
         f"{' / '.join(f'{s:.0%}' for s in weights.values())} at {sizes}: the embeddings and lm_head stay 16-bit",
         dev, where(weights, PAPER_WEIGHT_SHARE)),
        ("QeRL takes 40-50% of 16-bit LoRA's GPU memory", "§4.3",
         f"step peaks {' / '.join(f'{s:.0%}' for s in peaks.values())} of lora's at {sizes} (7B / 14B batch 8, "
         f"32B batch 2)", dev, where(peaks, PAPER_MEMORY_SHARE)),
    ]


def speed_claim_rows(results_dir) -> list[tuple]:
    """(claim, paper, kit, device, verdict) for each of the paper's speed and memory claims."""
    steps = _step_files(results_dir)
    batch_eight, *big = _step_rows(steps)
    return [*_rollout_rows(results_dir), _small_batch_rollout_row(steps), batch_eight, _small_batch_row(steps, 2),
            _small_batch_row(steps, 4), *big, *_big_batch_eight_rows(steps), *_memory_rows(steps)]


def render_speed_claims(results_dir) -> str:
    """The README's speed-and-memory claims table (markdown)."""
    return markdown_table(HEADER, speed_claim_rows(results_dir))

"""Evaluation: sample answers with the rollout engine, score them, summarise with intervals.

The same function serves a base model, an NVFP4 checkpoint and a LoRA checkpoint (the model
is whatever `load_model` / `attach_lora` returned), which is what `qerl eval`, the first-look
notebook and the entropy study call.

What is reported (per problem, then summarised):

* **pass@1** = mean over the K samples of each problem, averaged over problems (the paper's
  "Pass@1 averaged over runs"), with a 95% percentile-bootstrap interval over problems;
* **pass@K** = share of problems with at least one correct sample (K = samples);
* **format rate** = share of completions with `<think>…</think>` then `<answer>…</answer>`;
* mean completion length in tokens, and the share cut at `max_new_tokens` (truncated);
* optionally the teacher-forced mean next-token entropy of the model on its own completions.

Reproducibility: sampling draws come from the engine's seeded generator, one seed per engine
call derived from ``config.seed`` and the batch's position, and the bootstrap uses its own
generator seeded with ``config.seed``. The same model, problems, config (``batch_size`` included:
it decides which completions share an engine call) and device therefore
give the same records and the same summary. Wall-clock numbers live apart, in
``EvalReport.timing``, so a summary can be compared for equality.

Scoring is `qerl_lib.tasks.rewards.score_answers` (all completions in one batch): exact numeric or
math-verify equivalence, never the
official evaluator's first-character comparison (which counts "75" vs "72" as correct). The
answer must be marked (``<answer>``, ``\\boxed``, ``####``) unless ``last_number_fallback=True``,
which also accepts the last number of the text (useful for base models that ignore the format).
Defaults follow the paper's evaluation (temperature 0.6, top-p 0.95); `temperature=0` is greedy
and then one sample per problem is drawn (more would be identical).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

from qerl_lib.tasks.problems import encode_problems, gold_answer
from qerl_lib.engine.rollout import generate
from qerl_lib.evals.entropy import mean_token_entropy, token_entropies
from qerl_lib.tasks.rewards import extract_answer, format_reward, score_answers


@dataclass
class EvalConfig:
    """How to sample and score. The paper evaluates at temperature 0.6, top-p 0.95."""

    samples: int = 1                 # K completions per problem
    temperature: float = 0.6         # 0 = greedy
    top_p: float = 0.95
    max_new_tokens: int = 1024
    batch_size: int = 64             # completions (problem x sample) per engine call
    seed: int = 0                    # same seed, same samples, same numbers
    with_entropy: bool = False       # also the teacher-forced entropy on own completions
    entropy_batch_size: int = 16     # sequences per teacher-forced forward (full-vocab logits: memory)
    last_number_fallback: bool = False  # accept an unmarked final number (base models); off for RL
    first_number: bool = False       # the answer is the completion's first number (the expression task)
    n_boot: int = 2000

    def __post_init__(self):
        if self.samples < 1:
            raise ValueError(f"samples must be >= 1, got {self.samples}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        small = {k: getattr(self, k) for k in ("max_new_tokens", "batch_size", "entropy_batch_size")
                 if getattr(self, k) < 1}
        if small:
            raise ValueError(f"{' and '.join(small)} must be >= 1, got {small}")
        if self.n_boot < 100:
            raise ValueError(f"n_boot must be >= 100 bootstrap resamples for a usable interval, got {self.n_boot}")
        if self.temperature == 0 and self.samples > 1:
            raise ValueError("greedy decoding (temperature 0) gives identical samples: use samples=1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class EvalReport:
    summary: dict                                        # deterministic given model, problems, config
    records: list[dict] = field(default_factory=list)    # one per problem (see `evaluate`)
    timing: dict = field(default_factory=dict)           # wall clock: seconds, tokens/s (not reproducible)


def evaluate(model, tokenizer, problems: list[dict], config: EvalConfig | None = None,
             progress: bool = True, norm_overrides: dict | None = None) -> EvalReport:
    """Sample `config.samples` completions per problem, score them and summarise.

    `model` is anything the engine runs: a bf16 model, an NVFP4 model from `load_model`, or a
    peft model with LoRA adapters (run unmerged). `norm_overrides` (AQN's noisy RMSNorm weights,
    `qerl_lib.train.aqn.sample_norm_overrides`) are used for sampling only. Each record holds the
    question, gold answer, completions, extracted answers, correctness, format flags, lengths
    and finish reasons of one problem (and its per-completion entropies with `with_entropy`).
    """
    config = config or EvalConfig()
    if not problems:
        raise ValueError("no problems to evaluate: the dataset is empty")
    golds = [gold_answer(p) for p in problems]  # first: a problem without a gold answer fails before any work
    prompt_ids = encode_problems(tokenizer, problems)
    flat = [(i, k) for i in range(len(problems)) for k in range(config.samples)]
    completions: dict[tuple[int, int], object] = {}
    start = time.perf_counter()
    bar = _progress(len(flat), progress, "sampling")
    for b in range(0, len(flat), config.batch_size):
        chunk = flat[b:b + config.batch_size]
        outs = generate(model, [prompt_ids[i] for i, _ in chunk], max_new_tokens=config.max_new_tokens,
                        temperature=config.temperature, top_p=config.top_p, norm_overrides=norm_overrides,
                        seed=None if config.greedy else config.seed * 1_000_003 + b)
        for key, out in zip(chunk, outs):
            completions[key] = out
        bar.update(len(chunk))
    bar.close()
    seconds = time.perf_counter() - start

    texts_of = {key: tokenizer.decode(out.token_ids, skip_special_tokens=True) for key, out in completions.items()}
    # One batch for the scorer: answers that need math-verify are checked side by side.
    scores = dict(zip(flat, score_answers([texts_of[key] for key in flat], [golds[i] for i, _ in flat],
                                          last_number_fallback=config.last_number_fallback,
                                          first_number=config.first_number)))
    records = []
    for i, problem in enumerate(problems):
        outs = [completions[(i, k)] for k in range(config.samples)]
        texts = [texts_of[(i, k)] for k in range(config.samples)]
        records.append({
            "index": i, "id": problem.get("id", i), "question": problem["question"], "gold": golds[i],
            "completions": texts,
            "completion_ids": [list(o.token_ids) for o in outs],
            "answers": [extract_answer(t, last_number_fallback=config.last_number_fallback,
                                       first_number=config.first_number) for t in texts],
            "correct": [scores[(i, k)] for k in range(config.samples)],
            "formatted": [format_reward(t) for t in texts],
            "lengths": [len(o.token_ids) for o in outs],
            "finish_reasons": [o.finish_reason for o in outs],
        })

    summary = summarise(records, config)
    generated = sum(sum(r["lengths"]) for r in records)
    summary["generated_tokens"] = generated
    timing = {"sampling_seconds": round(seconds, 3),
              "tokens_per_second": round(generated / seconds, 1) if seconds > 0 else None}
    if config.with_entropy:
        ents = token_entropies(model, [prompt_ids[i] for i, _ in flat],
                               [completions[key].token_ids for key in flat],
                               batch_size=config.entropy_batch_size)
        for (i, k), e in zip(flat, ents):
            records[i].setdefault("entropy", []).append(float(e.mean()) if e.numel() else None)  # None: no tokens
        entropy = mean_token_entropy(ents)
        summary["entropy"] = entropy if math.isfinite(entropy) else None  # None: every completion was empty
    return EvalReport(summary=summary, records=records, timing=timing)


def summarise(records: list[dict], config: EvalConfig) -> dict:
    """pass@1 (with a bootstrap interval), pass@K, format rate, length statistics."""
    per_problem = torch.tensor([sum(r["correct"]) / len(r["correct"]) for r in records], dtype=torch.float64)
    lengths = [l for r in records for l in r["lengths"]]
    reasons = [f for r in records for f in r["finish_reasons"]]
    low, high = bootstrap_interval(per_problem, config.n_boot, config.seed)
    pass_k = float(sum(max(r["correct"]) for r in records) / len(records))
    return {
        "n_problems": len(records), "samples": config.samples,
        "pass@1": float(per_problem.mean()), "pass@1_ci95": [low, high],
        f"pass@{config.samples}": pass_k, "pass@k": pass_k,
        "format_rate": float(sum(sum(r["formatted"]) for r in records) / len(lengths)),
        "mean_length": float(sum(lengths) / len(lengths)),
        "truncated_rate": float(sum(f == "length" for f in reasons) / len(reasons)),
        "config": asdict(config),
    }


def bootstrap_interval(values: torch.Tensor, n_boot: int = 2000, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean, resampling problems."""
    if len(values) == 0:
        return (math.nan, math.nan)
    gen = torch.Generator().manual_seed(seed)
    means = values[torch.randint(len(values), (n_boot, len(values)), generator=gen)].mean(1)
    q = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return (float(q[0]), float(q[1]))


def _progress(total: int, enabled: bool, desc: str):
    from qerl_lib.progress import progress_bar

    return progress_bar(total=total, desc=desc, disable=not enabled, leave=False)


def compare_formats(models: dict, tokenizer, problems: list[dict], config: EvalConfig,
                    reference: str | None = None, progress: bool = True) -> dict:
    """Evaluate several versions of one model (e.g. {"bf16": m1, "nvfp4": m2}) on the same problems.

    Besides each model's own summary (accuracy, format, length) the result has, for every model,
    the teacher-forced entropy on the *reference* model's completions (identical tokens for
    everyone: a paired comparison), the answer agreement with the reference, and paired bootstrap
    intervals of the entropy differences. `entropy` (on a model's own completions) is exact for the
    reference (its own completions are the reference tokens) and costs one more teacher-forced
    pass per other model, done only with `config.with_entropy=True`.
    """
    from dataclasses import replace

    from qerl_lib.evals.entropy import paired_bootstrap, per_sequence_mean

    own_entropy = config.with_entropy
    config = replace(config, with_entropy=False)
    if not models:
        raise ValueError("compare_formats needs at least one model")
    reference = reference or next(iter(models))
    if reference not in models:
        raise ValueError(f"reference {reference!r} is not one of {list(models)}")
    prompt_ids = encode_problems(tokenizer, problems)
    reports = {name: evaluate(m, tokenizer, problems, config, progress) for name, m in models.items()}
    ref_tokens = [r["completion_ids"][0] for r in reports[reference].records]
    out: dict = {"reference": reference, "n_problems": len(problems), "formats": {}}
    ref_seq = None
    for name, model in models.items():
        ents = token_entropies(model, prompt_ids, ref_tokens, batch_size=config.entropy_batch_size)
        seq = per_sequence_mean(ents)
        ref_seq = seq if name == reference else ref_seq
        answers = [r["completions"][0] for r in reports[name].records]
        ref_answers = [r["completions"][0] for r in reports[reference].records]
        if name == reference:
            own = mean_token_entropy(ents)
        elif own_entropy:
            own = mean_token_entropy(token_entropies(model, prompt_ids, [r["completion_ids"][0] for r in
                                                                          reports[name].records],
                                                     batch_size=config.entropy_batch_size))
        else:
            own = None
        out["formats"][name] = {
            **{k: v for k, v in reports[name].summary.items() if k != "config"},
            "entropy": own,
            "entropy_on_reference": _finite_or_none(mean_token_entropy(ents)),  # None: no reference tokens
            "per_problem_entropy_on_reference": seq,
            "same_completion_as_reference": sum(a == b for a, b in zip(answers, ref_answers)) / len(answers),
            "per_problem_correct": [sum(r["correct"]) / len(r["correct"]) for r in reports[name].records],
        }
    for name in models:
        if name != reference:
            out["formats"][name]["entropy_diff_vs_reference"] = paired_bootstrap(
                ref_seq, out["formats"][name]["per_problem_entropy_on_reference"], config.n_boot, config.seed)
    out["config"] = {**asdict(config), "with_entropy": own_entropy}
    out["examples"] = {name: [{k: v for k, v in r.items() if k != "completion_ids"} for r in reports[name].records[:3]]
                       for name in models}
    return out


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def format_comparison(result: dict) -> str:
    """``compare_formats``' result as a fixed-width table (one row per model: pass@1 and its 95% interval, the
    share of answers in the marked format (``-`` where the answer is the first number), mean completion length,
    the entropy on the reference's tokens, the share of completions identical to the reference's), then each
    paired entropy difference, and a note where no model answered anything right (the accuracy comparison is
    then empty)."""
    ref = result["reference"]
    marked = not result["config"].get("first_number")  # the expression task reads the first number: no format
    lines = [f"{'model':8s} {'pass@1':>7s} {'95% CI':>15s} {'fmt rate':>8s} {'length':>7s} {'H ref':>7s} "
             f"{'same text':>9s}"]
    for name, f in result["formats"].items():
        lo, hi = f["pass@1_ci95"]
        h_ref = "-" if f["entropy_on_reference"] is None else f"{f['entropy_on_reference']:.3f}"
        rate = f"{f['format_rate']:.2f}" if marked else "-"
        lines.append(f"{name:8s} {f['pass@1']:7.3f} [{lo:5.3f}, {hi:5.3f}] {rate:>8s} "
                     f"{f['mean_length']:7.1f} {h_ref:>7s} {f['same_completion_as_reference']:9.2f}")
    lines.append("")
    for name, f in result["formats"].items():
        d = f.get("entropy_diff_vs_reference")
        if d is not None:
            lines.append(f"{name} - {ref} entropy on identical tokens: {d['mean_diff']:+.4f} nats, 95% CI "
                         f"[{d['low']:+.4f}, {d['high']:+.4f}] over {d['n']} problems")
    formats = result["formats"].values()
    if all(f["pass@1"] == 0 for f in formats):
        rates = ", ".join(f"{f['format_rate']:.2f}" for f in formats)
        longest = max(f["mean_length"] for f in formats)
        lines.append(f"no model answered a problem right (format rates {rates}; mean lengths up to {longest:.1f} of "
                     f"{result['config']['max_new_tokens']} tokens): the accuracy comparison is empty here")
    return "\n".join(lines)

"""The entropy study: does 4-bit quantization raise a policy's next-token entropy?

QeRL's central empirical claim (paper §3.2, Fig. 5) is that quantized weights make the policy's
next-token distribution flatter, and that this extra entropy helps RL explore. Its evidence
is entropy logged during training. This module measures the claim before any training, on one
model in four weight formats, with paired statistics.

What is measured
----------------
For each format f in bf16, nvfp4, mxfp4 and nf4 (the same model, weights round-tripped through
f by `qerl_lib.quant.formats.fake_quantize_`, lm_head kept in bf16 as the official recipe does):

1. **Own samples.** K completions per problem at the rollout temperature (1.0, top-p 1, as
   TRL's GRPO samples). The entropy is measured on the tokens f itself chose: what RL sees.
   Different formats write different text, so the per-problem comparison is paired by problem
   but not by token.
2. **Fixed references, teacher-forced.** The same tokens for every format: (a) the dataset's
   worked solution, rewritten in the prompt's format (``<think>steps</think> <answer>N</answer>``,
   GSM8K's ``<<calc>>`` annotations removed, `reference_completion`), and (b) bf16's own samples.
   Any difference in entropy here comes from the weights alone.
3. **Accuracy**: pass@1 of the own samples (mean over K) and, optionally, greedy pass@1, each
   with a 95% bootstrap interval, and the paired difference from bf16. The 135M model almost
   never writes the ``<answer>`` tags (format rate ~0 on GSM8K), so by default the last number of
   the text also counts as its answer (``last_number_fallback``, as lm-eval's "flexible-extract"
   does for the paper's base-model rows). The format rate is reported separately.
4. **Entropy vs σ (AQN)**: the NVFP4 model with Gaussian noise of standard deviation σ added to
   its RMSNorm weights (`qerl_lib.train.aqn`, the paper's noise injection), teacher-forced on the
   fixed references. Each σ is averaged over ``aqn_draws`` noise draws. Draw d uses the same
   standard-normal vector at every σ (only the scale changes), so the curve is smooth in σ.

Entropy is H = -Σ p log p in nats at temperature 1, averaged over completion tokens. The unit of
every interval is the problem. Per-problem means are compared in pairs (format minus bf16), and a
percentile bootstrap over problems gives the 95% interval (`qerl_lib.evals.entropy.paired_bootstrap`).
An interval that excludes 0 is a difference at this sample size. One that includes 0 is not
evidence of "no difference": it is evidence of no difference *large enough to detect here*.
Where there is nothing to measure (no completion tokens for a problem or a reference) the value
is null, with a sibling ``<key>_note`` saying why for the summary numbers, never NaN: JSON has none.

Deviations from the paper, and why
----------------------------------
* Weights are fake-quantized (quantize, then dequantize to bf16) and run through dense matmuls: each
  weight is the format's value rounded once to bf16, as transformers' compressed-tensors loader
  dequantizes. For NVFP4 that value, ``fp4 * s / gs``, is not a bf16 number in general: the FP4 kernel
  (and the packed path, ``nvfp4_backend="packed"``, computing in float32 on a CPU) applies ``1/gs`` in
  float32 instead, so its weights differ from the fake ones by that rounding. In bf16 the packed
  layers dequantize to the fake weights bit for bit (tests/test_entropy_study.py); notebook 04's
  float32 NVFP4 model is the unrounded one, and its entropy on the same tokens differs from this
  study's in the third decimal (dev/LOG.md 138). MXFP4 follows the OCP
  spec and NF4 is bitsandbytes' (blocks of 64, no double quantization; `qerl_lib.quant.formats`).
* The paper quantizes with AWQ calibration. We round-to-nearest with no calibration data, as the
  official NVFP4 script does (llm-compressor, data-free). AWQ would lower the error of all three
  4-bit formats.
* On CPU the model computes in float32 (``dtype="auto"``); on CUDA it computes in bf16. The
  weights are the same bf16 values in both cases: quantization is done in bf16 before any cast.
* The model is the embedded SmolLM2-135M-Instruct, not Qwen2.5-7B. Whether the direction holds at
  this scale is the question the study answers. It says nothing certain about 7B.
"""

from __future__ import annotations

import gc
import math
import re
from dataclasses import asdict, dataclass

import torch

from qerl_lib.train.aqn import apply_norm_overrides, sample_norm_overrides
from qerl_lib.tasks.problems import encode_prompts, load_problems
from qerl_lib.evals.entropy import NO_TOKENS, mean_token_entropy, paired_bootstrap, per_sequence_mean
from qerl_lib.errors import UserError
from qerl_lib.evals.evaluation import EvalConfig, bootstrap_interval, evaluate
from qerl_lib.quant.formats import FORMAT_BITS, fake_quantize_

FORMATS = ("bf16", "nvfp4", "mxfp4", "nf4")
DEFAULT_SIGMAS = (0.0, 1e-3, 2.5e-3, 5e-3, 1e-2)  # the paper's schedule runs from 1e-2 down to 5e-4
REFERENCES = ("own", "gold", "bf16_samples")


@dataclass
class StudyConfig:
    """What to compare and how much. Defaults: the full study; notebooks/06 shrinks them on CPU."""

    model: str = "smollm2"                # model folder, `smollm2`, or a hub id when online
    formats: tuple = FORMATS              # bf16 must be first: it is the baseline and the reference
    data: str = "arith"                   # arith or expr (generated, offline), gsm8k (hub or data_path), file
    data_path: str | None = None
    split: str = "test"
    n_problems: int = 256
    samples: int = 4                      # own completions per problem
    temperature: float = 1.0              # the RL rollout temperature (paper Table 4)
    max_new_tokens: int = 256
    greedy_accuracy: bool = True          # also greedy pass@1 (one more generation pass per format)
    last_number_fallback: bool = True     # score the last number when no answer is marked (see docstring)
    sigmas: tuple = DEFAULT_SIGMAS        # AQN σ values; () skips the σ sweep
    aqn_format: str = "nvfp4"             # the format AQN perturbs (QeRL's)
    aqn_draws: int = 2                    # noise draws averaged per σ > 0
    aqn_references: tuple = ("gold", "bf16_samples")  # fixed tokens the σ sweep is scored on
    nvfp4_backend: str = "fake"           # fake: round-tripped dense weights; packed: NVFP4Linear
    device: str = "cpu"
    dtype: str = "auto"                   # auto: bfloat16 on CUDA, float32 on CPU
    seed: int = 0
    batch_size: int = 64                  # completions per engine call
    entropy_batch_size: int = 16          # sequences per teacher-forced forward
    n_boot: int = 2000
    progress: bool = True

    def __post_init__(self):
        self.formats, self.sigmas = tuple(self.formats), tuple(float(s) for s in self.sigmas)
        self.aqn_references = tuple(self.aqn_references)
        if not self.aqn_references or any(r not in REFERENCES[1:] for r in self.aqn_references):
            raise UserError(f"aqn_references must name fixed references from {REFERENCES[1:]}, "
                            f"got {self.aqn_references}")
        unknown = [f for f in self.formats if f not in FORMATS]
        if unknown:
            raise UserError(f"unknown formats {unknown}: choose from {FORMATS}")
        if not self.formats or self.formats[0] != "bf16" or len(set(self.formats)) != len(self.formats):
            raise UserError(f"formats must start with 'bf16' (the baseline) and not repeat, got {self.formats}")
        if any(not math.isfinite(s) or s < 0 for s in self.sigmas):
            raise UserError(f"sigmas must be finite and >= 0, got {self.sigmas}")
        if self.sigmas and self.aqn_format not in self.formats:
            raise UserError(f"aqn_format {self.aqn_format!r} is not among formats {self.formats}")
        if self.n_problems < 2:
            raise UserError(f"n_problems must be >= 2 for an interval, got {self.n_problems}")
        if self.samples < 1 or self.aqn_draws < 1 or self.max_new_tokens < 1:
            raise UserError("samples, aqn_draws and max_new_tokens must be >= 1")
        if not self.temperature > 0:
            raise UserError(f"temperature must be > 0 for sampled completions, got {self.temperature}")
        if self.nvfp4_backend not in ("fake", "packed"):
            raise UserError(f"nvfp4_backend must be 'fake' or 'packed', got {self.nvfp4_backend!r}")
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise UserError(f"dtype must be auto, bfloat16 or float32, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if str(self.device).startswith("cuda") else torch.float32
        return getattr(torch, self.dtype)


_CALC_RE = re.compile(r"<<[^<>]*>>")  # GSM8K calculator annotations: "48/2 = <<48/2=24>>24"


def reference_completion(problem: dict) -> str:
    """The dataset's worked solution in the prompt's format: ``<think>steps</think> <answer>N</answer>``."""
    answer = problem["answer"]
    if "####" not in answer:
        raise UserError(f"record has no '#### N' final answer: {answer[:80]!r}")
    steps, final = answer.rsplit("####", 1)
    steps = _CALC_RE.sub("", steps).strip()
    return f"<think>\n{steps}\n</think>\n<answer>{final.strip()}</answer>"


def load_format_model(model_dir, fmt: str, device: str, dtype: torch.dtype, nvfp4_backend: str = "fake"):
    """The model with its Linear weights in `fmt` (lm_head untouched), on `device`, computing in `dtype`.

    Quantization runs on bf16 weights on `device` (NF4 goes through bitsandbytes on CPU, layer by
    layer), then the model is cast, so every compute dtype sees the same format values.
    Returns ``(model, layer_report)``, the report holding one SQNR per quantized layer (empty for bf16 and
    for the packed NVFP4 backend).
    """
    from qerl_lib.models.loader import load_model, replace_linear_with_nvfp4

    model = load_model(model_dir, device=device, dtype=torch.bfloat16)
    if fmt == "nvfp4" and nvfp4_backend == "packed":
        replace_linear_with_nvfp4(model)
        report = []
    else:
        report = fake_quantize_(model, fmt) if fmt != "bf16" else []
    return model.to(dtype).eval(), report


def _per_problem(values: list[float | None], owners: list[int], n: int) -> list[float | None]:
    """Mean of the per-completion values of each problem (None entries skipped; None if none)."""
    sums, counts = [0.0] * n, [0] * n
    for v, i in zip(values, owners):
        if v is not None:
            sums[i] += v
            counts[i] += 1
    return [s / c if c else None for s, c in zip(sums, counts)]


def _mean_or_none(values) -> float | None:
    """Mean of the values that are not None; None if there are none."""
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def _set_entropy(row: dict, key: str, value: float | None) -> None:
    """``row[key] = value``, or null with ``row[key + "_note"]`` saying why (JSON has no NaN)."""
    row[key] = value
    if value is None:
        row[f"{key}_note"] = NO_TOKENS


@torch.no_grad()
def grouped_token_entropies(model, prompts, items, chunk: int = 16) -> list[torch.Tensor]:
    """Per-token entropies of completions, running each prompt through the model once.

    `items` is a list of ``(prompt index, completion token ids)``. The result equals
    `qerl_lib.evals.entropy.token_entropies` on the pairs ``(prompts[i], completion)`` up to summation
    order (tests/test_entropy_study.py). Here the prompts (~150 tokens with the chat template) are
    longer than most completions, and every problem has 2K + 1 completions to score, so running the
    prompt once and reusing its KV cache for all of them cuts the compute about threefold.
    """
    device = next(model.parameters()).device
    out: list[torch.Tensor] = [torch.empty(0)] * len(items)
    by_prompt: dict[int, list[int]] = {}
    for j, (i, completion) in enumerate(items):
        if len(completion):
            by_prompt.setdefault(i, []).append(j)
    for i, js in by_prompt.items():
        prompt = torch.tensor([list(prompts[i])], device=device)
        for start in range(0, len(js), chunk):
            part = js[start:start + chunk]
            completions = [list(items[j][1]) for j in part]
            head = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
            first = head.logits[0, -1].float()  # the distribution of completion token 0
            longest = max(len(c) for c in completions)
            if longest > 1:  # tokens 1.. are predicted from completion positions 0..c-2
                cache = head.past_key_values
                cache.batch_repeat_interleave(len(part))
                ids = torch.zeros(len(part), longest - 1, dtype=torch.long)
                mask = torch.zeros(len(part), prompt.shape[1] + longest - 1, dtype=torch.long)
                mask[:, : prompt.shape[1]] = 1
                for r, c in enumerate(completions):  # right padding: causal attention never sees it
                    ids[r, : len(c) - 1] = torch.tensor(c[:-1])
                    mask[r, prompt.shape[1]: prompt.shape[1] + len(c) - 1] = 1
                rest = model(input_ids=ids.to(device), attention_mask=mask.to(device), past_key_values=cache,
                             use_cache=True).logits.float()
            for r, j in enumerate(part):
                steps = first[None] if len(completions[r]) == 1 else torch.cat(
                    [first[None], rest[r, : len(completions[r]) - 1]])
                logp = torch.log_softmax(steps, dim=-1)
                out[j] = -(logp.exp() * logp).sum(-1).cpu()
    return out


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _score(model, prompts, refs: dict[str, list], n: int, chunk: int
           ) -> dict[str, tuple[float | None, list[float | None]]]:
    """{reference: (token-mean entropy, per-problem means)}, every reference in one grouped pass; None
    where there are no tokens to score."""
    names = [name for name, items in refs.items() for _ in items]
    items = [item for group in refs.values() for item in group]
    ents = grouped_token_entropies(model, prompts, items, chunk)
    out = {}
    for name, group in refs.items():
        mine = [e for e, owner in zip(ents, names) if owner == name]
        mean = mean_token_entropy(mine)
        out[name] = (None if math.isnan(mean) else mean,
                     _per_problem(per_sequence_mean(mine), [i for i, _ in group], n))
    return out


def _aqn_curve(model, prompts, refs: dict, unperturbed: dict, config: StudyConfig) -> list[dict]:
    """Teacher-forced entropy of `model` on each fixed reference under AQN noise at every σ.

    σ = 0 is the unperturbed model, so its values are copied from the format's own row
    (`unperturbed`) instead of being recomputed; tests/test_entropy_study.py checks that the
    override path at σ = 0 gives exactly those numbers.
    """
    points = []
    for sigma in config.sigmas:
        point = {"sigma": sigma, "draws": 0 if sigma == 0 else config.aqn_draws}
        if sigma == 0:
            for name in refs:
                _set_entropy(point, f"entropy_{name}", unperturbed[f"entropy_{name}"])
                point.update({f"entropy_{name}_per_draw": [unperturbed[f"entropy_{name}"]],
                              f"per_problem_{name}": unperturbed[f"per_problem_{name}"]})
            points.append(point)
            continue
        draws = []
        for d in range(config.aqn_draws):
            generator = torch.Generator().manual_seed(config.seed * 7919 + d)  # same Z direction at every σ
            with apply_norm_overrides(model, sample_norm_overrides(model, sigma, generator)):
                draws.append(_score(model, prompts, refs, len(prompts), config.entropy_batch_size))
        for name in refs:
            point[f"entropy_{name}_per_draw"] = [d[name][0] for d in draws]
            _set_entropy(point, f"entropy_{name}", _mean_or_none(point[f"entropy_{name}_per_draw"]))
            point[f"per_problem_{name}"] = [_mean_or_none(v) for v in zip(*(d[name][1] for d in draws))]
        points.append(point)
    return points


def run_entropy_study(config: StudyConfig) -> dict:
    """Run the whole study and return its metrics (JSON-ready; see the module docstring)."""
    from transformers import AutoTokenizer

    from qerl_lib.engine.rollout import release
    from qerl_lib.models.loader import resolve_model_dir

    torch.manual_seed(config.seed)
    problems = load_problems(config.data, split=config.split, n=config.n_problems, seed=config.seed,
                             path=config.data_path)
    model_dir = resolve_model_dir(config.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = encode_prompts(tokenizer, [p["question"] for p in problems])
    n = len(problems)
    common = dict(max_new_tokens=config.max_new_tokens, batch_size=config.batch_size, seed=config.seed,
                  entropy_batch_size=config.entropy_batch_size, n_boot=config.n_boot,
                  last_number_fallback=config.last_number_fallback)
    sampled = EvalConfig(samples=config.samples, temperature=config.temperature, top_p=1.0, **common)
    greedy = EvalConfig(samples=1, temperature=0.0, **common)

    result: dict = {"formats": {}, "aqn": None}
    # Fixed references: lists of (problem index, token ids), the same tokens for every format.
    fixed = {"gold": [(i, tokenizer(reference_completion(p), add_special_tokens=False)["input_ids"])
                      for i, p in enumerate(problems)]}
    for fmt in config.formats:
        if config.progress:
            print(f"[entropy study] {fmt}: quantize, sample, score", flush=True)
        model, layers = load_format_model(model_dir, fmt, config.device, config.torch_dtype, config.nvfp4_backend)
        own = evaluate(model, tokenizer, problems, sampled, progress=config.progress)
        own_items = [(r["index"], ids) for r in own.records for ids in r["completion_ids"]]
        if fmt == "bf16":  # bf16's samples become a fixed reference for every format
            fixed["bf16_samples"] = own_items
        sqnr = sum(r["sqnr_db"] for r in layers) / len(layers) if layers else None
        row = {"bits_per_weight": FORMAT_BITS[fmt],
               "mean_layer_sqnr_db": sqnr if sqnr is None or math.isfinite(sqnr) else None,
               "sampled": {k: own.summary[k] for k in ("pass@1", "pass@1_ci95", "pass@k", "format_rate",
                                                     "mean_length", "truncated_rate")},
               "per_problem_correct_sampled": [sum(r["correct"]) / len(r["correct"]) for r in own.records],
               "examples": [{"question": r["question"], "gold": r["gold"], "completion": r["completions"][0]}
                            for r in own.records[:2]]}
        if sqnr is not None and not math.isfinite(sqnr):
            row["mean_layer_sqnr_db_note"] = "a layer came through the format exactly (infinite SQNR)"
        for name, (mean, per_problem) in _score(model, prompts, {"own": own_items, **fixed}, n,
                                                config.entropy_batch_size).items():
            _set_entropy(row, f"entropy_{name}", mean)
            row[f"per_problem_{name}"] = per_problem
        if config.greedy_accuracy:
            g = evaluate(model, tokenizer, problems, greedy, progress=config.progress)
            row["greedy"] = {k: g.summary[k] for k in ("pass@1", "pass@1_ci95", "format_rate", "mean_length")}
            row["per_problem_correct_greedy"] = [r["correct"][0] for r in g.records]
        if fmt == config.aqn_format and config.sigmas:
            aqn_refs = {name: fixed[name] for name in config.aqn_references}
            result["aqn"] = {"format": fmt, "draws": config.aqn_draws, "references": list(config.aqn_references),
                             "norms": ["input_layernorm", "post_attention_layernorm"],
                             "points": _aqn_curve(model, prompts, aqn_refs, row, config)}
        result["formats"][fmt] = row
        release(model)  # the engine's KV cache and CUDA graphs
        del model
        _free_memory()

    _add_comparisons(result, config)
    result["verdicts"] = verdict_lines(result)
    result["paper_direction_holds"] = {fmt: paper_direction_holds(result, fmt) for fmt in config.formats[1:]}
    result.update(n_problems=n, model=str(model_dir), data={"source": config.data, "path": config.data_path,
                                                             "split": config.split},
                  config={k: v for k, v in asdict(config).items() if k != "progress"})
    return result


def _add_comparisons(result: dict, config: StudyConfig) -> None:
    """Paired differences from bf16 (entropy on each reference, accuracy) and from σ = 0 (AQN)."""
    base = result["formats"]["bf16"]
    for fmt, row in result["formats"].items():
        if fmt == "bf16":
            continue
        row["diff_vs_bf16"] = {f"entropy_{ref}": paired_bootstrap(base[f"per_problem_{ref}"], row[f"per_problem_{ref}"],
                                                                  config.n_boot, config.seed)
                               for ref in REFERENCES}
        for kind in ("sampled", "greedy"):
            if f"per_problem_correct_{kind}" in row:
                row["diff_vs_bf16"][f"pass@1_{kind}"] = paired_bootstrap(
                    base[f"per_problem_correct_{kind}"], row[f"per_problem_correct_{kind}"], config.n_boot, config.seed)
    if result["aqn"]:
        unperturbed = result["formats"][result["aqn"]["format"]]
        for point in result["aqn"]["points"]:
            for ref in result["aqn"]["references"]:
                point[f"diff_vs_sigma0_{ref}"] = paired_bootstrap(unperturbed[f"per_problem_{ref}"],
                                                                  point[f"per_problem_{ref}"], config.n_boot, config.seed)
                point[f"diff_vs_bf16_{ref}"] = paired_bootstrap(result["formats"]["bf16"][f"per_problem_{ref}"],
                                                                point[f"per_problem_{ref}"], config.n_boot, config.seed)
    for row in result["formats"].values():  # intervals of the per-problem means themselves
        for ref in REFERENCES:
            vals = torch.tensor([v for v in row[f"per_problem_{ref}"] if v is not None], dtype=torch.float64)
            key = f"entropy_{ref}_problem_mean_ci95"
            row[key] = list(bootstrap_interval(vals, config.n_boot, config.seed)) if len(vals) else [None, None]
            if not len(vals):
                row[f"{key}_note"] = NO_TOKENS


def direction(diff: dict) -> str:
    """'higher' / 'lower' when the 95% interval excludes 0, else 'inconclusive'."""
    if diff["n"] == 0 or diff["low"] is None:
        return "inconclusive"
    return "higher" if diff["low"] > 0 else "lower" if diff["high"] < 0 else "inconclusive"


_REF_WORDS = {"own": "on its own samples", "gold": "on the reference solutions (teacher-forced)",
              "bf16_samples": "on BF16's samples (teacher-forced)"}


def verdict_lines(result: dict) -> list[str]:
    """One sentence per (format, reference), built from the interval, e.g.
    'NVFP4 raises entropy vs BF16 on its own samples: yes (+0.0123 nats, 95% CI [+0.0050, +0.0190] excludes 0,
    256 problems)'."""
    lines = []
    for fmt, row in result["formats"].items():
        for ref in REFERENCES if fmt != "bf16" else ():
            d = row["diff_vs_bf16"][f"entropy_{ref}"]
            if d["n"] == 0:
                lines.append(f"{fmt.upper()} raises entropy vs BF16 {_REF_WORDS[ref]}: not shown ({d.get('note')})")
                continue
            way = direction(d)
            answer = {"higher": "yes", "lower": "no, it lowers it", "inconclusive": "not shown"}[way]
            note = "excludes 0" if way != "inconclusive" else "includes 0"
            lines.append(f"{fmt.upper()} raises entropy vs BF16 {_REF_WORDS[ref]}: {answer} "
                         f"({d['mean_diff']:+.4f} nats, 95% CI [{d['low']:+.4f}, {d['high']:+.4f}] {note}, "
                         f"{d['n']} problems)")
    return lines


def paper_direction_holds(result: dict, fmt: str = "nvfp4") -> str:
    """'yes' if `fmt` raises entropy vs bf16 on every reference (each CI above 0), 'no' if any CI is
    below 0, otherwise 'inconclusive'."""
    ways = [direction(result["formats"][fmt]["diff_vs_bf16"][f"entropy_{ref}"]) for ref in REFERENCES]
    if "lower" in ways:
        return "no"
    return "yes" if all(w == "higher" for w in ways) else "inconclusive"

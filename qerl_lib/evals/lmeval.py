"""Score a saved model with lm-evaluation-harness, offline, on a local GSM8K-schema jsonl.

The official QeRL README scores base models with ``lm_eval --tasks gsm8k``, which downloads
``openai/gsm8k`` from the hub. This module writes an equivalent *local* task definition over
any jsonl with ``question`` / ``answer`` (``... #### N``) fields, so the harness runs with no
network, and runs it on a Hugging Face folder: the embedded model, a hub snapshot, or a LoRA
run merged into a dense bf16 checkpoint (`qerl_lib.models.lora.export_model(base, adapters, out)`).
lm-eval loads the folder with ``AutoModelForCausalLM`` itself, so it only scores what
transformers can load; the kit's packed NVFP4 modules are not used here (`qerl eval` is the
command for NVFP4 checkpoints and for unmerged adapters).

The task (one YAML file, written by `write_task`)
-------------------------------------------------
* ``dataset_path: json`` with ``data_files`` pointing at the absolute jsonl path: datasets'
  packaged json builder, which needs no hub;
* ``output_type: generate_until``, greedy (``do_sample: false``), ``max_gen_toks`` tokens, stop
  at the tokenizer's EOS (lm-eval adds it to ``until``);
* two prompts:

  - ``prompt="kit"``: the question plus the paper's ``<think>/<answer>`` instruction, the exact
    text `qerl_lib.tasks.problems.prompt_messages` sends, wrapped in the model's chat template
    (``apply_chat_template=True``). Same prompt as ``qerl eval`` and the RL rollouts;
  - ``prompt="gsm8k"``: lm-eval's own ``Question: ...\\nAnswer:`` without few-shot examples,
    no chat template (what ``lm_eval --tasks gsm8k --num_fewshot 0`` would send);

* ``doc_to_target: "{{answer}}"`` and lm-eval's usual ``regexes_to_ignore`` (``(?s).*#### ``
  strips the worked solution, then ``,``, ``$`` and a trailing ``.``), so the reference is the
  bare final number;
* filters that pull the *final number* out of the generated text: ``answer-tag`` (the number in
  the last ``<answer>`` block) and ``last-number`` (the last number anywhere) for the kit prompt;
  ``strict-match`` (``#### N``) and ``last-number`` for the gsm8k prompt;
* metric ``exact_match`` (a string comparison after the ignores).

Why the numbers can differ from ``qerl eval``
---------------------------------------------
lm-eval's ``exact_match`` compares strings: "72.0" vs "72" is wrong there and right in the
kit's scorer (exact `Fraction` equality, math-verify for LaTeX); and its regexes take the first
number inside ``<answer>`` where the kit takes the whole block. `run_lm_eval` therefore also
re-scores every raw response with `qerl_lib.tasks.rewards.score_answers` (``kit_accuracy``), so both
numbers sit side by side, computed from the same generations.

Equivalent shell command (after ``write_task(DATA, TASK_DIR)``)::

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 lm_eval --model hf \\
        --model_args pretrained=MODEL_DIR,dtype=float32 --device cpu \\
        --include_path TASK_DIR --tasks qerl_gsm8k_local --apply_chat_template --limit 8

(on a GPU: ``dtype=bfloat16 --device cuda:0``; drop ``--apply_chat_template`` for ``prompt="gsm8k"``).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from qerl_lib.tasks.problems import INSTRUCTION, read_problems
from qerl_lib.errors import UserError
from qerl_lib.io import write_text_atomic

DEFAULT_TASK = "qerl_gsm8k_local"
PROMPTS = ("kit", "gsm8k")
_NUMBER = r"-?[0-9][0-9,]*(?:\.[0-9]+)?"  # one capture group per regex: lm-eval's filter keeps group 1
_IGNORE = ["(?s).*#### ", ",", "\\$", "\\.$"]  # lm-eval's gsm8k.yaml list: reference -> bare number


def task_config(data_path: str | os.PathLike, *, task_name: str = DEFAULT_TASK, prompt: str = "kit",
                max_gen_toks: int = 512) -> dict:
    """The lm-eval task definition (a dict, written as YAML by `write_task`)."""
    if prompt not in PROMPTS:
        raise UserError(f"prompt must be one of {PROMPTS}, got {prompt!r}")
    if max_gen_toks < 1:
        raise UserError(f"max_gen_toks must be >= 1, got {max_gen_toks}")
    if not task_name.replace("_", "").replace("-", "").isalnum():
        raise UserError(f"task name {task_name!r}: use letters, digits, '_' and '-' only")
    data_path = Path(data_path).expanduser().resolve()
    read_problems(data_path)  # fail here, with the line number, rather than deep inside lm-eval
    if prompt == "kit":
        # jinja: the same text as qerl_lib.tasks.problems.prompt_messages; lm-eval wraps it in the chat template
        doc_to_text = "{{question.strip()}}\n" + INSTRUCTION
        until: list[str] = []  # lm-eval appends the tokenizer's EOS
        filters = [("answer-tag", rf"<answer>[^<]*?({_NUMBER})", 0),
                   ("last-number", rf"({_NUMBER})", -1)]
    else:
        doc_to_text = "Question: {{question}}\nAnswer:"
        until = ["Question:"]
        filters = [("strict-match", rf"#### ({_NUMBER})", 0), ("last-number", rf"({_NUMBER})", -1)]
    return {
        "task": task_name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_path)}},
        "test_split": "test",
        "output_type": "generate_until",
        "doc_to_text": doc_to_text,
        "doc_to_target": "{{answer}}",
        "num_fewshot": 0,
        "generation_kwargs": {"until": until, "do_sample": False, "temperature": 0.0, "max_gen_toks": max_gen_toks},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "ignore_case": True, "ignore_punctuation": False, "regexes_to_ignore": list(_IGNORE)}],
        "filter_list": [{"name": name, "filter": [{"function": "regex", "regex_pattern": pattern,
                                                  "group_select": group, "fallback": "[invalid]"},
                                                 {"function": "take_first"}]}
                        for name, pattern, group in filters],
        "repeats": 1,
        "metadata": {"version": 1.0, "prompt": prompt, "source": "qerl_lib.evals.lmeval"},
    }


def write_task(data_path: str | os.PathLike, task_dir: str | os.PathLike, *, task_name: str = DEFAULT_TASK,
               prompt: str = "kit", max_gen_toks: int = 512) -> Path:
    """Write ``<task_dir>/<task_name>.yaml`` for `data_path`; pass `task_dir` as lm-eval's include path."""
    import yaml

    config = task_config(data_path, task_name=task_name, prompt=prompt, max_gen_toks=max_gen_toks)
    text = "# written by qerl_lib.evals.lmeval.write_task; lm-eval task over a local GSM8K-schema jsonl\n"
    text += yaml.safe_dump(config, sort_keys=False, allow_unicode=True, width=1000)
    return write_text_atomic(Path(task_dir) / f"{task_name}.yaml", text)


def run_lm_eval(model_dir: str | os.PathLike, data_path: str | os.PathLike, *, limit: int | None = None,
                prompt: str = "kit", max_gen_toks: int = 512, device: str = "cpu", dtype: str | None = None,
                batch_size: int = 1, task_dir: str | os.PathLike | None = None, seed: int = 0) -> dict:
    """Run lm-eval's ``simple_evaluate`` offline on a saved HF folder; return metrics and samples.

    Returns ``{"task", "n", "metrics": {filter: {"exact_match", "exact_match_stderr"}},
    "kit_accuracy", "samples": [{"doc_id", "question", "gold", "prompt", "response", "filtered": {filter: str},
    "exact_match": {filter: 0/1}, "kit_correct"}]}``. ``kit_accuracy`` re-scores the same raw responses with the
    kit's scorer (see the module docstring for why the two may differ); it is None when there are no
    samples, as is a metric lm-eval reports as "N/A" or non-finite (JSON never holds NaN). ``prompt`` in each sample
    is the exact text lm-eval sent (chat template applied), for checking against the kit's prompt.

    `dtype` defaults to bfloat16 on CUDA and float32 on CPU: CPUs without AVX512-BF16 emulate bf16
    matmuls (about 3x slower here), and a 135M model in float32 is tiny anyway.
    """
    import tempfile

    model_dir = Path(model_dir).expanduser()
    if not (model_dir / "config.json").is_file():
        raise UserError(f"{model_dir} is not a saved Hugging Face model folder (no config.json): pass the "
                        "folder written by save_pretrained / `qerl prepare-model` / merge_to_bf16")
    if limit is not None and limit < 1:
        raise UserError(f"limit must be >= 1 problems, got {limit}")
    dtype = dtype or ("bfloat16" if str(device).startswith("cuda") else "float32")
    # Offline before lm-eval (and with it datasets / huggingface_hub) reads its settings.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory(prefix="qerl_lmeval_") as tmp:
        task_dir = Path(task_dir) if task_dir is not None else Path(tmp)
        write_task(data_path, task_dir, prompt=prompt, max_gen_toks=max_gen_toks)
        manager = TaskManager(include_path=str(task_dir), include_defaults=False)  # skip ~10k bundled YAMLs
        results = simple_evaluate(
            model="hf", model_args=f"pretrained={model_dir},dtype={dtype},trust_remote_code=False",
            tasks=[DEFAULT_TASK], task_manager=manager, limit=limit, device=device, batch_size=batch_size,
            apply_chat_template=(prompt == "kit"), log_samples=True, bootstrap_iters=0,
            random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
    return summarise_results(results)


def summarise_results(results: dict, task: str = DEFAULT_TASK) -> dict:
    """Pull the per-filter exact match and the per-sample responses out of lm-eval's result dict,
    and re-score each raw response with the kit's scorer."""
    from qerl_lib.tasks.rewards import extract_gold, score_answers

    raw = results["results"][task]
    metrics = {}
    for key, value in raw.items():  # keys look like "exact_match,answer-tag"
        metric, _, filt = key.partition(",")
        if metric in ("exact_match", "exact_match_stderr") and filt:
            metrics.setdefault(filt, {})[metric] = None if value == "N/A" else _finite_or_none(float(value))
    by_doc: dict[int, dict] = {}
    answer_fields: dict[int, str] = {}
    for s in results.get("samples", {}).get(task, []):  # one entry per (problem, filter)
        entry = by_doc.get(s["doc_id"])
        if entry is None:
            response = s["resps"][0][0]  # the raw generation, the same for every filter
            entry = by_doc[s["doc_id"]] = {
                "doc_id": s["doc_id"], "question": s["doc"]["question"], "gold": extract_gold(s["doc"]["answer"]),
                "prompt": s["arguments"][0][0], "response": response, "filtered": {}, "exact_match": {}}
            answer_fields[s["doc_id"]] = s["doc"]["answer"]
        entry["filtered"][s["filter"]] = s["filtered_resps"][0]
        entry["exact_match"][s["filter"]] = float(s["exact_match"])
    samples = list(by_doc.values())
    samples.sort(key=lambda s: s["doc_id"])
    # One batch: answers that need math-verify are checked side by side.
    scores = score_answers([s["response"] for s in samples], [answer_fields[s["doc_id"]] for s in samples])
    for sample, score in zip(samples, scores):
        sample["kit_correct"] = score
    kit = sum(scores) / len(samples) if samples else None  # None, not NaN: this goes into JSON
    return {"task": task, "n": len(samples), "metrics": metrics, "kit_accuracy": kit, "samples": samples}


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None

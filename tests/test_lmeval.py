"""Tests for qerl_lib.evals.lmeval: the local lm-eval task over a GSM8K-schema jsonl, run offline.

The filters and the metric are checked with lm-eval's own filter and metric code on canned
responses (no model), so the YAML is tested as lm-eval will read it. One end-to-end run on the
embedded model (2 problems, 8 new tokens, float32 on CPU) checks that the harness sends exactly
the kit's prompt and that its greedy text equals transformers' greedy generation.
"""

from __future__ import annotations

import json

import pytest

from qerl_lib.errors import UserError
from qerl_lib.evals.lmeval import DEFAULT_TASK, run_lm_eval, summarise_results, task_config, write_task

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is an optional dependency (requirements.txt)")

PROBLEMS = [
    {"question": "Ava has 3 apples. She buys 4 more. How many apples does she have?",
     "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "A box holds 1,200 pencils. 5 boxes hold how many?",
     "answer": "1200 * 5 = <<1200*5=6000>>6000\n#### 6,000"},
]


@pytest.fixture()
def data_file(tmp_path):
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return path


def apply_filters_and_metric(config: dict, response: str, answer: str) -> dict[str, tuple[str, float]]:
    """What lm-eval does to one response under `config`: each filter chain, then exact_match."""
    from lm_eval.api.metrics import exact_match_hf_evaluate
    from lm_eval.filters import get_filter  # importing lm_eval.filters registers "regex", "take_first"

    metric = config["metric_list"][0]
    out = {}
    for chain in config["filter_list"]:
        resps = [[response]]
        for step in chain["filter"]:
            kwargs = {k: v for k, v in step.items() if k != "function"}
            resps = list(get_filter(step["function"])(**kwargs).apply(resps, [{}]))
        filtered = resps[0] if isinstance(resps[0], str) else resps[0][0]
        score = exact_match_hf_evaluate([filtered], [answer], regexes_to_ignore=metric["regexes_to_ignore"],
                                        ignore_case=metric["ignore_case"])["exact_match"]
        out[chain["name"]] = (filtered, float(score))
    return out


# (id, prompt style, response, gold answer field, {filter: expected exact_match})
FILTER_CASES = [
    ("kit-answer-tag", "kit", "<think>3+4=7</think><answer>7</answer>", "#### 7", {"answer-tag": 1, "last-number": 1}),
    ("kit-commas-dollar-period", "kit", "<think>x</think><answer>$6,000.</answer>", "... #### 6,000",
     {"answer-tag": 1, "last-number": 1}),
    ("kit-words-in-answer", "kit", "<think>x</think><answer>She has 7 apples</answer>", "#### 7",
     {"answer-tag": 1, "last-number": 1}),
    # The official GSM8K scorer's first-character bug: "75" vs "72" must be wrong here too.
    ("kit-first-digit-is-not-enough", "kit", "<think>x</think><answer>75</answer>", "#### 72",
     {"answer-tag": 0, "last-number": 0}),
    ("kit-no-tags", "kit", "so the total is 7", "#### 7", {"answer-tag": 0, "last-number": 1}),
    ("kit-negative", "kit", "<answer>-3</answer>", "#### -3", {"answer-tag": 1, "last-number": 1}),
    # exact_match compares strings: 7.0 is wrong for lm-eval (the kit's scorer says right; see docstring).
    ("kit-string-not-number", "kit", "<answer>7.0</answer>", "#### 7", {"answer-tag": 0, "last-number": 0}),
    ("gsm8k-strict", "gsm8k", " 3 + 4 = 7\n#### 7", "#### 7", {"strict-match": 1, "last-number": 1}),
    ("gsm8k-no-marker", "gsm8k", " The answer is 7.", "#### 7", {"strict-match": 0, "last-number": 1}),
]


@pytest.mark.parametrize("prompt, response, answer, expected", [c[1:] for c in FILTER_CASES],
                         ids=[c[0] for c in FILTER_CASES])
def test_filters_and_exact_match_as_lm_eval_applies_them(data_file, prompt, response, answer, expected):
    results = apply_filters_and_metric(task_config(data_file, prompt=prompt), response, answer)
    assert {name: score for name, (_, score) in results.items()} == expected, results


def test_task_config_rejects_bad_input(tmp_path, data_file):
    with pytest.raises(UserError, match="prompt must be one of"):
        task_config(data_file, prompt="fewshot")
    with pytest.raises(UserError, match="does not exist"):
        task_config(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(UserError, match="GSM8K schema"):
        task_config(bad)
    with pytest.raises(UserError, match="max_gen_toks"):
        task_config(data_file, max_gen_toks=0)
    with pytest.raises(UserError, match="task name"):
        task_config(data_file, task_name="../evil")


def test_written_task_loads_offline_with_the_kit_prompt(tmp_path, data_file, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.tasks import TaskManager

    from qerl_lib.tasks.problems import prompt_messages

    yaml_path = write_task(data_file, tmp_path / "tasks")
    assert yaml_path.name == f"{DEFAULT_TASK}.yaml"
    manager = TaskManager(include_path=str(tmp_path / "tasks"), include_defaults=False)
    assert DEFAULT_TASK in manager.all_tasks
    task = manager.load([DEFAULT_TASK])["tasks"][DEFAULT_TASK]
    docs = list(task.test_docs())
    assert [d["question"] for d in docs] == [p["question"] for p in PROBLEMS]
    assert task.doc_to_text(docs[0]) == prompt_messages(PROBLEMS[0]["question"])[0]["content"]


def test_summarise_results_rescores_with_the_kit_scorer():
    # lm-eval's result layout (0.4.13): one sample entry per (problem, filter).
    doc = {"question": "q", "answer": "#### 7"}
    samples = [{"doc_id": 0, "doc": doc, "arguments": [("PROMPT", {})], "resps": [["<answer>7.0</answer>"]],
                "filtered_resps": [f], "filter": name, "exact_match": 0.0}
               for name, f in (("answer-tag", "7.0"), ("last-number", "7.0"))]
    raw = {"results": {DEFAULT_TASK: {"exact_match,answer-tag": 0.0, "exact_match_stderr,answer-tag": "N/A",
                                      "exact_match,last-number": 0.0, "exact_match_stderr,last-number": "N/A"}},
           "samples": {DEFAULT_TASK: samples}}
    out = summarise_results(raw)
    assert out["n"] == 1 and out["metrics"]["answer-tag"] == {"exact_match": 0.0, "exact_match_stderr": None}
    assert out["samples"][0]["filtered"] == {"answer-tag": "7.0", "last-number": "7.0"}
    assert out["kit_accuracy"] == 1.0  # 7.0 == 7 numerically


def test_run_lm_eval_end_to_end_on_the_embedded_model(embedded_model_dir, data_file, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qerl_lib.tasks.problems import render_prompt
    from qerl_lib.tasks.rewards import score_answer

    out = run_lm_eval(embedded_model_dir, data_file, limit=2, max_gen_toks=8, device="cpu")
    assert out["n"] == 2 and set(out["metrics"]) == {"answer-tag", "last-number"}
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_dir)
    for sample, problem in zip(out["samples"], PROBLEMS):
        assert sample["prompt"] == render_prompt(tokenizer, problem["question"])  # the kit's exact prompt
        assert sample["kit_correct"] == score_answer(sample["response"], problem["answer"])
    # The harness's greedy text is transformers' greedy text for that prompt (same weights, dtype).
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32)
    ids = tokenizer(out["samples"][0]["prompt"], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        greedy = model.generate(**ids, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(greedy[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    assert out["samples"][0]["response"] == text

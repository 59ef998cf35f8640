"""Tests for qerl_lib.evals.evaluation and `qerl eval` (qerl_lib/cli/eval_command.py).

Model runs use the embedded SmolLM2-135M on CPU with a few problems and 8-32 new tokens. The
CLI is run through `qerl_lib.cli.main`, so errors are checked exactly as a user sees them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from qerl_lib.evals.evaluation import EvalConfig, bootstrap_interval, evaluate, summarise

# an optional local GSM8K test split (GSM8K schema), next to the checkout as in tests/test_data.py
GSM8K_TEST = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


@pytest.fixture()
def qerl(monkeypatch):
    """`qerl ARGS...` as the console script runs it; wires `eval` in if generation.py does not yet."""
    from qerl_lib import cli
    from qerl_lib.cli.eval_command import register_eval

    original = cli.build_parser

    def build():
        parser = original()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        if "eval" not in sub.choices:
            register_eval(sub)
        return parser

    monkeypatch.setattr(cli, "build_parser", build)
    return cli.main


@pytest.fixture(scope="module")
def embedded(embedded_model_dir):
    from transformers import AutoTokenizer

    from qerl_lib.models.loader import load_model

    return load_model(embedded_model_dir, dtype=torch.float32), AutoTokenizer.from_pretrained(embedded_model_dir)


# ---- summary statistics ------------------------------------------------------------------------


def _record(correct, formatted=None, lengths=None, reasons=None):
    k = len(correct)
    return {"correct": correct, "formatted": formatted or [0.0] * k, "lengths": lengths or [10] * k,
            "finish_reasons": reasons or ["stop"] * k}


def test_summarise_against_hand_computed_values():
    records = [_record([1.0, 0.0], formatted=[1.0, 1.0], lengths=[4, 6], reasons=["stop", "length"]),
               _record([0.0, 0.0], lengths=[10, 20]),
               _record([1.0, 1.0], formatted=[1.0, 0.0])]
    s = summarise(records, EvalConfig(samples=2))
    assert s["pass@1"] == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert s["pass@2"] == s["pass@k"] == pytest.approx(2 / 3)
    assert s["format_rate"] == pytest.approx(3 / 6)
    assert s["mean_length"] == pytest.approx((4 + 6 + 10 + 20 + 10 + 10) / 6)
    assert s["truncated_rate"] == pytest.approx(1 / 6)
    low, high = s["pass@1_ci95"]
    assert 0.0 <= low <= s["pass@1"] <= high <= 1.0


def test_bootstrap_interval_matches_a_plain_loop():
    # Reference: the same resampling written as a plain Python loop over the same random indices.
    values = torch.tensor([0.0, 1.0, 0.5, 1.0, 0.0, 0.25], dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    idx = torch.randint(len(values), (500, len(values)), generator=gen)
    means = sorted(sum(float(values[j]) for j in row) / len(values) for row in idx.tolist())
    low, high = bootstrap_interval(values, n_boot=500, seed=3)
    ref = torch.quantile(torch.tensor(means, dtype=torch.float64), torch.tensor([0.025, 0.975], dtype=torch.float64))
    assert (low, high) == pytest.approx((float(ref[0]), float(ref[1])), abs=1e-12)  # same numbers, float64
    assert bootstrap_interval(torch.full((5,), 0.3, dtype=torch.float64)) == pytest.approx((0.3, 0.3))


@pytest.mark.parametrize("kwargs, match", [
    ({"samples": 0}, "samples"), ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": 0, "samples": 2}, "greedy"),
    ({"n_boot": 10}, "n_boot"),
], ids=["samples", "temperature", "top-p", "max-new-tokens", "greedy-samples", "n-boot"])
def test_eval_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EvalConfig(**kwargs)


# ---- evaluate() on the embedded model ------------------------------------------------------------


def test_same_seed_same_records_other_seed_other_samples(embedded):
    from qerl_lib.tasks.problems import generate_arith

    model, tokenizer = embedded
    problems = generate_arith("test", 2, seed=0)
    config = EvalConfig(samples=2, temperature=1.0, top_p=1.0, max_new_tokens=6, seed=5, with_entropy=True)
    first = evaluate(model, tokenizer, problems, config, progress=False)
    again = evaluate(model, tokenizer, problems, config, progress=False)
    assert first.summary == again.summary and first.records == again.records
    other = evaluate(model, tokenizer, problems, EvalConfig(**{**config.__dict__, "seed": 6, "with_entropy": False}),
                     progress=False)
    # 4 completions of 6 tokens at temperature 1 from a 49k vocabulary: all equal by chance is ~impossible.
    assert [r["completion_ids"] for r in other.records] != [r["completion_ids"] for r in first.records]
    rec = first.records[0]
    assert set(rec) >= {"question", "gold", "completions", "answers", "correct", "formatted", "lengths",
                        "finish_reasons", "entropy"}
    assert first.summary["entropy"] > 0 and len(rec["entropy"]) == 2
    assert len(rec["completions"]) == 2 and all(0 < n <= 6 for n in rec["lengths"])
    assert "tokens_per_second" in first.timing and "tokens_per_second" not in first.summary


# ---- the CLI -----------------------------------------------------------------------------------


@pytest.mark.skipif(not GSM8K_TEST.is_file(), reason="no local GSM8K test split next to the checkout")
def test_qerl_eval_on_gsm8k_is_reproducible_with_a_seed(qerl, tmp_path, capsys):
    args = ["eval", "--model", "smollm2", "--data", "gsm8k", "--path", str(GSM8K_TEST), "--n", "3",
            "--max-new-tokens", "32", "--temperature", "0.6", "--seed", "11", "--device", "cpu", "--quiet"]
    assert qerl(args + ["--json", str(tmp_path / "a.json")]) == 0
    assert qerl(args + ["--json", str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f"{x}.json").read_text()) for x in "ab")
    assert a["summary"] == b["summary"]  # every number, the interval included
    assert {"pass@1", "pass@1_ci95", "pass@k", "format_rate", "mean_length"} <= set(a["summary"])
    assert a["summary"]["n_problems"] == 3 and a["data"]["n"] == 3 and "provenance" in a
    rows_a = [json.loads(line) for line in (tmp_path / "a.records.jsonl").read_text().splitlines()]
    rows_b = [json.loads(line) for line in (tmp_path / "b.records.jsonl").read_text().splitlines()]
    assert rows_a == rows_b and len(rows_a) == 3
    assert rows_a[0]["gold"] == "18"  # Janet's ducks, the first GSM8K test problem
    last_line = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last_line)["pass@1"] == a["summary"]["pass@1"]  # last stdout line is one JSON document


def test_qerl_eval_greedy_and_lora(qerl, tmp_path, embedded_model_dir):
    pytest.importorskip("peft")
    from qerl_lib.models.loader import load_model
    from qerl_lib.models.lora import attach_lora, save_adapters

    # A tiny adapter with large random B, so the LoRA model must write different text.
    peft_model = attach_lora(load_model(embedded_model_dir, dtype=torch.float32), rank=2)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    save_adapters(peft_model, tmp_path / "adapter")

    args = ["eval", "--model", "smollm2", "--data", "arith", "--n", "2", "--max-new-tokens", "12", "--greedy",
            "--samples", "4", "--device", "cpu", "--quiet"]
    assert qerl(args + ["--json", str(tmp_path / "base.json")]) == 0
    assert qerl(args + ["--lora", str(tmp_path / "adapter"), "--json", str(tmp_path / "lora.json")]) == 0
    base, lora = (json.loads((tmp_path / f"{x}.json").read_text()) for x in ("base", "lora"))
    assert base["summary"]["samples"] == 1 and base["summary"]["config"]["temperature"] == 0.0  # --greedy wins
    assert lora["model"]["lora"] == str(tmp_path / "adapter")
    texts = [[json.loads(line)["completions"] for line in (tmp_path / f"{x}.records.jsonl").read_text().splitlines()]
             for x in ("base", "lora")]
    assert texts[0] != texts[1], "the adapter did not change the greedy text"


def test_gsm8k_offline_without_path_is_a_one_line_error(qerl, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what an offline machine looks like to hub_reachable
    assert qerl(["eval", "--model", "smollm2", "--data", "gsm8k", "--n", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("qerl eval: error:") and "--path" in err


@pytest.mark.parametrize("extra, match", [
    (["--n", "0"], "--n must be >= 1"),
    (["--n", "-5"], "--n must be >= 1"),
    (["--samples", "2", "--temperature", "0"], "greedy"),
    (["--data", "file"], "--path"),
    (["--data", "file", "--path", "/nonexistent/test.jsonl"], "does not exist"),
], ids=["n-zero", "n-negative", "greedy-with-samples", "file-without-path", "missing-file"])
def test_bad_arguments_are_one_line_errors(qerl, capsys, extra, match):
    assert qerl(["eval", "--model", "smollm2"] + extra) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err


def test_evaluate_checks_every_gold_answer_before_sampling():
    # model and tokenizer are None: reaching the tokenizer or the engine would raise something else.
    from qerl_lib.errors import UserError

    problems = [{"question": "q1", "answer": "#### 4"}, {"question": "q2", "answer": "1 + 1 = 2\n#### "}]
    with pytest.raises(UserError, match="gold answer is empty"):
        evaluate(None, None, problems, EvalConfig(), progress=False)


def test_records_pair_each_completion_with_its_own_score(monkeypatch):
    # evaluate() scores all completions in one batch; each record must get its own completions'
    # scores back, across engine calls (batch_size 3, 6 completions). No model: a stub engine and
    # tokenizer whose completion for (problem i, sample k) is texts[i][k].
    from types import SimpleNamespace

    from qerl_lib.evals import evaluation

    texts = {0: ["<answer>4</answer>", "<answer>60+12</answer>"], 1: ["<answer>7</answer>", "#### 8"],
             2: ["\\boxed{9}", "no answer"]}
    problems = [{"question": f"q{i}", "answer": f"#### {gold}"} for i, gold in enumerate([4, 8, 9])]

    class Tokenizer:
        chat_template = "stub"

        def apply_chat_template(self, messages, **kwargs):
            return messages[0]["content"]

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [int(text.split()[0][1:])]}  # "q2 ..." -> [2]

        def decode(self, ids, skip_special_tokens=True):
            return texts[ids[0]][ids[1]]

    drawn: dict[int, int] = {}

    def stub_generate(model, prompts, **kwargs):
        outs = []
        for (i,) in prompts:
            drawn[i] = drawn.get(i, -1) + 1
            outs.append(SimpleNamespace(token_ids=[i, drawn[i]], finish_reason="stop"))
        return outs

    monkeypatch.setattr(evaluation, "generate", stub_generate)
    report = evaluate(None, Tokenizer(), problems, EvalConfig(samples=2, batch_size=3, n_boot=100), progress=False)
    assert [r["correct"] for r in report.records] == [[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]]
    assert [r["completions"] for r in report.records] == [texts[0], texts[1], texts[2]]


@pytest.mark.parametrize("rows, match", [
    ([{"question": "q", "answer": "#### 3"}, {"question": "q", "answer": "work\n#### "}], "test.jsonl:2"),
    ([{"question": "q", "answer": "3"}], "test.jsonl:1"),
], ids=["empty-gold", "no-hash"])
def test_bad_gold_answers_fail_before_the_model_loads(qerl, tmp_path, capsys, rows, match):
    path = tmp_path / "test.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert qerl(["eval", "--model", "/nonexistent/model", "--data", "file", "--path", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and match in err


def test_qerl_eval_on_an_nvfp4_checkpoint(qerl, tmp_path, embedded_model_dir):
    import shutil

    from transformers import AutoModelForCausalLM, LlamaConfig

    from qerl_lib.models.loader import quantize_checkpoint

    # A tiny random Llama with the embedded tokenizer, quantized by the kit's native NVFP4A16 writer.
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(tmp_path / "dense")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (embedded_model_dir / name).exists():
            shutil.copy(embedded_model_dir / name, tmp_path / "dense" / name)
    quantize_checkpoint(tmp_path / "dense", tmp_path / "nvfp4", backend="native")
    args = ["eval", "--model", str(tmp_path / "nvfp4"), "--data", "arith", "--n", "2", "--max-new-tokens", "4",
            "--greedy", "--device", "cpu", "--quiet", "--json", str(tmp_path / "nvfp4.json")]
    assert qerl(args) == 0
    result = json.loads((tmp_path / "nvfp4.json").read_text())
    assert result["model"]["kind"] == "nvfp4" and result["summary"]["n_problems"] == 2

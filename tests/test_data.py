"""Embedded data: the arithmetic generator, the GSM8K loader and the prompt."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qerl_lib.tasks import problems as data
from qerl_lib.errors import UserError

SHARED_GSM8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "qerl_lib", *args], capture_output=True, text=True)


def test_same_seed_gives_byte_identical_files(tmp_path):
    for name in ("a", "b"):
        r = _cli("data", "arith", "--split", "train", "--n", "200", "--seed", "7", "--out", str(tmp_path / f"{name}.jsonl"))
        assert r.returncode == 0, r.stderr
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    r = _cli("data", "arith", "--split", "train", "--n", "200", "--seed", "8", "--out", str(tmp_path / "c.jsonl"))
    assert (tmp_path / "c.jsonl").read_bytes() != (tmp_path / "a.jsonl").read_bytes()


def test_train_and_test_never_overlap_across_seeds():
    train = [r for s in range(3) for r in data.generate_arith("train", 1500, seed=s)]
    test = [r for s in range(3) for r in data.generate_arith("test", 500, seed=s)]
    # the split is a function of the arithmetic content: no (start, ops) pair, and no question, in both
    assert not {r["id"] for r in train} & {r["id"] for r in test}
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert not {r["expression"] for r in train} & {r["expression"] for r in test}


@pytest.mark.parametrize("level", [None, 1, 2, 3, 4], ids=lambda l: f"level={l}")
def test_every_answer_matches_its_expression(level):
    records = data.generate_arith("test", 300, seed=3, level=level)
    assert len(records) == 300
    for r in records:
        gold = int(data.gold_answer(r))
        assert data.evaluate_expression(r["expression"]) == gold
        assert gold >= 0
        n_ops = sum(r["expression"].count(op) for op in " + ,- ,* ,/ ".split(","))
        assert r["level"] == n_ops
        if level is not None:
            assert r["level"] == level
        # the worked solution's last step is the answer, and every step's calculator note is right
        for step in r["answer"].splitlines()[:-1]:
            expr, result = step.split("<<")[1].split(">>")[0].split("=")
            assert data.evaluate_expression(expr) == int(result)


def test_templates_and_vocabularies_vary():
    records = data.generate_arith("train", 300, seed=0)
    first_words = {r["question"].split()[0] for r in records}
    things = {w for r in records for w in ("apples", "marbles", "books", "stamps") if w in r["question"]}
    assert len(first_words) >= 5 and len(things) >= 3


def test_bad_generator_input_is_a_clear_error():
    with pytest.raises(UserError, match="split"):
        data.generate_arith("valid", 3)
    with pytest.raises(UserError, match="level"):
        data.generate_arith("train", 3, level=7)
    with pytest.raises(UserError, match="n must be"):
        data.generate_arith("train", -1)


def test_evaluate_expression_refuses_anything_but_arithmetic():
    with pytest.raises(ValueError):
        data.evaluate_expression("__import__('os').getcwd()")
    with pytest.raises(ValueError):
        data.evaluate_expression("(7 / 2)")


@pytest.mark.skipif(not (SHARED_GSM8K / "test.jsonl").exists(), reason="shared GSM8K copy not present")
def test_gsm8k_local_file_loads_and_parses():
    records = data.load_gsm8k("test", SHARED_GSM8K / "test.jsonl")
    assert len(records) == 1319
    golds = [data.gold_answer(r) for r in records]
    assert all(g.lstrip("-").replace(".", "").isdigit() for g in golds)


def test_gsm8k_offline_without_path_is_one_clear_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="--path"):
        data.load_gsm8k("test")
    r = _cli("data", "gsm8k", "--out", "/dev/null")
    assert r.returncode == 2 and "--path" in r.stderr and "Traceback" not in r.stderr


def test_bad_jsonl_names_the_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "a #### 1"}) + "\n" + json.dumps({"question": "q"}) + "\n")
    with pytest.raises(UserError, match=r"bad.jsonl:2"):
        data.read_problems(bad)
    with pytest.raises(UserError, match="empty"):
        empty = tmp_path / "empty.jsonl"
        empty.write_text("")
        data.load_problems("file", path=empty)


def test_prompt_uses_chat_template_and_paper_instruction(embedded_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_model_dir)
    text = data.render_prompt(tok, "What is 2 + 3?")
    assert "<think>" in text and "<answer>" in text and "What is 2 + 3?" in text
    assert text.rstrip().endswith("<|im_start|>assistant")
    ids = data.encode_prompts(tok, ["What is 2 + 3?"])[0]
    assert tok.decode(ids) == text

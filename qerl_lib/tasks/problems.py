"""Problems and prompts: a seeded arithmetic word-problem generator, a GSM8K loader, the prompt.

Everything uses GSM8K's schema, so the rest of the kit never cares where a problem came
from: each record has `question` (text) and `answer` (worked solution ending in `#### N`).

The arithmetic generator
------------------------
GSM8K needs the hub (or a file); the kit's main job must not. `generate_arith` makes
GSM8K-style word problems with integer answers from a seed:

* level L (1-4) = number of arithmetic operations (+, -, x, ÷) applied to a start value;
  division only when exact, subtraction only while the running value stays positive;
* several sentence templates per operation and several vocabularies (people, things,
  places), so the surface text varies while the arithmetic stays checkable;
* each record keeps its `expression` (e.g. `((12 + 7) * 3)`), so a test can recompute
  every answer independently (`evaluate_expression`, a tiny AST walker, no `eval`);
* train and test can never overlap: a problem's split is a hash of its arithmetic content
  (level, start value, operations), so the same arithmetic lands in the same split whatever
  the seed, template or wording. Same seed -> byte-identical output.
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import random
from pathlib import Path
from typing import Iterable

from qerl_lib.errors import UserError

# The paper's instruction (QeRL App. E), appended to every problem: reasoning inside
# <think></think>, final answer inside <answer></answer>. Kept verbatim: it is part of the setup.
INSTRUCTION = ("Solve the following math problem step by step. The reasoning process and direct answer are "
               "enclosed within <think> </think> and <answer> </answer> tags, respectively, i.e., "
               "<think> reasoning process here </think> <answer> answer here </answer>.")

TEST_FRACTION = 0.2  # share of the arithmetic-content hash space reserved for the test split
LEVELS = (1, 2, 3, 4)

_VOCAB = [
    # (things, container, place, verb-collect)
    ("apples", "basket", "orchard", "picks"),
    ("stickers", "album", "shop", "collects"),
    ("marbles", "jar", "fair", "wins"),
    ("books", "shelf", "library", "buys"),
    ("cookies", "tray", "bakery", "bakes"),
    ("stamps", "folder", "post office", "gets"),
    ("seashells", "bucket", "beach", "finds"),
    ("pencils", "box", "school", "receives"),
]
_NAMES = ["Mia", "Liam", "Ava", "Noah", "Zara", "Omar", "Lena", "Ravi", "Chen", "Sofia", "Kofi", "Ines"]

_START = ["{name} has {a} {things}.", "There are {a} {things} in {name}'s {container}.",
          "{name} starts the day with {a} {things}."]
_OPS = {
    "+": ["At the {place}, {name} {collect} {b} more {things}.", "A friend gives {name} {b} more {things}.",
          "Then {name} adds {b} {things} to the {container}."],
    "-": ["{name} gives {b} {things} away.", "{b} of the {things} get lost on the way home.",
          "{name} uses {b} of the {things} for a project."],
    "*": ["Then the number of {things} becomes {b} times as large.", "{name} ends up with {b} times as many {things}.",
          "Each of the {things} is swapped for {b} new ones."],
    "/": ["{name} splits the {things} equally into {b} groups and keeps one group.",
          "{name} shares the {things} equally with friends so that {b} people get the same amount, keeping one share.",
          "The {things} are packed equally into {b} bags and {name} keeps one bag."],
}
_QUESTION = ["How many {things} does {name} have now?", "How many {things} are there at the end?",
             "What is the final number of {things}?"]
_PY_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}


def generate_arith(split: str, n: int, seed: int = 0, level: int | None = None) -> list[dict]:
    """`n` problems of the given split; `level` fixes the number of operations (default: mixed 1-4)."""
    if level is not None and level not in LEVELS:
        raise UserError(f"level must be one of {LEVELS} (number of operations), got {level}")
    rng = random.Random(f"qerl-arith:{split}:{seed}:{level}")

    def draw():
        lvl = level if level is not None else rng.choice(LEVELS)
        start, ops = _sample_arithmetic(rng, lvl)
        key = _content_key(lvl, start, ops)
        return key, lambda: _render(rng, lvl, start, ops, key)

    return distinct_in_split(split, n, draw, f"{split} problems at level {level}")


def distinct_in_split(split: str, n: int, draw, what: str) -> list[dict]:
    """`n` records with distinct content keys that hash into `split`. ``draw()`` returns (key, make):
    the content key of one random problem and a function that renders its record."""
    if split not in ("train", "test"):
        raise UserError(f"split must be 'train' or 'test', got {split!r}")
    if n < 0:
        raise UserError(f"n must be >= 0, got {n}")
    seen: set[str] = set()
    records: list[dict] = []
    attempts = 0
    while len(records) < n:
        attempts += 1
        if attempts > 200 * (n + 10):
            raise UserError(f"could not find {n} distinct {what}: ask for fewer")
        key, make = draw()
        if key in seen or split_of(key) != split:
            continue
        seen.add(key)
        records.append(make())
    return records


def split_of(content_key: str) -> str:
    """The split a piece of arithmetic belongs to, fixed by a hash of its content."""
    bucket = int(hashlib.sha256(content_key.encode()).hexdigest()[:8], 16) / 16**8
    return "test" if bucket < TEST_FRACTION else "train"


def _sample_arithmetic(rng: random.Random, level: int) -> tuple[int, list[tuple[str, int]]]:
    value = start = rng.randint(2, 60)
    ops: list[tuple[str, int]] = []
    while len(ops) < level:
        op = rng.choice("+-*/")
        if op == "+":
            b = rng.randint(2, 50)
        elif op == "-":
            if value <= 2:
                continue
            b = rng.randint(1, value - 1)
        elif op == "*":
            if value > 200:
                continue
            b = rng.randint(2, 5)
        else:
            divisors = [d for d in range(2, 10) if value % d == 0 and value // d >= 1]
            if not divisors:
                continue
            b = rng.choice(divisors)
        ops.append((op, b))
        value = _PY_OPS[op](value, b)
    return start, ops


def _content_key(level: int, start: int, ops: list[tuple[str, int]]) -> str:
    return f"L{level}:{start}:" + ",".join(f"{o}{b}" for o, b in ops)


def _render(rng: random.Random, level: int, start: int, ops: list[tuple[str, int]], key: str) -> dict:
    things, container, place, collect = rng.choice(_VOCAB)
    name = rng.choice(_NAMES)
    fill = dict(name=name, things=things, container=container, place=place, collect=collect)
    sentences = [rng.choice(_START).format(a=start, **fill)]
    steps, expression, value = [], str(start), start
    for op, b in ops:
        sentences.append(rng.choice(_OPS[op]).format(b=b, **fill))
        new = _PY_OPS[op](value, b)
        sym = {"+": "+", "-": "-", "*": "*", "/": "/"}[op]
        steps.append(f"{value} {sym} {b} = <<{value}{sym}{b}={new}>>{new}")
        expression = f"({expression} {sym} {b})"
        value = new
    sentences.append(rng.choice(_QUESTION).format(**fill))
    answer = "\n".join(steps) + f"\n#### {value}"
    return {"question": " ".join(sentences), "answer": answer, "expression": expression, "level": level,
            "id": hashlib.sha256(key.encode()).hexdigest()[:12]}


def evaluate_expression(expression: str) -> int:
    """Evaluate a generated expression (integers, + - * /, parentheses) without `eval`."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: _exact_div}

    def walk(node):
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](walk(node.left), walk(node.right))
        raise ValueError(f"unsupported expression element: {ast.dump(node)[:60]}")

    return walk(ast.parse(expression, mode="eval"))


def _exact_div(a: int, b: int) -> int:
    if a % b:
        raise ValueError(f"{a} / {b} is not an integer")
    return a // b


def gold_answer(record: dict) -> str:
    """The final answer of a GSM8K-schema record: the first line after the last `####`, commas
    removed. UserError when there is none (no `####`, or nothing after it)."""
    answer = record.get("answer")
    problem = _gold_problem(answer)
    if problem:
        raise UserError(f"{problem}: every answer must end with '#### N'")
    return answer.rsplit("####", 1)[1].strip().splitlines()[0].strip().replace(",", "")


def _gold_problem(answer) -> str | None:
    """What is wrong with an ``answer`` field as a source of the final answer, or None."""
    if not isinstance(answer, str) or "####" not in answer:
        return f"no '#### N' final answer (answer: {str(answer)[:60]!r})"
    if not answer.rsplit("####", 1)[1].strip().replace(",", ""):
        return "the gold answer is empty (nothing after '####')"
    return None


# ---------------------------------------------------------------------------------------------
# GSM8K and files

def read_problems(path: str | Path) -> list[dict]:
    """Read a GSM8K-schema jsonl file (UTF-8), checking every record has a `question` and an `answer`
    ending in a non-empty `#### N`; UserError naming the file and line otherwise."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"{path} does not exist: pass a jsonl file with 'question' and 'answer' fields")
    records = []
    with open(path, "rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UserError(f"{path}:{i}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}): "
                                "re-save the file as UTF-8") from None
            if i == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark some editors write
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{path}:{i} is not valid JSON ({e.msg}): fix or regenerate the file") from None
            problem = ("not a JSON object with a 'question' field" if not isinstance(rec, dict) or "question" not in rec
                       else _gold_problem(rec.get("answer")))
            if problem:
                raise UserError(f"{path}:{i} is not in GSM8K schema ({problem}): each line needs 'question' and "
                                "an 'answer' ending with '#### N'")
            records.append(rec)
    return records


def load_gsm8k(split: str = "test", path: str | Path | None = None) -> list[dict]:
    """GSM8K from a local jsonl (`path`) or from the hub dataset `openai/gsm8k` when online."""
    if path is not None:
        return read_problems(path)
    from qerl_lib.paths import hub_reachable

    if not hub_reachable():
        raise UserError("GSM8K needs the Hugging Face Hub, which is unreachable (offline?): pass a local copy with "
                        "--path path/to/test.jsonl (GSM8K schema)")
    try:
        import datasets

        ds = datasets.load_dataset("openai/gsm8k", "main", split=split)
        return [{"question": r["question"], "answer": r["answer"]} for r in ds]
    except Exception as e:
        raise UserError(f"GSM8K could not be loaded from the hub ({type(e).__name__}); offline? "
                        "pass a local copy with --path path/to/test.jsonl (GSM8K schema)") from None


def load_problems(data: str = "arith", split: str = "test", n: int | None = None, seed: int = 0,
                  path: str | Path | None = None, level: int | None = None) -> list[dict]:
    """One entry point for every command: `arith` (generated word problems), `expr` (generated bare
    expressions, `tasks/expressions.py`), `gsm8k` (hub or `path`), or `file` (`path`); the first `n`
    (all when None). Every returned record has a non-empty gold answer, checked here, before any
    model runs; a negative `n` is a UserError (a slice would silently drop the last rows)."""
    if n is not None and n < 0:
        raise UserError(f"n (--n) must be >= 0, got {n}")
    if data == "expr":
        from qerl_lib.tasks.expressions import generate_expressions  # it imports this module

        records = read_problems(path) if path else generate_expressions(split, n if n is not None else 64, seed,
                                                                         level if level is not None else 2)
    elif data == "arith":
        records = read_problems(path) if path else generate_arith(split, n if n is not None else 64, seed, level)
    elif data == "gsm8k":
        records = load_gsm8k(split, path)
    elif data == "file":
        if path is None:
            raise UserError("--data file needs --path FILE.jsonl")
        records = read_problems(path)
    else:
        raise UserError(f"unknown data source {data!r}: use arith, expr, gsm8k or file")
    if not records:
        raise UserError(f"no problems in {data} ({path or split}): the dataset is empty: pass a GSM8K-schema jsonl "
                        "with one {'question': ..., 'answer': ...} object per line (qerl data arith/gsm8k writes one)")
    records = records[:n] if n is not None else records
    for i, record in enumerate(records):
        problem = _gold_problem(record.get("answer") if isinstance(record, dict) else None)
        if problem:
            raise UserError(f"{data} ({path or split}) problem {i}: {problem}; every answer must end with '#### N'")
    return records


def write_problems(records: Iterable[dict], out: str | Path) -> Path:
    """Write records as jsonl, atomically, with stable key order (same seed -> same bytes)."""
    from qerl_lib.io import write_text_atomic

    return write_text_atomic(out, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


# ---------------------------------------------------------------------------------------------
# Prompts

def prompt_messages(question: str, instruction: str | None = None, prefill: str | None = None) -> list[dict]:
    """The chat messages for one problem: the question followed by its instruction (default the
    paper's; a record's own ``instruction`` field, as the expression task has, replaces it), and,
    with ``prefill``, the start of the assistant's reply that the model continues (``"36 + 32 ="``)."""
    messages = [{"role": "user", "content": f"{question.strip()}\n{instruction or INSTRUCTION}"}]
    if prefill:
        messages.append({"role": "assistant", "content": prefill})
    return messages


def problem_messages(record: dict) -> list[dict]:
    """`prompt_messages` of a problem record (its ``question``, ``instruction`` and ``prefill`` fields)."""
    return prompt_messages(record["question"], record.get("instruction"), record.get("prefill"))


def render_messages(tokenizer, messages: list[dict]) -> str:
    """Chat-template text that the model continues: a new assistant turn, or the prefilled one."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError("this tokenizer has no chat template: use an instruct/chat model, or set "
                        "tokenizer.chat_template")
    if messages[-1]["role"] == "assistant":
        return tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def render_prompt(tokenizer, question: str, instruction: str | None = None) -> str:
    """The prompt text for one problem, rendered with the model's chat template (generation turn open)."""
    return render_messages(tokenizer, prompt_messages(question, instruction))


def encode_prompts(tokenizer, questions: Iterable[str]) -> list[list[int]]:
    """Token ids of each rendered prompt with the paper's instruction (no padding; the engine pads)."""
    return [tokenizer(render_prompt(tokenizer, q), add_special_tokens=False)["input_ids"] for q in questions]


def encode_problems(tokenizer, problems: Iterable[dict]) -> list[list[int]]:
    """Token ids of each problem record's prompt (its own instruction and prefill, if any)."""
    return [tokenizer(render_messages(tokenizer, problem_messages(p)), add_special_tokens=False)["input_ids"]
            for p in problems]

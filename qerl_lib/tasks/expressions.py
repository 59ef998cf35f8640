"""Bare arithmetic expressions: a task a 135M model can learn with RL in a few dozen steps.

Why a second task
-----------------
The paper trains 3B-32B models on GSM8K and BigMath (QeRL §4.1). The kit's embedded model,
SmolLM2-135M-Instruct, solves almost none of the word problems in ``problems.py`` and rambles at
temperature 1, so most GRPO groups carry no reward spread and therefore no gradient: a training
claim tested there can only come out "inconclusive". RL sharpens what a policy can already do
sometimes; it needs a task where the base model is right *some* of the time. These levels are that
task: one or two operations on small operands, a one-line instruction, and an answer read from the
first number of the completion, so a short completion suffices (the presets cap it at 32 tokens).
The assistant's reply is prefilled with the expression and "=" (``"36 + 32 ="``): left alone, the
model restates the expression before answering, and its first number would be an operand.
``qerl calibrate`` measures, per level and temperature, the base model's pass@1 and the share of
groups with mixed rewards; the committed calibration picks the level used by the claim sweeps.

Levels (operands drawn uniformly; subtraction never goes below zero, division is always exact)

=====  ====================================  =========================
level  form                                  operands
=====  ====================================  =========================
1      a + b                                 1-60
2      a + b, a - b                          1-50
3      a + b, a - b, a x b                   +,-: 1-50; x: 2-12
4      (a + b) - c and friends, two of +,-   1-30
5      two operations of +, -, x             +,-: 1-30; x: 2-9
=====  ====================================  =========================

Records keep GSM8K's schema (``question``, ``answer`` ending in ``#### N``) plus ``expression``,
``level``, ``id``, ``instruction`` (the user message is ``question`` + newline + ``instruction``)
and ``prefill`` (the start of the reply; see ``problems.prompt_messages``). The split of a problem
is a hash of its arithmetic, as for the word problems, so train and test never share an expression.
"""

from __future__ import annotations

import hashlib
import random

from qerl_lib.errors import UserError
from qerl_lib.tasks.problems import distinct_in_split

EXPR_LEVELS = (1, 2, 3, 4, 5)
EXPR_INSTRUCTION = "Reply with the number only."

# level -> (operations allowed, count, operand range for + and -, operand range for x)
_LEVELS = {
    1: ("+", 1, (1, 60), None),
    2: ("+-", 1, (1, 50), None),
    3: ("+-*", 1, (1, 50), (2, 12)),
    4: ("+-", 2, (1, 30), None),
    5: ("+-*", 2, (1, 30), (2, 9)),
}
_SYMBOL = {"+": "+", "-": "-", "*": "×"}


def _apply(op: str, a: int, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def _sample(rng: random.Random, level: int) -> tuple[list[int], list[str]]:
    ops_allowed, count, add_range, mul_range = _LEVELS[level]
    while True:
        ops = [rng.choice(ops_allowed) for _ in range(count)]
        operands = [rng.randint(*(mul_range if ops[0] == "*" else add_range))]
        value = operands[0]
        for op in ops:
            b = rng.randint(*(mul_range if op == "*" else add_range))
            operands.append(b)
            value = _apply(op, value, b)
        values = _running_values(operands, ops)
        if min(values) >= 0:
            return operands, ops


def _running_values(operands: list[int], ops: list[str]) -> list[int]:
    values, value = [operands[0]], operands[0]
    for op, b in zip(ops, operands[1:]):
        value = _apply(op, value, b)
        values.append(value)
    return values


def expression_text(operands: list[int], ops: list[str]) -> str:
    """Left to right, with parentheses when a product follows a sum: ``(3 + 4) × 5``."""
    text = str(operands[0])
    for i, (op, b) in enumerate(zip(ops, operands[1:])):
        if op == "*" and i > 0 and ops[i - 1] in "+-":
            text = f"({text})"
        text = f"{text} {_SYMBOL[op]} {b}"
    return text


def generate_expressions(split: str, n: int, seed: int = 0, level: int = 2) -> list[dict]:
    """`n` distinct expression problems of `level` from `split` ('train' or 'test'); same seed, same bytes."""
    if level not in EXPR_LEVELS:
        raise UserError(f"expression level must be one of {EXPR_LEVELS}, got {level!r}")
    rng = random.Random(f"qerl-expr:{split}:{seed}:{level}")

    def draw():
        operands, ops = _sample(rng, level)
        key = f"E{level}:" + ",".join(str(x) for x in operands) + ":" + "".join(ops)
        return key, lambda: _record(operands, ops, level, key)

    return distinct_in_split(split, n, draw, f"level-{level} {split} expressions")


def _record(operands: list[int], ops: list[str], level: int, key: str) -> dict:
    text = expression_text(operands, ops)
    value = _running_values(operands, ops)[-1]
    return {"question": f"What is {text}?", "answer": f"{text} = {value}\n#### {value}",
            "expression": text.replace("×", "*"), "level": level, "instruction": EXPR_INSTRUCTION,
            "prefill": f"{text} =", "id": hashlib.sha256(key.encode()).hexdigest()[:12]}

"""Property-based tests (Hypothesis): the scorer on numbers in many formats, expressions and lists,
and the NVFP4 encode/decode round trip.

Each property runs ~200 examples (no deadline; the file takes seconds). Hypothesis prints the
failing example and a ``@reproduce_failure`` blob; no example database is written to the checkout.
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qerl_lib.quant.nvfp4 import GROUP_SIZE, NVFP4Weight, dequantize, pack_fp4, quantize, unpack_fp4
from qerl_lib.tasks.rewards import parse_plain_number, score_answer

PROPERTY = settings(max_examples=200, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


class NoMathVerify:
    """A verifier that fails the test if called: numbers, expressions and lists against a numeric
    gold must be decided exactly, without math-verify."""

    def equivalent_many(self, pairs, **kwargs):
        raise AssertionError(f"math-verify was asked about {pairs}")

    equivalent = equivalent_many


NO_VERIFY = NoMathVerify()

# ---- the scorer -------------------------------------------------------------------------------------


@st.composite
def numbers(draw) -> tuple[Fraction, str, str]:
    """(value, plain text, text with thousands commas) of an integer or a decimal, maybe negative."""
    negative = draw(st.booleans())
    whole = draw(st.integers(min_value=0, max_value=10**12))
    decimals = draw(st.one_of(st.just(""), st.text("0123456789", min_size=1, max_size=4)))
    sign = "-" if negative else ""
    tail = f".{decimals}" if decimals else ""
    plain, commas = f"{sign}{whole}{tail}", f"{sign}{whole:,}{tail}"
    return Fraction(plain), plain, commas


def dressed(draw, number: str) -> str:
    """`number` the way a model may write it: "$" before it, a period after it."""
    dollar = draw(st.sampled_from(["", "$", "\\$"]))
    if dollar and number.startswith("-"):
        number = draw(st.sampled_from([f"-{dollar}{number[1:]}", f"{dollar}{number}"]))
    else:
        number = dollar + number
    return number + draw(st.sampled_from(["", "."]))


def marked(draw, answer: str) -> str:
    """`answer` as the final answer of a completion, in one of the markings the scorer reads. Not
    ``#### answer`` when the answer spans lines: there the answer is the ``####`` line alone."""
    form = draw(st.sampled_from(["tags", "boxed", "boxed-in-tags"] + ([] if "\n" in answer else ["hash"])))
    if form == "tags":
        return f"<think>some reasoning, 12 + 3 = 15</think>\n<answer>{answer}</answer>"
    if form == "boxed":
        return f"So the result is \\boxed{{{answer}}}"
    if form == "boxed-in-tags":
        return f"<think>r</think><answer>The answer is \\boxed{{{answer}}}</answer>"
    return f"Reasoning first.\n#### {answer}"


@PROPERTY
@given(st.data(), numbers())
def test_a_number_in_any_format_scores_as_itself(data, number):
    value, plain, commas = number
    pred = dressed(data.draw, data.draw(st.sampled_from([plain, commas])))
    completion = marked(data.draw, pred)
    gold = data.draw(st.sampled_from([plain, commas, f"work\n#### {commas}"]))
    assert parse_plain_number(pred) == value
    assert score_answer(completion, gold, verifier=NO_VERIFY) == 1.0


def decimal_text(value: Fraction) -> str:
    """`value` (a multiple of 1e-6) written out exactly with six decimals."""
    micro = value * 10**6
    assert micro.denominator == 1
    whole, part = divmod(abs(micro.numerator), 10**6)
    return f"{'-' if value < 0 else ''}{whole}.{part:06d}"


@PROPERTY
@given(st.data(), numbers(), st.integers(min_value=1, max_value=10**6), st.booleans())
def test_a_different_number_never_scores(data, number, delta, whole_units):
    value, plain, commas = number
    other = value + (delta if whole_units else Fraction(delta, 10**6)) * data.draw(st.sampled_from([1, -1]))
    pred = marked(data.draw, dressed(data.draw, decimal_text(other)))
    assert score_answer(pred, data.draw(st.sampled_from([plain, commas])), verifier=NO_VERIFY) == 0.0


OPERATORS = ["+", "-", "*", "\u00d7", "\\times", "\\cdot", "/"]


@PROPERTY
@given(st.data(), st.integers(0, 10**6), st.integers(1, 10**6), st.sampled_from(OPERATORS), st.booleans())
def test_an_expression_never_scores(data, a, b, op, spaced):
    space = " " if spaced or op.startswith("\\") else ""
    value = {"+": a + b, "-": a - b, "/": Fraction(a, b)}.get(op, a * b)
    gold = data.draw(st.sampled_from([str(value) if op != "/" else f"{value.numerator}/{value.denominator}",
                                      str(a), str(b)]))
    if op == "/":  # a/b is a fraction, that is a number; a sum of fractions is not
        expression = f"{a}/{b}{space}+{space}{a}/{b}"
    else:
        expression = f"{a}{space}{op}{space}{b}"
    assert parse_plain_number(expression) is None
    assert score_answer(marked(data.draw, expression), gold, verifier=NO_VERIFY) == 0.0


@PROPERTY
@given(st.data(), st.lists(st.integers(-10**6, 10**6), min_size=2, max_size=4),
       st.sampled_from([", ", "; ", "\n", " or ", " and ", " \\\\ "]))
def test_a_list_never_scores(data, items, separator):
    gold = str(data.draw(st.sampled_from(items)))
    answer = separator.join(str(i) for i in items)
    assert parse_plain_number(answer) is None
    assert score_answer(marked(data.draw, answer), gold, verifier=NO_VERIFY) == 0.0


# ---- NVFP4: quantizing a dequantized NVFP4 tensor gives its codes and scales back -----------------------

# Positive normal E4M3 block scales (2^-6 .. 448): every bit pattern 0x08..0x7E.
NORMAL_E4M3 = sorted({float(v) for v in torch.arange(0x08, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()})
NONZERO_CODES = [c for c in range(16) if c not in (0, 8)]


@st.composite
def nvfp4_tensors(draw) -> NVFP4Weight:
    """An NVFP4 weight the quantizer could have written: in every block one weight at the block
    scale's full range (code +-6), no -0 code (the quantizer writes 0 for an exact zero), normal
    E4M3 scales, and all-zero blocks with the quantizer's zero-block scale 0.125."""
    n, blocks = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    codes = torch.zeros(n, blocks, GROUP_SIZE, dtype=torch.uint8)
    scales = torch.zeros(n, blocks)
    for row in range(n):
        for block in range(blocks):
            if draw(st.integers(0, 9)) == 0:
                scales[row, block] = 0.125
                continue
            values = draw(st.lists(st.sampled_from([0] + NONZERO_CODES), min_size=GROUP_SIZE, max_size=GROUP_SIZE))
            values[draw(st.integers(0, GROUP_SIZE - 1))] = draw(st.sampled_from([7, 15]))  # +6 or -6
            codes[row, block] = torch.tensor(values, dtype=torch.uint8)
            scales[row, block] = draw(st.sampled_from(NORMAL_E4M3))
    amax = draw(st.floats(min_value=1e-4, max_value=1e3))  # the tensor's absmax sets the global scale
    global_scale = torch.tensor([2688.0 / amax], dtype=torch.float32)
    return NVFP4Weight(pack_fp4(codes.reshape(n, -1)), scales.to(torch.float8_e4m3fn), global_scale)


@PROPERTY
@given(nvfp4_tensors(), st.sampled_from([torch.bfloat16, torch.float32]))
def test_nvfp4_requantizing_a_dequantized_tensor_is_exact(q, dtype):
    again = quantize(dequantize(q, dtype), global_scale=q.weight_global_scale)
    assert torch.equal(unpack_fp4(again.weight_packed), unpack_fp4(q.weight_packed))
    assert torch.equal(again.weight_scale.view(torch.uint8), q.weight_scale.view(torch.uint8))
    assert torch.equal(again.weight_global_scale, q.weight_global_scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_nvfp4_round_trip_on_a_quantized_weight(dtype):
    # The same from the other end: a real quantize() output whose block scales are all normal.
    torch.manual_seed(0)
    w = torch.randn(64, 128, dtype=dtype)
    q = quantize(w)
    assert float(q.weight_scale.float().min()) >= 2**-6
    again = quantize(dequantize(q, dtype), global_scale=q.weight_global_scale)
    assert torch.equal(again.weight_scale.view(torch.uint8), q.weight_scale.view(torch.uint8))
    codes = unpack_fp4(q.weight_packed)
    assert torch.equal(unpack_fp4(again.weight_packed), torch.where(codes == 8, 0, codes))  # -0 comes back as 0

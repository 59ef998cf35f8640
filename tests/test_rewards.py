"""Tests for qerl_lib.tasks.rewards: answer extraction, equivalence, time limit, format reward, TRL glue.

The math-verify worker is started once per module (about 0.5 s); cases that must time out use a
second verifier with a 1 s limit so the file stays fast. The worker process itself (time limit,
recovery, threads, resource caps) is tested in tests/test_verifier.py.
"""

from __future__ import annotations

import functools
import pickle
import time
from fractions import Fraction

import pytest

from qerl_lib.errors import UserError
from qerl_lib.tasks.rewards import (
    SafeReward,
    accuracy_reward,
    extract_answer,
    extract_gold,
    format_reward,
    format_reward_func,
    parse_plain_number,
    score_answer,
    score_answers,
)

# The timeout tests assert on the verifier's counters (a kill per slow answer, no crash). Wall-clock time is only
# a hang guard: math-verify computes the towers below for minutes, so "limit + 10 s" still catches a limit that
# does not hold, without failing on a loaded runner.
HANG_GUARD_S = 10.0
# The parallelism tests give each slow answer a 3 s limit: N_SLOW of them one after another take >= 18 s, side by
# side about 3 s; the bound, two limits, leaves 3 s of slack and is still far from the serial time.
PARALLEL_LIMIT_S = 3.0




def wrap(answer: str) -> str:
    return f"<think>Let me work it out.</think>\n<answer>{answer}</answer>"


# (id, completion, gold, expected score)
SCORE_CASES = [
    ("exact", wrap("72"), "72", 1.0),
    ("exact-gsm8k-answer-field", wrap("72"), "Natalia sold 48/2 = 24 clips in May.\n48+24 = 72\n#### 72", 1.0),
    ("commas-pred", wrap("1,234"), "1234", 1.0),
    ("commas-gold", wrap("1234"), "#### 1,234", 1.0),
    ("commas-millions", wrap("1,234,567"), "1234567", 1.0),
    ("dollar-sign", wrap("$18"), "18", 1.0),
    ("dollar-latex-escaped", wrap("\\$18"), "18", 1.0),
    ("dollar-word", wrap("18 dollars"), "18", 1.0),
    ("units-in-sentence", wrap("She has 18 apples left."), "18", 1.0),
    ("percent-sign-ignored", wrap("25%"), "25", 1.0),
    ("equation-takes-last-side", wrap("5 + 13 = 18"), "18", 1.0),
    ("markdown-bold", wrap("**18**"), "18", 1.0),
    ("boxed-no-tags", "So the total is \\boxed{18}.", "18", 1.0),
    ("boxed-inside-answer", wrap("The answer is \\boxed{18}"), "18", 1.0),
    ("boxed-wins-inside-answer", wrap("first 75, finally \\boxed{72}"), "72", 1.0),
    ("boxed-nested-braces", "\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("latex-frac-vs-decimal", wrap("\\frac{1}{2}"), "0.5", 1.0),
    ("decimal-vs-latex-frac-gold", wrap("0.5"), "\\frac{1}{2}", 1.0),
    ("slash-fraction-vs-decimal", wrap("3/4"), "0.75", 1.0),
    ("dfrac-to-integer", wrap("\\dfrac{144}{2}"), "72", 1.0),
    ("latex-frac-is-a-number", wrap("\\frac{144}{2}"), "72", 1.0),
    ("latex-frac-shorthand", wrap("\\frac12"), "0.5", 1.0),
    ("latex-frac-negative", wrap("-\\frac{3}{4}"), "-0.75", 1.0),
    ("hash-format", "<think>48+24=72</think>\n#### 72", "72", 1.0),
    ("negative", wrap("-5"), "-5", 1.0),
    ("negative-unicode-minus", wrap("\u22125"), "-5", 1.0),
    ("sign-matters", wrap("5"), "-5", 0.0),
    ("decimal-trailing-zero", wrap("7.50"), "7.5", 1.0),
    ("integer-vs-point-zero", wrap("7"), "7.0", 1.0),
    ("decimal-close-but-wrong", wrap("7.05"), "7.5", 0.0),
    ("no-float-rounding", wrap("72.0000001"), "72", 0.0),
    # Regression test for the official GSM8K scorer (docs/paper_settings.md): it compared only the first
    # character of the extracted answer and the gold answer, so "75" vs "72" scored full marks.
    ("official-bug-first-digit", wrap("75"), "72", 0.0),
    ("official-bug-prefix", wrap("7"), "72", 0.0),
    ("official-bug-longer", wrap("720"), "72", 0.0),
    ("empty-completion", "", "72", 0.0),
    ("empty-answer-block", "<think>72</think><answer></answer>", "72", 0.0),
    ("blank-answer-block", "<think>72</think><answer>   </answer>", "72", 0.0),
    ("empty-block-is-final", "<think>x</think><answer></answer> #### 72", "72", 0.0),
    ("no-answer-no-fallback", "I think the answer is 72", "72", 0.0),
    ("unclosed-answer-tag", "<think>ok</think><answer>72", "72", 0.0),
    ("markdown-heading-not-answer", "#### Step 1\nwe get 72", "72", 0.0),
    ("answer-block-beats-reasoning-numbers", "<think>12 + 60 = 72, or 75?</think><answer>72</answer>", "72", 1.0),
    ("reasoning-number-does-not-count", "<think>maybe 72</think><answer>75</answer>", "72", 0.0),
    ("last-answer-block-wins", "<answer>75</answer> wait, no. <answer>72</answer>", "72", 1.0),
    ("hedged-two-numbers", wrap("72 or 75"), "72", 0.0),
    ("answer-list", wrap("72, 75"), "72", 0.0),
    # One answer: a single number, or a closed form equal to the gold. Expressions and lists never
    # score (issue "Nothing lost, nothing silent": "60+12" and "72\n73" used to score).
    ("expression-sum", wrap("60+12"), "72", 0.0),
    ("expression-sum-spaced", wrap("60 + 12"), "72", 0.0),
    ("expression-latex-times", wrap("6 \\times 12"), "72", 0.0),
    ("expression-unicode-times", wrap("6 \u00d7 12"), "72", 0.0),
    ("expression-boxed", "So \\boxed{60+12}.", "72", 0.0),
    ("expression-hash", "<think>r</think>\n#### 60+12", "72", 0.0),
    ("equation-ending-in-expression", wrap("72 = 60 + 12"), "72", 0.0),
    ("unevaluated-power", wrap("2^{3}"), "8", 0.0),
    ("unevaluated-sqrt", wrap("\\sqrt{4}"), "2", 0.0),
    ("two-lines-last-is-gold", wrap("72\n73"), "73", 0.0),
    ("two-lines-first-is-gold", wrap("72\n73"), "72", 0.0),
    ("assignments-list", wrap("x = 1, y = 2"), "2", 0.0),
    ("semicolon-list", wrap("72; 73"), "73", 0.0),
    ("two-numbers-in-prose", wrap("18 apples and 3 pears"), "18", 0.0),
    ("subtraction-is-not-a-sign", wrap("x - 5"), "-5", 0.0),
    ("prose-comma-one-number", wrap("She has 18 apples, all red."), "18", 1.0),
    ("hyphenated-unit", wrap("an 18-year-old"), "18", 1.0),
    ("sign-set-apart", wrap("- 5"), "-5", 1.0),
    ("braced-number", wrap("{72}"), "72", 1.0),
    ("degrees", wrap("72^\\circ"), "72", 1.0),
    ("latex-thousands-braces", wrap("1{,}234"), "1234", 1.0),
    ("latex-thousands-thin-space", wrap("1\\,234"), "1234", 1.0),
    ("thousands-comma-not-a-list", wrap("72,750"), "72750", 1.0),
    # A gold that is not a plain number: math-verify decides, lists and expressions aside.
    ("closed-form-same", wrap("\\frac{\\sqrt{3}}{2}"), "\\frac{\\sqrt{3}}{2}", 1.0),
    ("closed-form-equivalent", wrap("\\sqrt{8}"), "2\\sqrt{2}", 1.0),
    ("closed-form-wrong", wrap("\\sqrt{3}"), "2\\sqrt{2}", 0.0),
    ("closed-form-in-a-list", wrap("\\sqrt{2}, \\sqrt{3}"), "\\sqrt{2}", 0.0),
    ("expression-vs-closed-form", wrap("1+1"), "\\sqrt{4}", 0.0),
    ("list-gold-list-pred", wrap("2, 1"), "1, 2", 1.0),
    ("power-gold-number-pred", wrap("1024"), "2^{10}", 1.0),
    ("power-gold-same-power", wrap("2^{10}"), "2^{10}", 1.0),
]


@pytest.mark.parametrize("completion, gold, expected", [c[1:] for c in SCORE_CASES], ids=[c[0] for c in SCORE_CASES])
def test_score_answer_table(verifier, completion, gold, expected):
    assert score_answer(completion, gold, verifier=verifier) == expected


def test_score_answer_uses_shared_verifier_by_default():
    # No verifier passed: the process-wide one starts on demand and handles the LaTeX path.
    assert score_answer(wrap("\\frac{144}{2}"), "72") == 1.0


def test_last_number_fallback_is_opt_in(verifier):
    text = "Adding them gives 48 + 24 = 72"
    assert score_answer(text, "72", verifier=verifier) == 0.0
    assert score_answer(text, "72", verifier=verifier, last_number_fallback=True) == 1.0


EXTRACT_CASES = [
    ("answer-block", "<answer> 72 </answer>", False, "72"),
    ("boxed-in-block", "<answer>so \\boxed{ 7 } yes</answer>", False, "7"),
    ("boxed-nested", "x \\boxed{\\frac{a}{b}} y", False, "\\frac{a}{b}"),
    ("boxed-space-before-brace", "\\boxed {9}", False, "9"),
    ("fbox", "\\fbox{9}", False, "9"),
    ("last-boxed", "\\boxed{1} then \\boxed{2}", False, "2"),
    ("truncated-boxed-uses-earlier", "\\boxed{1} then \\boxed{2", False, "1"),
    ("hash", "reasoning\n#### 1,234\n", False, "1,234"),
    ("last-hash", "#### 5\nno wait\n#### 6", False, "6"),
    ("block-beats-boxed-and-hash", "\\boxed{1} #### 2 <answer>3</answer>", False, "3"),
    ("nothing", "no answer here", False, None),
    ("fallback-last-number", "first 3, then -4.5 and 1,000 apples", True, "1,000"),
    ("fallback-without-numbers", "no numbers", True, None),
    ("empty-block", "<answer></answer>", True, None),
    ("conversational", [{"role": "assistant", "content": "<answer>8</answer>"}], False, "8"),
]


@pytest.mark.parametrize("completion, fallback, expected", [c[1:] for c in EXTRACT_CASES],
                         ids=[c[0] for c in EXTRACT_CASES])
def test_extract_answer(completion, fallback, expected):
    assert extract_answer(completion, last_number_fallback=fallback) == expected


@pytest.mark.parametrize("field, expected", [
    ("Janet has 3 ducks.\n3*2 = 6\n#### 6", "6"),
    ("#### 1,234", "1,234"),
    ("work\n#### 18\nextra line", "18"),
    ("\\frac{1}{2}", "\\frac{1}{2}"),
    (72, "72"),
], ids=["gsm8k-field", "commas-kept", "first-line-after-hash", "bare-latex", "numeric-column"])
def test_extract_gold(field, expected):
    assert extract_gold(field) == expected


@pytest.mark.parametrize("field", ["", "   ", "solution\n#### ", None],
                         ids=["empty", "blank", "empty-after-hash", "none"])
def test_extract_gold_rejects_missing_answer(field):
    with pytest.raises(UserError, match="gold answer"):
        extract_gold(field)


@pytest.mark.parametrize("text, expected", [
    ("72", Fraction(72)), ("1,234.5", Fraction(24690, 20)), ("-$5", Fraction(-5)), (".25", Fraction(1, 4)),
    ("-3/4", Fraction(-3, 4)), ("1/0", None), ("x = 12 cm", Fraction(12)), ("60 km/h", Fraction(60)),
    ("72 or 75", None), ("1,2", None), ("1e3", None), ("2^{3}", None), ("\\frac{1}{2}", Fraction(1, 2)), ("", None),
    ("x = 1, y = 2", None), ("60+12", None), ("72\n73", None), ("{72}", Fraction(72)), ("- 5", Fraction(-5)),
    ("x - 5", None), ("\\dfrac{-3}{4}", Fraction(-3, 4)), ("1.5/3", Fraction(1, 2)), ("\\sqrt{4}", None),
], ids=["int", "commas-decimal", "neg-dollar", "leading-dot", "neg-fraction", "zero-denominator", "assignment-unit",
        "unit-with-slash", "two-numbers", "comma-list", "exponent-notation", "latex-power", "latex-frac", "empty",
        "assignment-list", "sum", "two-lines", "braced", "sign-set-apart", "subtraction", "dfrac-negative",
        "decimal-fraction", "sqrt"])
def test_parse_plain_number(text, expected):
    assert parse_plain_number(text) == expected


# Inputs that make sympy/math-verify compute for minutes or forever (big-integer towers in C code
# that signal.alarm cannot interrupt), plus huge inputs that must be refused before parsing.
ADVERSARIAL = [
    ("latex-power-tower", wrap("10^{10^{10^{10}}}")),
    ("right-assoc-2-tower", wrap("2^{2^{2^{2^{2^{2^{2^{2}}}}}}}")),
    ("flat-2-tower", wrap("2^2^2^2^2^2^2^2")),
    ("python-power-tower", wrap("10**10**10**10")),
    ("huge-factorial", wrap("(10^{100000})!")),
    ("boxed-tower", "\\boxed{9^{9^{9^{9}}}}"),
    ("100k-char-answer", wrap("9" * 100_000)),
    ("100k-char-latex-answer", wrap("\\sqrt{" * 10_000 + "2" + "}" * 10_000)),
]


# Gold "18" is a plain number, so these are refused without math-verify; gold "2^{3}" is not, so
# the power towers reach math-verify and must be stopped by the time limit.
@pytest.mark.parametrize("gold", ["18", "2^{3}"], ids=["number-gold", "expression-gold"])
@pytest.mark.parametrize("completion", [c[1] for c in ADVERSARIAL], ids=[c[0] for c in ADVERSARIAL])
def test_adversarial_answer_returns_zero_within_limit(quick_verifier, completion, gold):
    quick_verifier.start()  # a restart after the previous case's timeout is not part of this answer's limit
    calls, timeouts, crashes = quick_verifier.calls, quick_verifier.timeouts, quick_verifier.crashes
    start = time.monotonic()
    assert score_answer(completion, gold, verifier=quick_verifier) == 0.0
    elapsed = time.monotonic() - start
    # refused before math-verify, answered by it, or stopped by the limit (one kill); never a crash
    assert quick_verifier.calls - calls <= 1 and quick_verifier.timeouts - timeouts <= 1
    assert quick_verifier.crashes == crashes, "the worker died instead of the limit stopping the comparison"
    if gold == "18":
        assert quick_verifier.calls == calls, "a plain-number gold is decided without math-verify"
    assert elapsed < quick_verifier.timeout_s + HANG_GUARD_S, f"took {elapsed:.2f} s: the limit did not hold"


HANGING = wrap("10^{10^{10^{10}}}")  # math-verify 0.9 computes this for minutes (see test_verifier.py)
N_SLOW = 6


def test_batch_of_slow_answers_times_out_in_parallel(quick_verifier):
    # Six answers that each hang math-verify: checked one after another they would take 6 limits.
    quick_verifier.start()
    timeouts, crashes = quick_verifier.timeouts, quick_verifier.crashes
    start = time.monotonic()
    scores = accuracy_reward(["q"] * (N_SLOW + 1), [HANGING] * N_SLOW + [wrap("8")], ["2^{3}"] * (N_SLOW + 1),
                             verifier=quick_verifier, timeout_s=PARALLEL_LIMIT_S)
    elapsed = time.monotonic() - start
    assert scores == [0.0] * N_SLOW + [1.0]
    assert quick_verifier.timeouts == timeouts + N_SLOW, "each slow answer must have been stopped by the limit"
    assert quick_verifier.crashes == crashes
    assert elapsed < 2 * PARALLEL_LIMIT_S, \
        f"took {elapsed:.2f} s for {N_SLOW} slow answers: not side by side (one after another >= {N_SLOW * PARALLEL_LIMIT_S} s)"


def test_safe_reward_scores_slow_answers_in_parallel(quick_verifier):
    # SafeReward calls accuracy_reward once per completion; being thread-safe, those calls overlap.
    reward = SafeReward(functools.partial(accuracy_reward, verifier=quick_verifier, timeout_s=PARALLEL_LIMIT_S))
    assert reward.thread_safe
    quick_verifier.start()
    timeouts = quick_verifier.timeouts
    start = time.monotonic()
    scores = reward(prompts=["q"] * (N_SLOW + 2), completions=[HANGING] * N_SLOW + [wrap("8"), None],
                    answer=["2^{3}"] * (N_SLOW + 2))
    elapsed = time.monotonic() - start
    assert scores == [0.0] * N_SLOW + [1.0, 0.0]
    assert reward.errors == 1 and "TypeError" in reward.last_error  # the None completion, counted alone
    assert quick_verifier.timeouts == timeouts + N_SLOW, "each slow answer must have been stopped by the limit"
    assert elapsed < 2 * PARALLEL_LIMIT_S, \
        f"took {elapsed:.2f} s for {N_SLOW} slow answers: not side by side (one after another >= {N_SLOW * PARALLEL_LIMIT_S} s)"


def test_score_answers_matches_score_answer_and_checks_lengths(verifier):
    completions = [wrap(a) for a in ("72", "60+12", "\\sqrt{8}", "75")]
    golds = ["#### 72", "72", "2\\sqrt{2}", "72"]
    assert score_answers(completions, golds, verifier=verifier) == [1.0, 0.0, 1.0, 0.0]
    assert score_answers(completions, golds, verifier=verifier) == [
        score_answer(c, g, verifier=verifier) for c, g in zip(completions, golds)]
    with pytest.raises(ValueError, match="gold answers"):
        score_answers(completions, golds[:2], verifier=verifier)
    calls = verifier.calls
    with pytest.raises(UserError, match="gold answer is empty"):  # raised before anything is verified
        score_answers([HANGING, wrap("1")], ["2^{3}", ""], verifier=verifier)
    assert verifier.calls == calls, "the hanging answer was sent to math-verify before the empty gold was refused"


class _CountingStr(str):
    """A completion that counts the characters its own string methods may touch (``find(sub, start, end)``: the
    span searched; the others: the whole text). ``completion_text`` hands a ``str`` subclass on as it is, so the
    extraction's scans of the completion are counted; what they return (slices, plain ``str``) is not."""

    chars = 0

    def _spent(self, start=None, end=None):
        lo = 0 if start is None else (start if start >= 0 else max(len(self) + start, 0))
        hi = len(self) if end is None else (end if end >= 0 else max(len(self) + end, 0))
        _CountingStr.chars += max(min(hi, len(self)) - lo, 0)


def _counting_method(name, ranged):
    base = getattr(str, name)

    def method(self, *args):
        if ranged:
            self._spent(*(args[1:3]))
        else:
            _CountingStr.chars += len(self)
        return base(self, *args)
    return method


for _name in ("find", "rfind", "index", "rindex", "count", "startswith", "endswith"):
    setattr(_CountingStr, _name, _counting_method(_name, ranged=True))
for _name in ("split", "rsplit", "splitlines", "partition", "rpartition", "replace", "strip", "lstrip", "rstrip",
              "lower", "upper", "casefold", "translate", "encode", "__contains__", "__iter__", "__getitem__",
              "join", "format", "expandtabs", "isdigit", "isspace", "isalpha", "isalnum", "isascii", "__eq__", "__hash__"):
    setattr(_CountingStr, _name, _counting_method(_name, ranged=False))


def _extraction_work(n_tags: int, monkeypatch) -> tuple[int, list[tuple[str, int]]]:
    """The work of ``extract_answer`` on ``n_tags`` unclosed "<answer>" tags before "<answer>72</answer>", counted
    without a clock: Python bytecodes executed, plus characters touched by the completion's string methods, plus
    characters scanned by regexes (spies on ``qerl_lib.tasks.rewards``'s compiled patterns and its ``re``
    module). Returns (that count, [(regex pattern, length of the text it scanned)])."""
    import re
    import sys
    import types

    from qerl_lib.tasks import rewards

    scans = []

    def spy(fn, pattern_of):
        def call(*args, **kwargs):
            pattern, text = pattern_of(args)
            scans.append((pattern, len(text) if isinstance(text, str) else 0))
            return fn(*args, **kwargs)
        return call

    class PatternSpy:
        def __init__(self, compiled):
            self._compiled = compiled

        def __getattr__(self, name):
            attr = getattr(self._compiled, name)
            if name in ("search", "match", "fullmatch", "findall", "finditer", "split"):
                return spy(attr, lambda a: (self._compiled.pattern, a[0]))
            if name in ("sub", "subn"):
                return spy(attr, lambda a: (self._compiled.pattern, a[1]))
            return attr

    for name, value in vars(rewards).items():
        if isinstance(value, re.Pattern):
            monkeypatch.setattr(rewards, name, PatternSpy(value))
    fake_re = types.SimpleNamespace(**{k: getattr(re, k) for k in dir(re) if not k.startswith("__")})
    for fn in ("search", "match", "fullmatch", "findall", "finditer", "split"):
        setattr(fake_re, fn, spy(getattr(re, fn), lambda a: (str(getattr(a[0], "pattern", a[0])), a[1])))
    for fn in ("sub", "subn"):
        setattr(fake_re, fn, spy(getattr(re, fn), lambda a: (str(getattr(a[0], "pattern", a[0])), a[2])))
    monkeypatch.setattr(rewards, "re", fake_re)

    completion = _CountingStr("<answer>" * n_tags + "<answer>72</answer>")
    _CountingStr.chars = 0
    ops = 0

    def tracer(frame, event, arg):
        nonlocal ops
        frame.f_trace_opcodes = True
        if event == "opcode":
            ops += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        answer = rewards.extract_answer(completion)
    finally:
        sys.settrace(previous)
        monkeypatch.undo()
    assert answer == "72", answer
    return ops + _CountingStr.chars + sum(length for _, length in scans), scans


def test_long_completion_with_many_tags_is_linear(verifier, monkeypatch):
    """12.5k and 25k unclosed "<answer>" tags before the answer: the extraction's work, counted without a clock
    (``_extraction_work``), must grow at most linearly with the text (a ".*?" regex between tags, a per-tag loop or
    a per-tag re-scan would be quadratic here), and no regex that scans the whole completion may have an unbounded
    wildcard (".*?", ".*", ".+"), which backtracks quadratically on these tags."""
    n = 12_500
    work_n, _ = _extraction_work(n, monkeypatch)
    work_2n, scans_2n = _extraction_work(2 * n, monkeypatch)
    assert work_2n <= 2.2 * work_n + 1000, f"extraction work {work_n} -> {work_2n} for twice the tags: not linear"
    for pattern, length in scans_2n:
        if length > 1000:  # a scan of (nearly) the whole completion
            assert not any(w in pattern for w in (".*", ".+", "*?", "+?")), \
                f"the regex {pattern!r} scans the whole {length}-character completion and can backtrack quadratically"
    completion = "<answer>" * n + "<answer>72</answer>"
    assert score_answer(completion, "72", verifier=verifier) == 1.0
    assert extract_answer("x" * 100_000) is None


FORMAT_CASES = [
    ("good", "<think>12+60=72</think>\n<answer>72</answer>", 1.0),
    ("whitespace-around", "\n <think>r</think>  <answer>72</answer>\n\n", 1.0),
    ("conversational", [{"role": "assistant", "content": "<think>r</think><answer>1</answer>"}], 1.0),
    ("missing-think", "<answer>72</answer>", 0.0),
    ("missing-answer", "<think>r</think> 72", 0.0),
    ("empty-think", "<think> </think><answer>72</answer>", 0.0),
    ("empty-answer", "<think>r</think><answer></answer>", 0.0),
    ("text-before", "Sure! <think>r</think><answer>72</answer>", 0.0),
    ("text-after", "<think>r</think><answer>72</answer> Also, here is another question...", 0.0),
    ("text-between", "<think>r</think> so <answer>72</answer>", 0.0),
    ("answer-first", "<answer>72</answer><think>r</think>", 0.0),
    ("two-answer-blocks", "<think>r</think><answer>7</answer><answer>72</answer>", 0.0),
    ("nested-close-think", "<think>a</think>b</think><answer>72</answer>", 0.0),
    ("empty-completion", "", 0.0),
]


@pytest.mark.parametrize("completion, expected", [c[1:] for c in FORMAT_CASES], ids=[c[0] for c in FORMAT_CASES])
def test_format_reward(completion, expected):
    assert format_reward(completion) == expected


# What TRL's GRPOTrainer passes to a reward function besides prompts/completions/dataset columns.
def trl_extras(n):
    return {"completion_ids": [[1, 2]] * n, "trainer_state": object(), "log_extra": lambda column, values: None,
            "log_metric": lambda name, value: None}


def test_trl_signature_with_conversational_completions(verifier):
    prompts = [[{"role": "user", "content": "q"}]] * 3
    completions = [
        [{"role": "assistant", "content": "<think>24+48</think><answer>72</answer>"}],
        [{"role": "assistant", "content": "<think>oops</think><answer>75</answer>"}],
        [{"role": "assistant", "content": "\\boxed{\\frac{144}{2}}"}],
    ]
    answers = ["...\n#### 72"] * 3
    rewards = accuracy_reward(prompts, completions, answers, verifier=verifier, **trl_extras(3))
    assert rewards == [1.0, 0.0, 1.0]
    assert format_reward_func(prompts=prompts, completions=completions, **trl_extras(3)) == [1.0, 1.0, 0.0]
    assert format_reward_func(prompts=["q"], completions=["<think>r</think><answer>1</answer>"]) == [1.0]


def test_accuracy_reward_needs_one_gold_per_completion(verifier):
    with pytest.raises(ValueError, match="answer"):
        accuracy_reward(["q", "q"], ["<answer>1</answer>", "<answer>2</answer>"], ["#### 1"], verifier=verifier)


def test_safe_reward_counts_a_failing_completion(verifier):
    logged = []
    reward = SafeReward(functools.partial(accuracy_reward, verifier=verifier))
    assert reward.__name__ == "accuracy_reward"  # TRL reads __name__ for its reward columns
    completions = [wrap("72"), None, wrap("75"), wrap("18")]  # None: completion_text raises TypeError
    answers = ["#### 72", "#### 72", "#### 72", ""]  # "": extract_gold raises UserError
    rewards = reward(prompts=["q"] * 4, completions=completions, answer=answers, completion_ids=[[0]] * 4,
                     trainer_state=None, log_metric=lambda name, value: logged.append((name, value)))
    assert rewards == [1.0, 0.0, 0.0, 0.0]
    assert reward.errors == 2 and reward.scored == 4
    assert "UserError" in reward.last_error
    assert logged == [("accuracy_reward/errors", 2.0)]
    assert reward.take_errors() == 2 and reward.take_errors() == 0
    reward(prompts=["q"], completions=[wrap("72")], answer=["72"])
    assert reward.errors == 2 and reward.take_errors() == 0


def test_safe_reward_slices_per_sample_columns_and_keeps_none():
    seen = []

    def probe(prompts, completions, level, **kwargs):
        seen.append((prompts, completions, level, kwargs["shared"]))
        if level[0] == 3:
            raise RuntimeError("boom")
        return [None if level[0] == 2 else float(level[0])]

    reward = SafeReward(probe, name="probe_reward")
    out = reward(prompts=["a", "b", "c"], completions=["x", "y", "z"], level=[1, 2, 3], shared="same")
    assert out == [1.0, None, 0.0]  # None passes through: TRL reads it as "no reward for this one"
    assert seen[0] == (["a"], ["x"], [1], "same")
    assert reward.__name__ == "probe_reward" and reward.errors == 1 and "boom" in reward.last_error
    with pytest.raises(ValueError, match="prompts"):
        reward(prompts=["a"], completions=["x", "y"], level=[1, 2])


def test_safe_reward_raises_on_missing_dataset_column(verifier):
    # A missing "answer" column would fail every sample; that is a setup bug, not a per-sample error.
    reward = SafeReward(functools.partial(accuracy_reward, verifier=verifier))
    with pytest.raises(TypeError, match="answer"):
        reward(prompts=["q"], completions=[wrap("72")], solution=["72"])
    assert reward.errors == 0


def test_reward_with_verifier_survives_pickling(verifier):
    # TRL and multiprocessing may pickle reward functions; the copy starts its own worker.
    copy = pickle.loads(pickle.dumps(SafeReward(functools.partial(accuracy_reward, verifier=verifier))))
    try:
        assert copy(prompts=["q"], completions=[wrap("\\frac{1}{2}")], answer=["0.5"]) == [1.0]
        assert copy.func.keywords["verifier"] is not verifier
    finally:
        copy.func.keywords["verifier"].close()

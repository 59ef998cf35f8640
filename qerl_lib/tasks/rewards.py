"""Rewards for math RL: find the final answer, decide whether it equals the gold answer, check the format.

How a completion is scored
--------------------------
1. **Text.** A completion is a string or, for chat datasets, TRL's list of ``{"role", "content"}``
   messages; we score the content of the last assistant message (`completion_text`).
2. **Extraction** (`extract_answer`), first rule that applies wins:

   a. the last *closed* ``<answer>...</answer>`` block (the tags the kit's prompt asks for). If it
      holds a ``\\boxed{...}``, the boxed content is the answer. This block is final even when it is
      empty: an empty block gives no answer, we do not go looking elsewhere;
   b. else the last ``\\boxed{...}`` (braces balanced; ``\\fbox`` too), the MATH/BigMath habit;
   c. else the last ``#### N``, the rest of its line (GSM8K's own answer format, and the
      paper-era official prompt's);
   d. else, only if ``last_number_fallback=True``, the last number anywhere in the text.

   With ``first_number=True`` (the bare-expression task, ``tasks/expressions.py``) none of the
   rules above applies: the answer is the first number of the completion, so "12" and "12, since
   7 + 5 = 12" score, while "7 + 5 = 12" answers 7 and does not. Answering first is the task.

   The training reward keeps (d) **off**: producing a marked answer is part of the task, and the
   paper-era official scorer also required its marker. (d) is for scoring base models that ignore
   the instruction. Tags are case-sensitive; an unclosed ``<answer>`` (truncated output) gives no answer.
3. **Equivalence** (`answers_match`), pred vs gold. *The final answer must be one answer*: a
   single number, or a closed form equal to the gold. Expressions and lists never score.

   * **List**: two or more parts holding a number or LaTeX, split at top-level commas (not
     thousands commas), semicolons, line breaks, ``\\\\``, "or" and "and": ``72, 75``, ``72\\n73``,
     ``72 or 75``, ``x = 1, y = 2``. A list scores 0 unless the gold is a list too. Prose around
     one number is fine: ``She has 18 apples, all red.``
   * **Plain number** (`parse_plain_number`): one number (thousands commas in groups of three,
     optional sign and decimals, a fraction ``a/b`` or ``\\frac{a}{b}``) with only words around it:
     ``$18``, ``18 dollars``, ``25%`` (the ``%`` is ignored, so "25%" equals 25, not 0.25),
     ``72^\\circ``, ``**18**``; in an equation the text after the last ``=`` (``5 + 13 = 18``).
   * **Expression**: arithmetic of plain numbers only (``60+12``, ``3 \\times 4``, ``2^{3}``).

   When the gold is a plain number (GSM8K, the generated tasks: every gold the kit ships), the
   prediction must be a plain number too, and the two are compared as exact `Fraction`s: 7 ==
   7.0 == 7.00, 0.5 == 1/2 == \\frac{1}{2}, 1,234 == 1234. Anything else scores 0 without
   math-verify: ``60+12``, ``2^{3}`` and ``\\sqrt{4}`` leave the arithmetic undone. Otherwise the
   gold is a closed form (``\\frac{\\sqrt{3}}{2}``, ``2\\pi``) and math-verify (``parse`` +
   ``verify``) decides, on both answers wrapped in ``$...$``, unless the prediction is a list or an
   expression and the gold is not. math-verify runs in worker processes under a hard wall-clock
   limit per answer (`MathVerifier`, default 2 s); a batch (`score_answers`, `accuracy_reward`)
   is checked side by side (up to `MathVerifier`'s ``max_parallel``, default 8, at once), so N slow answers
   take about ceil(N / 8) limits, not N.
4. **Format** (`format_reward`): 1.0 iff the completion is exactly one non-empty ``<think>`` block
   followed by one non-empty ``<answer>`` block, with only whitespace around them.

Why math-verify runs in a worker process
----------------------------------------
math-verify's own time limit is ``signal.alarm``, which cannot interrupt a C-level big-integer
power (``10**10**10**10``) and does not work off the main thread. `qerl_lib.tasks.verifier.MathVerifier`
runs it in killable children of a warm worker instead (details there). Answers longer than
``max_answer_chars`` (1000) score 0 without parsing. Model output is never ``eval``'ed: numbers go
through `Fraction`, the rest through math-verify's LaTeX/sympy parser.

Where we deviate from the official code (docs/paper_settings.md; QeRL arXiv 2510.11696 and its release)
---------------------------------------------------------------
* Official HEAD GSM8K correctness zipped two *strings* and kept element ``[0]``: a first-character
  match, so "75" scored full marks against gold "72" (and an empty answer raised). Here "75" vs
  "72" is 0 (pinned by a regression test).
* Official HEAD gave 2.0 for a correct answer, the paper-era commit 1.0; the paper plots accuracy
  reward on 0-1. We return 1.0/0.0 and 1.0/0.0 for format; the weights (official: format 0.2) live in
  the trainer config, not here.
* Official soft format used ``re.match`` (start-anchored, any trailing text, empty blocks allowed);
  ours also rejects trailing text, repeated tags and empty blocks, so rambling past the answer or
  stuffing several answer blocks does not earn the format reward.

TRL glue: `accuracy_reward` and `format_reward_func` take TRL's ``reward_funcs`` signature;
`SafeReward` wraps any of them so that one completion that raises scores 0.0 and is counted; a
function marked ``thread_safe`` (`accuracy_reward`) it calls for all completions at once, in threads.
"""

from __future__ import annotations

import inspect
import re
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from typing import Any, Callable

from qerl_lib.errors import UserError
from qerl_lib.tasks.verifier import DEFAULT_TIMEOUT_S, MathVerifier, shared_verifier

__all__ = [  # the verifier names are re-exported: callers import everything scoring needs from here
    "DEFAULT_TIMEOUT_S", "DEFAULT_MAX_ANSWER_CHARS", "MathVerifier", "SafeReward", "accuracy_reward",
    "answers_match", "completion_text", "extract_answer", "extract_gold", "format_reward",
    "format_reward_func", "last_boxed", "parse_plain_number", "score_answer", "score_answers", "shared_verifier",
]
DEFAULT_MAX_ANSWER_CHARS = 1000  # no GSM8K/MATH final answer is this long; longer ones score 0 unparsed

# ---- Completion text and answer extraction -------------------------------------------------------


def completion_text(completion: Any) -> str:
    """The text of a completion: a string as is; for TRL's conversational form (a list of
    ``{"role", "content"}`` dicts) the content of the last assistant message (the last message if
    none is marked assistant). Content given as a list of parts keeps its ``text`` parts."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):
        completion = [completion]
    if isinstance(completion, (list, tuple)):
        if not completion:
            return ""
        if not all(isinstance(m, dict) for m in completion):
            raise TypeError("a conversational completion must be a list of {'role', 'content'} dicts")
        assistant = [m for m in completion if m.get("role") == "assistant"]
        content = (assistant or list(completion))[-1].get("content") or ""
        if isinstance(content, list):  # multimodal-style parts: [{"type": "text", "text": ...}, ...]
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if not isinstance(content, str):
            raise TypeError(f"message content must be a string, got {type(content).__name__}")
        return content
    raise TypeError(f"a completion must be a string or a list of messages, got {type(completion).__name__}")


# Number token: optional sign, thousands commas in groups of three (or plain digits), optional
# decimals. ASCII only, so exotic Unicode digits never reach Fraction. No exponent notation:
# Fraction("1e999999999") would build a billion-digit integer.
_NUM = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+"
_NUMBER_RE = re.compile(rf"(?<![\w.])(?:{_NUM})(?!\d|[.,]\d)", re.ASCII)
_HASH_ANSWER_RE = re.compile(r"####[ \t]*([^\n]*)")
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_MAX_BOX_TRIES = 8  # how many earlier \boxed to try when the last ones are unbalanced (truncated)


def _braced_content(text: str, start: int) -> str | None:
    """Content of the ``{...}`` group opening at ``text[start:]`` after optional spaces, braces
    balanced; None when there is no group or it never closes."""
    i = start
    while i < len(text) and text[i] in " \t":
        i += 1
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last balanced ``\\boxed{...}`` (or ``\\fbox{...}``) in `text`, else None."""
    end = len(text)
    for _ in range(_MAX_BOX_TRIES):
        found = [(text.rfind(cmd, 0, end), cmd) for cmd in _BOX_COMMANDS]
        pos, cmd = max(found)
        if pos < 0:
            return None
        content = _braced_content(text, pos + len(cmd))
        if content is not None:
            return content
        end = pos
    return None


def _last_answer_block(text: str) -> str | None:
    # rfind, not a regex: ".*?" between tags is quadratic on 100k characters of repeated "<answer>".
    close = text.rfind("</answer>")
    if close < 0:
        return None
    open_ = text.rfind("<answer>", 0, close)
    return None if open_ < 0 else text[open_ + len("<answer>"):close]


def extract_answer(completion: Any, *, last_number_fallback: bool = False, first_number: bool = False) -> str | None:
    """The final answer of a completion (rules a-d in the module docstring), stripped; None if none.
    ``first_number=True``: the first number of the completion instead (the expression task).

    >>> extract_answer("<think>12+60=72</think><answer>72</answer>")
    '72'
    >>> extract_answer("12, because 7 + 5 = 12", first_number=True)
    '12'
    """
    text = completion_text(completion)
    if first_number:
        match = _NUMBER_RE.search(text.replace("\u2212", "-"))
        return match.group() if match else None
    block = _last_answer_block(text)
    if block is not None:
        boxed = last_boxed(block)
        answer = (boxed if boxed is not None else block).strip()
        return answer or None
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed.strip() or None
    for match in reversed(list(_HASH_ANSWER_RE.finditer(text))):
        candidate = match.group(1).strip()
        # A markdown heading "#### Step 3" is not an answer: require something number- or LaTeX-like.
        if candidate and candidate[0] in "-+$\\.0123456789\u2212":
            return candidate
    if last_number_fallback:
        numbers = _NUMBER_RE.findall(text)
        if numbers:
            return numbers[-1]
    return None


def extract_gold(answer_field: str) -> str:
    """The gold final answer from a GSM8K-schema ``answer`` field (worked solution ending in
    ``#### N``: the text after the last ``####``, first line), or the field itself when it is
    already a bare answer. Returned as written (commas kept); equivalence handles them."""
    if isinstance(answer_field, (int, float)) and not isinstance(answer_field, bool):
        answer_field = str(answer_field)  # a numeric dataset column
    if not isinstance(answer_field, str):
        raise UserError(f"gold answer must be a string, got {type(answer_field).__name__}")
    text = answer_field
    if "####" in text:
        tail = text.rsplit("####", 1)[1].strip()
        text = tail.splitlines()[0] if tail else ""
    text = text.strip()
    if not text:
        raise UserError("gold answer is empty: the answer field must end with '#### N' (GSM8K schema) "
                        "or be the bare final answer")
    return text


# ---- Equivalence: one answer, exact on plain numbers ---------------------------------------------

_TEXT_WRAPPERS_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_LATEX_SPACES_RE = re.compile(r"\\[,!;: ]|~")
_THIN_SPACE_THOUSANDS_RE = re.compile(r"(?<=\d)\\,(?=\d{3}(?!\d))")  # 1\,234
_DEGREES_RE = re.compile(r"\^\s*(?:\{\s*\\circ\s*\}|\\circ)|\u00b0")
_SIGNED_NUM = f"(?:{_NUM})"
_LATEX_FRAC_RE = re.compile(rf"\\[dt]?frac\s*(?:\{{\s*({_SIGNED_NUM})\s*\}}\s*\{{\s*({_SIGNED_NUM})\s*\}}|(\d)\s*(\d))",
                            re.ASCII)
# One number or fraction a/b (the denominator may carry a sign when it came from \frac{1}{-2}).
_VALUE_RE = re.compile(rf"(?<![\w.])({_NUM})(?:\s*/\s*({_SIGNED_NUM}))?(?!\d|[.,]\d)", re.ASCII)
# What may surround the one number of a plain answer: words, spaces, light punctuation, currency
# and %, "/" between letters (km/h) and "-" inside words (18-year-old). No digits, operators, braces.
_PROSE_RE = re.compile(r"(?:[A-Za-z\s%.,:;'!?&()\u20ac\u00a3]|(?<=[A-Za-z])/(?=[A-Za-z])"
                       r"|(?<=[A-Za-z0-9])-(?=[A-Za-z]))*")
_SEPARATOR_WORDS_RE = re.compile(r"\b(?:or|and)\b", re.IGNORECASE)
_MATHY_RE = re.compile(r"[0-9\\]")
# Arithmetic of plain numbers, once each number is replaced by "N" (see `_answer_shape`).
_ARITHMETIC_RE = re.compile(r"(?:N|\s|[-+*/^()\[\]{}\u00d7\u00b7\u22c5\u00f7]|\\times|\\cdot|\\div|\\left|\\right)*")


def _normalize(text: str) -> str:
    s = text.replace("\u2212", "-").replace("\u2248", "=").replace("\\%", "%").replace("{,}", ",")
    s = s.replace("\\$", "").replace("$", "")
    for delim in ("\\(", "\\)", "\\[", "\\]"):
        s = s.replace(delim, "")
    for _ in range(3):  # \text{\textbf{18}} nests at most a couple of levels in practice
        s = _TEXT_WRAPPERS_RE.sub(r"\1", s)
    s = _THIN_SPACE_THOUSANDS_RE.sub("", s)
    s = _DEGREES_RE.sub("", s)
    s = _LATEX_SPACES_RE.sub(" ", s)
    s = _LATEX_FRAC_RE.sub(lambda m: f"{m.group(1) or m.group(3)}/{m.group(2) or m.group(4)}", s)
    s = s.strip()
    if s.startswith("####"):
        s = s[4:].strip()
    while s.startswith("{") and _braced_content(s, 0) == s[1:-1]:  # {72}: one group around all of it
        s = s[1:-1].strip()
    return s


def _is_thousands_comma(s: str, i: int) -> bool:
    return 0 < i and s[i - 1].isdigit() and s[i + 1:i + 4].isdigit() and len(s[i + 1:i + 4]) == 3 and \
        not s[i + 4:i + 5].isdigit()


def _top_level_parts(s: str) -> list[str]:
    """`s` cut at separators outside brackets: commas that are not thousands commas, semicolons,
    line breaks, LaTeX's ``\\\\`` and the words "or"/"and"."""
    s = _SEPARATOR_WORDS_RE.sub(";", s.replace("\\\\", ";"))
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
        elif depth == 0 and (ch in ";\n" or (ch == "," and not _is_thousands_comma(s, i))):
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def _is_list(normalized: str) -> bool:
    return sum(bool(_MATHY_RE.search(part)) for part in _top_level_parts(normalized)) >= 2


def _plain_value(s: str) -> Fraction | None:
    """The one number (or a/b) of a normalized, list-free answer with only prose around it."""
    if "=" in s:
        s = s.rsplit("=", 1)[1]
    s = s.strip().strip("*_").strip()  # markdown emphasis: **18**
    s = s.rstrip(".").strip()
    s = re.sub(r"^-\s+(?=\.?\d)", "-", s)  # "- 5": a sign set apart
    values = list(_VALUE_RE.finditer(s))
    if len(values) != 1:
        return None
    value = values[0]
    # Prose before the number, then after it (matched in place, so "-year-old" sees the digit before it).
    if not (_PROSE_RE.fullmatch(s[:value.start()] + " ") and _PROSE_RE.fullmatch(s, value.end())):
        return None
    numerator = Fraction(value.group(1).replace(",", ""))
    if value.group(2) is None:
        return numerator
    denominator = Fraction(value.group(2).replace(",", ""))
    return numerator / denominator if denominator else None


def parse_plain_number(text: str) -> Fraction | None:
    """The exact value of a plain-number answer (see module docstring), or None when `text` is not
    one: no number, a list, an expression, LaTeX other than ``\\frac`` of two numbers."""
    s = _normalize(text)
    return None if _is_list(s) else _plain_value(s)


def _answer_shape(text: str) -> str:
    """'list', 'number', 'expression' (arithmetic of plain numbers) or 'other' (LaTeX, symbols)."""
    s = _normalize(text)
    if _is_list(s):
        return "list"
    if _plain_value(s) is not None:
        return "number"
    last_side = s.rsplit("=", 1)[1] if "=" in s else s
    numbers = _VALUE_RE.subn("N", last_side)
    if numbers[1] >= 2 and _ARITHMETIC_RE.fullmatch(numbers[0]):
        return "expression"
    return "other"


def _match_without_verifier(pred: str, gold: str) -> bool | None:
    """Whether `pred` equals `gold` when that is decided without math-verify, else None."""
    gold_value = parse_plain_number(gold)
    if gold_value is not None:
        return parse_plain_number(pred) == gold_value
    pred_shape = _answer_shape(pred)
    if pred_shape in ("list", "expression") and pred_shape != _answer_shape(gold):
        return False
    return None


def answers_match(pred: str, gold: str, *, timeout_s: float | None = None,
                  verifier: MathVerifier | None = None) -> bool:
    """Whether answer `pred` equals answer `gold` (module docstring, step 3): exact on plain
    numbers, else math-verify under a time limit (`timeout_s`, default the verifier's). A timeout
    counts as not equal."""
    decided = _match_without_verifier(pred, gold)
    if decided is not None:
        return decided
    return (verifier or shared_verifier()).equivalent(gold, pred, timeout_s=timeout_s)


def score_answers(completions: list, golds: list, *, last_number_fallback: bool = False, first_number: bool = False,
                  timeout_s: float | None = None, verifier: MathVerifier | None = None,
                  max_answer_chars: int = DEFAULT_MAX_ANSWER_CHARS) -> list[float]:
    """`score_answer` for each (completion, gold) pair; the answers that need math-verify are checked
    side by side, so slow ones cost about one time limit together. Every answer is extracted
    before any is verified: a completion or gold that raises does so before any waiting."""
    if len(completions) != len(golds):
        raise ValueError(f"got {len(completions)} completions but {len(golds)} gold answers")
    scores: list[float] = []
    to_verify: list[tuple[int, str, str]] = []
    for i, (completion, gold) in enumerate(zip(completions, golds)):
        pred = extract_answer(completion, last_number_fallback=last_number_fallback, first_number=first_number)
        gold = extract_gold(gold)
        decided = False if pred is None or len(pred) > max_answer_chars else _match_without_verifier(pred, gold)
        if decided is None:
            to_verify.append((i, gold, pred))
        scores.append(1.0 if decided else 0.0)
    if to_verify:
        equal = (verifier or shared_verifier()).equivalent_many([(g, p) for _, g, p in to_verify], timeout_s=timeout_s)
        for (i, _, _), same in zip(to_verify, equal):
            scores[i] = 1.0 if same else 0.0
    return scores


def score_answer(completion: Any, gold: str, *, last_number_fallback: bool = False, first_number: bool = False,
                 timeout_s: float | None = None, verifier: MathVerifier | None = None,
                 max_answer_chars: int = DEFAULT_MAX_ANSWER_CHARS) -> float:
    """1.0 when the completion's final answer equals `gold`, else 0.0. `gold` may be the bare answer
    or a whole GSM8K answer field (``... #### N``)."""
    return score_answers([completion], [gold], last_number_fallback=last_number_fallback, first_number=first_number,
                         timeout_s=timeout_s, verifier=verifier, max_answer_chars=max_answer_chars)[0]


# ---- Format reward -------------------------------------------------------------------------------

_FORMAT_RE = re.compile(r"\A\s*<think>(.*?)</think>\s*<answer>(.*?)</answer>\s*\Z", re.DOTALL)
_TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def format_reward(completion: Any) -> float:
    """1.0 iff the completion is ``<think>R</think> <answer>A</answer>`` with R and A non-empty, each
    tag exactly once, only whitespace around; else 0.0. The opening ``<think>`` must be in the
    completion (the kit's prompt does not pre-fill it)."""
    text = completion_text(completion)
    if any(text.count(tag) != 1 for tag in _TAGS):
        return 0.0
    match = _FORMAT_RE.match(text)
    return 1.0 if match and match.group(1).strip() and match.group(2).strip() else 0.0


# ---- TRL reward functions ------------------------------------------------------------------------


def accuracy_reward(prompts: list, completions: list, answer: list, *, last_number_fallback: bool = False,
                    first_number: bool = False, timeout_s: float | None = None, verifier: MathVerifier | None = None,
                    **kwargs) -> list[float]:
    """TRL ``reward_funcs`` entry: `score_answers` of the completions against the dataset's ``answer``
    column (GSM8K ``... #### N`` or bare). Options via ``functools.partial``. One raising completion
    fails the batch: wrap in `SafeReward` for training. Thread-safe (marked ``thread_safe``)."""
    if len(answer) != len(completions):
        raise ValueError(f"got {len(completions)} completions but {len(answer)} gold answers: the "
                         f"dataset needs an 'answer' column, one per prompt")
    return score_answers(completions, answer, last_number_fallback=last_number_fallback, first_number=first_number,
                         timeout_s=timeout_s, verifier=verifier)


accuracy_reward.thread_safe = True  # SafeReward may score its completions from several threads at once


def format_reward_func(prompts: list, completions: list, **kwargs) -> list[float]:
    """TRL ``reward_funcs`` entry: `format_reward` per completion."""
    return [format_reward(c) for c in completions]


def _callable_name(func: Callable) -> str:
    while hasattr(func, "func") and not hasattr(func, "__name__"):  # functools.partial
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def _is_thread_safe(func: Callable) -> bool:
    while hasattr(func, "func") and not hasattr(func, "thread_safe"):  # functools.partial
        func = func.func
    return getattr(func, "thread_safe", False) is True


_MAX_REWARD_THREADS = 32  # threads of one SafeReward call (the verifier runs 8 comparisons at once by default)


class SafeReward:
    """Wrap a TRL reward function so a completion whose scoring raises gets `default` (0.0) instead
    of crashing the step, and is counted.

    The wrapped function is called once per completion, with every per-sample keyword (a list as
    long as `completions`) sliced to that sample, so one bad completion costs only its own reward.
    For a function marked ``thread_safe = True`` (`accuracy_reward`) these calls run at once, in
    threads, so their math-verify time limits overlap instead of adding up; others are called in
    order. Argument mismatches (a missing dataset column) raise at once instead of being counted.
    ``errors`` is the running total, ``take_errors()`` returns the count since the last take (one
    number per trainer step), ``last_error`` the latest message. When TRL passes its ``log_metric``
    callback, the per-call count is also logged as ``<name>/errors``. ``__name__`` is the wrapped
    function's (TRL names the reward columns with it).
    """

    def __init__(self, func: Callable, *, default: float = 0.0, name: str | None = None):
        if not callable(func):
            raise TypeError(f"SafeReward wraps a reward function, got {type(func).__name__}")
        self.func = func
        self.default = float(default)
        self.__name__ = name or _callable_name(func)
        self.thread_safe = _is_thread_safe(func)
        self.errors = self.scored = self._errors_taken = 0
        self.last_error: str | None = None

    def __call__(self, prompts: list | None, completions: list, **kwargs) -> list[float | None]:
        n = len(completions)
        prompts = [None] * n if prompts is None else prompts
        if len(prompts) != n:
            raise ValueError(f"got {len(prompts)} prompts for {n} completions: they must pair one to one")
        try:  # a missing dataset column is a setup bug for every sample: raise it, do not count it
            inspect.signature(self.func).bind(prompts=prompts, completions=completions, **kwargs)
        except TypeError as exc:
            raise TypeError(f"reward function {self.__name__} cannot take these arguments ({exc}): check the "
                            f"dataset columns it needs") from exc
        except ValueError:  # no introspectable signature (a builtin): let the calls decide
            pass
        per_sample = {k for k, v in kwargs.items() if isinstance(v, (list, tuple)) and len(v) == n}

        def one(i: int) -> float | None:
            sample_kwargs = {k: ([v[i]] if k in per_sample else v) for k, v in kwargs.items()}
            out = self.func(prompts=[prompts[i]], completions=[completions[i]], **sample_kwargs)
            if len(out) != 1:
                raise ValueError(f"returned {len(out)} rewards for 1 completion")
            return None if out[0] is None else float(out[0])  # None: TRL's "no reward"

        if self.thread_safe and n > 1:
            with ThreadPoolExecutor(max_workers=min(n, _MAX_REWARD_THREADS)) as pool:
                futures = [pool.submit(one, i) for i in range(n)]
        else:
            futures = None
        rewards: list[float | None] = []
        errors_now = 0
        for i in range(n):
            try:
                rewards.append(futures[i].result() if futures is not None else one(i))
            except Exception as exc:  # noqa: BLE001 -- the point of the wrapper; KeyboardInterrupt passes
                errors_now += 1
                self.last_error = f"{type(exc).__name__}: {exc}"[:500]
                rewards.append(self.default)
        self.errors += errors_now
        self.scored += n
        log_metric = kwargs.get("log_metric")
        if callable(log_metric):
            log_metric(f"{self.__name__}/errors", float(errors_now))
        return rewards

    def take_errors(self) -> int:
        """Errors since the previous call (the first call: since creation)."""
        new = self.errors - self._errors_taken
        self._errors_taken = self.errors
        return new

    def __repr__(self) -> str:
        return f"SafeReward({self.__name__}, errors={self.errors}, scored={self.scored})"

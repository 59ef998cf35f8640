"""Rollout workloads of uneven lengths: what an RL rollout batch looks like, for `qerl bench rollout`.

A GRPO rollout's completions end where each one stops: some after a short answer, a few at the
length limit. A fixed-length benchmark (every row generates ``gen_len`` tokens) hides what this
costs an engine that decodes a static batch until its longest member is done: the finished rows
keep their slots. The ``gsm8k-like`` workload gives every row its own length, drawn from the
distribution of GSM8K's worked solutions (``data/workloads/gsm8k_lengths.json``: 7473 training
solutions, median 113 tokens, 90th percentile 199, longest 454) scaled so that the longest solution
is ``gen_len``. At ``gen_len`` 2048 the median row wants ~510 tokens.

Two numbers describe a static batch on such a workload:

* ``useful tokens``: the sum of the rows' lengths (what the rollout needs);
* ``slot_utilization``: useful tokens / (batch x longest row): the share of decode slots that
  produce a kept token. A continuous-batching engine, which gives a finished row's slot to the next
  prompt, approaches 1; a static batch pays 1 / slot_utilization in decode steps.

Random-weight models rarely emit an end token, so the lengths are imposed as per-row token budgets
(``generate(max_new_tokens=[...])``), the same cut a stop token would make.
"""

from __future__ import annotations

import bisect
import json
import random

from qerl_lib.paths import DATA_DIR

WORKLOADS = ("fixed", "gsm8k-like")
LENGTHS_FILE = DATA_DIR / "workloads" / "gsm8k_lengths.json"


def length_quantiles() -> tuple[list[float], list[int]]:
    """(percentiles 0..100, token length at each) of GSM8K's worked solutions."""
    record = json.loads(LENGTHS_FILE.read_text())
    return [float(p) for p in record["percentiles"]], [int(t) for t in record["tokens"]]


def sample_lengths(workload: str, rows: int, gen_len: int, seed: int = 0) -> list[int]:
    """One completion length per row, each in [1, gen_len]: all ``gen_len`` for "fixed"; for "gsm8k-like"
    inverse-CDF draws from the GSM8K solution lengths (linear between percentiles), scaled so the longest
    solution is ``gen_len``. Seeded: the same (rows, gen_len, seed) gives the same lengths."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}: choose one of {', '.join(WORKLOADS)}")
    if rows < 1 or gen_len < 1:
        raise ValueError(f"rows and gen_len must be >= 1, got {rows} and {gen_len}")
    if workload == "fixed":
        return [gen_len] * rows
    percentiles, tokens = length_quantiles()
    scale = gen_len / tokens[-1]
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        p = rng.uniform(0.0, 100.0)
        i = min(bisect.bisect_right(percentiles, p), len(percentiles) - 1)  # percentiles[i - 1] <= p < percentiles[i]
        lo_p, hi_p, lo_t, hi_t = percentiles[i - 1], percentiles[i], tokens[i - 1], tokens[i]
        length = lo_t + (hi_t - lo_t) * (p - lo_p) / (hi_p - lo_p)
        out.append(min(gen_len, max(1, round(length * scale))))
    return out


def slot_utilization(lengths: list[int]) -> float:
    """Useful tokens / (rows x longest row): the share of a static batch's decode slots that are kept."""
    return sum(lengths) / (len(lengths) * max(lengths))

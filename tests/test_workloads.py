"""The uneven-length rollout workload (bench/workloads.py): lengths drawn from GSM8K's solution lengths."""

from __future__ import annotations

import pytest

from qerl_lib.bench.workloads import length_quantiles, sample_lengths, slot_utilization


def test_the_length_table_is_a_distribution():
    percentiles, tokens = length_quantiles()
    assert percentiles[0] == 0 and percentiles[-1] == 100 and percentiles == sorted(percentiles)
    assert tokens == sorted(tokens) and tokens[0] >= 1


def test_gsm8k_like_lengths_follow_the_scaled_quantiles():
    gen_len = 2048
    lengths = sample_lengths("gsm8k-like", 20000, gen_len, seed=3)
    assert all(1 <= n <= gen_len for n in lengths)
    _, tokens = length_quantiles()
    scale = gen_len / tokens[-1]
    ordered = sorted(lengths)
    for p in (10, 50, 90):  # empirical quantiles of 20000 draws within 3% of the scaled table's
        assert ordered[p * len(ordered) // 100] == pytest.approx(tokens[p] * scale, rel=0.03), p
    assert max(lengths) <= gen_len and max(lengths) > 0.6 * gen_len, "the tail reaches toward the limit"
    assert sample_lengths("gsm8k-like", 50, gen_len, seed=3) == lengths[:50], "seeded, and a prefix of longer draws"
    assert sample_lengths("gsm8k-like", 50, gen_len, seed=4) != lengths[:50]


def test_fixed_workload_and_utilization():
    assert sample_lengths("fixed", 4, 512) == [512] * 4
    assert slot_utilization([512] * 4) == 1.0
    assert slot_utilization([100, 300, 400]) == pytest.approx(800 / 1200)
    skewed = sample_lengths("gsm8k-like", 64, 2048, seed=0)
    assert 0.2 < slot_utilization(skewed) < 0.7, "a static batch of 64 keeps well under all of its slots"


@pytest.mark.parametrize("args, message", [(("uniform", 4, 8), "unknown workload"), (("fixed", 0, 8), ">= 1"),
                                           (("gsm8k-like", 4, 0), ">= 1")])
def test_bad_workload_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        sample_lengths(*args)


def test_the_engine_timing_counts_useful_tokens_on_uneven_lengths():
    """bench.rollout.time_engine on a tiny CPU model: each row runs to its own length, the call to the
    longest; tok_s counts the rows' tokens, and the row records the static batch's slot utilization."""
    from qerl_lib.bench.rollout import Row, time_engine
    from tests.test_engine import tiny_model

    model = tiny_model("llama")
    row = Row("tiny", "bf16", 6, 0, "eager", "qerl", prompt_len=8, gen_len=40, workload="gsm8k-like")
    time_engine(model, row, "eager", None, repeats=1, seed=5)
    lengths = sample_lengths("gsm8k-like", 6, 40, seed=5)
    assert row.useful_tokens == sum(lengths) < 6 * 40
    assert row.slot_utilization == pytest.approx(slot_utilization(lengths), abs=1e-4)
    assert row.tok_s > 0 and row.ms_per_step > 0
    fixed = time_engine(model, Row("tiny", "bf16", 6, 0, "eager", "qerl", 8, 40), "eager", None, 1, 5)
    assert fixed.useful_tokens == 240 and fixed.slot_utilization == 1.0


def test_continuous_scheduling_runs_the_same_rollout_in_fewer_row_steps():
    """bench.rollout.time_engine with ``prompts`` > ``batch``: "static" runs batches of ``batch`` in turn,
    "continuous" refills ``batch`` rows; both return every prompt's tokens (time_engine checks the count),
    and the continuous schedule keeps more of its row-steps busy."""
    from qerl_lib.bench.rollout import Row, time_engine
    from tests.test_engine import tiny_model

    model = tiny_model("llama")
    rows = {s: time_engine(model, Row("tiny", "bf16", 4, 0, "eager", "qerl", prompt_len=8, gen_len=40,
                                      workload="gsm8k-like", scheduling=s, prompts=16), "eager", None, 1, 5)
            for s in ("static", "continuous")}
    lengths = sample_lengths("gsm8k-like", 16, 40, seed=5)
    static, continuous = rows["static"], rows["continuous"]
    assert static.useful_tokens == continuous.useful_tokens == sum(lengths)
    chunks = [lengths[i:i + 4] for i in range(0, 16, 4)]
    assert static.slot_utilization == pytest.approx(sum(lengths) / (4 * sum(max(c) for c in chunks)), abs=1e-4)
    assert continuous.slot_utilization > static.slot_utilization
    assert static.schedule is None and continuous.schedule["refills"] == 16 - 4, "every queued prompt refills a row"

"""The claim sweeps' task, flags, spec validation and statistics (CPU, no model)."""

from __future__ import annotations

import pytest

from qerl_lib.errors import UserError
from qerl_lib.studies.claims import holm, paired_difference, verdict
from qerl_lib.studies.sweep import parse_spec, plan_runs
from qerl_lib.tasks.expressions import EXPR_LEVELS, generate_expressions
from qerl_lib.tasks.problems import evaluate_expression, gold_answer
from qerl_lib.tasks.rewards import extract_answer, score_answer
from qerl_lib.train.presets import make_config


@pytest.mark.parametrize("level", EXPR_LEVELS)
def test_expression_answers_are_right_and_splits_disjoint(level):
    train = generate_expressions("train", 300, seed=1, level=level)
    test = generate_expressions("test", 100, seed=1, level=level)
    for rec in train + test:
        assert int(gold_answer(rec)) == evaluate_expression(rec["expression"]) >= 0
        assert rec["prefill"].endswith(" =") and rec["level"] == level
    assert not {r["expression"] for r in train} & {r["expression"] for r in test}
    assert generate_expressions("test", 100, seed=1, level=level) == test  # same seed, same problems


@pytest.mark.parametrize("text,answer", [(" 55", "55"), (" 55.", "55"), (" 55, since 48 + 7 = 55", "55"),
                                         (" 48 + 7 = 55", "48"), ("", None), (" fifty", None), (" −3", "-3")])
def test_first_number_reader(text, answer):
    assert extract_answer(text, first_number=True) == answer
    assert score_answer(text, "#### 55", first_number=True) == float(answer == "55")


def test_ablation_flags_compose_and_contradictions_fail():
    bf16_aqn = make_config("smollm2-expr", base_format="bf16", aqn_target="rollout")
    assert (bf16_aqn.base, bf16_aqn.noise_target, bf16_aqn.arm_label) == ("bf16", "rollout", "bf16+aqn")
    assert make_config("smollm2-expr", mode="qerl").arm_label == "qerl"
    assert make_config("smollm2-expr", mode="qerl", aqn_target="off").arm_label == "nvfp4"
    assert make_config("smollm2-expr", mode="lora", lr=1e-4).learning_rate == 1e-4
    assert make_config("smollm2-expr", base_format="mxfp4").arm_label == "mxfp4"
    with pytest.raises(UserError, match="mode qlora trains on a nf4 base"):
        make_config("smollm2-expr", mode="qlora", base_format="nvfp4")
    with pytest.raises(UserError, match="aqn_target"):
        make_config("smollm2-expr", aqn_target="sometimes")


def _spec(**changes):
    raw = {"name": "t", "preset": "smollm2-expr", "seeds": [0, 1], "concurrency": 1,
           "arms": [{"name": "lora", "mode": "lora"}, {"name": "qerl", "mode": "qerl"}]}
    raw.update(changes)
    return parse_spec(raw)


def test_spec_validation_fails_before_anything_loads():
    assert len(plan_runs(_spec())) == 4
    with pytest.raises(UserError, match="unknown or misplaced field"):
        plan_runs(_spec(arms=[{"name": "a", "mode": "lora", "learnig_rate": 1}]))
    with pytest.raises(UserError, match="no runs"):
        plan_runs(_spec(seeds=[]))
    with pytest.raises(UserError, match="drop one of them"):
        plan_runs(_spec(arms=[{"name": "a", "mode": "lora", "base_format": "nvfp4"}]))
    with pytest.raises(UserError, match="unknown key"):
        _spec(concurency=2)
    with pytest.raises(UserError, match="the equivalence test pairs seeds"):
        _spec(blocks={"c": {"arms": ["lora", "qerl"], "test": "equivalence", "pairing": "problem"}})
    assert _spec(blocks={"c": {"arms": ["lora", "qerl"], "test": "equivalence"}}).blocks["c"]["test"] == "equivalence"


def test_paired_statistics_match_scipy():
    from scipy.stats import ttest_rel

    a = {s: v for s, v in enumerate([0.52, 0.49, 0.55, 0.50, 0.47])}
    b = {s: v for s, v in enumerate([0.45, 0.46, 0.47, 0.44, 0.46])}
    diff = paired_difference(a, b)
    assert diff["p"] == pytest.approx(ttest_rel(list(a.values()), list(b.values())).pvalue, rel=1e-9)
    assert diff["ci"][0] < diff["mean"] < diff["ci"][1]
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert verdict({**diff, "p_holm": diff["p"]}) == "holds"
    assert verdict({**diff, "p_holm": diff["p"]}, direction=-1) == "does not hold"

"""Notebook 08's study (``studies/scheduling.py``), its figure (``plots/scheduling.py``) and the continuous engine's
admission record (``Timing.extra["admissions"]``) it draws from. CPU, a tiny random model."""

from __future__ import annotations

import json

import pytest
import torch

from qerl_lib.engine.rollout import RolloutEngine
from qerl_lib.studies.scheduling import (SchedulingConfig, continuous_timeline, format_gpu_rows, format_study,
                                         gpu_scheduling_rows, scheduling_study, static_timeline)
from tests.test_engine import tiny_model


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (int(torch.randint(3, 9, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _rows_never_overlap(timeline):
    by_row = {}
    for _, row, first, end in timeline:
        by_row.setdefault(row, []).append((first, end))
    for spans in by_row.values():
        spans.sort()
        assert all(a_end <= b_first for (_, a_end), (b_first, _) in zip(spans, spans[1:])), spans


def test_static_timeline_starts_each_batch_after_the_longest_of_the_last():
    # token 0 from the prefill, tokens 1..n-1 from decode steps: a batch of longest 5 holds its rows for 4 steps
    assert static_timeline([3, 5, 2, 4, 1], 2) == [[0, 0, 0, 2], [1, 1, 0, 4], [2, 0, 4, 5], [3, 1, 4, 7],
                                                   [4, 0, 7, 7]]


def test_the_continuous_engine_records_where_each_sequence_ran():
    model = tiny_model("qwen2")
    prompts, caps = _prompts(7), [5, 2, 9, 3, 4, 2, 6]
    engine = RolloutEngine(model)
    out = engine.generate(prompts, caps, temperature=1.0, stop_token_ids=[], row_seeds=list(range(7)), max_batch=3,
                          timing=True)
    admissions = engine.last_timing.extra["admissions"]
    assert sorted(a[0] for a in admissions) == list(range(7))  # every prompt admitted once
    assert [a for a in admissions if a[2] == 0] == [[0, 0, 0], [1, 1, 0], [2, 2, 0]]  # the first rows at once
    timeline = continuous_timeline(admissions, [len(c.token_ids) for c in out])
    _rows_never_overlap(timeline)
    assert all(end - first == caps[seq] - 1 for seq, _, first, end in timeline)
    assert max(end for *_, end in timeline) == engine.last_timing.steps  # the last decode step ends the call


def test_the_study_gives_the_same_completions_in_fewer_iterations():
    model = tiny_model("qwen2")
    config = SchedulingConfig(slots=3, max_new_tokens=24, seed=1)
    study = scheduling_study(model, _prompts(9, seed=1), config)
    assert study["same_completions"] is True
    assert study["useful_tokens"] == sum(study["lengths"]) and len(study["lengths"]) == 9
    static, cont = study["static"], study["continuous"]
    for part in (static, cont):
        _rows_never_overlap(part["timeline"])
        assert sorted(seq for seq, *_ in part["timeline"]) == list(range(9))
        assert 0 < part["slot_utilization"] <= 1 and part["tok_s"] > 0
    assert cont["decode_steps"] <= static["decode_steps"]
    assert study["steps_saved"] == pytest.approx(1 - cont["decode_steps"] / static["decode_steps"])
    assert cont["refills"] == 6 and "same completions: True" in format_study(study)


def test_one_batch_of_prompts_has_nothing_to_refill():
    study = scheduling_study(tiny_model("qwen2"), _prompts(2), SchedulingConfig(slots=4, max_new_tokens=8))
    assert study["config"]["slots"] == 2 and study["continuous"]["timeline"] == study["static"]["timeline"]
    assert study["continuous"]["refills"] == 0


@pytest.mark.parametrize("kwargs, match", [({"slots": 0}, "slots must be a positive integer"),
                                           ({"max_new_tokens": 1}, "max_new_tokens must be an integer >= 2"),
                                           ({"workload": "zipf"}, "workload must be one of fixed, gsm8k-like"),
                                           ({"temperature": 0.0}, "temperature must be > 0")])
def test_bad_config_names_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SchedulingConfig(**kwargs)


def test_empty_prompts_are_refused():
    with pytest.raises(ValueError, match="prompts is empty"):
        scheduling_study(tiny_model("qwen2"), [])


def _rollout_file(rows, device="NVIDIA H200"):
    return {"provenance": {"device": {"name": device}}, "rows": rows}


def test_gpu_rows_pair_the_kits_static_and_continuous_rows(tmp_path):
    base = dict(model="qwen2.5-7b", weights="nvfp4", rank=16, batch=64, prompt_len=256, gen_len=1024,
                workload="gsm8k-like", prompts=256, error=None)
    rows = [{**base, "engine": "qerl", "scheduling": "static", "tok_s": 2000.0, "slot_utilization": 0.4},
            {**base, "engine": "qerl", "scheduling": "continuous", "tok_s": 3000.0, "slot_utilization": 0.6},
            {**base, "engine": "vllm", "scheduling": "continuous", "tok_s": 2500.0},
            {**base, "rank": 0, "engine": "qerl", "scheduling": "continuous", "tok_s": 9.0}]  # no static partner
    (tmp_path / "rollout_x.json").write_text(json.dumps(_rollout_file(rows)))
    (tmp_path / "other.json").write_text(json.dumps({"claims": []}))
    (tmp_path / "broken.json").write_text("{")
    (pair,) = gpu_scheduling_rows(tmp_path)
    assert pair["device"] == "H200" and pair["continuous_over_static"] == pytest.approx(1.5)
    assert pair["vllm_tok_s"] == 2500.0 and pair["file"] == "rollout_x.json"
    assert "1.50x" in format_gpu_rows([pair]) and "no committed GPU measurement" in format_gpu_rows([])


def test_the_figure_names_its_json_and_refuses_one_without_timelines(tmp_path):
    from PIL import Image

    from qerl_lib.plots.scheduling import plot_schedule

    study = {"config": {"slots": 2},
             "static": {"timeline": static_timeline([3, 1, 2], 2), "decode_steps": 3, "slot_utilization": 0.5,
                        "tok_s": 10.0},
             "continuous": {"timeline": [[0, 0, 0, 2], [1, 1, 0, 0], [2, 1, 0, 1]], "decode_steps": 2,
                            "slot_utilization": 0.75, "tok_s": 15.0, "refills": 1, "refill_prefills": 1}}
    src = tmp_path / "study.json"
    src.write_text(json.dumps(study))
    png = plot_schedule(src, tmp_path / "fig" / "schedule.png")
    assert Image.open(png).text["Source"] == str(src)
    src.write_text(json.dumps({"config": {"slots": 2}, "static": study["static"]}))
    with pytest.raises(ValueError, match="no continuous timeline"):
        plot_schedule(src, tmp_path / "x.png")


@pytest.mark.cuda
def test_cuda_study_under_graphs_gives_the_same_completions_and_a_consistent_record():
    """On the GPU (CUDA-graph decode, the continuous call's warm prefills): the same completions under both
    schedules, and the admission record ends at the continuous call's last decode step."""
    from tests.test_engine import tiny_cuda_model

    model = tiny_cuda_model("bf16")
    engine = RolloutEngine(model)
    study = scheduling_study(model, _prompts(9, seed=3), SchedulingConfig(slots=3, max_new_tokens=24, seed=3),
                             engine=engine)
    assert study["same_completions"] is True
    assert study["continuous"]["decode_steps"] == engine.last_timing.steps
    assert study["continuous"]["refills"] == 6
    for part in (study["static"], study["continuous"]):
        _rows_never_overlap(part["timeline"])
